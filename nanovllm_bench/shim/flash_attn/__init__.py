"""A stand-in `flash_attn` package, for running upstream nano-vllm where the flash-attn package is absent.

nano-vllm calls two flash-attn functions. Both go to nanovllm_ref's FlashAttention adapter
(nanovllm_ref/attn/flash_backend.py), which finds another installed FlashAttention: vLLM's bundled FA3 or
flash-attn-4. Only the nano-vllm peer's process puts this folder on sys.path (nanovllm_bench/peers/upstream.py):
on vLLM's path a `flash_attn` folder makes vLLM import `flash_attn.ops` from it and fail at start-up.
"""
import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)     # flash-attn-4's `flash_attn.cute` stays importable

from nanovllm_ref.attn import flash_backend as _flash  # noqa: E402

# This package stands where the flash-attn package would be, so that one is not looked for.
_impl = _flash.find_implementation(skip=("flash-attn",))
if _impl is None:
    raise ImportError("no FlashAttention for nano-vllm: neither vLLM's FA3 (vllm.vllm_flash_attn) nor "
                      "flash-attn-4 (flash_attn.cute) imports here")
IMPLEMENTATION = _impl.describe()


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, softmax_scale=None,
                           causal=False, block_table=None):
    """nano-vllm's prefill call: k, v are this step's keys ([num_tokens, kv_heads, head_dim]), or with a
    block_table the paged caches ([num_blocks, block_size, kv_heads, head_dim])."""
    if not causal:
        raise NotImplementedError("the stand-in maps causal attention only (nano-vllm asks for nothing else)")
    if block_table is None:
        return _impl.varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    return _impl.paged_prefill(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                            causal=False):
    """nano-vllm's decode call: q [batch, 1, heads, head_dim] against the paged caches."""
    return _impl.paged_decode(q[:, 0], k_cache, v_cache, block_table, cache_seqlens, softmax_scale)[:, None]
