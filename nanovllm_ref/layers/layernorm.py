"""RMSNorm, plain and fused with the residual add (chapter 01; Zhang & Sennrich 2019).

y = x / sqrt(mean(x^2) + eps) * weight. The mean of squares is taken in fp32: in bf16 the sum of 1000s of
squares loses most of its low bits. The fused form `forward(x, residual)` first adds the residual in the
model dtype (as HF does, so results match it bit for bit), returns the normed value and the new residual
stream. Neither form writes into its inputs: the caller may still need them.
"""
import torch
from torch import nn

from nanovllm_ref.utils.fusion import fused


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> x / sqrt(mean(x^2) + eps) * weight, mean of squares in fp32, result in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@fused
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual); the add is in the model dtype, as in HF."""
    x = x + residual
    return rms_norm.eager(x, weight, eps), x


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale. `norm` and `add_norm` are the functions it calls (the reference ones
    by default; the model passes the engine's choice: compiled, or a student's part from nanovllm_ref.Parts)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, norm=rms_norm, add_norm=add_rms_norm):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.norm, self.add_norm = norm, add_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [num_tokens, hidden]. Without residual returns norm(x); with it returns
        (norm(x + residual), x + residual)."""
        if residual is None:
            return self.norm(x, self.weight, self.eps)
        return self.add_norm(x, residual, self.weight, self.eps)

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, use_pdl: bool = False):
        """(norm(x + residual), x + residual) in one Triton kernel (kernels/rms_norm.py), also when x is a
        GEMM's split-K partial sums [S, T, hidden] fp32; with residual None, (norm(x), x). Same numbers as
        the reference functions; the model's fused decode route calls it only where those are the parts."""
        from nanovllm_ref.kernels.rms_norm import add_rms_norm as add_rms_norm_kernel
        return add_rms_norm_kernel(x, residual, self.weight, self.eps, use_pdl=use_pdl)
