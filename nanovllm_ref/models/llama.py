"""Llama (and SmolLM2, which is a Llama) for inference (chapter 03).

Architecturally Qwen3 without the per-head q/k RMSNorm, so it reuses the Qwen3 modules. Differences that
live in config.json (attention_bias, mlp_bias, head_dim, tied embeddings, rope theta) are read there.
Follows HF `modeling_llama.py`. Llama-3 style rope scaling is not supported (the loader refuses it).
"""
from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM


class LlamaForCausalLM(Qwen3ForCausalLM):
    QK_NORM = False

    def __init__(self, config, parts=None, fuse: bool = False):
        scaling = getattr(config, "rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
        if kind not in (None, "default"):
            raise ValueError(f"rope scaling {kind!r} is not supported by nanovllm_ref's Llama")
        super().__init__(config, parts, fuse)
