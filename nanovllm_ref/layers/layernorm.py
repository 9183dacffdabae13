"""RMSNorm, plain and fused with the residual add (chapter 01; Zhang & Sennrich 2019).

y = x / sqrt(mean(x^2) + eps) * weight. The mean of squares is taken in fp32: in bf16 the sum of 1000s of
squares loses most of its low bits. The fused form `forward(x, residual)` first adds the residual in the
model dtype (as HF does, so results match it bit for bit), returns the normed value and the new residual
stream. Neither form writes into its inputs: the caller may still need them.
"""
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [num_tokens, hidden]. Without residual returns norm(x); with it returns
        (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
