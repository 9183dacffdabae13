"""The whole decode step of one sequence in one persistent Triton kernel (chapter 10; issue 29, rounds 6-7).

Why
    A batch-1 decode step of Qwen3-0.6B is ~270 dependent kernels (9 a layer, round 5's profile). Its weights
    take 0.28 ms to read on an H200 and the step took 1.02 ms: each small kernel pays its ramp-up and drain,
    and a GEMV of 2-12 MB is too short to reach the copy bandwidth on its own. Here one program per SM stays
    resident for all the layers and a grid-wide barrier stands where a kernel boundary was (the "megakernel"
    of Mirage / Hazy Research's "No Bubbles", 2025, and the cooperative-groups grid sync of CUDA).

What it computes (batch 1, M = 1; the same values as the layer-by-layer forward of models/qwen3.py with the
fused kernels of kernels/rms_norm.py, qk_norm_rope_store.py, small_gemm.py and attention.py: each step rounds to
the model dtype where the reference chain rounds, kernels/numerics.py), per layer, as five phases:
    P0 add + RMSNorm (the previous layer's down partials + residual; layer 0: the token's embedding row),
       then the QKV GEMV                                          -> qkv [Nqkv] model dtype
    P1 attention: work items (KV head j, split s). Each normalises and rotates the G query heads of j (and,
       for the split holding the newest position, k and v of the token, which it stores into the paged cache
       first), streams its key range with online softmax and writes a partial output and its log-sum-exp;
       the last split of j to finish merges the splits (an atomic count per KV head: no extra barrier)
                                                                  -> attn [H * d] model dtype
    P2 o_proj GEMV in split-K items                               -> o partials [KS_o, hidden] fp32
    P3 add + RMSNorm (o partials + residual), gate_up GEMV with SiLU-and-mul -> act [I] model dtype
    P4 down GEMV in split-K items                                 -> down partials [KS_d, hidden] fp32
and at the end the final add + RMSNorm -> out [hidden]. Every program recomputes the 1-row norms itself (a
few KB from L2) rather than waiting on a program that would. The residual stream alternates between two
rows, so a phase never overwrites the row another program is still reading.

Barriers and the interpreter
    `_grid_sync` counts arrivals on one int32 (release by each program, acquire polls), so it needs every
    program resident at once: the grid is one program per SM. Data another program wrote in this launch is
    loaded with cache_modifier=".cg" (L2, never a stale L1 line). A barrier gives up after MAX_SPIN polls and
    counts that in `err` (a result then is wrong, but nothing hangs). The last program out resets the
    counters, so a CUDA-graph replay starts from zero. Triton's interpreter runs programs one after another,
    where a barrier of several programs would wait forever: `stepwise=True` (the interpreter's default)
    launches each phase of each layer as its own kernel instead, with the same code and no barriers; one
    program (programs=1) runs the fused path there, barriers, exit reset and merge count included. On a GPU the
    first launch with barriers checks that every program can be resident at once (max_resident) and raises
    ValueError naming `programs` if not; after the first launch outside a CUDA-graph capture it reads the
    give-up count once (check_errors: RuntimeError if any). Later give-ups (another process taking SMs) are
    only counted in `errors`: reading it every step would cost a host sync.

Weights are read where the model keeps them: `table` [L, 8] int64 holds each layer's tensor as an element
offset from one base tensor (all share the model dtype), so no copy or re-layout is made. Where the offsets are
multiples of 16 elements (checked on the host; `_weight` then tells the compiler): without that hint Triton cannot
prove the loads' alignment and issues one 2-byte load per element, not 16-byte vectors (677 of the sm_90
kernel's global loads were 16-bit before the hint, 5 after: bench/persistent_step.py --compile-check).
Limits: one sequence, tensor parallel size 1, no linear biases, head_dim even; the model (models/qwen3.py)
uses it only when FusedKernels.persistent is on (decode_kernels="persistent") and those hold, else its layers
run.

Measured on an H200 (bench/results/README.md, rounds 6 and 7; persistent_h200_2026-12-0{2,3}_*.json). The
engine's plan leaves it off unless asked (decode_kernels="persistent"): it is level with the layers, and its
barriers need every program resident, which a GPU shared with other processes does not promise.
- A grid barrier of 132 programs costs 0.92-0.94 us (280 barriers in 260-265 us).
- Qwen3-0.6B shape, bf16, one decode step without the LM head, in CUDA-graph replays, at contexts 129 / 613 /
  2,049: this version 828 / 852 / 943 us against the layers' 828 / 841 / 898 (2026-12-03, call 5). The first
  version (2026-12-02) took 1,069 / 1,084 / 1,268: its weight loads were 2-byte scalars (the alignment hint
  above took it to 885 / 889 / 1,003), q went through global scratch, and each GEMV phase loaded its first
  W tile after its barrier (`hoist` loads it before; 4 warps instead of 8).
- The engine, ab4 against 1d52cd7 in one call: batch-1 952 -> 987 tok/s, the 1:512 graph replay 1.025 -> 0.988
  ms; throughput unchanged (batch-1 steps are 7 of the workload's 1,023).
- Inside the fused launch (program 0's clock at each phase start, context 613): norm + QKV 4.7 us, attention
  9.7, o_proj 3.0, norm + gate_up 7.9, down 4.4 a layer, each with its barrier (~0.9). Reading each phase's
  weights at the copy bandwidth would take 2.0 / - / 1.0 / 3.0 / 1.5 us. What costs is latency: a phase is a
  chain of dependent round trips (the barrier, x, the norm's block reduction, W, the store and the release),
  and one program an SM keeps about one W tile in flight.
- Tried and not kept: L2 prefetch of the weights (`prefetch`, this step's, stays as an option, off) and of
  the next steps' weights and KV (taken out): within +-3 %, worse with the hoist; the attention phase's first KV tile before its barrier (4 warps then
  spill 312 bytes: 953-1,159 us; 8 warps 864-1,019), two programs an SM (264 programs: 873 against 852).
- fp32 on the H200: hidden state within 2.6e-6 (relative) of the layers'; bf16: 1.9-4 % (rounding that 28
  random layers amplify; the same kernels in fp32 agree). The engine's bf16 and fp32 equivalence tests against
  HF pass with it (tests/gpu_runs/2026-12-03e_triton_persistent_*.xml: 23 and 23).
"""
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm_ref.kernels.attention import LOG2E, _key_rows, _load_kv_tile, _online_softmax_step
from nanovllm_ref.kernels.numerics import interpreting, round_to

# Triton picks interpreter or compiler when each @triton.jit below runs (see nanovllm_ref/kernels/__init__.py).
DEFINED_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

MAX_SPIN = tl.constexpr(1 << 18)  # polls before a barrier gives up (~0.2 s; a phase takes microseconds): counted, never a hang
PHASES = 5                  # per layer, above; step = layer * PHASES + phase, then one final step


@triton.jit
def _grid_sync(bar_ptr, err_ptr, target):
    """Wait until the counter at bar_ptr reaches `target` (each program adds 1 per barrier)."""
    tl.debug_barrier()                          # all of this program's writes come before its arrival
    tl.atomic_add(bar_ptr, 1, sem="release")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
    spins = 0
    while (seen < target) & (spins < MAX_SPIN):
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
        spins += 1
    if seen < target:                           # gave up (a target reached on the last poll is no give-up)
        tl.atomic_add(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _reset_at_exit(bar_ptr, exit_ptr, nprog, count_ptr, NUM_COUNTS: tl.constexpr):
    """The last program out resets the barrier counters and the NUM_COUNTS counters at count_ptr, so the next
    launch (a graph replay) starts from 0 even after one whose barriers gave up: every program has passed its
    last barrier once it gets here, so no one polls them any more."""
    if tl.atomic_add(exit_ptr, 1, sem="acq_rel") == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0)
        for i in tl.static_range(NUM_COUNTS):
            tl.atomic_xchg(count_ptr + i, 0)
        tl.atomic_xchg(exit_ptr, 0)


@triton.jit
def _globaltimer():
    """The GPU's global nanosecond clock (PTX %globaltimer). GPU only."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _phase_barrier(bar_ptr, err_ptr, nprog, step, step_lo, ts_ptr, pid, STEPWISE: tl.constexpr,
                   TIMESTAMPS: tl.constexpr):
    """The grid barrier before `step` (none before a launch's first step, none when STEPWISE); TIMESTAMPS:
    program 0 then writes the clock at ts_ptr[step] (when the step's work starts: bench/persistent_step.py)."""
    if not STEPWISE:
        if step > step_lo:
            _grid_sync(bar_ptr, err_ptr, nprog * (step - step_lo))
    if TIMESTAMPS:
        if pid == 0:
            tl.store(ts_ptr + step, _globaltimer())


@triton.jit
def _prefetch_l2(ptrs):
    """Ask for the 128-byte lines at `ptrs` into L2 (PTX prefetch.global.L2): no value, no wait, no effect on
    any result. GPU only (the interpreter cannot run inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_items(w_ptr, pid, nprog, N, K, BN: tl.constexpr, KC: tl.constexpr, UP_ROWS):
    """L2 prefetch of the W lines this program's GEMV items (row tile, K chunk) will read; UP_ROWS > 0 also asks
    for the rows UP_ROWS below (gate_up's up half). Issued before a barrier, so the wait hides the fetch."""
    LINES: tl.constexpr = (KC + 63) // 64                       # 64 bf16 = one 128-byte line
    row_tiles = tl.cdiv(N, BN)
    for item in range(pid, row_tiles * tl.cdiv(K, KC), nprog):
        rows = tl.minimum((item % row_tiles) * BN + tl.arange(0, BN), N - 1).to(tl.int64)
        cols = tl.minimum((item // row_tiles) * KC + tl.arange(0, LINES) * 64, K - 1)
        ptrs = w_ptr + rows[:, None] * K + cols[None, :]
        _prefetch_l2(ptrs)
        if UP_ROWS > 0:
            _prefetch_l2(ptrs + UP_ROWS * K)


@triton.jit
def _weight(base_ptr, weights, column, ALIGNED: tl.constexpr):
    """The tensor of `column` in this layer's table row, an element offset from base_ptr. ALIGNED: the host found
    every offset a multiple of 16 and says so here, so that the compiler can prove 16-byte alignment and load 8
    bf16 at once (separate allocations, as a model's parameters are, always are)."""
    offset = tl.load(weights + column)
    if ALIGNED:
        offset = tl.multiple_of(offset, 16)
    return base_ptr + offset


@triton.jit
def _kv_offset(layer, layer_stride_kv, ALIGNED: tl.constexpr):
    """Element offset of `layer`'s KV cache from layer 0's (ALIGNED: the stride is a multiple of 16)."""
    offset = layer.to(tl.int64) * layer_stride_kv
    if ALIGNED:
        offset = tl.multiple_of(offset, 16)
    return offset


@triton.jit
def _load_row(ptr, offs, mask, CG: tl.constexpr):
    """fp32 values at ptr + offs; CG: written by another program in this launch (read from L2)."""
    if CG:
        return tl.load(ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _sum_parts(ptr, num_parts, stride, offs, mask, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """sum_s ptr[s * stride + offs] (fp32 split-K partials), rounded to the model dtype as a GEMM writes."""
    x = tl.zeros(offs.shape, dtype=tl.float32)
    for s in range(num_parts):
        x += _load_row(ptr + s * stride, offs, mask, True)
    return round_to(x, dtype, EMULATE)


@triton.jit
def _rms_norm_row(h, w_ptr, offs, mask, n, eps, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """RMSNorm of one fp32 row h (masked entries 0) with weight w: the rounding of kernels/rms_norm.py."""
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_to(w * round_to(h * rstd, dtype, EMULATE), dtype, EMULATE)


@triton.jit
def _w_tile(w_ptr, t, k0, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """W[t*BN : (t+1)*BN, k0 : k0+BK] of a row-major [N, K] weight as a [BN, BK] tile (zeros outside: a tile
    past the last loads nothing)."""
    rows = t * BN + tl.arange(0, BN)
    cols = k0 + tl.arange(0, BK)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
                   mask=(rows < N)[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _add_norm_phase(x_parts, num_parts, res_in, res_out, w_norm, ids_ptr, embed_ptr, pid, eps, FIRST,
                    HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """The normed row every program needs: h = round(sum of partials) + residual (FIRST: the embedding row of
    the token), stored by program 0 as the new residual; returns RMSNorm(h) * w, fp32 [BLOCK_H]."""
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HIDDEN
    if FIRST:
        token = tl.load(ids_ptr).to(tl.int64)
        h = _load_row(embed_ptr + token * HIDDEN, offs, mask, False)
    else:
        x = _sum_parts(x_parts, num_parts, HIDDEN, offs, mask, dtype, EMULATE)
        h = round_to(x + _load_row(res_in, offs, mask, True), dtype, EMULATE)
    if pid == 0:
        tl.store(res_out + offs, h.to(dtype), mask=mask)
    return _rms_norm_row(h, w_norm, offs, mask, HIDDEN, eps, dtype, EMULATE)


@triton.jit
def _gemv_first(w_ptr, pid, N: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, BN: tl.constexpr,
                SILU_MUL: tl.constexpr):
    """The W tile(s) of this program's first item of _gemv_phase (gate and up with SILU_MUL, else W twice):
    loaded before the phase's barrier, so the wait hides their latency (HOIST)."""
    w = _w_tile(w_ptr, pid, 0, N, HIDDEN, BN, BLOCK_H)
    if SILU_MUL:
        u = _w_tile(w_ptr + N * HIDDEN, pid, 0, N, HIDDEN, BN, BLOCK_H)
    else:
        u = w
    return w, u


@triton.jit
def _gemv_tile_out(x, w, u, out_ptr, t, N: tl.constexpr, BN: tl.constexpr, SILU_MUL: tl.constexpr,
                   dtype: tl.constexpr, EMULATE: tl.constexpr):
    """out[t*BN : (t+1)*BN] = W_tile @ x rounded to the model dtype, or silu(gate) * up (SILU_MUL) with the
    rounding of small_gemm.linear_silu_mul."""
    rows = t * BN + tl.arange(0, BN)
    y = round_to(tl.sum(w.to(tl.float32) * x[None, :], axis=1), dtype, EMULATE)
    if SILU_MUL:
        up = round_to(tl.sum(u.to(tl.float32) * x[None, :], axis=1), dtype, EMULATE)
        y = round_to(round_to(y * tl.sigmoid(y), dtype, EMULATE) * up, dtype, EMULATE)
    tl.store(out_ptr + rows, y.to(dtype), mask=rows < N)


@triton.jit
def _gemv_phase(normed, w_ptr, out_ptr, pid, nprog, w_first, u_first, HIDDEN: tl.constexpr, N: tl.constexpr,
                BLOCK_H: tl.constexpr, BN: tl.constexpr, SILU_MUL: tl.constexpr, HOIST: tl.constexpr,
                dtype: tl.constexpr, EMULATE: tl.constexpr):
    """out[N] = W @ normed (the QKV projection), or with SILU_MUL, W = [W_gate; W_up] ([2N, hidden]) and
    out = silu(gate) * up; row tiles of BN, tile pid first (w_first, u_first when HOIST), then every nprog-th."""
    n_tiles = tl.cdiv(N, BN)
    if HOIST:
        if pid < n_tiles:
            _gemv_tile_out(normed, w_first, u_first, out_ptr, pid, N, BN, SILU_MUL, dtype, EMULATE)
        first = pid + nprog
    else:
        first = pid
    for t in range(first, n_tiles, nprog):
        w = _w_tile(w_ptr, t, 0, N, HIDDEN, BN, BLOCK_H)
        if SILU_MUL:
            u = _w_tile(w_ptr + N * HIDDEN, t, 0, N, HIDDEN, BN, BLOCK_H)
        else:
            u = w
        _gemv_tile_out(normed, w, u, out_ptr, t, N, BN, SILU_MUL, dtype, EMULATE)


@triton.jit
def _split_k_first(w_ptr, pid, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr):
    """The W tile of this program's first _split_k_phase item (loaded before the barrier: HOIST)."""
    row_tiles = tl.cdiv(N, BN)
    return _w_tile(w_ptr, pid % row_tiles, (pid // row_tiles) * KC, N, K, BN, KC)


@triton.jit
def _split_k_item(x_ptr, w, part_ptr, item, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                  KC: tl.constexpr):
    """part[c, rows] = W_tile @ x[c*KC:(c+1)*KC] (fp32) for item = (row tile t, K chunk c)."""
    row_tiles = tl.cdiv(N, BN)
    rows = (item % row_tiles) * BN + tl.arange(0, BN)
    c = item // row_tiles
    offs_k = c * KC + tl.arange(0, KC)
    x = _load_row(x_ptr, offs_k, offs_k < K, True)
    tl.store(part_ptr + c * N + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1), mask=rows < N)


@triton.jit
def _split_k_phase(x_ptr, w_ptr, part_ptr, pid, nprog, w_first, N: tl.constexpr, K: tl.constexpr,
                   BN: tl.constexpr, KC: tl.constexpr, HOIST: tl.constexpr):
    """part[c, n] = W[n, c*KC:(c+1)*KC] @ x[c*KC:(c+1)*KC] (fp32) for items (row tile, K chunk c): item pid
    first (its tile w_first when HOIST), then every nprog-th."""
    row_tiles = tl.cdiv(N, BN)
    items = row_tiles * tl.cdiv(K, KC)
    if HOIST:
        if pid < items:
            _split_k_item(x_ptr, w_first, part_ptr, pid, N, K, BN, KC)
        first = pid + nprog
    else:
        first = pid
    for item in range(first, items, nprog):
        w = _w_tile(w_ptr, item % row_tiles, (item // row_tiles) * KC, N, K, BN, KC)
        _split_k_item(x_ptr, w, part_ptr, item, N, K, BN, KC)


@triton.jit
def _norm_rope_rows(x, x_rot, w_ptr, cos, sin_signed, offs_d, rot_d, d_mask, eps,
                    HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """Rows of heads [R, BLOCK_D] (fp32) and the same rows rotated by half a head (x_rot[:, d] = x[:, rot_d]):
    per-head RMSNorm (Qwen3) then rotate-half RoPE, x * cos + x_rot * sin_signed (sin_signed = -sin in the
    first half), rounded as kernels/qk_norm_rope_store.py rounds. Whole rows, so the result is already the
    [heads, d] operand tl.dot takes (no staging through memory). Returns fp32 [R, BLOCK_D]."""
    if QK_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        w_rot = tl.load(w_ptr + rot_d, mask=d_mask, other=0.0).to(tl.float32)
        x = round_to(w[None, :] * round_to(x * rstd[:, None], dtype, EMULATE), dtype, EMULATE)
        x_rot = round_to(w_rot[None, :] * round_to(x_rot * rstd[:, None], dtype, EMULATE), dtype, EMULATE)
    return round_to(x * cos[None, :] + x_rot * sin_signed[None, :], dtype, EMULATE)


@triton.jit
def _attention_phase(qkv_ptr, q_norm_w, k_norm_w, k_cache, v_cache, positions_ptr, slot_ptr, table_ptr,
                     context_lens_ptr, cos_sin_ptr, stride_cs, part_out, part_lse, count_ptr,
                     attn_ptr, pid, nprog, eps, qk_scale, num_splits,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     TILE_IN_BLOCK: tl.constexpr, QK_NORM: tl.constexpr, CAST_FP32: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, dtype: tl.constexpr, EMULATE: tl.constexpr):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    KV_ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM            # a cache slot holds [Hkv, d]
    context_len = tl.load(context_lens_ptr)
    pos = tl.load(positions_ptr).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rot_d = (offs_d + HALF) % HEAD_DIM                         # the partner of d in rotate-half RoPE
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d % HALF, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d % HALF, mask=d_mask, other=0.0)
    sin_signed = tl.where(offs_d < HALF, -sin, sin)
    offs_n = tl.arange(0, BLOCK_N)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    last = context_len - 1                                     # the newest position: this step's token
    for item in range(pid, NUM_KV_HEADS * num_splits, nprog):
        kv_head = item // num_splits
        split = item % num_splits
        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)
        # q of the group's heads, normed and rotated in registers (rows [BLOCK_G, BLOCK_D] for tl.dot)
        heads = kv_head * GROUP + offs_g
        qm = g_mask[:, None] & d_mask[None, :]
        q_rows = qkv_ptr + heads[:, None] * HEAD_DIM
        q = tl.load(q_rows + offs_d[None, :], mask=qm, other=0.0, cache_modifier=".cg").to(tl.float32)
        q_rot = tl.load(q_rows + rot_d[None, :], mask=qm, other=0.0, cache_modifier=".cg").to(tl.float32)
        q = _norm_rope_rows(q, q_rot, q_norm_w, cos, sin_signed, offs_d, rot_d, d_mask, eps, HEAD_DIM, QK_NORM,
                            dtype, EMULATE).to(dtype)
        if CAST_FP32:
            q = q.to(tl.float32)
        if (start <= last) & (last < end):
            # This split holds the token's own position: store its k (normed, rotated) and v first.
            k_row = qkv_ptr + (NUM_HEADS + kv_head) * HEAD_DIM
            k = tl.load(k_row + offs_d[None, :], mask=d_mask[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
            k_rot = tl.load(k_row + rot_d[None, :], mask=d_mask[None, :], other=0.0,
                            cache_modifier=".cg").to(tl.float32)
            k = _norm_rope_rows(k, k_rot, k_norm_w, cos, sin_signed, offs_d, rot_d, d_mask, eps, HEAD_DIM, QK_NORM,
                                dtype, EMULATE)
            slot = tl.load(slot_ptr).to(tl.int64)
            dst = slot * KV_ROW + kv_head * HEAD_DIM
            tl.store(k_cache + dst + offs_d[None, :], k.to(dtype), mask=d_mask[None, :])
            v = tl.load(k_row + KV_ROW + offs_d, mask=d_mask, other=0.0, cache_modifier=".cg")
            tl.store(v_cache + dst + offs_d, v, mask=d_mask)
            tl.debug_barrier()                                 # the new k, v seen by every thread of the program
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            valid = tile_start + offs_n < end
            rows = _key_rows(table_ptr, 0, tile_start, offs_n, valid, BLOCK_SIZE, True, TILE_IN_BLOCK)
            k, v = _load_kv_tile(k_cache, v_cache, rows, kv_head, KV_ROW, HEAD_DIM, KV_ROW, HEAD_DIM, offs_d,
                                 valid, d_mask, CAST_FP32)
            acc, m_i, l_i = _online_softmax_step(q, k, v, acc, m_i, l_i, qk_scale, valid[None, :], True,
                                                 DOT_PRECISION)
        has_keys = l_i > 0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part_rows = heads * num_splits + split                  # workspace [H, S, d] and [H, S]
        tl.store(part_out + part_rows[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_lse + part_rows, lse, mask=g_mask)
        tl.debug_barrier()
        # The last split of this KV head to arrive merges all of them (kernels/attention.py's merge).
        if tl.atomic_add(count_ptr + kv_head, 1, sem="acq_rel") == num_splits - 1:
            tl.debug_barrier()
            offs_s = tl.arange(0, BLOCK_S)
            s_mask = offs_s < num_splits
            for g in range(GROUP):
                head = kv_head * GROUP + g
                lse_s = tl.load(part_lse + head * num_splits + offs_s, mask=s_mask, other=float("-inf"),
                                cache_modifier=".cg")
                m = tl.max(lse_s, 0)
                m = tl.where(m == float("-inf"), 0.0, m)
                w = tl.exp2(lse_s - m)
                denom = tl.sum(w, 0)
                parts = tl.load(part_out + (head * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                                mask=s_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
                o = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
                tl.store(attn_ptr + head * HEAD_DIM + offs_d, o.to(dtype), mask=d_mask)
            tl.atomic_xchg(count_ptr + kv_head, 0)             # ready for the next layer


@triton.jit(do_not_specialize=["step_lo", "step_hi", "num_splits", "layer_stride_kv"])
def _persistent_decode_kernel(
    base_ptr, table_ptr, embed_ptr, final_norm_ptr, ids_ptr, out_ptr,
    k_cache_ptr, v_cache_ptr, layer_stride_kv,
    positions_ptr, slot_ptr, block_table_ptr, context_lens_ptr, cos_sin_ptr, stride_cs,
    resid_ptr, qkv_ptr, part_out, part_lse, count_ptr, attn_ptr, o_part, act_ptr, d_part,
    bar_ptr, exit_ptr, err_ptr, ts_ptr, eps, qk_scale, num_splits, step_lo, step_hi,
    NUM_LAYERS: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_IN_BLOCK: tl.constexpr,
    BN_QKV: tl.constexpr, BN_O: tl.constexpr, KC_O: tl.constexpr, BN_GU: tl.constexpr,
    BN_DOWN: tl.constexpr, KC_DOWN: tl.constexpr,
    PHASES: tl.constexpr, QK_NORM: tl.constexpr, STEPWISE: tl.constexpr, PREFETCH: tl.constexpr,
    HOIST: tl.constexpr, TIMESTAMPS: tl.constexpr,
    ALIGNED: tl.constexpr, KV_ALIGNED: tl.constexpr,
    CAST_FP32: tl.constexpr,
    EMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    NQKV: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    KS_O: tl.constexpr = (Q_SIZE + KC_O - 1) // KC_O
    KS_DOWN: tl.constexpr = (INTER + KC_DOWN - 1) // KC_DOWN
    for step in range(step_lo, step_hi):
        layer = step // PHASES
        phase = step % PHASES
        weights = table_ptr + layer * 8       # columns: PersistentDecode.WEIGHTS
        if PREFETCH:                          # this step's weights into L2 while its barrier waits
            if layer < NUM_LAYERS:
                if phase == 0:
                    _prefetch_items(_weight(base_ptr, weights, 0, ALIGNED), pid, nprog, NQKV, HIDDEN, BN_QKV, BLOCK_H,
                                    0)
                elif phase == 2:
                    _prefetch_items(_weight(base_ptr, weights, 1, ALIGNED), pid, nprog, HIDDEN, Q_SIZE, BN_O, KC_O, 0)
                elif phase == 3:
                    _prefetch_items(_weight(base_ptr, weights, 2, ALIGNED), pid, nprog, INTER, HIDDEN, BN_GU, BLOCK_H,
                                    INTER)
                elif phase == 4:
                    _prefetch_items(_weight(base_ptr, weights, 3, ALIGNED), pid, nprog, HIDDEN, INTER, BN_DOWN,
                                    KC_DOWN, 0)
        # Each phase: what it reads that no earlier step writes (its first W tile: HOIST) is loaded before the
        # barrier, then the barrier (every program wrote its part of what this phase reads), then the work.
        if layer == NUM_LAYERS:                                # the final norm
            _phase_barrier(bar_ptr, err_ptr, nprog, step, step_lo, ts_ptr, pid, STEPWISE, TIMESTAMPS)
            if pid == 0:
                offs = tl.arange(0, BLOCK_H)
                mask = offs < HIDDEN
                x = _sum_parts(d_part, KS_DOWN, HIDDEN, offs, mask, dtype, EMULATE)
                h = round_to(x + _load_row(resid_ptr + HIDDEN, offs, mask, True), dtype, EMULATE)
                y = _rms_norm_row(h, final_norm_ptr, offs, mask, HIDDEN, eps, dtype, EMULATE)
                tl.store(out_ptr + offs, y.to(dtype), mask=mask)
        elif phase == 0:
            qkv_w = _weight(base_ptr, weights, 0, ALIGNED)
            w_qkv, u_qkv = _gemv_first(qkv_w, pid, NQKV, HIDDEN, BLOCK_H, BN_QKV, False)
            _phase_barrier(bar_ptr, err_ptr, nprog, step, step_lo, ts_ptr, pid, STEPWISE, TIMESTAMPS)
            normed = _add_norm_phase(d_part, KS_DOWN, resid_ptr + HIDDEN, resid_ptr,
                                     _weight(base_ptr, weights, 4, ALIGNED), ids_ptr, embed_ptr, pid, eps, layer == 0,
                                     HIDDEN, BLOCK_H, dtype, EMULATE)
            _gemv_phase(normed, qkv_w, qkv_ptr, pid, nprog, w_qkv, u_qkv,
                        HIDDEN, NQKV, BLOCK_H, BN_QKV, False, HOIST, dtype, EMULATE)
        elif phase == 1:
            _phase_barrier(bar_ptr, err_ptr, nprog, step, step_lo, ts_ptr, pid, STEPWISE, TIMESTAMPS)
            kv = _kv_offset(layer, layer_stride_kv, KV_ALIGNED)
            _attention_phase(qkv_ptr, _weight(base_ptr, weights, 6, ALIGNED), _weight(base_ptr, weights, 7, ALIGNED),
                             k_cache_ptr + kv, v_cache_ptr + kv, positions_ptr, slot_ptr, block_table_ptr,
                             context_lens_ptr, cos_sin_ptr, stride_cs, part_out, part_lse, count_ptr,
                             attn_ptr, pid, nprog, eps, qk_scale, num_splits,
                             NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HALF, BLOCK_D, BLOCK_G, BLOCK_N,
                             BLOCK_S, BLOCK_SIZE, TILE_IN_BLOCK, QK_NORM, CAST_FP32, DOT_PRECISION, dtype, EMULATE)
        elif phase == 2:
            o_w = _weight(base_ptr, weights, 1, ALIGNED)
            w_o = _split_k_first(o_w, pid, HIDDEN, Q_SIZE, BN_O, KC_O)
            _phase_barrier(bar_ptr, err_ptr, nprog, step, step_lo, ts_ptr, pid, STEPWISE, TIMESTAMPS)
            _split_k_phase(attn_ptr, o_w, o_part, pid, nprog, w_o, HIDDEN, Q_SIZE, BN_O, KC_O, HOIST)
        elif phase == 3:
            gu_w = _weight(base_ptr, weights, 2, ALIGNED)
            w_gu, u_gu = _gemv_first(gu_w, pid, INTER, HIDDEN, BLOCK_H, BN_GU, True)
            _phase_barrier(bar_ptr, err_ptr, nprog, step, step_lo, ts_ptr, pid, STEPWISE, TIMESTAMPS)
            normed = _add_norm_phase(o_part, KS_O, resid_ptr, resid_ptr + HIDDEN, _weight(base_ptr, weights, 5, ALIGNED),
                                     ids_ptr, embed_ptr, pid, eps, False, HIDDEN, BLOCK_H, dtype, EMULATE)
            _gemv_phase(normed, gu_w, act_ptr, pid, nprog, w_gu, u_gu,
                        HIDDEN, INTER, BLOCK_H, BN_GU, True, HOIST, dtype, EMULATE)
        else:
            down_w = _weight(base_ptr, weights, 3, ALIGNED)
            w_down = _split_k_first(down_w, pid, HIDDEN, INTER, BN_DOWN, KC_DOWN)
            _phase_barrier(bar_ptr, err_ptr, nprog, step, step_lo, ts_ptr, pid, STEPWISE, TIMESTAMPS)
            _split_k_phase(act_ptr, down_w, d_part, pid, nprog, w_down, HIDDEN, INTER, BN_DOWN, KC_DOWN, HOIST)
    if TIMESTAMPS:
        if pid == 0:
            tl.store(ts_ptr + step_hi, _globaltimer())          # program 0 is the one that ends the step
    if not STEPWISE:
        _reset_at_exit(bar_ptr, exit_ptr, nprog, count_ptr, NUM_KV_HEADS)   # with the merge counts


def _tile_rows(n: int, k: int, programs: int, max_elems: int) -> int:
    """Rows a GEMV tile takes: the power of two (>= 1) whose tiles spread n rows most evenly over `programs`
    (fewest rows in the busiest program), the largest such while a tile holds <= max_elems weights."""
    best = None
    bn = 1
    while bn <= max(1, triton.next_power_of_2(n)) and bn * k <= max(max_elems, k):
        busiest = triton.cdiv(triton.cdiv(n, bn), programs) * bn
        if best is None or busiest <= best[0]:
            best = (busiest, bn)
        bn *= 2
    return best[1]


def _split_k_tiles(n: int, k: int, programs: int, max_elems: int) -> tuple[int, int]:
    """(rows, K chunk) of a split-K GEMV's items: the fewest bytes the busiest program reads, counting its
    bf16 weights and the fp32 partials every program of the next phase reads back (n per K chunk)."""
    best = None
    kc = triton.next_power_of_2(k)
    smallest = min(16, kc)                                   # K below 16: one chunk of all of it
    while kc >= smallest:
        bn = 1
        while bn <= triton.next_power_of_2(n) and bn * kc <= max(max_elems, kc):
            items = triton.cdiv(n, bn) * triton.cdiv(k, kc)
            cost = triton.cdiv(items, programs) * bn * min(kc, k) * 2 + triton.cdiv(k, kc) * n * 4
            if best is None or cost <= best[0]:          # ties: the larger tile
                best = (cost, bn, kc)
            bn *= 2
        kc //= 2
    return best[1], best[2]


@dataclass(frozen=True)
class PersistentConfig:
    """Launch shape: programs (one per SM on a GPU), KV splits per head, and the tile of each projection."""
    programs: int
    num_splits: int
    bn_qkv: int
    bn_o: int
    kc_o: int
    bn_gate_up: int
    bn_down: int
    kc_down: int
    block_n: int
    num_warps: int
    prefetch: bool = False          # ask for each phase's weights into L2 before its barrier (GPU only)
    hoist: bool = True              # load each GEMV phase's first W tile before its barrier (into registers)
    timestamps: bool = False        # program 0 writes the clock at each step's start into .timestamps (GPU only)


def choose_config(hidden: int, inter: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  programs: int, gpu: bool) -> PersistentConfig:
    """Tiles so that every projection's rows spread evenly over `programs`, <= 16 K weights a tile (8 K for
    gate_up, which loads a gate and an up tile); KV splits so that kv_heads x splits ~ programs."""
    bh = triton.next_power_of_2(hidden)
    nqkv = (num_heads + 2 * num_kv_heads) * head_dim
    bn_o, kc_o = _split_k_tiles(hidden, num_heads * head_dim, programs, 16384)
    bn_down, kc_down = _split_k_tiles(hidden, inter, programs, 16384)
    return PersistentConfig(
        programs=programs, num_splits=max(1, programs // num_kv_heads),
        bn_qkv=_tile_rows(nqkv, bh, programs, 16384), bn_o=bn_o, kc_o=kc_o,
        bn_gate_up=_tile_rows(inter, bh, programs, 8192), bn_down=bn_down, kc_down=kc_down,
        block_n=64 if gpu else 16, num_warps=4 if gpu else 1)


class PersistentDecode:
    """One model's persistent batch-1 decode step: its weight table, work buffers and launch shape, made once.

    weights: per layer a dict with "qkv" [Nqkv, hidden], "o" [hidden, H * d], "gate_up" [2I, hidden],
        "down" [hidden, I], "input_norm", "post_norm" [hidden], and "q_norm", "k_norm" [d] (Qwen3) or None;
        every tensor contiguous, one dtype and device (the model's own parameters: nothing is copied).
    embed: [vocab, hidden]; final_norm: [hidden]; eps: the RMSNorm epsilon (one for every norm).
    k_caches, v_caches: per layer [num_blocks, block_size, Hkv, d] views into one cache tensor at a fixed
        stride (engine/kv_cache.allocate_kv_cache); cos_sin_cache [max_position, d] fp32.
    programs: None = one per SM (a GPU) or 3 (the interpreter); stepwise: None = only under the interpreter,
        where stepwise=False needs programs=1 (its barriers then pass at once: the fused path, testable on a CPU).
    Raises ValueError naming the argument whose type, shape, dtype, device or value does not fit these layouts.
    """
    WEIGHTS = ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "q_norm", "k_norm")   # the table's columns

    def __init__(self, weights: list[dict], embed: torch.Tensor, final_norm: torch.Tensor, eps: float,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], cos_sin_cache: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 programs: int | None = None, stepwise: bool | None = None):
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_heads % num_kv_heads or head_dim % 2:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) and "
                             f"head_dim ({head_dim}) even")
        if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs <= 0):
            raise ValueError(f"programs must be None or a positive int, got {programs!r}")
        for name, value in (("eps", eps), ("scale", scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name, value in (("weights", weights), ("k_caches", k_caches), ("v_caches", v_caches)):
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list with one entry per layer, got {type(value).__name__}")
        if not isinstance(embed, torch.Tensor) or embed.dim() != 2 or not embed.is_contiguous() or \
                not embed.dtype.is_floating_point:
            raise ValueError(f"embed: expected a contiguous floating-point [vocab, hidden] tensor, got "
                             f"{tuple(embed.shape) if isinstance(embed, torch.Tensor) else type(embed).__name__}")
        self.num_layers = len(weights)
        if self.num_layers == 0 or len(k_caches) != self.num_layers or len(v_caches) != self.num_layers:
            raise ValueError("weights, k_caches and v_caches need one entry per layer (at least one)")
        for i, layer in enumerate(weights):
            if not isinstance(layer, dict):
                raise ValueError(f"weights[{i}]: expected a dict of {', '.join(self.WEIGHTS)}, got {type(layer).__name__}")
            missing = [name for name in self.WEIGHTS if name not in layer]
            if missing:
                raise ValueError(f"weights[{i}] lacks {', '.join(missing)} (each layer needs {', '.join(self.WEIGHTS)})")
            if not isinstance(layer["gate_up"], torch.Tensor) or layer["gate_up"].dim() != 2:
                raise ValueError(f"layer {i} gate_up: expected a [2I, hidden] tensor")
        self.dtype, self.device = embed.dtype, embed.device
        self.hidden = embed.shape[1]
        self.inter = weights[0]["gate_up"].shape[0] // 2
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_norm = weights[0]["q_norm"] is not None
        for i, layer in enumerate(weights):
            if (layer["q_norm"] is None) != (layer["k_norm"] is None) or (layer["q_norm"] is None) == self.qk_norm:
                raise ValueError(f"weights[{i}]: q_norm and k_norm must both be tensors (Qwen3) or both None (Llama), "
                                 "the same in every layer")
        shapes = {"qkv": ((num_heads + 2 * num_kv_heads) * head_dim, self.hidden),
                  "o": (self.hidden, num_heads * head_dim), "gate_up": (2 * self.inter, self.hidden),
                  "down": (self.hidden, self.inter), "input_norm": (self.hidden,), "post_norm": (self.hidden,),
                  "q_norm": (head_dim,), "k_norm": (head_dim,)}

        def check(what, t, shape, dtype):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.is_contiguous() or \
                    t.dtype != dtype or t.device != self.device:
                got = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else t
                raise ValueError(f"{what}: expected a contiguous {shape} {dtype} tensor on {self.device}, got {got}")

        check("final_norm", final_norm, (self.hidden,), self.dtype)
        if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dim() != 2:
            raise ValueError("cos_sin_cache: expected a [max_position, head_dim] float32 tensor")
        check("cos_sin_cache", cos_sin_cache, (cos_sin_cache.shape[0], head_dim), torch.float32)
        base = embed
        rows = []
        for i, layer in enumerate(weights):
            row = []
            for name in self.WEIGHTS:
                t = layer[name]
                if t is None and name in ("q_norm", "k_norm") and not self.qk_norm:
                    row.append(0)                               # never read (QK_NORM off)
                    continue
                check(f"layer {i} {name}", t, shapes[name], self.dtype)
                offset, rem = divmod(t.data_ptr() - base.data_ptr(), t.element_size())
                if rem:
                    raise ValueError(f"layer {i} {name}: its address is not a whole number of elements from embed's")
                row.append(offset)
            rows.append(row)
        # Every offset a multiple of 16 elements: the kernel may say so (_weight), and its loads are 16-byte vectors.
        self.aligned = all(offset % 16 == 0 for row in rows for offset in row)
        self.table = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.embed, self.final_norm, self.eps, self.cos_sin = embed, final_norm, float(eps), cos_sin_cache
        cache_shape = k_caches[0].shape if isinstance(k_caches[0], torch.Tensor) else None
        if cache_shape is None or len(cache_shape) != 4 or tuple(cache_shape[2:]) != (num_kv_heads, head_dim) or \
                min(cache_shape[:2]) < 1:
            raise ValueError(f"k_caches, v_caches: expected [num_blocks, block_size, {num_kv_heads}, {head_dim}] "
                             f"tensors, got {None if cache_shape is None else tuple(cache_shape)}")
        for caches, which in ((k_caches, "k_caches"), (v_caches, "v_caches")):
            for i, c in enumerate(caches):
                check(f"{which}[{i}]", c, tuple(cache_shape), self.dtype)
        self.k_cache, self.v_cache = k_caches[0], v_caches[0]
        stride = k_caches[1].data_ptr() - k_caches[0].data_ptr() if self.num_layers > 1 else 0
        layer_bytes = k_caches[0].numel() * k_caches[0].element_size()
        if self.num_layers > 1 and abs(stride) < layer_bytes:
            raise ValueError("k_caches: the layers' caches overlap (one tensor for several layers?)")
        for i in range(self.num_layers):
            for caches in (k_caches, v_caches):
                if caches[i].data_ptr() - caches[0].data_ptr() != i * stride:
                    raise ValueError("k_caches, v_caches: the per-layer caches must be views at one fixed stride "
                                     "(engine/kv_cache.allocate_kv_cache)")
        self.layer_stride_kv, rem = divmod(stride, k_caches[0].element_size())
        if rem:
            raise ValueError("k_caches: the stride between layers' caches must be a whole number of elements")
        self.block_size = k_caches[0].shape[1]
        self.qk_scale = scale * LOG2E
        gpu = self.device.type == "cuda" and not interpreting()
        if programs is None:
            programs = torch.cuda.get_device_properties(self.device).multi_processor_count if gpu else 3
        self.stepwise = (not gpu) if stepwise is None else bool(stepwise)
        if not gpu and not self.stepwise and programs != 1:
            raise ValueError("stepwise=False needs a GPU or programs=1: the interpreter runs programs one after "
                             "another, so a barrier of several would wait forever")
        self.config = choose_config(self.hidden, self.inter, num_heads, num_kv_heads, head_dim, programs, gpu)
        c, dev, f32 = self.config, self.device, torch.float32
        block_g = max(16, triton.next_power_of_2(num_heads // num_kv_heads)) if gpu else \
            triton.next_power_of_2(num_heads // num_kv_heads)
        self.block_g = block_g
        self.resid = torch.empty(2, self.hidden, dtype=self.dtype, device=dev)
        self.qkv = torch.empty(shapes["qkv"][0], dtype=self.dtype, device=dev)
        self.part_out = torch.empty(num_heads, c.num_splits, head_dim, dtype=f32, device=dev)
        self.part_lse = torch.empty(num_heads, c.num_splits, dtype=f32, device=dev)
        self.attn = torch.empty(num_heads * head_dim, dtype=self.dtype, device=dev)
        self.o_part = torch.empty(triton.cdiv(num_heads * head_dim, c.kc_o), self.hidden, dtype=f32, device=dev)
        self.act = torch.empty(self.inter, dtype=self.dtype, device=dev)
        self.d_part = torch.empty(triton.cdiv(self.inter, c.kc_down), self.hidden, dtype=f32, device=dev)
        # counters: [0] barrier, [1] exit, [2] barrier give-ups, [3:] merge counts per KV head
        self.counters = torch.zeros(3 + num_kv_heads, dtype=torch.int32, device=dev)
        self.timestamps = torch.zeros(self.num_layers * PHASES + 2, dtype=torch.int64, device=dev)   # ns
        self._resident_checked = None          # the config whose programs were checked to fit (GPU, first launch)
        self._errors_checked = False           # the give-up count read once (check_errors)

    @property
    def errors(self) -> torch.Tensor:
        """int32 [1]: barriers that gave up waiting (0 unless programs could not all be resident)."""
        return self.counters[2:3]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """One decode step of one sequence: input_ids, positions [1] int64, slot_mapping [1] int32,
        block_tables [1, max_blocks] int32, context_lens [1] int32 (this token included) -> the final
        normed hidden state [1, hidden] in the model dtype; writes the token's k, v into every layer's cache.
        No host synchronisation (safe in a CUDA graph), so on a GPU the values are the caller's contract, as
        for the layers' kernels (the scheduler makes them); on the CPU they are checked too.
        Raises ValueError naming the argument whose shape, dtype, device or (CPU) value does not fit, and
        for `programs` more than the GPU keeps resident at once (the grid barriers would give up)."""
        self.check_inputs(input_ids, positions, slot_mapping, block_tables, context_lens)
        steps = self.num_layers * PHASES + 1
        spans = [(s, s + 1) for s in range(steps)] if self.stepwise else [(0, steps)]
        return self.run_steps(spans, self.stepwise, input_ids, positions, slot_mapping, block_tables, context_lens)

    def check_inputs(self, input_ids, positions, slot_mapping, block_tables, context_lens) -> None:
        """The checks of __call__ (above): ValueError naming the first argument that does not fit."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.shape != (1,):
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids: the persistent decode step takes one sequence's token, shape (1,), got {shape}")
        for name, t, shape in (("input_ids", input_ids, (1,)), ("positions", positions, (1,)),
                               ("slot_mapping", slot_mapping, (1,)), ("context_lens", context_lens, (1,)),
                               ("block_tables", block_tables, None)):
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or \
                    t.device != self.device or (shape is not None and tuple(t.shape) != shape) or \
                    (shape is None and (t.dim() != 2 or t.shape[0] != 1 or t.shape[1] == 0)):
                got = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
                want = "[1, max_blocks]" if shape is None else "[1]"
                raise ValueError(f"{name}: expected an int32 or int64 {want} tensor on {self.device} (one sequence), "
                                 f"got {got}")
        if block_tables.stride(1) != 1:
            raise ValueError("block_tables: its rows must be contiguous (stride 1 along max_blocks)")
        if self.device.type == "cpu":                          # free to read here (no device to wait on)
            ctx, pos = int(context_lens[0]), int(positions[0])
            capacity = block_tables.shape[1] * self.block_size
            if not 1 <= ctx <= min(capacity, self.cos_sin.shape[0]):
                raise ValueError(f"context_lens: {ctx} is outside 1..{min(capacity, self.cos_sin.shape[0])} (the "
                                 f"block table holds {capacity} tokens, the RoPE cache {self.cos_sin.shape[0]})")
            if pos != ctx - 1:
                raise ValueError(f"positions: a decode step's token is at context_lens - 1 = {ctx - 1}, got {pos}")
            used = block_tables[0, :-(-ctx // self.block_size)]
            if bool(((used < 0) | (used >= self.k_cache.shape[0])).any()):
                raise ValueError(f"block_tables: the blocks of the context's {ctx} tokens must lie in "
                                 f"0..{self.k_cache.shape[0] - 1}, got {used.tolist()}")
            slots = self.k_cache.shape[0] * self.block_size
            if not 0 <= int(slot_mapping[0]) < slots:
                raise ValueError(f"slot_mapping: {int(slot_mapping[0])} is outside the cache's 0..{slots - 1}")
            if not 0 <= int(input_ids[0]) < self.embed.shape[0]:
                raise ValueError(f"input_ids: token {int(input_ids[0])} is outside the vocabulary 0..{self.embed.shape[0] - 1}")

    def run_steps(self, spans, stepwise: bool, input_ids, positions, slot_mapping, block_tables, context_lens):
        """Launch the kernel once per (first, last + 1) step range in `spans` (step = layer * PHASES + phase),
        with barriers inside a range unless `stepwise`. __call__ runs every step; a benchmark may time one
        phase's launches alone (bench/persistent_step.py --breakdown). Returns the output row [1, hidden]."""
        out = torch.empty(1, self.hidden, dtype=self.dtype, device=self.device)
        c = self.config
        emulate = interpreting()
        for lo, hi in spans:
            args = (self.embed, self.table, self.embed, self.final_norm, input_ids, out,
                    self.k_cache, self.v_cache, self.layer_stride_kv,
                    positions, slot_mapping, block_tables, context_lens, self.cos_sin, self.cos_sin.stride(0),
                    self.resid, self.qkv, self.part_out, self.part_lse, self.counters[3:], self.attn,
                    self.o_part, self.act, self.d_part, self.counters[0:1], self.counters[1:2], self.counters[2:3],
                    self.timestamps, self.eps, self.qk_scale, c.num_splits, lo, hi)
            meta = dict(
                NUM_LAYERS=self.num_layers, HIDDEN=self.hidden, INTER=self.inter, NUM_HEADS=self.num_heads,
                NUM_KV_HEADS=self.num_kv_heads, HEAD_DIM=self.head_dim,
                BLOCK_H=triton.next_power_of_2(self.hidden),
                BLOCK_D=triton.next_power_of_2(self.head_dim), BLOCK_G=self.block_g, BLOCK_N=c.block_n,
                BLOCK_S=triton.next_power_of_2(c.num_splits), BLOCK_SIZE=self.block_size,
                TILE_IN_BLOCK=self.block_size % c.block_n == 0,
                BN_QKV=c.bn_qkv, BN_O=c.bn_o, KC_O=c.kc_o, BN_GU=c.bn_gate_up, BN_DOWN=c.bn_down,
                KC_DOWN=c.kc_down, PHASES=PHASES, QK_NORM=self.qk_norm, STEPWISE=stepwise,
                PREFETCH=c.prefetch and not emulate,
                HOIST=c.hoist, TIMESTAMPS=c.timestamps and not emulate, ALIGNED=self.aligned,
                KV_ALIGNED=self.layer_stride_kv % 16 == 0,
                CAST_FP32=emulate,
                EMULATE=emulate, DOT_PRECISION="ieee" if (self.dtype == torch.float32 or emulate) else "tf32",
                num_warps=c.num_warps)
            if not stepwise and not emulate and self._resident_checked != c:
                # Before the first launch with barriers: every program must fit on the GPU at once.
                compiled = _persistent_decode_kernel.warmup(*args, grid=(c.programs,), **meta)
                compiled._init_handles()
                props = torch.cuda.get_device_properties(self.device)
                fits = max_resident(compiled.n_regs, c.num_warps, compiled.metadata.shared, props)
                if c.programs > fits:
                    raise ValueError(f"programs: {c.programs} programs of {c.num_warps} warps, {compiled.n_regs} "
                                     f"registers and {compiled.metadata.shared} bytes of shared memory each; this "
                                     f"GPU keeps at most {fits} resident at once, and the grid barriers need all")
                self._resident_checked = c
            _persistent_decode_kernel[(c.programs,)](*args, **meta)
            if not stepwise and not emulate and not self._errors_checked and \
                    not torch.cuda.is_current_stream_capturing():
                self.check_errors()                    # once, at the first launch outside a graph capture (a sync)
                self._errors_checked = True
        return out

    def check_errors(self) -> None:
        """Raise RuntimeError if any grid barrier has given up waiting since this step was made (its results are
        then wrong: some program was not resident, e.g. another process held SMs). Waits for the device. The
        step runs this itself once, after its first launch outside a CUDA-graph capture."""
        gave_up = int(self.errors.item())
        if gave_up:
            raise RuntimeError(f"the persistent decode step's grid barriers gave up {gave_up} times: its "
                               f"{self.config.programs} programs were not all resident at once (a GPU shared with "
                               "other work?), so its results are wrong; use decode_kernels='auto'")


def max_resident(regs_per_thread: int, num_warps: int, shared_bytes: int, props) -> int:
    """Programs of one kernel an NVIDIA GPU keeps resident at once: per SM the least of what its registers
    (allocated per warp in units of 256), threads, shared memory and block slots allow, times its SMs.
    props: torch.cuda.get_device_properties (the sm_90 figures stand in for any it lacks)."""
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    shared_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    blocks_sm = getattr(props, "max_blocks_per_multi_processor", 32)
    regs_warp = -(-max(regs_per_thread, 1) * 32 // 256) * 256
    per_sm = min(regs_sm // (regs_warp * num_warps), threads_sm // (32 * num_warps), blocks_sm,
                 shared_sm // shared_bytes if shared_bytes else blocks_sm)
    return per_sm * props.multi_processor_count
