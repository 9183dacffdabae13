"""Write this step's keys and values into the paged KV cache (chapter 06).

What it computes
    For every token i of the step, with s = slot_mapping[i] (s = block_id * block_size + offset):
        k_cache.view(-1, Hkv, D)[s] = key[i];  v_cache.view(-1, Hkv, D)[s] = value[i]
    A slot of -1 means "do not write": the padding rows of a batch replayed through a captured CUDA graph.
    This is the "store" half of PagedAttention (Kwon et al., 2023, "Efficient Memory Management for Large
    Language Model Serving with PagedAttention", §4.1): logically contiguous tokens live in fixed-size
    physical blocks anywhere in the cache, and the block manager has already turned (sequence, position)
    into a flat slot, so the kernel is a pure scatter.

Tiling
    One program per token; it moves the whole [num_kv_heads, head_dim] row of K and of V (1-4 KiB for real
    models) in one masked 2-D load and store. There is no reuse to exploit, so bigger tiles would not help;
    one token per program keeps the kernel a dozen lines and still saturates bandwidth at prefill sizes.
    BLOCK_H and BLOCK_D are the next powers of two (Triton tiles must be), masked back to the real sizes.

Strides
    key/value usually come from a fused QKV projection, so they are views into a wider [N, (H+2Hkv)*D]
    matrix: the token stride is not Hkv*D. We pass the token and head strides and only require
    stride(-1) == 1. The caches are allocated by the engine and must be contiguous.

Checks are cheap (shapes, dtypes, devices; never the slot values), because on GPU this runs inside a
captured CUDA graph where a host synchronisation is not allowed.

`store_kvcache_torch` has the same semantics in plain PyTorch for CPU engines (and as the reference).
"""
import os

import torch
import triton
import triton.language as tl

from nanovllm_ref.attn.torch_backend import _check_store_args, store_kvcache_torch  # noqa: F401  (re-export)

# Triton picks interpreter or compiler when each @triton.jit below runs (see nanovllm_ref/kernels/__init__.py).
DEFINED_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:   # padding row of a CUDA-graph batch: nothing to store
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    # The cache row of a slot is contiguous ([Hkv, D]), so its address needs no strides beyond the slot.
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Triton scatter of key/value [N, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D]."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need stride(-1) == 1 (head_dim contiguous)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
