"""Mutation tests of the chapter 06 check helpers (nanovllm_course/ch06.py).

Each check passes on the reference answers (printing exactly its `E6.n ok` line), fails on a stub with
"not implemented yet", and fails on planted plausible mistakes with a message pointing at the mistake.
The Triton mutants are one kernel each with a `BUG` constexpr that switches one mistake on; without CUDA
they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before this module
defines them). The out-of-bounds mutants (slot -1 written, unmasked block-table load) are caught by the
interpreter's memory watch; on a GPU the slot -1 write is caught by the guard rows.
"""
import functools
import os
import re

import pytest
import torch
import triton
import triton.language as tl

from course_checks import fails, passes, stub
from nanovllm_course import ch06
from nanovllm_course.export import is_stub, parts_from_functions

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"



# == E6.1 ===================================================================================================

@triton.jit
def _store_mutant(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                  stride_vh, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, BUG: tl.constexpr):
    if BUG == "int32":
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token)
    else:
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    if BUG == "padding_to_slot_1":    # "slots below 1 are special": padding rows go to slot 1
        slot = tl.where(slot < 0, 1, slot)
    if BUG == "writeback":            # a padding row copies slot 0 onto itself: "harmless", and no branch
        if slot < 0:
            row = h * HEAD_DIM + d
            m = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
            tl.store(k_cache_ptr + row, tl.load(k_cache_ptr + row, mask=m), mask=m)
            tl.store(v_cache_ptr + row, tl.load(v_cache_ptr + row, mask=m), mask=m)
    if ((slot >= 0) & (BUG != "slot_gt_zero")) | ((slot > 0) & (BUG == "slot_gt_zero")) | (BUG == "writes_minus_one"):
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        if BUG == "no_mask":
            mask = (h < BLOCK_H) & (d < BLOCK_D)
        if BUG == "contiguous_key":
            stride_kt = NUM_KV_HEADS * HEAD_DIM
            stride_kh = HEAD_DIM
            stride_vt = NUM_KV_HEADS * HEAD_DIM
            stride_vh = HEAD_DIM
        if BUG == "v_with_k_strides":
            stride_vt = stride_kt
            stride_vh = stride_kh
        if BUG == "k_with_v_strides":
            stride_kt = stride_vt
            stride_kh = stride_vh
        if BUG == "head_stride_d":        # the head stride taken as HEAD_DIM, as if heads were packed
            stride_kh = HEAD_DIM
            stride_vh = HEAD_DIM
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
        if BUG == "slot_plus_one":
            dst = (slot + 1) * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
        if BUG == "store_unmasked":       # masked loads, unmasked stores: padded lanes spill into the next slot
            k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
            v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
            store_mask = (h < BLOCK_H) & (d < BLOCK_D) & (h * HEAD_DIM + d < 2 * NUM_KV_HEADS * HEAD_DIM)
        elif BUG == "load_unmasked":      # whole tiles loaded, only the store masked
            k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d)
            v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d)
            store_mask = mask
        else:
            k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
            v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
            store_mask = mask
        if BUG == "via_fp16":             # "save bandwidth": the row passes through fp16
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        if BUG == "kv_swapped":
            tl.store(k_cache_ptr + dst, v, mask=store_mask)
            tl.store(v_cache_ptr + dst, k, mask=store_mask)
        else:
            tl.store(k_cache_ptr + dst, k, mask=store_mask)
            tl.store(v_cache_ptr + dst, v, mask=store_mask)
        if BUG == "clears_key":           # "frees" the staged row after storing it
            tl.store(key_ptr + token * stride_kt + h * stride_kh + d, tl.zeros_like(k), mask=mask)


def store_with(bug):
    def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
        n, hkv, d = key.shape
        if bug == "launcher_asserts":
            assert key.is_contiguous() and value.is_contiguous(), "key/value must be contiguous"
        if bug == "last_token_skipped":
            n -= 1                        # grid off by one
        _store_mutant[(n,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1),
                            value.stride(0), value.stride(1), NUM_KV_HEADS=hkv, HEAD_DIM=d,
                            BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d), BUG=bug)
    return store_kvcache


# (mistake, what the message must say); each kernel is rejected on every call, whatever the draw
STORE_MUTANTS = [
    ("no_mask", "mask"),
    ("writes_minus_one", "slot of -1 means 'do not write'"),
    ("contiguous_key", "is a strided view"),
    ("kv_swapped", "did you swap them"),
    ("v_with_k_strides", "address value with stride_vt, stride_vh"),        # V read with K's strides
    ("slot_gt_zero", "test slot >= 0, not slot > 0"),                        # slot 0 skipped
    ("writeback", "has slot -1, but your kernel stored into slot 0"),        # padding rows copy slot 0 onto itself
]
STORE_MUTANTS += [
    ("k_with_v_strides", "key was read with value's strides"),
    ("head_stride_d", "head 0 is right, a later head is wrong"),
    ("via_fp16", "holds the wrong values"),
    ("last_token_skipped", "was not written"),
    ("clears_key", "your store changed key, value or slot_mapping"),
]
if INTERPRET:       # only the interpreter's memory watch hands over slots past 2**31 elements and sees each store
    STORE_MUTANTS += [("load_unmasked", "mask the tile: BLOCK_H and BLOCK_D are powers of two"),
                      ("padding_to_slot_1", "has slot -1, but your kernel stored into slot 1"),
                      ("int32", "overflow int32"), ("store_unmasked", "mask every load and store"),
                      ("slot_plus_one", "wrote"), ("launcher_asserts", "your launcher or kernel raised AssertionError")]


def test_e6_1(capsys):
    passes(ch06.check_store_kvcache, ch06.reference_store_kvcache, tag="E6.1", capsys=capsys)
    passes(ch06.check_store_kvcache, ch06.reference_triton_store_kvcache, tag="E6.1", capsys=capsys)
    passes(ch06.check_store_kvcache, store_with("none"), tag="E6.1", capsys=capsys)
    fails(ch06.check_store_kvcache, stub, match="not implemented yet")


@pytest.mark.parametrize("bug,says", STORE_MUTANTS, ids=[m[0] for m in STORE_MUTANTS])
def test_e6_1_rejects_every_time(bug, says):
    for _ in range(3):                            # fresh draws each call: every one must reject, with the hint
        fails(ch06.check_store_kvcache, store_with(bug), match=re.escape(says))


GPU_PATH_STORE_MUTANTS = [           # what a GPU run checks (values and guard rows; no memory watch)
    ("writes_minus_one", "your store wrote just before k_cache"),
    ("slot_plus_one", "your store wrote past the end of"),
    ("store_unmasked", "your store wrote past the end of k_cache"),
    ("padding_to_slot_1", "changed although no token maps to it|holds the wrong values"),
]


@pytest.mark.parametrize("bug,says", GPU_PATH_STORE_MUTANTS, ids=[m[0] for m in GPU_PATH_STORE_MUTANTS])
def test_e6_1_without_the_memory_watch(bug, says, monkeypatch):
    """On a GPU there is no memory watch: the guard rows and the values must still reject these. Under the
    interpreter the watch is switched off to see that; on a GPU it is off anyway."""
    if INTERPRET:
        monkeypatch.setattr(ch06, "interpreting", lambda: False)
        monkeypatch.setattr(ch06, "kernel_device", lambda: "cpu")
    for _ in range(3):
        fails(ch06.check_store_kvcache, store_with(bug), match=says)            # says: a regular expression


def test_e6_1_int32_case_runs_under_the_interpreter():
    assert ch06.shifts_supported() == INTERPRET


# == E6.2 ===================================================================================================

def softmax_with(**flags):
    return functools.partial(ch06.reference_online_softmax, **flags)


def softmax_direct(scores, values, tile):
    return torch.softmax(scores, dim=-1) @ values


def softmax_shifts_scores_in_place(scores, values, tile):
    scores -= scores.max(dim=-1, keepdim=True).values          # "for stability", on the caller's tensor
    return torch.softmax(scores, dim=-1) @ values


def softmax_transposed(scores, values, tile):
    return (torch.softmax(scores, dim=-1) @ values).T


def test_e6_2_hints_are_reached():
    for _ in range(3):
        fails(ch06.check_online_softmax, softmax_shifts_scores_in_place, match="online_softmax changed its inputs")
        fails(ch06.check_online_softmax, softmax_transposed, match="has shape")


def test_e6_2(capsys):
    passes(ch06.check_online_softmax, ch06.reference_online_softmax, tag="E6.2", capsys=capsys)
    passes(ch06.check_online_softmax, softmax_direct, tag="E6.2", capsys=capsys)
    fails(ch06.check_online_softmax, stub, match="not implemented yet")


def written_online_softmax(mistake):
    """E6.2 as a student writes it, with one mistake (or none: mistake "none")."""
    def online_softmax(scores, values, tile):
        rows, num_keys = scores.shape
        m = torch.full((rows,), float("-inf"))
        l = torch.zeros(rows)
        acc = torch.zeros(rows, values.shape[1])
        stop = num_keys - num_keys % tile if mistake == "full_tiles_only" else num_keys
        for start in range(0, stop, tile):
            s, v = scores[:, start:start + tile], values[start:start + tile]
            if mistake == "no_max":                       # "the scores are small": no running max at all
                p = torch.exp(s)
                l, acc = l + p.sum(1), acc + p @ v
                continue
            m_new = torch.maximum(m, s.max(1).values)
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            if mistake == "max_updated_first":            # m = m_new before alpha: alpha is always 1
                m = m_new
            alpha = torch.exp(shift - m) if mistake == "alpha_inverted" else torch.exp(m - shift)
            p = torch.exp(s - (torch.where(torch.isinf(m), shift, m)[:, None] if mistake == "stale_max" else
                               shift[:, None]))
            if mistake == "exp2":
                alpha, p = torch.exp2(m - shift), torch.exp2(s - shift[:, None])
            l = l * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p @ v
            m = m_new
        return acc if mistake == "no_divide" else acc / l[:, None]
    return online_softmax


def softmax_without_max(scores, values, tile):
    e = torch.exp(scores)
    return (e / e.sum(-1, keepdim=True)) @ values


def softmax_in_fp16(scores, values, tile):
    return (torch.softmax(scores.half(), dim=-1) @ values.half()).float()


# (wrong E6.2, what its hint must say): each mistake gets its own hint, in every run
SOFTMAX_MUTANTS = [
    (written_online_softmax("no_max"), "subtract the running max before exp"),
    (softmax_without_max, "subtract the running max before exp"),
    (written_online_softmax("max_updated_first"), "compute alpha with the OLD m"),
    (written_online_softmax("alpha_inverted"), "you used exp(m_new - m_old)"),
    (written_online_softmax("stale_max"), "p = exp(s - m_new), with the running max that includes this tile"),
    (written_online_softmax("exp2"), "torch.exp2(x) is 2**x"),
    (written_online_softmax("no_divide"), "return acc / l"),
    (written_online_softmax("full_tiles_only"), "the last tile may be partial"),
    (ch06.tile_average_softmax, "each tile's softmax was averaged over the tiles"),
    (softmax_in_fp16, "the precision of fp16 or bf16"),
    (softmax_with(dtype=torch.bfloat16), "the precision of fp16 or bf16"),
    (softmax_with(rescale_acc=False, rescale_sum=False), "multiply the running sum l and the accumulator acc"),
    (softmax_with(rescale_acc=False), "accumulator must be rescaled"),
    (softmax_with(rescale_sum=False), "running sum must be rescaled"),
    (softmax_with(max_init=0.0), "start the running max at -inf"),
    (softmax_with(guard_empty=False), "exp(-inf - (-inf)) is NaN"),
]


def test_e6_2_a_student_written_answer_passes(capsys):
    passes(ch06.check_online_softmax, written_online_softmax("none"), tag="E6.2", capsys=capsys)


@pytest.mark.parametrize("fn,says", SOFTMAX_MUTANTS, ids=[
    "no_max", "softmax_without_max", "max_updated_first", "alpha_inverted", "stale_max", "exp2", "no_divide",
    "full_tiles_only", "tile_average", "fp16", "bf16", "no_rescale", "acc_not_rescaled", "sum_not_rescaled",
    "max_starts_at_0", "no_guard_for_masked_tiles"])
def test_e6_2_each_mistake_gets_its_own_hint_in_every_run(fn, says):
    for _ in range(3):
        fails(ch06.check_online_softmax, fn, match=re.escape(says))


# == E6.3 ===================================================================================================

@triton.jit
def _decode_mutant(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, scale,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CAST_FP32: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, BUG: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    if BUG == "gqa_modulo":
        heads = g * tl.num_programs(1) + kv_head
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    if BUG == "q_contiguous":         # q addressed as if contiguous [B, H, D]
        stride_qb = tl.num_programs(1) * GROUP * HEAD_DIM
        stride_qh = HEAD_DIM
    if BUG == "q_strides_of_out":         # q addressed with the output's (contiguous) strides
        stride_qb = stride_ob
        stride_qh = stride_oh
    if BUG == "q_unmasked":
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :])
    else:
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    if BUG == "max_starts_at_zero":
        m = tl.zeros([BLOCK_G], tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, context_len, BLOCK_N):
        pos = start + n
        valid = pos < context_len
        if BUG == "unmasked_table":
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE)
        elif BUG == "kv_unmasked":        # table load masked without other=, K/V loads masked by d only
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid)
        else:
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
        if BUG == "int32":
            rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        else:
            rows = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        if BUG == "kv_unmasked":
            kv_mask = (n[:, None] >= 0) & (d[None, :] < HEAD_DIM)
        if BUG == "no_other":             # masked-off lanes hold whatever memory holds
            k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask)
            v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask)
        else:
            k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if BUG == "kv_swapped":
            k, v = v, k
        if CAST_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if BUG != "no_mask":
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        if BUG == "no_max":               # "scores are small": p = exp(s), no running max (alpha = 1)
            m_new = tl.zeros([BLOCK_G], tl.float32)
            m = m_new
        if BUG == "exp2":
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
        else:
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
        if BUG == "no_rescale":
            l = l + tl.sum(p, 1)
            acc = acc + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    out = acc / l[:, None]
    if BUG == "store_padded_rows":
        q_mask = d[None, :] < HEAD_DIM
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)


def decode_with(bug):
    def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        batch, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        if bug == "fp32_out":
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if bug == "into_q":               # "no extra buffer": the output overwrites the queries
            out = q
        _decode_mutant[(batch, num_kv_heads)](
            q, k_cache, v_cache, block_tables, context_lens, out, scale, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_N=16 if INTERPRET else 64, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), CAST_FP32=INTERPRET,
            DOT_PRECISION="ieee" if INTERPRET or q.dtype == torch.float32 else "tf32", BUG=bug)
        return out
    return paged_decode


DECODE_MUTANTS = [
    ("fp32_out", "has dtype torch.float32, expected torch.bfloat16"),
    ("into_q", "paged_decode changed its input q"),
    ("no_mask", "keys past context_len in the last tile must not count"),
    ("kv_swapped", "did you swap them"),
    ("no_rescale", "rescale l and acc"),
    ("gqa_modulo", "not h % Hkv"),
    ("exp2", "log2"),
    ("q_contiguous", "q is a strided view"),
    ("q_strides_of_out", "not with the output's strides"),
    ("no_max", "subtract the running max before exp"),           # NaN once the scores are in the hundreds
    ("max_starts_at_zero", "start the running max m at -inf, not 0"),   # scores far below 0: 0 / 0
]
if INTERPRET:      # silent on a GPU (or a crash later); the interpreter's memory watch and poison see them
    DECODE_MUTANTS += [
        ("unmasked_table", "mask=pos < context_len"),
        ("no_other", "give the K and V loads other=0.0"),       # masked lanes read garbage: NaN here
        ("store_padded_rows", "store only the real lanes"),
        ("int32", "compute the row offsets in int64"),
        ("kv_unmasked", "mask the K/V loads with (pos < context_len)"),
        ("q_unmasked", "mask the query load with (g < GROUP)"),
    ]


def test_e6_3(capsys):
    passes(ch06.check_paged_decode, ch06.reference_torch_paged_decode, tag="E6.3", capsys=capsys)
    passes(ch06.check_paged_decode, ch06.reference_triton_paged_decode, tag="E6.3", capsys=capsys)
    passes(ch06.check_paged_decode, decode_with("none"), tag="E6.3", capsys=capsys)
    fails(ch06.check_paged_decode, stub, match="not implemented yet")


@pytest.mark.parametrize("bug,says", DECODE_MUTANTS, ids=[m[0] for m in DECODE_MUTANTS])
def test_e6_3_rejects_every_time(bug, says):
    for _ in range(2):
        fails(ch06.check_paged_decode, decode_with(bug), match=re.escape(says))


# == E6.4 ===================================================================================================

def test_e6_3_scale_forgotten():
    def no_scale(q, k_cache, v_cache, block_tables, context_lens, scale):
        return ch06.reference_triton_paged_decode(q, k_cache, v_cache, block_tables, context_lens, 1.0)
    for _ in range(2):
        fails(ch06.check_paged_decode, no_scale, match=re.escape("multiply the scores q . k by `scale`"))


def split_reference(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits):
    return ch06.reference_triton_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits)


def split_average(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits):
    """Splits computed right (tiles of 16, as the interpreter's launcher), merged by a plain average instead
    of weighting each split by its log-sum-exp."""
    batch, num_heads, head_dim = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // hkv
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(context_lens[b])
        pos = torch.arange(n, device=q.device)
        rows = block_tables[b].long()[pos // bs] * bs + pos % bs
        k = k_cache.reshape(-1, hkv, head_dim)[rows].float().repeat_interleave(group, 1)
        v = v_cache.reshape(-1, hkv, head_dim)[rows].float().repeat_interleave(group, 1)
        per = -(-(-(-n // 16)) // num_splits) * 16
        parts = []
        for s in range(num_splits):
            lo, hi = s * per, min((s + 1) * per, n)
            if lo < hi:
                p = torch.softmax(torch.einsum("hd,thd->ht", q[b].float(), k[lo:hi]) * scale, dim=-1)
                parts.append(torch.einsum("ht,thd->hd", p, v[lo:hi]))
        out[b] = torch.stack(parts).mean(0).to(q.dtype)
    return out


def split_with(**flags):
    def paged_decode_split(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits):
        kw = dict(flags)
        if kw.get("splits_merged") == -1:             # the merge loop stops one split short
            kw["splits_merged"] = num_splits - 1 if num_splits > 1 else None
        return ch06.reference_split_variant(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits,
                                            16, **kw).to(q.device)
    return paged_decode_split


def split_never_merged(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits):
    """The partial kernel runs (here: the reference's), but nothing writes the returned tensor."""
    ch06.reference_triton_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits)
    return torch.empty_like(q)


def split_lse_without_log_l(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits):
    """Each split's weight taken as exp(m_s - M), its running max only (log l_s forgotten)."""
    B, H, D = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(context_lens[b])
        pos = torch.arange(n)
        rows = block_tables[b].long()[pos // bs] * bs + pos % bs
        k = k_cache.reshape(-1, hkv, D)[rows].float().repeat_interleave(H // hkv, 1)
        v = v_cache.reshape(-1, hkv, D)[rows].float().repeat_interleave(H // hkv, 1)
        s = torch.einsum("hd,thd->ht", q[b].float(), k) * scale
        per = -(-(-(-n // 16)) // num_splits) * 16
        parts, maxes = [], []
        for i in range(num_splits):
            lo, hi = i * per, min((i + 1) * per, n)
            if lo < hi:
                parts.append(torch.einsum("ht,thd->hd", torch.softmax(s[:, lo:hi], -1), v[lo:hi]))
                maxes.append(s[:, lo:hi].max(-1).values)
        w = torch.exp(torch.stack(maxes) - torch.stack(maxes).max(0).values)
        out[b] = ((w[..., None] * torch.stack(parts)).sum(0) / w.sum(0)[..., None]).to(q.dtype)
    return out


SPLIT_MUTANTS = [
    (split_with(splits_merged=-1), "the merge must read every split"),
    (split_lse_without_log_l, "merge with the log-sum-exp of each split"),
    (split_average, "log-sum-exp"),
    (split_with(empty="nan"), "acc / l is 0 / 0 = NaN"),
    (split_with(empty="weight"), "must weigh nothing in the merge"),
    (split_with(merge="unnormalised"), "divide the merged sum by the sum of the weights"),
    (split_with(tiles="floor"), "rounded UP"),
    (split_with(merge="no_max"), "Merge the splits with exp(lse_s - M)"),     # NaN once the scores are large
]
if INTERPRET:
    SPLIT_MUTANTS.append((split_never_merged, "no kernel stored into the tensor your launcher returned"))


def test_e6_4(capsys):
    passes(ch06.check_split_decode, split_reference, tag="E6.4", capsys=capsys)
    passes(ch06.check_split_decode, split_with(), tag="E6.4", capsys=capsys)
    fails(ch06.check_split_decode, stub, match="not implemented yet")


@pytest.mark.parametrize("fn,says", SPLIT_MUTANTS, ids=["last_split_lost", "lse_m_only", "average", "nan", "weight",
                                                         "unnormalised", "floor", "merge_no_max",
                                                         "never_merged"][:len(SPLIT_MUTANTS)])
def test_e6_4_rejects_every_time(fn, says):
    for _ in range(2):
        fails(ch06.check_split_decode, fn, match=re.escape(says))


# == the notebook's parts ===================================================================================

def test_a_launcher_whose_kernel_factory_is_a_stub_counts_as_a_stub(tmp_path, monkeypatch):
    (tmp_path / "released06.py").write_text(
        "import functools\n\n\n@functools.cache\ndef make_store_kernel():\n"
        "    raise NotImplementedError(\"Exercise 6.1: write the kernel\")\n\n\n"
        "def store_kvcache(key, value, k_cache, v_cache, slot_mapping):\n    kernel = make_store_kernel()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import released06
    assert is_stub(released06.store_kvcache)
    parts, used = parts_from_functions(store_kvcache=released06.store_kvcache)
    assert used == [] and parts.store_kvcache is None
    parts, used = parts_from_functions(store_kvcache=ch06.reference_triton_store_kvcache)
    assert used == ["store_kvcache"] and parts.store_kvcache is ch06.reference_triton_store_kvcache


# == figures and the GPU timing script ======================================================================

def test_tile_walk_figure_matches_the_grid_of_the_notebook():
    from nanovllm_course import figures_ch06
    owner = figures_ch06.tile_owner(**figures_ch06.WALK)
    assert owner[0] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2] and owner[5] == [3, 3, 3, 3, 4, 4, 4, 4, 5, 5]


def test_timing_figure_draws_from_the_bench_json(tmp_path):
    from nanovllm_course import figures_ch06
    rows = [dict(batch=b, context=c, student_us=10.0 * b, reference_us=5.0 * b + 3, reference_1split_us=9.0 * b)
            for c in (1024, 8192) for b in (1, 8, 64)]
    path = figures_ch06.decode_timing(tmp_path / "t.png", dict(device="test GPU", rows=rows))
    assert path.is_file() and path.stat().st_size > 10_000


def test_the_timing_script_loads_the_solution_kernel_from_the_notebook():
    import importlib.util
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("ch06_timing", root / "bench" / "ch06_kernel_timing.py")
    timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timing)
    kernel = timing.load_from_notebook(root / "solutions" / "06_triton_kernels.ipynb")
    gen = torch.Generator().manual_seed(1)
    args = ch06.make_paged_batch(gen, 4, 2, 16, 4, [1, 4, 5, 9], device=ch06.kernel_device())
    expected = ch06.reference_torch_paged_decode(*args, 0.25)
    torch.testing.assert_close(kernel(*args, 0.25), expected, rtol=1e-4, atol=1e-4)
