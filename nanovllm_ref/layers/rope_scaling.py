"""RoPE frequency scaling from an HF config (chapter 02): plain, linear and YaRN.

A checkpoint trained with a stretched RoPE says so in config.json (`rope_scaling` in transformers 4,
`rope_parameters` in transformers 5; both hold a `rope_type`, or the older `type`). Ignoring it runs a
different model, so every rope type is either computed here or refused by name.

- "default": inv_freq_i = base^(-2i/d), i = 0 .. d/2-1 (Su et al. 2021, RoFormer).
- "linear" (position interpolation, Chen et al. 2023): inv_freq_i / factor, i.e. positions divided by factor.
- "yarn" (Peng et al. 2023, "YaRN", §3.2-3.4): each frequency is interpolated (divided by factor), kept
  (extrapolated) or blended, depending on how many full turns it makes over the original context
  L = original_max_position_embeddings. Dimension pair i turns L * inv_freq_i / (2 pi) times; pairs that
  turn more than beta_fast (32) times keep their frequency, pairs that turn fewer than beta_slow (1) times
  are interpolated, and a linear ramp over i joins the two. cos and sin are then multiplied by the attention
  factor 0.1 ln(factor) + 1 (or the configured `attention_factor`, or the DeepSeek `mscale` /
  `mscale_all_dim` ratio), which scales q.k by its square, as HF transformers does.

Refused (ValueError naming the key): any other rope_type (dynamic, longrope, llama3, ...), and
partial_rotary_factor != 1.
"""
import math

import torch

from nanovllm_ref.utils.checks import is_finite

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


def rope_parameters_of(hf_config) -> dict:
    """The RoPE settings of an HF config as one dict with a "rope_type" key ("default" when unscaled).

    Reads transformers 5's `rope_parameters`, else transformers 4's `rope_scaling` (+ `rope_theta`).
    Raises ValueError if the setting is not a dict.
    """
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, key, None)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"config.json {key} must be an object, got {type(params).__name__}")
        params = dict(params)
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
        return params
    return {"rope_type": "default"}


def _positive(params: dict, key: str, default=None) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite(value) or value <= 0:
        raise ValueError(f"config.json rope scaling {key!r} must be a number > 0, got {value!r}")
    return float(value)


def rope_frequencies(head_dim: int, base: float, params: dict | None, max_position: int):
    """Inverse frequencies and the cos/sin factor of one RoPE setting.

    head_dim: d, even. base: rope_theta. params: from `rope_parameters_of` (None = "default").
    max_position: the model's max_position_embeddings (YaRN's factor defaults to it over the original).
    Returns (inv_freq: fp32 tensor [d/2], attention_scaling: float that multiplies cos and sin).
    Raises ValueError naming the config key for an unsupported rope_type or setting.
    """
    params = params or {"rope_type": "default"}
    kind = params.get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json rope scaling rope_type={kind!r} is not supported by nanovllm_ref; "
                         f"supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={params['partial_rotary_factor']!r} is not "
                         "supported (the engine rotates the whole head)")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim        # 2i/d
    inv_freq = 1.0 / (base ** exponent)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / _positive(params, "factor"), 1.0

    # yarn
    original = _positive(params, "original_max_position_embeddings", max_position)
    factor = params.get("factor")
    factor = max_position / original if factor is None else _positive(params, "factor")
    beta_fast = _positive(params, "beta_fast", params.get("beta_fast") or 32)
    beta_slow = _positive(params, "beta_slow", params.get("beta_slow") or 1)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    else:
        attention = _positive(params, "attention_factor")

    def pair_of(turns):      # the (fractional) pair index i whose frequency makes `turns` turns over `original`
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = pair_of(beta_fast), pair_of(beta_slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if hi == lo:
        hi += 0.001
    # 0 for the fast pairs (kept), 1 for the slow pairs (interpolated), linear in between
    interpolate = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    inv_freq = inv_freq / factor * interpolate + inv_freq * (1 - interpolate)
    return inv_freq, float(attention)
