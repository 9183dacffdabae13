"""Qwen3 decoder-only transformer for inference (chapter 03). Mirrors HF `modeling_qwen3.py` numerically,
with the engine's fused and tensor-parallel layers; upstream nano-vllm `models/qwen3.py`.

Per layer: x -> RMSNorm -> attention (fused QKV, per-head q/k RMSNorm, RoPE, GQA) -> + residual
           -> RMSNorm -> MLP (fused gate/up, SiLU-and-mul, down) -> + residual.
The residual add is fused into the next RMSNorm call. Shapes: tokens of all sequences in the step are
packed into one dimension, [num_tokens, hidden]; the attention context says where each sequence starts.

`packed_modules_mapping` tells the loader which checkpoint tensors go into which fused parameter.

Built as `Qwen3ForCausalLM(hf_config, parts=None, fuse=False, kernels=None)`: `parts` (a nanovllm_ref.Parts,
or None for the reference parts) supplies the element-wise ops, the weight loaders, the attention back-end
and the KV store; `fuse=True` swaps the reference element-wise ops for their compiled versions
(utils/fusion.py). `kernels` (a utils.fusion.FusedKernels) names the hand-written Triton kernels of the
decode step; None means "every one the parts allow" when fuse=True and the model is built on a CUDA device,
and none otherwise (models/decode_kernels.py decides).

Three routes through the model, chosen once per step in `DecoderModel.forward` (`step_kernels`):
| route          | when                                                    | per layer (Qwen3)                          |
| general        | prefill; no kernels                                     | the modules' forward: cuBLAS GEMMs and     |
|                |                                                         | the (compiled) reference ops               |
| fused decode   | decode of 1..max_m tokens with any kernel on            | `decode_fused`: add+RMSNorm, qkv GEMM,     |
|                |                                                         | q/k-norm+RoPE+store, attention (1-2),      |
|                |                                                         | o_proj split-K, add+RMSNorm, gate_up+SiLU, |
|                |                                                         | down split-K: 9 kernels (8 with one split) |
| large decode   | decode of > max_m tokens with an element-wise kernel on | `decode_fused` with cuBLAS GEMMs: the same |
|                | (`FusedKernels.large_batch`)                            | add+RMSNorm and q/k-norm+RoPE+store kernels|
Inside the fused route each step uses its kernel only where `kernels` says so, and otherwise the same
module call as the general route, so a student's part still runs as written.
"""
import torch
from torch import nn

from nanovllm_ref.config import rope_theta
from nanovllm_ref.layers.activation import SiluAndMul, silu_and_mul
from nanovllm_ref.layers.attention import Attention
from nanovllm_ref.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm_ref.layers.layernorm import RMSNorm, add_rms_norm, rms_norm
from nanovllm_ref.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                        load_gate_up_shard, load_qkv_shard)
from nanovllm_ref.layers.rope_scaling import rope_parameters_of
from nanovllm_ref.layers.rotary_embedding import RotaryEmbedding, apply_rope, apply_rotary, rope_cos_sin
from nanovllm_ref.models import decode_kernels
from nanovllm_ref.utils.context import current_metadata
from nanovllm_ref.utils.fusion import FusedKernels, choose, fused
from nanovllm_ref.utils.parallel import get_tp_size

# The reference of each part a model uses (nanovllm_ref.Parts field name -> function).
_REFERENCE_OPS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rope_cos_sin": rope_cos_sin,
                  "rotary": apply_rope, "silu_and_mul": silu_and_mul, "qkv_weight_loader": load_qkv_shard,
                  "gate_up_weight_loader": load_gate_up_shard}


class ModelOps:
    """The functions a model calls, resolved once from `parts` (None = the reference), `fuse` and `kernels`
    (the decode step's Triton kernels: see the module docstring; ValueError names a kernel that the parts
    do not allow)."""

    def __init__(self, parts=None, fuse: bool = False, kernels: FusedKernels | None = None, qk_norm: bool = True):
        for name, ref in _REFERENCE_OPS.items():
            setattr(self, name, choose(getattr(parts, name, ref) if parts is not None else ref, ref, fuse))
        self.attention_backend = getattr(parts, "attention_backend", None)
        self.store_kvcache = getattr(parts, "store_kvcache", None)
        # Qwen3's q/k norm + RoPE in one compiled kernel, only when both parts are the reference ones.
        reference_qk = getattr(parts, "rms_norm", rms_norm) is rms_norm and getattr(parts, "rotary", apply_rope) is apply_rope
        self.qk_norm_rope = qk_norm_rope.compiled() if fuse and reference_qk else None
        self.kernels = decode_kernels.resolve(parts, fuse, kernels, qk_norm)


@fused
def qk_norm_rope(positions, q, k, q_weight, k_weight, eps: float, cos_sin_cache):
    """Qwen3's per-head RMSNorm of q [T, H, d] and k [T, Hkv, d], then RoPE: one kernel when compiled."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config, qk_norm: bool, ops: ModelOps | None = None):
        ops = ops if ops is not None else ModelOps()
        super().__init__()
        tp = get_tp_size()
        self.head_dim = head_dim_of(config)
        total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads // tp, total_kv // tp
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          total_kv, bias=bias, loader=ops.qkv_weight_loader)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_theta(config),
                                          rope_parameters_of(config), cos_sin=ops.rope_cos_sin, rotary=ops.rotary)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              backend=ops.attention_backend, store=ops.store_kvcache)
        self.qk_norm = qk_norm
        self.fused_qk_norm_rope = ops.qk_norm_rope
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, norm=ops.rms_norm, add_norm=ops.add_rms_norm)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, norm=ops.rms_norm, add_norm=ops.add_rms_norm)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden_states)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (H + 2 * Hkv) * d] -> attention output [T, H * d]: q/k norm, RoPE, KV store, attention."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm and self.fused_qk_norm_rope is not None:      # one compiled kernel (GPU)
            q, k = self.fused_qk_norm_rope(positions, q, k, self.q_norm.weight, self.k_norm.weight,
                                           self.q_norm.eps, self.rotary_emb.cos_sin_cache)
        else:
            if self.qk_norm:                # Qwen3 normalises each head before RoPE (keeps logits bounded)
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary_emb(positions, q, k)
        return self.attn(q.flatten(1), k.flatten(1), v)

    def decode_fused(self, positions: torch.Tensor, hidden_states: torch.Tensor, kernels: FusedKernels):
        """The decode step of `forward` on the kernels that `kernels` turns on (the fused route of the module
        docstring). hidden_states: [B, hidden] -> [B, hidden], or o_proj's split-K partials [S, B, hidden]
        fp32 when kernels.split_k (the next add + RMSNorm kernel sums them)."""
        pdl = kernels.pdl
        qkv = self.qkv_proj.forward_small(hidden_states, pdl) if kernels.gemm else self.qkv_proj(hidden_states)
        if kernels.qk_norm_rope_store and self.attn.k_cache.numel() > 0:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            q = decode_kernels.qk_norm_rope_store(
                qkv, positions, self.rotary_emb.cos_sin_cache, norms[0], norms[1], norms[2], self.attn.k_cache,
                self.attn.v_cache, current_metadata().slot_mapping, self.num_heads, self.num_kv_heads,
                self.head_dim, use_pdl=pdl)
            o = self.attn.decode_cached(q)            # k and v of this step are in the cache already
        else:
            o = self.attend(positions, qkv)
        if kernels.split_k:
            return self.o_proj.forward_partials(o, pdl)
        return self.o_proj.forward_small(o, pdl) if kernels.gemm else self.o_proj(o)


class DecoderMLP(nn.Module):
    def __init__(self, config, ops: ModelOps | None = None):
        ops = ops if ops is not None else ModelOps()
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias,
                                                       loader=ops.gate_up_weight_loader)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul(ops.silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def decode_fused(self, x: torch.Tensor, kernels: FusedKernels) -> torch.Tensor:
        """`forward` on the decode kernels: [B, hidden] -> [B, hidden], or down's split-K partials
        [S, B, hidden] fp32 when kernels.split_k."""
        pdl = kernels.pdl
        if kernels.gemm_silu:
            h = self.gate_up_proj.forward_silu_mul(x, pdl)           # gate_up GEMM + SiLU-and-mul, one kernel
        else:
            h = self.act_fn(self.gate_up_proj.forward_small(x, pdl) if kernels.gemm else self.gate_up_proj(x))
        if kernels.split_k:
            return self.down_proj.forward_partials(h, pdl)
        return self.down_proj.forward_small(h, pdl) if kernels.gemm else self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, config, qk_norm: bool, ops: ModelOps | None = None):
        ops = ops if ops is not None else ModelOps()
        super().__init__()
        self.self_attn = DecoderAttention(config, qk_norm, ops)
        self.mlp = DecoderMLP(config, ops)
        norms = dict(eps=config.rms_norm_eps, norm=ops.rms_norm, add_norm=ops.add_rms_norm)
        self.input_layernorm = RMSNorm(config.hidden_size, **norms)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norms)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def decode_fused(self, positions, hidden_states, residual, kernels: FusedKernels):
        """`forward` of a decode step on the decode kernels. hidden_states: [B, hidden], or the previous
        layer's split-K partials [S, B, hidden] fp32; returns the same kinds (hidden or partials, residual)."""
        hidden_states, residual = _norm(self.input_layernorm, hidden_states, residual, kernels)
        hidden_states = self.self_attn.decode_fused(positions, hidden_states, kernels)
        hidden_states, residual = _norm(self.post_attention_layernorm, hidden_states, residual, kernels)
        return self.mlp.decode_fused(hidden_states, kernels), residual


def _norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, kernels: FusedKernels):
    """One RMSNorm of the fused decode route: (normed, new residual). The Triton kernel where `kernels`
    says so (it also takes split-K partials for x), else the module as the general route calls it."""
    if residual is None:
        if kernels.rms_norm:
            return norm.forward_fused(x, None, kernels.pdl)
        return norm(x), x
    if kernels.add_rms_norm:
        return norm.forward_fused(x, residual, kernels.pdl)
    return norm(x, residual)


class DecoderModel(nn.Module):
    def __init__(self, config, qk_norm: bool, ops: ModelOps | None = None):
        ops = ops if ops is not None else ModelOps()
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, qk_norm, ops) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, norm=ops.rms_norm, add_norm=ops.add_rms_norm)
        self.kernels = ops.kernels

    def step_kernels(self, num_tokens: int) -> FusedKernels | None:
        """The kernels of this step's route (module docstring), or None for the general route: a decode step
        of 1..max_m tokens takes every kernel on; a larger decode step only the element-wise ones (the GEMMs
        are cuBLAS's at that size, and without the small GEMMs there are no split-K partials)."""
        if not self.kernels.any() or current_metadata().is_prefill or num_tokens < 1:
            return None
        if num_tokens <= self.kernels.max_m:
            return self.kernels
        large = self.kernels.large_batch()
        return large if large.any() else None

    def fused_route(self, num_tokens: int) -> bool:
        """Whether this step takes a fused decode route (module docstring)."""
        return self.step_kernels(num_tokens) is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        kernels = self.step_kernels(input_ids.shape[0])
        if kernels is not None:
            for layer in self.layers:
                hidden_states, residual = layer.decode_fused(positions, hidden_states, residual, kernels)
            return _norm(self.norm, hidden_states, residual, kernels)[0]
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    QK_NORM = True
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, parts=None, fuse: bool = False, kernels: FusedKernels | None = None):
        super().__init__()
        self.model = DecoderModel(config, self.QK_NORM, ModelOps(parts, fuse, kernels, self.QK_NORM))
        self.kernels = self.model.kernels          # which decode kernels this model uses (utils/fusion.py)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[num_seqs, hidden] -> [num_seqs, vocab] (None on tensor-parallel ranks other than 0)."""
        return self.lm_head(hidden_states)
