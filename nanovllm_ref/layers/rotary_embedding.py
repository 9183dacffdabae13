"""Rotary position embedding, RoPE (chapter 02; Su et al. 2021, "RoFormer", §3.4).

Each pair of channels (i, i + d/2) of a query or key at position p is rotated by the angle
p * base^(-2i/d) ("rotate half", the GPT-NeoX layout that HF Llama and Qwen3 use). cos and sin for every
position up to max_position are computed once, in fp32 (`rope_cos_sin`), into `cos_sin_cache`
[max_position, d] (first half cos, second half sin). Scaled RoPE (linear, YaRN) changes the frequencies
and may multiply cos and sin by a factor: see `rope_scaling.py`.
"""
import torch
from torch import nn

from nanovllm_ref.layers.rope_scaling import rope_frequencies
from nanovllm_ref.utils.fusion import fused


def rope_cos_sin(head_dim: int, max_position: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the angles p * base^(-2i/head_dim), each [max_position, head_dim // 2] fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)   # [P, d/2]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, d]; cos, sin: [num_tokens, d/2] fp32. Returns x rotated, x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)          # broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@fused
def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [T, H, d] and k [T, Hkv, d] by the angles of their positions [T] (int64), with the tables
    cos, sin [max_position, d/2] fp32 from `rope_cos_sin`. Returns (q, k) in their dtypes."""
    c, s = cos[positions], sin[positions]
    return apply_rotary(q, c, s), apply_rotary(k, c, s)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin tables of one head size; `forward(positions, q, k)` rotates q and k.
    `cos_sin` builds the tables (None: the reference `rope_cos_sin`; a part of yours: Parts.rope_cos_sin) and
    `rotary` applies them (the reference by default).
    rope_parameters: the config's RoPE setting (`rope_scaling.rope_parameters_of`); None or type "default"
    is plain RoPE. Raises ValueError for a scaling the engine does not implement, or for a scaled RoPE with
    a `cos_sin` of yours (which knows only plain RoPE)."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_parameters: dict | None = None,
                 cos_sin=None, rotary=apply_rope):
        super().__init__()
        kind = (rope_parameters or {}).get("rope_type", "default")
        if kind == "default":
            if rope_parameters:
                rope_frequencies(head_dim, base, rope_parameters, max_position)    # refuses unsupported keys
            cos, sin = (cos_sin or rope_cos_sin)(head_dim, max_position, base)
        else:
            if cos_sin is not None:
                raise ValueError(f"config.json rope scaling rope_type={kind!r} needs the reference rope_cos_sin "
                                 "(Parts.rope_cos_sin builds plain RoPE tables only)")
            inv_freq, scale = rope_frequencies(head_dim, base, rope_parameters, max_position)
            angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)   # [P, d/2]
            cos, sin = angles.cos() * scale, angles.sin() * scale
        self.register_buffer("cos_sin_cache", torch.cat((cos, sin), dim=-1), persistent=False)
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [num_tokens] int64; q: [num_tokens, H, d]; k: [num_tokens, Hkv, d]."""
        cos, sin = self.cos_sin_cache.chunk(2, dim=-1)
        return self.rotary(positions, q, k, cos, sin)
