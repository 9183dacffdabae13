"""Q/K RMSNorm + RoPE + KV-cache store of one decode step in one Triton kernel (chapter 10); the same for prefill.

What it computes, from the fused QKV projection output of T tokens (q, k, v are column slices of it):
    q_t,h = rope(rms_norm(q_t,h) * q_weight, pos_t)          -> returned, [T, H, d]
    k_t,j = rope(rms_norm(k_t,j) * k_weight, pos_t)          -> k_cache at slot_mapping[t]
    v_t,j                                                     -> v_cache at slot_mapping[t]
for every query head h and KV head j. Without norm weights (Llama) the RMSNorm step is skipped. A slot
of -1 stores nothing (the padding rows of a batch replayed through a CUDA graph); q is computed for
every row either way. `qk_norm_rope` is the same kernel without the store, for prefill steps: it returns q
and k, and the attention layer stores k and v itself (where it also attends over this step's k and v).

The maths is the reference's (layers/layernorm.py, layers/rotary_embedding.py): RMSNorm per head with
the mean of squares in fp32, rounded to the model dtype, times the weight, rounded again; then RoPE in the
GPT-NeoX "rotate half" layout, where channel i pairs with channel i + d/2:
    out[i] = x[i] * cos - x[i + d/2] * sin,   out[i + d/2] = x[i + d/2] * cos + x[i] * sin,
with cos/sin read from the model's cos_sin_cache [max_position, d] fp32 (first half cos, second half
sin; scaled RoPE variants only change that table). The store is the one of kernels/store_kvcache.py
(PagedAttention's reshape_and_cache, Kwon et al. 2023, §4.1). vLLM fused the same three steps for small
batches (PR 38621: 5.0 -> 2.3 us).

Tiling: grid (T, cdiv(H + 2 * Hkv, BLOCK_R)). The heads of a token are rows of one tile: q heads, then k heads,
then v heads, as they sit in the qkv row. A program owns BLOCK_R of them, each read as its two halves
(BLOCK_HALF = next power of two of d/2, masked), so the rotation pairs line up without a shuffle; q and k rows
are normed and rotated, k and v rows are stored in the cache, q rows returned. BLOCK_ROWS = 8: the earlier
grid of one 1-warp program per head (6,144 programs at 256 tokens) took 5.2 us on the H200 at 256 tokens,
for about 3 MB moved; 8 rows a program take 2.8 (bench/results/kernels_round8_h200_2026-12-03.json).

The input may also be split-K partial sums [S, T, C] fp32 of the QKV GEMM (kernels/small_gemm.py): they
are added and rounded to the model dtype as they are loaded, so that GEMM needs no reduction kernel.
"""
import torch
import triton
import triton.language as tl

from nanovllm_ref.kernels.numerics import DEFINED_INTERPRETED, interpreting, pdl_launch_kwargs, round_to  # noqa: F401
from nanovllm_ref.kernels.small_gemm import preloads_weights


@triton.jit
def _load_half(qkv_ptr, num_parts, stride_ps, row_offset, offs, mask, dtype: tl.constexpr,
               PARTIALS: tl.constexpr, EMULATE_ROUNDING: tl.constexpr):
    """fp32 values of one half head at qkv[t, col + offs] (summing split-K partials when given)."""
    if PARTIALS:
        x = tl.zeros(offs.shape, dtype=tl.float32)
        for s in range(num_parts):
            x += tl.load(qkv_ptr + s * stride_ps + row_offset + offs, mask=mask, other=0.0).to(tl.float32)
        return round_to(x, dtype, EMULATE_ROUNDING)
    else:
        return tl.load(qkv_ptr + row_offset + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rotate(x1, x2, cos, sin, dtype: tl.constexpr, EMULATE_ROUNDING: tl.constexpr):
    """RoPE of the halves (x1, x2) by (cos, sin) in fp32, each result rounded once to the model dtype."""
    return (round_to(x1 * cos - x2 * sin, dtype, EMULATE_ROUNDING),
            round_to(x2 * cos + x1 * sin, dtype, EMULATE_ROUNDING))


@triton.jit(do_not_specialize=["num_parts"])
def _qk_norm_rope_store_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, slot_mapping_ptr,
    k_cache_ptr, v_cache_ptr, q_out_ptr,
    num_parts, stride_ps, stride_t, stride_cs, stride_qt, stride_qh, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr, QK_NORM: tl.constexpr, PARTIALS: tl.constexpr,
    EMULATE_ROUNDING: tl.constexpr, USE_PDL: tl.constexpr, TO_CACHE: tl.constexpr = True,
    LAUNCH_EARLY: tl.constexpr = False,
):
    # The head rows of one token: q heads 0..H-1, k heads H..H+Hkv-1, v heads after them, as they sit in a qkv
    # row (head r starts at column r * HEAD_DIM). This program owns rows r0 .. r0 + BLOCK_R - 1, each as its
    # two halves, so the rotation pairs (i, i + d/2) line up without a shuffle.
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]           # [BLOCK_R, 1]
    offs = tl.arange(0, BLOCK_HALF)[None, :]                                    # [1, BLOCK_HALF]
    is_q = rows < NUM_HEADS
    is_k = (rows >= NUM_HEADS) & (rows < NUM_HEADS + NUM_KV_HEADS)
    is_v = (rows >= NUM_HEADS + NUM_KV_HEADS) & (rows < NUM_HEADS + 2 * NUM_KV_HEADS)
    cols = offs < HALF
    mask = (is_q | is_k | is_v) & cols
    dtype = q_out_ptr.dtype.element_ty
    if USE_PDL and LAUNCH_EARLY:
        tl.extra.cuda.gdc_launch_dependents()     # one row: the attention behind may launch now; its wait holds it
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pos = tl.load(positions_ptr + token).to(tl.int64)
    if TO_CACHE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    else:                    # k into a [T, Hkv, d] output (k_cache_ptr), row = token; v is not written
        slot = token
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=cols, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=cols, other=0.0)
    row = token * stride_t + rows * HEAD_DIM
    x1 = _load_half(qkv_ptr, num_parts, stride_ps, row, offs, mask, dtype, PARTIALS, EMULATE_ROUNDING)
    x2 = _load_half(qkv_ptr, num_parts, stride_ps, row + HALF, offs, mask, dtype, PARTIALS, EMULATE_ROUNDING)
    # v rows are stored as loaded; q and k rows are normed (Qwen3) and rotated.
    y1, y2 = x1, x2
    if QK_NORM:
        # The reference's rounding: the normed value, then the weight multiply, each rounded to the model dtype.
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.where(is_q, tl.load(q_weight_ptr + offs, mask=cols, other=0.0).to(tl.float32),
                      tl.load(k_weight_ptr + offs, mask=cols, other=0.0).to(tl.float32))
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + offs, mask=cols, other=0.0).to(tl.float32),
                      tl.load(k_weight_ptr + HALF + offs, mask=cols, other=0.0).to(tl.float32))
        y1 = round_to(w1 * round_to(x1 * rstd, dtype, EMULATE_ROUNDING), dtype, EMULATE_ROUNDING)
        y2 = round_to(w2 * round_to(x2 * rstd, dtype, EMULATE_ROUNDING), dtype, EMULATE_ROUNDING)
    y1, y2 = _rotate(y1, y2, cos, sin, dtype, EMULATE_ROUNDING)
    y1 = tl.where(is_v, x1, y1).to(dtype)
    y2 = tl.where(is_v, x2, y2).to(dtype)
    q_dst = q_out_ptr + token * stride_qt + rows * stride_qh + offs
    tl.store(q_dst, y1, mask=mask & is_q)
    tl.store(q_dst + HALF, y2, mask=mask & is_q)
    # A cache slot holds [Hkv, d] contiguously ([num_blocks, block_size, Hkv, d] cache). Slot -1 is a padding
    # row of a batch replayed through a CUDA graph: it stores nothing (q is still computed for it).
    if slot >= 0:
        kv_head = tl.where(is_k, rows - NUM_HEADS, rows - NUM_HEADS - NUM_KV_HEADS)
        kv_dst = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs
        tl.store(k_cache_ptr + kv_dst, y1, mask=mask & is_k)
        tl.store(k_cache_ptr + kv_dst + HALF, y2, mask=mask & is_k)
        if TO_CACHE:
            tl.store(v_cache_ptr + kv_dst, y1, mask=mask & is_v)
            tl.store(v_cache_ptr + kv_dst + HALF, y2, mask=mask & is_v)


# Head rows a program owns. Qwen3-0.6B's shape on the H200 (bench/results/kernels_round8_h200_2026-12-03.json):
# 8 rows a program was the fastest or within 0.05 us of it at 1 to 256 tokens (256 tokens: 2.79 us, against
# 2.93 with all 32 rows and 5.17 with the earlier kernel of one program per head).
BLOCK_ROWS = 8


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int, use_pdl: bool = False,
                       block_rows: int | None = None) -> torch.Tensor:
    """Normalise and rotate q and k of one step, write k and v into the paged cache, return q.

    qkv: [T, (H + 2 * Hkv) * d] in the model dtype (the QKV projection output; rows may be strided, columns
        contiguous), or its split-K partial sums [S, T, (H + 2 * Hkv) * d] fp32.
    positions: [T] int64 (or int32); cos_sin_cache: [max_position, d] fp32, cos in the first half, sin in the
        second (layers/rotary_embedding.RotaryEmbedding.cos_sin_cache).
    q_weight, k_weight: [d] in the model dtype (Qwen3's q_norm/k_norm), or both None (no q/k norm: Llama).
    k_cache, v_cache: [num_blocks, block_size, Hkv, d] contiguous, the model dtype.
    slot_mapping: [T] int32 or int64; slot = block_id * block_size + offset, -1 = store nothing.
    block_rows: head rows a program owns (a power of two; default BLOCK_ROWS = 8); benchmarks set it.
    Returns q: [T, H, d], a new contiguous tensor in the model dtype (the cache dtype).
    Raises ValueError on shapes, dtypes or devices that disagree (the slot values are not checked: no host
    synchronisation, so it can run inside a CUDA graph).
    """
    _check_qkv(qkv, positions, cos_sin_cache, q_weight, k_weight, num_heads, num_kv_heads, head_dim, block_rows)
    num_tokens = qkv.shape[-2]
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    dtype = k_cache.dtype
    if v_cache.dtype != dtype or (qkv.dim() == 2 and qkv.dtype != dtype):
        raise ValueError(f"qkv ({qkv.dtype}), k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions and slot_mapping must be [T={num_tokens}], got {tuple(positions.shape)} "
                         f"and {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if any(t.device != qkv.device for t in (k_cache, v_cache, slot_mapping)):
        raise ValueError("all tensors must be on one device")
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=dtype, device=qkv.device)
    _launch(qkv, positions, cos_sin_cache, q_weight, k_weight, eps, slot_mapping, k_cache, v_cache, q,
            num_heads, num_kv_heads, head_dim, use_pdl, block_rows, to_cache=True)
    return q


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 num_heads: int, num_kv_heads: int, head_dim: int, use_pdl: bool = False,
                 block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same kernel without the store, for prefill steps (the attention layer stores k and v and attends
    over them): q/k RMSNorm (skipped without weights) and RoPE.

    qkv: [T, (H + 2 * Hkv) * d] in the model dtype (rows may be strided, columns contiguous); the other
    arguments as in `qk_norm_rope_store`. Returns (q [T, H, d], k [T, Hkv, d]), new contiguous tensors in
    qkv's dtype; v is the column slice qkv[:, (H + Hkv) * d:] as it is. Raises ValueError as
    `qk_norm_rope_store` does, and for split-K partials (a prefill's QKV projection writes none)."""
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [T, C] (no split-K partials), got shape {tuple(qkv.shape)}")
    _check_qkv(qkv, positions, cos_sin_cache, q_weight, k_weight, num_heads, num_kv_heads, head_dim, block_rows)
    num_tokens = qkv.shape[0]
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _launch(qkv, positions, cos_sin_cache, q_weight, k_weight, eps, positions, k, k, q,
            num_heads, num_kv_heads, head_dim, use_pdl, block_rows, to_cache=False)
    return q, k


def _check_qkv(qkv, positions, cos_sin_cache, q_weight, k_weight, num_heads, num_kv_heads, head_dim, block_rows):
    """The checks both entry points share: qkv's shape, the q/k norm weights, positions, the RoPE table."""
    if qkv.dim() not in (2, 3):
        raise ValueError(f"qkv must be [T, C] or split-K partials [S, T, C], got shape {tuple(qkv.shape)}")
    num_tokens, width = qkv.shape[-2], qkv.shape[-1]
    if width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv has {width} columns; (num_heads + 2 * num_kv_heads) * head_dim = "
                         f"{(num_heads + 2 * num_kv_heads) * head_dim}")
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if qkv.stride(-1) != 1:
        raise ValueError("qkv needs stride(-1) == 1 (columns contiguous)")
    if qkv.dim() == 3 and qkv.dtype != torch.float32:
        raise ValueError(f"split-K partials must be float32, got {qkv.dtype}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given (Qwen3) or both be None (Llama)")
    if q_weight is not None and (q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,)):
        raise ValueError(f"q_weight and k_weight must be [{head_dim}]")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [T={num_tokens}], got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be [max_position, {head_dim}] float32, got "
                         f"{tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype}")
    tensors = [positions, cos_sin_cache] + ([q_weight, k_weight] if q_weight is not None else [])
    if any(t.device != qkv.device for t in tensors):
        raise ValueError("all tensors must be on one device")
    if block_rows is not None and (not isinstance(block_rows, int) or block_rows < 1
                                   or block_rows & (block_rows - 1)):
        raise ValueError(f"block_rows must be a power of two >= 1, got {block_rows!r}")


def _launch(qkv, positions, cos_sin_cache, q_weight, k_weight, eps, slot_mapping, k_dst, v_dst, q,
            num_heads, num_kv_heads, head_dim, use_pdl, block_rows, to_cache: bool):
    num_tokens = qkv.shape[-2]
    if num_tokens == 0:
        return
    partials = qkv.dim() == 3
    half = head_dim // 2
    qk_norm = q_weight is not None
    num_rows = num_heads + 2 * num_kv_heads
    block_r = block_rows or min(BLOCK_ROWS, triton.next_power_of_2(num_rows))
    block_half = triton.next_power_of_2(half)
    _qk_norm_rope_store_kernel[(num_tokens, triton.cdiv(num_rows, block_r))](
        qkv, positions, cos_sin_cache, q_weight if qk_norm else q, k_weight if qk_norm else q, slot_mapping,
        k_dst, v_dst, q,
        qkv.shape[0] if partials else 1, qkv.stride(0) if partials else 0, qkv.stride(-2),
        cos_sin_cache.stride(0), q.stride(0), q.stride(1), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_HALF=block_half, BLOCK_R=block_r, QK_NORM=qk_norm, PARTIALS=partials,
        EMULATE_ROUNDING=interpreting(), USE_PDL=use_pdl, TO_CACHE=to_cache, LAUNCH_EARLY=preloads_weights(num_tokens),
        num_warps=max(1, min(4, block_r * block_half // 256)), **pdl_launch_kwargs(use_pdl),
    )
