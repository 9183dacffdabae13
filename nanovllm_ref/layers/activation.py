"""SiLU-and-multiply, the gate of the SwiGLU MLP (chapter 03; Shazeer 2020, "GLU Variants")."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_ref.utils.fusion import fused


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] = [gate | up] -> silu(gate) * up: [..., d], in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] = [gate | up] -> silu(gate) * up: [..., d]. Same dtype as x. `fn` is the function
    it calls (the reference by default)."""

    def __init__(self, fn=silu_and_mul):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
