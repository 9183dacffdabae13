"""SiLU-and-multiply, the gate of the SwiGLU MLP (chapter 03; Shazeer 2020, "GLU Variants")."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm_ref.utils.fusion import fused


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """x: [..., 2 * d] = [gate | up] -> silu(gate) * up: [..., d]. Same dtype as x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
