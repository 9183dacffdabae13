"""SiLU-and-mul of a [gate | up] row in one Triton kernel, for the steps the small GEMM's epilogue does not
serve: prefill and decode batches above its max_m rows, after cuBLAS's gate_up GEMM (chapter 10).

What it computes, as layers/activation.silu_and_mul does in eager PyTorch (every op writes the model dtype):
    s = silu(gate) = gate * sigmoid(gate)      in fp32, rounded to the model dtype
    out = s * up                                in fp32, rounded to the model dtype
for x [T, 2 * d] = [gate | up] -> out [T, d]. The small GEMM's SiLU epilogue (kernels/small_gemm.py) rounds at the
same two points.

Why a kernel: Inductor's compiled form (dynamic shapes) ran at about a third of the copy bandwidth on the H200:
4.6 ms of a 14,336-token prefill step, 166 us a layer for 264 MB moved (profile of
bench/results/ab8_h200_2026-12-03_call3.json). Tiling: grid (T, cdiv(d, BLOCK)), BLOCK = 1,024 columns a program,
so each thread loads 8 contiguous bf16 values of gate and of up (16-byte loads).
"""
import torch
import triton
import triton.language as tl

from nanovllm_ref.kernels.numerics import DEFINED_INTERPRETED, interpreting, pdl_launch_kwargs, round_to  # noqa: F401

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_xt, stride_ot, BLOCK: tl.constexpr,
                         EMULATE_ROUNDING: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    gate = tl.load(x_ptr + row * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xt + d + cols, mask=mask, other=0.0).to(tl.float32)
    s = round_to(gate * tl.sigmoid(gate), dtype, EMULATE_ROUNDING)      # F.silu writes the model dtype
    tl.store(out_ptr + row * stride_ot + cols, round_to(s * up, dtype, EMULATE_ROUNDING).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
    """x: [T, 2 * d] = [gate | up] (rows may be strided, columns contiguous), any float dtype -> silu(gate) * up:
    [T, d], a new contiguous tensor in x's dtype. Raises ValueError for another rank, an odd width or
    non-contiguous columns. No host synchronisation: capturable in a CUDA graph."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, 2 * d], got shape {tuple(x.shape)}")
    if x.shape[1] % 2:
        raise ValueError(f"x must have an even number of columns ([gate | up]), got {x.shape[1]}")
    if x.stride(-1) != 1:
        raise ValueError("x needs stride(-1) == 1 (columns contiguous)")
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or d == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        x, out, d, x.stride(0), out.stride(0), BLOCK=block, EMULATE_ROUNDING=interpreting(), USE_PDL=use_pdl,
        num_warps=max(1, min(4, block // 256)), **pdl_launch_kwargs(use_pdl),
    )
    return out
