"""Attention over the paged KV cache in Triton: prefill and split-KV decode (chapter 06).

Layouts are those of `nanovllm_ref/attn/__init__.py`: q [tokens, H, D]; caches
[num_blocks, block_size, Hkv, D]; block_tables [num_seqs, max_blocks] int32 padded with -1. Every kernel
here is checked against the pure-PyTorch reference `nanovllm_ref/attn/torch_backend.py`.

1. Online softmax (FlashAttention-2, Dao 2023, §3.1)
   Attention for one query row is softmax(q·Kᵀ·scale)·V over all keys. Instead of materialising the whole
   score row, we stream the keys in tiles of BLOCK_N and keep three running values per query row:
   m (the largest score so far), l (the sum of exp(score - m)) and acc (the sum of exp(score - m)·v).
   When a tile raises the maximum from m to m', the old sums are rescaled by exp(m - m'), so after the
   last tile acc / l is exactly the softmax-weighted sum. We work in base 2 (exp2, with the scale
   multiplied by log2(e)) because exp2 is the native GPU instruction; the result is identical.

2. Paged keys
   The key of absolute position `pos` of sequence b lives in cache row
       slot = block_tables[b, pos // block_size] * block_size + pos % block_size.
   Fast path: when block_size is a multiple of BLOCK_N, a tile of BLOCK_N consecutive positions (tiles
   start at multiples of BLOCK_N) never straddles a block, so one block-table load serves the tile and
   the rows are contiguous in memory. General path (block sizes 1, 4, 48, ...): compute the slot per
   token from the block table; still correct for every block size, just one extra (cached) load per row.

3. Prefill (`paged_prefill`, `varlen_prefill`): grid (query tiles, heads, sequences). A program owns
   BLOCK_M query rows of one sequence and one head, reads cu_seqlens on the device, and loops over key
   tiles up to the causal limit. Causality is bottom-right aligned: query i of a sequence with q_len new
   tokens and k_len keys sits at absolute position k_len - q_len + i (a cached prefix or earlier chunks
   come first). `varlen_prefill` reuses the same kernel with "slot = token index" into contiguous k/v.
   Tiles: BLOCK_M=128, BLOCK_N=64 for bf16/fp16 with head_dim <= 128 on GPU - the FlashAttention-2
   shape, large enough to keep the tensor cores busy while the K/V tiles (2 x 16 KiB) and the Q tile
   (32 KiB) fit in shared memory with pipelining. Smaller for fp32 (twice the bytes) or head_dim > 128.

4. Decode (`paged_decode`): split-KV, "Flash-Decoding" (Dao, Haziza, Massa, Sizov, 2023). One query per
   sequence gives only num_seqs x num_kv_heads independent programs, far too few for 132 SMs when the
   batch is small and the context long. So the context is also cut into `num_splits` ranges; grid
   (num_kv_heads, num_seqs, num_splits): the KV heads of a sequence are launched side by side, and read the
   cache rows that hold all of a token's heads together. Each program streams its range with online softmax and writes a
   partial output plus its log-sum-exp (lse) to a workspace; a second small kernel merges the splits:
       out = sum_s exp(lse_s - max lse) * out_s / sum_s exp(lse_s - max lse).
   GQA: a program handles all G = H / Hkv query heads that share its KV head, so each K/V tile is read
   from memory once per group, not once per query head (decode is memory-bound: bytes are the cost).
   The G query rows are padded to BLOCK_G = 16 rows because tl.dot needs every dimension >= 16 on GPU;
   the extra rows are zeros and are never stored. BLOCK_N = 64 keys per tile on GPU.
   No host synchronisation (no .item(), shapes from .shape only) so the call can be captured in a CUDA
   graph; the number of splits is sized from block_tables.shape[1] * block_size, the longest context the
   table can describe.

Numerics: on the CPU interpreter every load is cast to fp32 before any maths (its bf16 arithmetic is not
trustworthy). On GPU, tl.dot takes the input dtype (bf16/fp16 tensor cores) with fp32 accumulation, and
the probabilities are rounded to the input dtype for the P·V product, as FlashAttention does; softmax
statistics are always fp32. fp32 inputs use input_precision="ieee" (no TF32) so fp32 stays fp32-exact.
Outputs are in q.dtype.
"""
import functools
import os

import torch
import triton
import triton.language as tl

from nanovllm_ref.kernels.numerics import pdl_launch_kwargs

LOG2E = 1.4426950408889634

# Triton picks interpreter or compiler when each @triton.jit below runs (see nanovllm_ref/kernels/__init__.py).
DEFINED_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Min tokens a decode split should own (one GPU tile): shorter splits are pure set-up and merge cost. On an
# H200, batch 1 at 512 tokens took 4.9 us with 8 splits of 64 tokens against 6.1 us with 4 of 128
# (bench/results/gpu_kernels_h200.json, split sweep).
MIN_TOKENS_PER_SPLIT = 64
MAX_SPLITS = 64


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_precision(dtype) -> str:
    """fp32 inputs: exact fp32 products ("ieee"), not TF32's 10-bit mantissa. Ignored for bf16/fp16 on GPU;
    the interpreter casts everything to fp32 first, so it always gets "ieee"."""
    return "ieee" if dtype == torch.float32 or _interpreting() else "tf32"


@triton.jit
def _key_rows(block_table_ptr, seq_k_start, tile_start, offs_n, valid,
              BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, TILE_IN_BLOCK: tl.constexpr):
    """Cache/tensor row index (int64) of each key position tile_start + offs_n."""
    pos = tile_start + offs_n
    if PAGED:
        if TILE_IN_BLOCK:
            # The whole tile sits in one block: one block-table load, contiguous rows.
            block_id = tl.load(block_table_ptr + tile_start // BLOCK_SIZE).to(tl.int64)
            rows = block_id * BLOCK_SIZE + (tile_start % BLOCK_SIZE) + offs_n
        else:
            # Per-token gather: works for any block size (1, 4, 48, ...). Masked rows never touch the
            # table, so -1 padding entries past the context are never used.
            block_id = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            rows = block_id * BLOCK_SIZE + pos % BLOCK_SIZE
    else:
        rows = (seq_k_start + pos).to(tl.int64)
    return rows


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, rows, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_d, valid,
                  d_mask, CAST_FP32: tl.constexpr):
    """K and V tiles [BLOCK_N, BLOCK_D] for the given rows; invalid rows read as 0 (and are masked later)."""
    mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    if CAST_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, acc, m_i, l_i, qk_scale, mask,
                         APPLY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One FlashAttention-2 step: fold a tile of keys into the running (acc, m, l) of every query row.

    Scores are in base 2 (qk_scale includes log2 e). `mask` [rows, BLOCK_N] is True where a key is visible;
    callers guarantee each row has seen at least one visible key by its first tile, so m_new is finite."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if APPLY_MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)                 # rescales what was accumulated under the old maximum
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# ------------------------------------------------------------------------------------------------ prefill

# Block-table width changes from step to step: do not compile a variant for widths of 1 or multiples of 16
# (Triton specialises integer arguments on those by default), so warm-up covers every width.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, cu_q_ptr, cu_k_ptr, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, TILE_IN_BLOCK: tl.constexpr, CAST_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Causal rows at the end of a sequence see the most keys: launch those tiles first so the longest
    # programs do not start last and leave a tail.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:      # the grid is sized for the longest sequence
        return
    k_start = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_start
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = k_len - q_len + offs_m      # bottom-right causal alignment

    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Keys before `full_end` are visible to every row of the tile (the first row sits at k_len - q_len +
    # m_block * BLOCK_M): those tiles skip the causal mask. Keys after the last row's position are masked
    # for every row: stop at `k_end`. Key 0 is in the first tile, so every row has a finite maximum.
    full_end = ((k_len - q_len + m_block * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    k_end = k_len - q_len + tl.minimum((m_block + 1) * BLOCK_M, q_len)
    for tile_start in range(0, full_end, BLOCK_N):
        valid = tile_start + offs_n < k_end
        rows = _key_rows(table, k_start, tile_start, offs_n, valid, BLOCK_SIZE, PAGED, TILE_IN_BLOCK)
        k, v = _load_kv_tile(k_ptr, v_ptr, rows, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_d,
                             valid, d_mask, CAST_FP32)
        acc, m_i, l_i = _online_softmax_step(q, k, v, acc, m_i, l_i, qk_scale, valid[None, :],
                                             False, DOT_PRECISION)
    for tile_start in range(full_end, k_end, BLOCK_N):
        pos = tile_start + offs_n
        valid = pos < k_end
        rows = _key_rows(table, k_start, tile_start, offs_n, valid, BLOCK_SIZE, PAGED, TILE_IN_BLOCK)
        k, v = _load_kv_tile(k_ptr, v_ptr, rows, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_d,
                             valid, d_mask, CAST_FP32)
        causal = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        acc, m_i, l_i = _online_softmax_step(q, k, v, acc, m_i, l_i, qk_scale, causal, True, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _prefill_config(dtype, head_dim):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Small tiles under the interpreter: it runs every tile in
    numpy, and small tiles make the tests cross tile boundaries at tiny sizes."""
    if _interpreting():
        return 16, 16, 4, 1
    if dtype == torch.float32 or head_dim > 128:
        return 64, 32, 4, 2
    return 128, 64, 8, 3


def _check_q(q, num_kv_heads, head_dim):
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != k/v head_dim {head_dim}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError("q needs stride(-1) == 1")


def _launch_prefill(q, k, v, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, paged,
                    block_size, stride_k, stride_v, launch=None):
    if launch is not None and (not isinstance(launch, tuple) or len(launch) != 4 or
                               not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in launch)
                               or any(v & (v - 1) for v in launch[:3])):
        raise ValueError(f"launch must be (BLOCK_M, BLOCK_N, num_warps, num_stages): powers of two but num_stages, "
                         f"every one a positive int; got {launch!r}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs <= 0:
        return out
    block_m, block_n, num_warps, num_stages = launch or _prefill_config(q.dtype, head_dim)
    table = block_tables if paged else cu_seqlens_q          # dummy pointer when not paged
    grid = (triton.cdiv(max_seqlen_q, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k, v, out, table, cu_seqlens_q, cu_seqlens_k, scale * LOG2E,
        q.stride(0), q.stride(1), stride_k[0], stride_k[1], stride_v[0], stride_v[1],
        out.stride(0), out.stride(1), block_tables.stride(0) if paged else 0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, PAGED=paged, TILE_IN_BLOCK=paged and block_size % block_n == 0,
        CAST_FP32=_interpreting(), DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, scale):
    """Causal varlen attention whose keys (cached prefix + this step's tokens) come from the paged cache."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    _check_q(q, k_cache.shape[2], k_cache.shape[3])
    if block_tables.dim() != 2 or block_tables.shape[0] != cu_seqlens_q.shape[0] - 1:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    return _launch_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           scale, True, k_cache.shape[1],
                           (k_cache.stride(1), k_cache.stride(2)), (v_cache.stride(1), v_cache.stride(2)))


def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, launch=None):
    """Causal varlen attention over this step's k/v only (no cache): the paged kernel with slot = token.
    launch: (BLOCK_M, BLOCK_N, num_warps, num_stages) in place of `_prefill_config`'s (benchmarks:
    bench/kernels_round14.py); the engine passes none."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k/v must be [tokens, num_kv_heads, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need stride(-1) == 1")
    _check_q(q, k.shape[1], k.shape[2])
    return _launch_prefill(q, k, v, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, scale, False, 1,
                           (k.stride(0), k.stride(1)), (v.stride(0), v.stride(1)), launch)


# ------------------------------------------------------------------------------------------------- decode

@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
    stride_qb, stride_qh, stride_ct, stride_ch, stride_bt, stride_ob, stride_oh, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_IN_BLOCK: tl.constexpr, CAST_FP32: tl.constexpr, ONE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False, HEAD_MAJOR: tl.constexpr = True,
):
    if USE_PDL:           # launched before the kernel in front of it ended: wait until its writes are visible
        tl.extra.cuda.gdc_wait()
    # HEAD_MAJOR: grid (Hkv, B, splits), so the programs launched one after another are the KV heads of one
    # sequence. They read neighbouring 256-byte pieces of the same cache rows (a row holds all Hkv heads of a
    # token) at about the same time, where the (B, Hkv, splits) order spreads them a whole wave apart.
    if HEAD_MAJOR:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        num_heads = tl.num_programs(0) * GROUP
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_heads = tl.num_programs(1) * GROUP
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)

    # This split's key range, in whole tiles (so a fast-path tile never straddles a block). Splits are
    # sized from this sequence's own length, so every split of a sequence gets the same amount of work.
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq64 * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        valid = tile_start + offs_n < end
        rows = _key_rows(table, 0, tile_start, offs_n, valid, BLOCK_SIZE, True, TILE_IN_BLOCK)
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, rows, kv_head, stride_ct, stride_ch, stride_ct, stride_ch,
                             offs_d, valid, d_mask, CAST_FP32)
        # Only the last tile of a split can be partial; every tile has >= 1 valid key, so m stays finite.
        acc, m_i, l_i = _online_softmax_step(q, k, v, acc, m_i, l_i, qk_scale, valid[None, :], True,
                                             DOT_PRECISION)

    # An empty split (or a CUDA-graph padding row with context_len 0) has l = 0: output 0, lse = -inf,
    # so the merge gives it weight 0 instead of producing NaN.
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if ONE_SPLIT:
        tl.store(out_ptr + seq64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part_rows = (seq64 * num_heads + heads) * num_splits + split          # workspace [B, H, S, D]
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_mask)
        tl.store(part_lse_ptr + part_rows, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        # The kernel behind (o_proj's small GEMM) may launch at once: at one row it loads its weights before its
        # own wait (kernels/small_gemm.py, GemmConfig.preload), so they stream in while this small merge runs.
        # Its wait still holds it until this grid has ended and its writes are visible.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)          # all splits empty: every weight becomes 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    parts = tl.load(part_out_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many KV splits so that batch x kv_heads x splits fills the GPU about twice over (two waves hide
    the tail of uneven sequences), without splits shorter than MIN_TOKENS_PER_SPLIT tokens.
    Batch 1, 8 KV heads, 4096 tokens on an H200 (132 SMs): min(33, 64) = 33 splits, 264 programs.
    Batch 64 x 8 heads = 512 programs already fill it: 1 split, no merge kernel at all (measured: 2 or 4
    splits were 7% slower there). Batches of mixed lengths gained 3-6 % from 2-4 splits in the kernel alone
    (bench/results/kernels_round5_h200_2026-12-02_mixed.json), but the whole bench workload did not get
    faster with them (ab5_h200_2026-12-02_balance_splits.json: decode device time 5.025 -> 5.000 s, plain
    throughput 24,340 -> 23,899 tok/s, one run each), so the rule stays."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    programs = max(1, batch * num_kv_heads)
    by_occupancy = triton.cdiv(2 * sms, programs)
    by_length = max(1, triton.cdiv(max_context, MIN_TOKENS_PER_SPLIT))
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _decode_block_n() -> int:
    return 16 if _interpreting() else 64


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None, block_n=None,
                 use_pdl: bool = False, num_warps: int | None = None, num_stages: int | None = None,
                 head_major: bool | None = None):
    """One query per sequence against its paged context. q: [B, H, D] -> [B, H, D].

    num_splits / block_n / num_warps / num_stages / head_major override the heuristics (`decode_num_splits`;
    head_major: the launch order, KV heads of a sequence side by side, default unless the batch passes 65,535;
    tests and benchmarks: bench/kernels_round5.py, bench/kernels_round8.py); the engine passes none of them.
    use_pdl: launch both kernels with programmatic dependent launch (Hopper, kernels/numerics.py), each waiting
    on the device for the kernel before it: the decode step's other kernels are launched so, and a launch that
    overlaps the previous kernel's tail saves about a microsecond (the engine's plan sets it with its decode
    kernels' PDL). No host synchronisation: safe to capture in a CUDA graph."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_q(q, num_kv_heads, k_cache.shape[3])
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [num_seqs={batch}, max_blocks], got {tuple(block_tables.shape)}")
    if context_lens.dim() != 1 or context_lens.shape[0] != batch:
        raise ValueError(f"context_lens must be [num_seqs={batch}], got {tuple(context_lens.shape)}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    # 64-key tiles, 4 warps, 2 stages. 32-key tiles with 2 warps and 3 stages were 4 % faster on 256 equal
    # 512-token contexts but made the whole bench workload (mixed lengths) 4 % slower on the H200
    # (bench/results/ab5_h200_2026-12-02_small_tiles.json), so they are not used.
    block_n, num_warps, num_stages = block_n or _decode_block_n(), num_warps or 4, num_stages or 2
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out                      # unused: the kernel writes `out` directly
    # The KV heads of a sequence launched side by side (HEAD_MAJOR), unless the batch passes CUDA's 65,535 limit
    # on a grid's second axis.
    head_major = (batch <= 65535) if head_major is None else head_major
    grid = (num_kv_heads, batch, num_splits) if head_major else (batch, num_kv_heads, num_splits)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), num_splits,
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE_IN_BLOCK=block_size % block_n == 0, CAST_FP32=_interpreting(),
        ONE_SPLIT=num_splits == 1, DOT_PRECISION=_dot_precision(q.dtype), USE_PDL=use_pdl, HEAD_MAJOR=head_major,
        num_warps=num_warps,
        num_stages=num_stages, **pdl_launch_kwargs(use_pdl),
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, USE_PDL=use_pdl,
            num_warps=4, **pdl_launch_kwargs(use_pdl),
        )
    return out
