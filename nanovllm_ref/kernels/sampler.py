"""The sampler's row draw as one pass over the logits (issue 29): `layers.sampler.sample_rows` without
top-k / top-p, for the decode step's CUDA graph.

What it computes, per row b of logits [B, V]: temperature 0 -> the greedy token (argmax, NaN never wins, the
first of equal maxima); temperature T > 0 -> the exponential race of layers/sampler.py with the same
counter-based noise E[b, v] (the hash of (seed_b, counter_b, v), bit for bit `exponential_noise`), in its
Gumbel form: argmax_v (logit_v / T - log E_v). That is argmax_v softmax(logit / T)_v / E_v with the softmax's
normaliser taken out of the comparison (log is monotonic), so no softmax is needed and the row is read once.
A row holding +inf draws among its +inf tokens alone, uniformly (argmax of -log E over them), as
`finite_rows` has it. Rounding may break an exact near-tie between two tokens differently from the compiled
reference; nothing else differs.

Why a kernel: torch.compile made the row draw one reduction kernel per row (one program reads a whole row of
151,936 logits) with 64-bit integer hashing. On the H200 (profile4, 2026-12-01) that took 0.067 + 0.041 ms at
batch 1 and 0.45 ms at batch 256 of a 6 ms step: 1.7 us a row, most of the decode step's per-row cost.
Here the vocabulary is split over many programs (`_partial_kernel`: each one a slice of one row, hashing in
32-bit integers, whose multiplies wrap as the reference's masks do, and no division per logit), and a second kernel (`_merge_kernel`)
picks each row's winner among its slices: the smallest vocabulary index among equal scores, as argmax does.
No host synchronisation, fixed shapes per batch size: capturable in a CUDA graph.
"""
import functools
import os

import torch
import triton
import triton.language as tl

# Triton picks interpreter or compiler when each @triton.jit below runs (see nanovllm_ref/kernels/__init__.py).
DEFINED_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

BLOCK_V = 1024              # logits per loop iteration of one program
MIN_SLICE = 4096            # the fewest logits a program reads (below this, launching it costs more)
PROGRAMS_PER_SM = 8


@triton.jit
def _mix32(x):
    """MurmurHash3's 32-bit finaliser on uint32 (layers/sampler._mix32; the multiplies wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x85EBCA6B, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full([], 0xC2B2AE35, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _neg_log_noise(row_hash, offs):
    """-log E for Exp(1) draws E = -log1p(-u), u from the hash of (row, token) as exponential_noise makes it.
    log1p(-u) without a division: for u < 2**-6 its Taylor series to u**4 (the next term is below 2**-26 of the
    sum), else log(1 - u), where 1 - u is exact or within 2**-25 of it (Sterbenz's lemma for u >= 0.5)."""
    col = offs.to(tl.uint32) * tl.full([], 0x27D4EB2F, tl.uint32)
    bits = _mix32(_mix32(row_hash ^ col) ^ row_hash)
    u = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 1.0 - 5.960464477539063e-08)
    series = u * (1.0 + u * (0.5 + u * (0.3333333432674408 + u * 0.25)))
    neg_log1p = tl.where(u < 0.015625, series, -tl.log(1.0 - u))       # -log1p(-u) = E > 0
    return -tl.log(neg_log1p)


@triton.jit
def _fold(score, offs, best, best_idx):
    """Fold a block into per-lane running bests (lane i holds the best of offsets i, i + BLOCK, ...). Earlier
    blocks hold smaller indices, so a lane takes the new value only when it is strictly greater."""
    better = score > best
    return tl.where(better, score, best), tl.where(better, offs, best_idx)


@triton.jit
def _reduce(best, best_idx, BIG: tl.constexpr):
    """(max over lanes, the smallest index holding it): argmax's first-of-equal-maxima over the slice."""
    m = tl.max(best, 0)
    return m, tl.min(tl.where(best == m, best_idx, BIG), 0)


@triton.jit(do_not_specialize=["vocab", "slice_len", "num_slices"])
def _partial_kernel(logits_ptr, stride_l, temps_ptr, seeds_ptr, counters_ptr, part_ptr, idx_ptr, vocab, slice_len,
                    num_slices, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    row64 = row.to(tl.int64)
    seed = (tl.load(seeds_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
    counter = (tl.load(counters_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
    row_hash = _mix32(seed ^ (counter * tl.full([], 0x9E3779B1, tl.uint32)))
    temp = tl.load(temps_ptr + row)
    inv_t = 1.0 / tl.where(temp > 0, temp, 1.0)
    NEG: tl.constexpr = float("-inf")
    BIG: tl.constexpr = 2**31 - 1
    # Per-lane running bests, reduced across lanes once at the end: a block reduction per loop step and race
    # took 14 % of the kernel's time on the H200 (256 rows: 198 -> 170 us, kernels_round8_h200_2026-12-03_call3.json).
    g_best, g_idx = tl.full([BLOCK], NEG, tl.float32), tl.full([BLOCK], BIG, tl.int32)   # greedy: the largest logit
    s_best, s_idx = tl.full([BLOCK], NEG, tl.float32), tl.full([BLOCK], BIG, tl.int32)   # finite logits' race
    i_best, i_idx = tl.full([BLOCK], NEG, tl.float32), tl.full([BLOCK], BIG, tl.int32)   # +inf logits' race
    start = part * slice_len
    end = tl.minimum(start + slice_len, vocab)
    for v0 in range(start, end, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        mask = offs < end
        x = tl.load(logits_ptr + row64 * stride_l + offs, mask=mask, other=NEG).to(tl.float32)
        x = tl.where(x != x, NEG, x)                                  # NaN never wins
        g_best, g_idx = _fold(x, offs, g_best, g_idx)
        gumbel = _neg_log_noise(row_hash, offs)
        pinf = x == float("inf")
        finite = x > NEG
        score = tl.where(finite & (~pinf), x * inv_t + gumbel, NEG)
        s_best, s_idx = _fold(score, offs, s_best, s_idx)
        i_best, i_idx = _fold(tl.where(pinf & mask, gumbel, NEG), offs, i_best, i_idx)
    g_max, g_arg = _reduce(g_best, g_idx, BIG)
    s_max, s_arg = _reduce(s_best, s_idx, BIG)
    i_max, i_arg = _reduce(i_best, i_idx, BIG)
    # A slice with no +inf token reports its finite race; one with any reports its +inf race (a +inf token
    # always beats every finite one, whatever the noise: finite_rows keeps only the +inf tokens of such a row).
    has_inf = i_arg < BIG
    slot = row64 * num_slices + part
    tl.store(part_ptr + slot * 3 + 0, g_max)
    tl.store(part_ptr + slot * 3 + 1, tl.where(has_inf, i_max, s_max))
    tl.store(part_ptr + slot * 3 + 2, has_inf.to(tl.float32))
    tl.store(idx_ptr + slot * 2 + 0, g_arg)
    tl.store(idx_ptr + slot * 2 + 1, tl.where(has_inf, i_arg, s_arg))


@triton.jit(do_not_specialize=["num_slices"])
def _merge_kernel(part_ptr, idx_ptr, temps_ptr, out_ptr, num_slices, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    m = s < num_slices
    slot = row * num_slices + s
    NEG: tl.constexpr = float("-inf")
    BIG: tl.constexpr = 2**31 - 1
    g = tl.load(part_ptr + slot * 3 + 0, mask=m, other=NEG)
    sc = tl.load(part_ptr + slot * 3 + 1, mask=m, other=NEG)
    inf = tl.load(part_ptr + slot * 3 + 2, mask=m, other=0.0)
    g_idx = tl.load(idx_ptr + slot * 2 + 0, mask=m, other=BIG)
    sc_idx = tl.load(idx_ptr + slot * 2 + 1, mask=m, other=BIG)
    temp = tl.load(temps_ptr + row)
    gm = tl.max(g, 0)
    greedy = tl.min(tl.where((g == gm) & (g_idx < BIG), g_idx, BIG), 0)
    any_inf = tl.max(inf, 0) > 0
    # slices of the kind that wins: +inf races if the row has a +inf token, else the finite races
    eligible = m & ((inf > 0) == any_inf) & (sc_idx < BIG)
    sc = tl.where(eligible, sc, NEG)
    sm = tl.max(sc, 0)
    sampled = tl.min(tl.where(eligible & (sc == sm), sc_idx, BIG), 0)
    greedy = tl.where(greedy == BIG, 0, greedy)           # a row of nothing but -inf / NaN: token 0, as argmax
    sampled = tl.where(sampled == BIG, 0, sampled)
    tl.store(out_ptr + row, tl.where(temp > 0, sampled, greedy).to(tl.int64))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_slices(batch: int, vocab: int, device: torch.device) -> int:
    """Vocabulary slices a row is split into: a power of two (so the merge kernel compiles for a handful of
    sizes only), about PROGRAMS_PER_SM programs per SM over the batch (a program of 4 warps holds an eighth of
    an SM's threads, so 8 fill it: each program streams its slice with no other latency hiding), no slice
    under MIN_SLICE logits, at most 64. On the H200 (132 SMs) and Qwen3's 151,936 logits: 32 slices up to
    batch 32, 4 at batch 256 (1,024 programs), 2 at 512."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    want = max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, max(batch, 1)), vocab // MIN_SLICE, 64))
    return 1 << (want.bit_length() - 1)


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, top_k=None, top_p=None, seeds=None,
                counters=None, block_v: int = BLOCK_V, num_warps: int = 4) -> torch.Tensor:
    """layers.sampler.sample_rows for rows without top-k / top-p and with seeds (module docstring).
    logits [B, V] any float dtype (rows contiguous); temperatures [B] fp32; seeds, counters [B] int64.
    block_v (logits a loop step, a power of two) and num_warps: the launch (benchmarks set them).
    Returns [B] int64. Raises ValueError for top_k / top_p or missing seeds (the reference handles those)."""
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if top_k is not None or top_p is not None or seeds is None or counters is None:
        raise ValueError("the sampler kernel draws unfiltered rows with counter-based seeds only; "
                         "layers.sampler.sample_rows takes top_k / top_p and torch's generator")
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [num_seqs, vocab] with contiguous rows, got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    slices = num_slices(batch, vocab, logits.device)
    slice_len = triton.cdiv(triton.cdiv(vocab, slices), block_v) * block_v
    slices = triton.cdiv(vocab, slice_len)
    part = torch.empty(batch * slices * 3, dtype=torch.float32, device=logits.device)
    idx = torch.empty(batch * slices * 2, dtype=torch.int32, device=logits.device)
    temps = temperatures.to(torch.float32).contiguous()
    _partial_kernel[(batch, slices)](logits, logits.stride(0), temps, seeds.to(torch.int64).contiguous(),
                                     counters.to(torch.int64).contiguous(), part, idx, vocab, slice_len, slices,
                                     BLOCK=block_v, num_warps=num_warps)
    _merge_kernel[(batch,)](part, idx, temps, out, slices, BLOCK_S=max(2, triton.next_power_of_2(slices)),
                            num_warps=1)
    return out
