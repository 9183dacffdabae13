"""FlashAttention back-end: used when the `flash-attn` package imports (optional; no wheel on PyPI).

Thin wrappers that map our back-end contract (nanovllm_ref/attn/__init__.py) onto flash-attn 2's API, as
upstream nano-vllm `layers/attention.py` does:
- varlen_prefill  -> flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ..., causal=True)
- paged_prefill   -> the same, with k/v = the paged caches and block_table=block_tables
- paged_decode    -> flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=context_lens,
                                             block_table=block_tables, causal=True)
flash-attn's paged KV needs the block size to be a multiple of 256, so `resolve_backend` picks this
back-end only then. Causal masks in flash-attn >= 2.1 are bottom-right aligned, as our contract requires.
"""
import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanovllm_ref.attn.torch_backend import store_kvcache  # noqa: F401  (the engine uses the Triton store on GPU)

PAGE_MULTIPLE = 256


def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                  softmax_scale=scale, causal=True)


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale):
    return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                  softmax_scale=scale, causal=True, block_table=block_tables)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                  block_table=block_tables, softmax_scale=scale, causal=True)
    return out.squeeze(1)
