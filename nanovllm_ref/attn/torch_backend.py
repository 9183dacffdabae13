"""Pure-PyTorch attention over a paged KV cache: the readable reference back-end (chapter 04).

Slow but obviously right. Every other back-end is tested against this one. Layouts and argument meanings
are in `nanovllm_ref/attn/__init__.py`. Maths runs in fp32 whatever the cache dtype, because the softmax of
bf16 scores loses the small probabilities that a long context is made of.

`store_kvcache` writes this step's K/V into the cache (the Triton version is kernels/store_kvcache.py).
The decode path has no host synchronisation (no `.item()`, no data-dependent shapes), so it can be captured
in a CUDA graph; the prefill paths loop over sequences in Python and are never captured.
"""
import torch
import torch.nn.functional as F


def _causal_attention(q, k, v, scale):
    """q: [q_len, H, D]; k, v: [k_len, Hkv, D] with k_len >= q_len. Query i sees keys 0..k_len-q_len+i."""
    q_len, k_len = q.shape[0], k.shape[0]
    # Bottom-right aligned causal mask: the last query is the newest token and sees every key.
    rows = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
    mask = torch.arange(k_len, device=q.device)[None, :] <= rows          # [q_len, k_len] bool
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale, enable_gqa=True)                     # [H, q_len, D]
    return out.transpose(0, 1).to(q.dtype)


def _gather_blocks(cache, block_table, num_tokens):
    """The first `num_tokens` entries of one sequence's cache: [num_tokens, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]                       # [n, block_size, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:num_tokens]


def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    """Causal attention over packed sequences with no cached prefix. Returns [num_tokens, H, D]."""
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        qs, qe, ks, ke = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        out[qs:qe] = _causal_attention(q[qs:qe], k[ks:ke], v[ks:ke], scale)
    return out


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale):
    """Causal attention whose keys (cached prefix + this step's tokens) come from the paged cache."""
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        qs, qe = bounds_q[i], bounds_q[i + 1]
        k_len = bounds_k[i + 1] - bounds_k[i]
        k = _gather_blocks(k_cache, block_tables[i], k_len)
        v = _gather_blocks(v_cache, block_tables[i], k_len)
        out[qs:qe] = _causal_attention(q[qs:qe], k, v, scale)
    return out


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One new query per sequence against its whole paged context. q: [B, H, D] -> [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads                                     # GQA: query heads per KV head
    # Padding entries are -1; clamp so the gather stays in range, the length mask removes them.
    table = block_tables.long().clamp(min=0)
    k = k_cache[table].reshape(batch, -1, num_kv_heads, head_dim).float()  # [B, T, Hkv, D]
    v = v_cache[table].reshape(batch, -1, num_kv_heads, head_dim).float()
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * scale                # [B, Hkv, G, T]
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgt,bthd->bhgd", probs, v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def _check_store_args(key, value, k_cache, v_cache, slot_mapping):
    """Shape/dtype/device checks that need no host synchronisation (safe under CUDA-graph capture)."""
    if key.dim() != 3:
        raise ValueError(f"key must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(key.shape[1:]):
        raise ValueError(f"key rows are {tuple(key.shape[1:])} but cache rows are {tuple(k_cache.shape[2:])} "
                         "(num_kv_heads, head_dim)")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 (or int64), got {slot_mapping.dtype}")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtype mismatch: key {key.dtype}, value {value.dtype}, "
                         f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    devices = {key.device, value.device, k_cache.device, v_cache.device, slot_mapping.device}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """Same semantics in plain PyTorch: index_copy into the flattened cache, skipping slot -1.

    The boolean filter is a host synchronisation on CUDA, so use this on CPU (or outside CUDA graphs)."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[keep])


store_kvcache_torch = store_kvcache
