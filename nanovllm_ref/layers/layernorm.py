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
    by default; the model passes the engine's choice: compiled, or a student's part from nanovllm_ref.Parts).
    kernel: None, or "norm" / "add" / "both": which of the two forms run as the Triton kernel of
    kernels/rms_norm.py (one kernel for the residual add and the norm, same numbers up to fp32 sum order;
    the engine builds it only where the form's function is the reference); pdl: launch it with PDL."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, norm=rms_norm, add_norm=add_rms_norm,
                 kernel: str | None = None, pdl: bool = False):
        super().__init__()
        if kernel not in (None, "norm", "add", "both"):
            raise ValueError(f"kernel must be None, 'norm', 'add' or 'both', got {kernel!r}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.norm, self.add_norm = norm, add_norm
        self.kernel, self.pdl = kernel, pdl

    def forward(self, x, residual: torch.Tensor | None = None):
        """x: [num_tokens, hidden], or a row-parallel GEMM's layers.linear.SplitK partials (then the kernel sums
        them first, and the result is also the new residual stream). Without residual returns norm(x); with it
        returns (norm(x + residual), x + residual)."""
        partials = getattr(x, "partials", None)                # a SplitK hand-off (layers/linear.py)
        if self.kernel in ("both", "add" if residual is not None else "norm") or partials is not None:
            if self.kernel is None:
                raise TypeError("split-K partials reach an RMSNorm built without its kernel")
            from nanovllm_ref.kernels.rms_norm import add_rms_norm as add_rms_norm_kernel
            out, h = add_rms_norm_kernel(x if partials is None else partials, residual, self.weight, self.eps,
                                         use_pdl=self.pdl)
            return out if residual is None else (out, h)
        if residual is None:
            return self.norm(x, self.weight, self.eps)
        return self.add_norm(x, residual, self.weight, self.eps)
