"""Triton attention back-end (chapter 06): thin wrappers over `nanovllm_ref/kernels`.

Same functions, signatures and cache layout as the reference `torch_backend` (see `nanovllm_ref/attn`).
The kernels and their design notes (online softmax, paged gather, split-KV decode) are in
`nanovllm_ref/kernels/attention.py`; the KV store is `nanovllm_ref/kernels/store_kvcache.py`.

`varlen_prefill` (no cache) runs our Triton kernel. PyTorch's own FlashAttention varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, CUDA, fp16/bf16) is wired in as an option
(PREFER_TORCH_VARLEN): on an H200 with torch 2.11 it was slower than ours at 8 x 1024 tokens of
Qwen3-0.6B attention (178 us against 136 us; bench/gpu_kernels.py), so it is off by default.
"""
import inspect

import torch

# Import through the package: nanovllm_ref/kernels/__init__.py switches on the Triton interpreter on a
# machine without CUDA before any kernel is defined.
from nanovllm_ref.kernels import attention as _attn
from nanovllm_ref.kernels.store_kvcache import store_kvcache, store_kvcache_torch  # noqa: F401  (re-export)

__all__ = ["varlen_prefill", "paged_prefill", "paged_decode", "paged_decode_pdl", "store_kvcache",
           "store_kvcache_torch"]

PREFER_TORCH_VARLEN = False  # use torch's varlen_attn for varlen_prefill where it applies
_torch_varlen = None         # (function, its keyword names) once probed; False if unusable


def _probe_torch_varlen():
    global _torch_varlen
    if _torch_varlen is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
            _torch_varlen = (varlen_attn, set(inspect.signature(varlen_attn).parameters))
        except Exception:
            _torch_varlen = False
    return _torch_varlen


def _torch_varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    """PyTorch's FlashAttention varlen kernel, or None when it does not apply here."""
    global _torch_varlen
    probed = _probe_torch_varlen()
    if not probed or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if q.shape[-1] % 8 != 0 or q.shape[-1] > 256:
        return None
    fn, params = probed
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)              # causal; flash aligns it bottom-right
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return None
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        return None
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True              # torch 2.11 has no flag and takes GQA as is (checked on GPU)
    try:
        return fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
    except (RuntimeError, ValueError, TypeError):
        _torch_varlen = False                        # e.g. no flash kernel for this GPU: use ours from now on
        return None


def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    """Causal attention over this step's tokens only (no cached prefix). Returns [num_tokens, H, D]."""
    if PREFER_TORCH_VARLEN:
        out = _torch_varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
        if out is not None:
            return out
    return _attn.varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale):
    """Causal attention whose keys (cached prefix + this step's tokens) come from the paged cache."""
    return _attn.paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, scale)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One new query per sequence against its whole paged context. q: [B, H, D] -> [B, H, D].
    Split-KV (Flash-Decoding); no host synchronisation, so it can be captured in a CUDA graph."""
    return _attn.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_decode_pdl(q, k_cache, v_cache, block_tables, context_lens, scale):
    """`paged_decode` with its kernels launched by programmatic dependent launch (Hopper): what an engine whose
    decode kernels use PDL attends with (nanovllm_ref.Parts.resolve)."""
    return _attn.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, use_pdl=True)
