"""What a model's layers call: one frozen record, made once when the engine is built (chapters 03, 10).

`ModelOps()` is the reference, eager: the functions of nanovllm_ref/layers, the torch attention back-end and KV
store, no hand-written kernels. That is what `Qwen3ForCausalLM(config)` builds (chapter 03). The engine
builds its model with `Parts.model_ops(...)` (nanovllm_ref/parts.py), the one place that decides which of
the parts are the reference ones: those it may compile (utils/fusion.py) and stand Triton kernels in for
(`kernels`); a part you pass stays as written.

Each layer picks its kernel when it is built from this record, as vLLM's CustomOp dispatch does, and has one
forward: RMSNorm the add + RMSNorm kernel, a linear layer the small-M GEMM up to `kernels.max_m` rows (with
split-K partials out of o_proj and down_proj, SiLU-and-mul in gate_up's epilogue), the attention the
q/k-norm + RoPE + KV-store kernel in decode steps. Which kernel a row count or a step kind takes is decided
inside that forward, never by a second method.
"""
from dataclasses import dataclass
from typing import Callable

from nanovllm_ref.layers.activation import silu_and_mul
from nanovllm_ref.layers.layernorm import add_rms_norm, rms_norm
from nanovllm_ref.layers.linear import load_gate_up_shard, load_qkv_shard
from nanovllm_ref.layers.rotary_embedding import apply_rope
from nanovllm_ref.utils.fusion import FusedKernels


@dataclass(frozen=True)
class ModelOps:
    """rms_norm ... gate_up_weight_loader: the functions of nanovllm_ref.Parts' fields of the same names, as the
    model calls them (compiled or not; rope_cos_sin None = the reference, which also builds scaled RoPE
    tables); qk_norm_rope: Qwen3's q/k RMSNorm + RoPE compiled into one kernel
    (models/qwen3.qk_norm_rope.compiled()), or None (the modules one after the other); attention_backend: an
    attn.AttentionBackend or a back-end module, None = the torch back-end; store_kvcache: the KV store, None =
    the torch one; kernels: the Triton kernels the layers use (utils/fusion.FusedKernels; none by default)."""
    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    rope_cos_sin: Callable | None = None
    rotary: Callable = apply_rope
    silu_and_mul: Callable = silu_and_mul
    qkv_weight_loader: Callable = load_qkv_shard
    gate_up_weight_loader: Callable = load_gate_up_shard
    qk_norm_rope: Callable | None = None
    attention_backend: object = None
    store_kvcache: Callable | None = None
    kernels: FusedKernels = FusedKernels()

    def __post_init__(self):
        if not isinstance(self.kernels, FusedKernels):
            raise TypeError(f"ModelOps.kernels must be a FusedKernels, got {type(self.kernels).__name__}")
