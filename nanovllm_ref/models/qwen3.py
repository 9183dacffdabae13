"""Qwen3 decoder-only transformer for inference (chapter 03). Mirrors HF `modeling_qwen3.py` numerically,
with the engine's fused and tensor-parallel layers; upstream nano-vllm `models/qwen3.py`.

Per layer: x -> RMSNorm -> attention (fused QKV, per-head q/k RMSNorm, RoPE, GQA) -> + residual
           -> RMSNorm -> MLP (fused gate/up, SiLU-and-mul, down) -> + residual.
The residual add is fused into the next RMSNorm call. Shapes: tokens of all sequences in the step are
packed into one dimension, [num_tokens, hidden]; the attention context says where each sequence starts.

`packed_modules_mapping` tells the loader which checkpoint tensors go into which fused parameter.

Built as `Qwen3ForCausalLM(hf_config, ops=None)`: `ops` (models/ops.ModelOps, made by the engine with
nanovllm_ref.Parts.model_ops; None = the reference, eager) says what each layer calls: the element-wise ops
and weight loaders (compiled, or a student's parts), the attention back-end and KV store, and the Triton
kernels (`ops.kernels`, utils/fusion.FusedKernels). Each module picks its kernels when it is built and has
one forward (vLLM's CustomOp dispatch); what a step's size or kind changes is decided inside it:

| module                 | built with a kernel (ops.kernels)           | in a step                                     |
|------------------------|---------------------------------------------|-----------------------------------------------|
| RMSNorm (every norm)   | rms_norm / add_rms_norm: one Triton kernel  | every step; it also sums split-K partials     |
| qkv / o / gate_up /    | gemm: the small-M Triton GEMM               | batches of 1..max_m rows; larger ones cuBLAS  |
| down projections       |                                             |                                               |
| o_proj, down_proj      | split_k: out as layers.linear.SplitK        | the same batches: partials the next norm sums |
| gate_up_proj           | gemm_silu: SiLU-and-mul in its epilogue     | the same batches; larger ones and prefill:    |
|                        | (kernels/silu_mul.py after cuBLAS above)    | cuBLAS, then the SiLU-and-mul kernel (act_fn  |
|                        |                                             | is Identity: gate_up applies it)              |
| attention              | qk_norm_rope_store: q/k norm + RoPE + KV    | decode steps once the cache exists; prefill   |
|                        | store in one kernel                         | runs it without the store (qk_norm_rope)      |
A decode step of up to max_m rows then runs 9 kernels a layer (8 with one attention split); a larger one
keeps the norm and q/k kernels with cuBLAS GEMMs. With FusedKernels.persistent (decode_kernels="persistent"; off
in the engine's plan: level with these kernels on the H200) a decode step of one sequence is one persistent
kernel instead (kernels/persistent_decode.py).
"""
import torch
from torch import nn

from nanovllm_ref.config import rope_theta
from nanovllm_ref.layers.activation import SiluAndMul
from nanovllm_ref.layers.attention import Attention
from nanovllm_ref.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm_ref.layers.layernorm import RMSNorm, rms_norm
from nanovllm_ref.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, SmallGemm)
from nanovllm_ref.layers.rope_scaling import rope_parameters_of
from nanovllm_ref.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from nanovllm_ref.models.ops import ModelOps
from nanovllm_ref.utils.context import current_metadata
from nanovllm_ref.utils.fusion import fused
from nanovllm_ref.utils.parallel import get_tp_size


def _gemm(ops: ModelOps, **form) -> SmallGemm | None:
    """How a linear layer runs small batches under `ops` (layers/linear.SmallGemm), or None (F.linear)."""
    k = ops.kernels
    return SmallGemm(max_m=k.max_m, pdl=k.pdl, **form) if k.gemm else None


def _norm_kernel(ops: ModelOps) -> str | None:
    k = ops.kernels
    return {(True, True): "both", (True, False): "norm", (False, True): "add"}.get((k.rms_norm, k.add_rms_norm))


def _qk_norm_rope_store(*args, **kwargs):
    """kernels/qk_norm_rope_store.qk_norm_rope_store, imported at its first call (defining a Triton kernel fixes
    interpreter or compiler for the process: nanovllm_ref/kernels/__init__.py)."""
    from nanovllm_ref.kernels.qk_norm_rope_store import qk_norm_rope_store
    return qk_norm_rope_store(*args, **kwargs)


def _silu_and_mul_kernel(x):
    """kernels/silu_mul.silu_and_mul (SiLU-and-mul after cuBLAS's gate_up GEMM), imported at its first call."""
    from nanovllm_ref.kernels.silu_mul import silu_and_mul
    return silu_and_mul(x)


def _qk_norm_rope_kernel(*args, **kwargs):
    """kernels/qk_norm_rope_store.qk_norm_rope (the prefill form: no store), imported at its first call."""
    from nanovllm_ref.kernels.qk_norm_rope_store import qk_norm_rope as kernel
    return kernel(*args, **kwargs)


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
                                          total_kv, bias=bias, loader=ops.qkv_weight_loader, small_gemm=_gemm(ops))
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias,
                                        small_gemm=_gemm(ops, split_k=ops.kernels.split_k))
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_theta(config),
                                          rope_parameters_of(config), cos_sin=ops.rope_cos_sin, rotary=ops.rotary)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads,
                              backend=ops.attention_backend, store=ops.store_kvcache)
        self.qk_norm = qk_norm
        self.fused_qk_norm_rope = ops.qk_norm_rope            # compiled q/k norm + RoPE (GPU), or None
        self.qk_kernel = ops.kernels.qk_norm_rope_store        # q/k norm + RoPE + KV store, one Triton kernel
        self.pdl = ops.kernels.pdl
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, norm=ops.rms_norm, add_norm=ops.add_rms_norm)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, norm=ops.rms_norm, add_norm=ops.add_rms_norm)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        """positions [T] int64, hidden_states [T, hidden] -> o_proj's output [T, hidden] (or its SplitK)."""
        qkv = self.qkv_proj(hidden_states)
        if self.qk_kernel:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            if not current_metadata().is_prefill and self.attn.has_cache:
                # One kernel: q/k norm, RoPE, and k, v written into the cache; attention then reads them there.
                q = _qk_norm_rope_store(qkv, positions, self.rotary_emb.cos_sin_cache, *norms, self.attn.k_cache,
                                        self.attn.v_cache, current_metadata().slot_mapping, self.num_heads,
                                        self.num_kv_heads, self.head_dim, use_pdl=self.pdl)
                return self.o_proj(self.attn(q))
            # Prefill: the same kernel returns q and k (the layer stores k and v, and attends over them).
            q, k = _qk_norm_rope_kernel(qkv, positions, self.rotary_emb.cos_sin_cache, *norms, self.num_heads,
                                        self.num_kv_heads, self.head_dim, use_pdl=self.pdl)
            v = qkv[:, self.q_size + self.kv_size:]
            return self.o_proj(self.attn(q, k.flatten(1), v))
        return self.o_proj(self.attend(positions, qkv))

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


class DecoderMLP(nn.Module):
    def __init__(self, config, ops: ModelOps | None = None):
        ops = ops if ops is not None else ModelOps()
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        epilogue = ops.kernels.gemm_silu
        # With the SiLU epilogue gate_up_proj applies SiLU-and-mul itself (in its GEMM for small batches, with the
        # SiLU-and-mul kernel after cuBLAS for larger ones), so act_fn is the identity; otherwise gate_up_proj
        # returns [gate | up] and act_fn applies it.
        act = SiluAndMul(_silu_and_mul_kernel if epilogue else ops.silu_and_mul)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias,
                                                       loader=ops.gate_up_weight_loader, act=act if epilogue else None,
                                                       small_gemm=_gemm(ops, silu_epilogue=epilogue))
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias,
                                           small_gemm=_gemm(ops, split_k=ops.kernels.split_k))
        self.act_fn = nn.Identity() if epilogue else act

    def forward(self, x: torch.Tensor):
        """x [T, hidden] -> down_proj's output [T, hidden] (or its SplitK)."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, qk_norm: bool, ops: ModelOps | None = None):
        ops = ops if ops is not None else ModelOps()
        super().__init__()
        self.self_attn = DecoderAttention(config, qk_norm, ops)
        self.mlp = DecoderMLP(config, ops)
        norms = dict(eps=config.rms_norm_eps, norm=ops.rms_norm, add_norm=ops.add_rms_norm, kernel=_norm_kernel(ops),
                     pdl=ops.kernels.pdl)
        self.input_layernorm = RMSNorm(config.hidden_size, **norms)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norms)

    def forward(self, positions, hidden_states, residual):
        """hidden_states: [T, hidden] (or the previous layer's SplitK); residual: [T, hidden] or None (layer 0).
        Returns (the MLP's output, the residual stream)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, config, qk_norm: bool, ops: ModelOps | None = None):
        ops = ops if ops is not None else ModelOps()
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, qk_norm, ops) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, norm=ops.rms_norm, add_norm=ops.add_rms_norm,
                            kernel=_norm_kernel(ops), pdl=ops.kernels.pdl)
        # A decode step of one sequence as one persistent kernel (kernels/persistent_decode.py; the engine's plan
        # leaves it off unless decode_kernels="persistent"). Made at its first step, once the KV cache exists,
        # and made again if the cache is re-allocated. The kernel has no linear biases and no tensor parallelism.
        self.persistent = ops.kernels.persistent
        if self.persistent and (get_tp_size() > 1 or getattr(config, "attention_bias", False)
                                or getattr(config, "mlp_bias", False)):
            raise ValueError("FusedKernels.persistent needs tensor parallel size 1 and a model without attention_bias "
                             "or mlp_bias (the persistent step has neither)")
        self._persistent_step, self._persistent_key, self._retired_steps = None, None, []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.persistent and input_ids.shape[0] == 1:
            meta = current_metadata()
            if not meta.is_prefill and meta.block_tables is not None and self.layers[0].self_attn.attn.has_cache:
                return self.persistent_step()(input_ids, positions, meta.slot_mapping, meta.block_tables,
                                              meta.context_lens)
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def persistent_step(self, programs: int | None = None):
        """The kernels/persistent_decode.PersistentDecode of this model's weights and KV cache, made once per
        cache; `programs` (default: one per SM, 3 under the interpreter) makes it again with that many."""
        attns = [layer.self_attn for layer in self.layers]
        key = attns[0].attn.k_cache.data_ptr()
        if self._persistent_step is None or self._persistent_key != key or \
                (programs is not None and programs != self._persistent_step.config.programs):
            from nanovllm_ref.kernels.persistent_decode import PersistentDecode
            weights = [{"qkv": a.qkv_proj.weight, "o": a.o_proj.weight, "gate_up": layer.mlp.gate_up_proj.weight,
                        "down": layer.mlp.down_proj.weight, "input_norm": layer.input_layernorm.weight,
                        "post_norm": layer.post_attention_layernorm.weight,
                        "q_norm": a.q_norm.weight if a.qk_norm else None,
                        "k_norm": a.k_norm.weight if a.qk_norm else None} for a, layer in zip(attns, self.layers)]
            a = attns[0]
            if self._persistent_step is not None:
                # A CUDA graph captured with the old step still points at its scratch: keep that alive.
                self._retired_steps.append(self._persistent_step)
            self._persistent_step = PersistentDecode(
                weights, self.embed_tokens.weight, self.norm.weight, self.norm.eps,
                [x.attn.k_cache for x in attns], [x.attn.v_cache for x in attns], a.rotary_emb.cos_sin_cache,
                a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale, programs=programs)
            self._persistent_key = key
        return self._persistent_step


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

    def __init__(self, config, ops: ModelOps | None = None):
        super().__init__()
        ops = ops if ops is not None else ModelOps()
        if not isinstance(ops, ModelOps):
            raise TypeError(f"ops must be a models.ops.ModelOps or None, got {type(ops).__name__}")
        self.model = DecoderModel(config, self.QK_NORM, ops)
        self.kernels = ops.kernels                 # which Triton kernels this model uses (utils/fusion.py)
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
