"""Qwen3 decoder-only transformer for inference (chapter 03). Mirrors HF `modeling_qwen3.py` numerically,
with the engine's fused and tensor-parallel layers; upstream nano-vllm `models/qwen3.py`.

Per layer: x -> RMSNorm -> attention (fused QKV, per-head q/k RMSNorm, RoPE, GQA) -> + residual
           -> RMSNorm -> MLP (fused gate/up, SiLU-and-mul, down) -> + residual.
The residual add is fused into the next RMSNorm call. Shapes: tokens of all sequences in the step are
packed into one dimension, [num_tokens, hidden]; the attention context says where each sequence starts.

`packed_modules_mapping` tells the loader which checkpoint tensors go into which fused parameter.
"""
import torch
from torch import nn

from nanovllm_ref.config import rope_theta
from nanovllm_ref.layers.activation import SiluAndMul
from nanovllm_ref.layers.attention import Attention
from nanovllm_ref.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm_ref.layers.layernorm import RMSNorm, rms_norm
from nanovllm_ref.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm_ref.layers.rope_scaling import rope_parameters_of
from nanovllm_ref.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from nanovllm_ref.utils.fusion import fused
from nanovllm_ref.utils.parallel import get_tp_size


@fused
def qk_norm_rope(positions, q, k, q_weight, k_weight, eps: float, cos_sin_cache):
    """Qwen3's per-head RMSNorm of q [T, H, d] and k [T, Hkv, d], then RoPE: one kernel when compiled."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q, k = rms_norm.eager(q, q_weight, eps), rms_norm.eager(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        tp = get_tp_size()
        self.head_dim = head_dim_of(config)
        total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads // tp, total_kv // tp
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          total_kv, bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_theta(config),
                                          rope_parameters_of(config))
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:                    # Qwen3 normalises each head before RoPE (keeps logits bounded)
            q, k = qk_norm_rope(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                self.rotary_emb.cos_sin_cache)
        else:
            q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q.flatten(1), k.flatten(1), v)
        return self.o_proj(o)


class DecoderMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        self.self_attn = DecoderAttention(config, qk_norm)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, config, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, qk_norm) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
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

    def __init__(self, config):
        super().__init__()
        self.model = DecoderModel(config, self.QK_NORM)
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
