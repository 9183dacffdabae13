"""CPU attention back-end: the torch back-end's maths, arranged for a CPU (issue 15).

Same functions, signatures and cache layout as the reference `torch_backend` (see `nanovllm_ref/attn`), and
tested against it. `resolve_backend("auto", "cpu")` picks this one. What differs, and why:

- Decode gathers only the tokens each sequence has. The torch back-end gathers whole blocks (with 256-token
  blocks and ~100-token contexts, most of what it copies is empty) and then runs einsum/masked-softmax.
  Here the flat slot of every real token (`block_table[t // bs] * bs + t % bs`) is computed once per step
  and reused by all layers; each layer does one `index_select` per cache and one SDPA call.
- GQA without copies: the G query heads that share a KV head become G "query rows" of that head,
  q: [B, Hkv, G, D] against k: [B, Hkv, T, D], so no K/V head is repeated.
- Prefill uses SDPA's causal flag where a sequence has no cached prefix (no mask tensor to build).
- `store_kvcache` skips the boolean filter of slot -1 (three `nonzero` calls per layer) when a step has
  no such slot; whether it has one is checked once per step.

The per-step plans are cached by tensor identity and in-place version, so they are rebuilt whenever the
model runner hands over new (or modified) metadata. This reads metadata on the host (`.tolist()`, `max`):
fine on a CPU, and a reason not to use this back-end inside a CUDA graph.
"""
import torch
import torch.nn.functional as F

from nanovllm_ref.attn.torch_backend import _check_store_args


class _Memo:
    """Remembers one value computed from some metadata tensors until they are replaced or their values change.

    The model runner makes new metadata tensors every step, and every layer of the step passes the same
    ones, so the value is built once per step. A copy of the tensors' values guards against a caller that
    writes into them in place (inference tensors have no version counter to tell us)."""

    def __init__(self):
        self.key, self.copies, self.value = None, None, None

    def get(self, tensors, extra, build):
        key = tuple(id(t) for t in tensors) + tuple(extra)
        if key != self.key or not all(c.shape == t.shape and torch.equal(c, t) for c, t in zip(self.copies, tensors)):
            self.key = None
            self.value = build()
            # The copies also keep the ids from being reused: the originals stay alive with the key.
            self.key, self.copies, self.refs = key, [t.clone() for t in tensors], tensors
        return self.value


_decode_plan, _store_plan = _Memo(), _Memo()


def _slots(block_table_row, length, block_size):
    """Flat cache slots of tokens 0..length-1 of one sequence: [length] int64."""
    t = torch.arange(length, device=block_table_row.device)
    return block_table_row.long()[t // block_size] * block_size + t % block_size


def _attend(q, k, v, scale, causal=False, mask=None):
    """q: [q_len, H, D]; k, v: [k_len, Hkv, D] -> [q_len, H, D], fp32 maths, GQA through enable_gqa."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return out.transpose(0, 1).to(q.dtype)


def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    """Causal attention over packed sequences with no cached prefix. Returns [num_tokens, H, D]."""
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        qs, qe, ks, ke = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if qe - qs == ke - ks:
            out[qs:qe] = _attend(q[qs:qe], k[ks:ke], v[ks:ke], scale, causal=True)
        else:                                        # more keys than queries: bottom-right aligned mask
            out[qs:qe] = _attend(q[qs:qe], k[ks:ke], v[ks:ke], scale, mask=_bottom_right(qe - qs, ke - ks, q.device))
    return out


def _bottom_right(q_len, k_len, device):
    """[q_len, k_len] bool: query i sees keys 0..k_len-q_len+i."""
    return torch.arange(k_len, device=device)[None, :] <= torch.arange(q_len, device=device)[:, None] + (k_len - q_len)


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale):
    """Causal attention whose keys (cached prefix + this step's tokens) come from the paged cache."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        qs, qe = bounds_q[i], bounds_q[i + 1]
        k_len = bounds_k[i + 1] - bounds_k[i]
        slots = _slots(block_tables[i], k_len, block_size)
        k, v = k_flat.index_select(0, slots), v_flat.index_select(0, slots)
        if qe - qs == k_len:
            out[qs:qe] = _attend(q[qs:qe], k, v, scale, causal=True)
        else:
            out[qs:qe] = _attend(q[qs:qe], k, v, scale, mask=_bottom_right(qe - qs, k_len, q.device))
    return out


def _build_decode_plan(block_tables, context_lens, block_size):
    """Slots [B * T] of every real token (T = longest context; shorter rows repeat a valid slot) and the
    [B, 1, 1, T] bool mask of real tokens."""
    lens = context_lens.long()
    batch, longest = lens.shape[0], max(int(lens.max()), 1)
    t = torch.arange(longest, device=lens.device)
    valid = t[None, :] < lens[:, None]                                       # [B, T]
    table = block_tables.long().clamp(min=0)
    blocks = table.gather(1, (t // block_size).clamp(max=table.shape[1] - 1).expand(batch, -1))
    slots = torch.where(valid, blocks * block_size + t % block_size, 0)
    return slots.reshape(-1), valid[:, None, None, :], longest


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One new query per sequence against its whole paged context. q: [B, H, D] -> [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    slots, valid, longest = _decode_plan.get((block_tables, context_lens), (block_size,),
                                             lambda: _build_decode_plan(block_tables, context_lens, block_size))
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(batch, longest, num_kv_heads, head_dim)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(batch, longest, num_kv_heads, head_dim)
    # The G query heads of each KV head act as G query rows of that head: no K/V head is repeated.
    qg = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                         attn_mask=valid, scale=scale)             # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write this step's K/V at `slot_mapping` (slot -1: skip), like torch_backend.store_kvcache."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)

    def plan():
        keep = slot_mapping >= 0
        return (None if bool(keep.all()) else keep), slot_mapping[keep].long()
    keep, slots = _store_plan.get((slot_mapping,), (), plan)
    if keep is not None:
        key, value = key[keep], value[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)
