"""Rotary position embedding, RoPE (chapter 02; Su et al. 2021, "RoFormer", §3.4).

Each pair of channels (i, i + d/2) of a query or key at position p is rotated by the angle
p * base^(-2i/d) ("rotate half", the GPT-NeoX layout that HF Llama and Qwen3 use). cos and sin for every
position up to max_position are computed once, in fp32, into `cos_sin_cache` [max_position, d]
(first half cos, second half sin). Scaled RoPE (linear, YaRN) changes the frequencies and may multiply
cos and sin by a factor: see `rope_scaling.py`.
"""
import torch
from torch import nn

from nanovllm_ref.layers.rope_scaling import rope_frequencies
from nanovllm_ref.utils.fusion import fused


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, d]; cos, sin: [num_tokens, d/2] fp32. Returns x rotated, x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)          # broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@fused
def rotary_qk(positions, q, k, cos_sin_cache):
    """Rotate q [T, H, d] and k [T, Hkv, d] by their positions [T]: one fused kernel when compiled."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_parameters: dict | None = None):
        """rope_parameters: the config's RoPE scaling (`rope_scaling.rope_parameters_of`); None = plain RoPE.
        Raises ValueError for a scaling the engine does not implement."""
        super().__init__()
        inv_freq, scale = rope_frequencies(head_dim, base, rope_parameters, max_position)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)   # [P, d/2]
        self.register_buffer("cos_sin_cache", torch.cat((angles.cos(), angles.sin()), dim=-1) * scale,
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [num_tokens] int; q: [num_tokens, H, d]; k: [num_tokens, Hkv, d]."""
        return rotary_qk(positions, q, k, self.cos_sin_cache)
