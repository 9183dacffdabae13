"""Llama (and SmolLM2, which is a Llama) for inference (chapter 03).

Architecturally Qwen3 without the per-head q/k RMSNorm, so it reuses the Qwen3 modules. Differences that
live in config.json (attention_bias, mlp_bias, head_dim, tied embeddings, rope theta and scaling) are read
there; `config.check_model_config` refuses the settings the engine does not implement. Follows HF
`modeling_llama.py`.
"""
from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM


class LlamaForCausalLM(Qwen3ForCausalLM):
    QK_NORM = False
