"""The attention layer of the engine: store this step's K/V in the paged cache, then attend (chapter 04).

q, k, v arrive flat from the fused QKV projection: [num_tokens, heads * head_dim]. The layer
1. writes k and v into its layer's cache at `context.slot_mapping` (store_kvcache), then
2. calls its attention back-end (nanovllm_ref/attn; the model runner's choice, or a Parts back-end):
   - prefill with no cached prefix: attention over this step's k, v (`varlen_prefill`);
   - prefill with a cached prefix or an earlier chunk: keys come from the cache (`paged_prefill`);
   - decode: one query per sequence against its whole context in the cache (`paged_decode`).
Before the KV cache exists (the model runner's warm-up), step 1 is skipped and prefill uses k, v directly.
A decode step whose k and v a fused kernel already wrote into the cache (models/qwen3.py: q/k norm + RoPE +
store in one kernel) calls the layer with k = v = None: step 1 is skipped, step 2 is the same.

The step's metadata (slot mapping, cu_seqlens, block tables, context lengths) is not an argument of
forward: it is read from `current_metadata()`, set by the model runner's `with attention_metadata(meta):`
around the forward (nanovllm_ref/utils/context.py, the one hidden channel of the design).
"""
import torch
from torch import nn

from nanovllm_ref.attn.torch_backend import store_kvcache as store_kvcache_torch
from nanovllm_ref.utils.context import current_metadata


class Attention(nn.Module):
    """Paged attention of one layer. backend: an object with varlen_prefill / paged_prefill / paged_decode
    (nanovllm_ref.attn.AttentionBackend; default the torch back-end); store: the KV-store function
    (key, value, k_cache, v_cache, slot_mapping) -> None (default the torch one)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, backend=None, store=None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = self.v_cache = torch.tensor([])   # views of the engine's cache, set by the model runner
        if backend is None:
            from nanovllm_ref.attn import get_backend
            backend = get_backend("torch")
        self.backend = backend
        self.store = store if store is not None else store_kvcache_torch

    @property
    def has_cache(self) -> bool:
        """The KV cache exists (the model runner allocated it after its warm-up)."""
        return self.k_cache.numel() > 0

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """q: [N, H * D] (or [N, H, D]); k, v: [N, Hkv * D], or both None in a decode step whose k and v are in
        the cache already (module docstring) -> [N, H * D]."""
        ctx = current_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        has_cache = self.has_cache
        if k is None:
            if ctx.is_prefill or not has_cache:
                raise ValueError("k and v may be left out only in a decode step, once the KV cache exists")
        else:
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            if has_cache:
                self.store(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_prefill:
            if ctx.block_tables is None or not has_cache:
                o = self.backend.varlen_prefill(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                                ctx.max_seqlen_q, ctx.max_seqlen_k, self.scale)
            else:
                o = self.backend.paged_prefill(q, self.k_cache, self.v_cache, ctx.block_tables,
                                               ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                               ctx.max_seqlen_q, ctx.max_seqlen_k, self.scale)
        else:
            o = self.backend.paged_decode(q, self.k_cache, self.v_cache, ctx.block_tables,
                                          ctx.context_lens, self.scale)
        return o.reshape(-1, self.num_heads * self.head_dim)
