"""A trial for GPU speed round 14 (issue 29): the decode projections at 65-256 rows as a Triton GEMM whose x and W
tiles come through TMA tensor descriptors (Hopper's bulk tensor copies) instead of pointer loads. Bench only: the
engine runs cuBLAS at these sizes (kernels/small_gemm.py's docstring says why), and this kernel moves there only if
bench/kernels_round14.py measures it faster.

It computes what kernels/small_gemm.py's three forms compute, with the same rounding:
    "full"     y [M, N] = x [M, K] @ W [N, K].T, in x's dtype;
    "partials" P [S, M, N] fp32, split-K partial sums (sum over S = x @ W.T), which add + RMSNorm adds up;
    "silu"     W = [W_gate; W_up] [2I, K]: y [M, I] = silu(x @ W_gate.T) * (x @ W_up.T), rounded as the unfused ops.
No bias (Qwen3 and Llama have none). A tile that runs past M, N or K reads zeros (TMA's out-of-bounds fill); the
columns past N (or, for the gate, into the up rows) are computed and never stored.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm_ref.kernels.numerics import interpreting, pdl_launch_kwargs, round_to
from nanovllm_ref.kernels.small_gemm import GemmConfig


@triton.jit(do_not_specialize=["M"])
def _tma_gemm_kernel(x_desc, w_desc, out_ptr, M, N, K, stride_os, stride_om, k_per_split, up_rows,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PARTIALS: tl.constexpr, SILU_MUL: tl.constexpr, CAST_FP32: tl.constexpr,
                     EMULATE_ROUNDING: tl.constexpr, USE_PDL: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in tl.range(k_start, k_stop, BLOCK_K, num_stages=NUM_STAGES):
        x = x_desc.load([m0, k0])
        w = w_desc.load([n0, k0])
        if CAST_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
        if SILU_MUL:
            u = w_desc.load([up_rows + n0, k0])
            if CAST_FP32:
                u = u.to(tl.float32)
            acc_up = tl.dot(x, tl.trans(u), acc_up)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    rows = offs_m.to(tl.int64)[:, None] * stride_om
    if PARTIALS:
        tl.store(out_ptr + split * stride_os + rows + offs_n[None, :], acc, mask=out_mask)
    else:
        dtype = out_ptr.dtype.element_ty
        y = round_to(acc, dtype, EMULATE_ROUNDING)
        if SILU_MUL:
            up = round_to(acc_up, dtype, EMULATE_ROUNDING)
            y = round_to(y * tl.sigmoid(y), dtype, EMULATE_ROUNDING)
            y = round_to(y * up, dtype, EMULATE_ROUNDING)
        tl.store(out_ptr + rows + offs_n[None, :], y.to(dtype), mask=out_mask)


def gemm(x: torch.Tensor, weight: torch.Tensor, kind: str, config: GemmConfig, use_pdl: bool = False) -> torch.Tensor:
    """x [M, K] (K contiguous, rows 16-byte aligned) @ weight [N, K].T in form `kind` (module docstring), tiles
    and K splits from `config` (block_*, split_k for "partials", num_warps, num_stages; use_dot is implied)."""
    if kind not in ("full", "partials", "silu"):
        raise ValueError(f"kind must be 'full', 'partials' or 'silu', got {kind!r}")
    m, k = x.shape
    n = weight.shape[0]
    n_out = n // 2 if kind == "silu" else n
    partials = kind == "partials"
    splits = config.num_splits(k) if partials else 1
    if partials:
        out = torch.empty((splits, m, n_out), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    grid = (triton.cdiv(n_out, config.block_n), splits, triton.cdiv(m, config.block_m))
    _tma_gemm_kernel[grid](x_desc, w_desc, out, m, n_out, k, out.stride(0) if partials else 0, out.stride(-2),
                           config.k_per_split(k) if partials else k, n_out if kind == "silu" else 0,
                           BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                           PARTIALS=partials, SILU_MUL=kind == "silu", CAST_FP32=interpreting(),
                           EMULATE_ROUNDING=interpreting(), USE_PDL=use_pdl, NUM_STAGES=config.num_stages,
                           num_warps=config.num_warps, **pdl_launch_kwargs(use_pdl))
    return out
