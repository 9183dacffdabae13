"""Residual add + RMSNorm in one Triton kernel, optionally summing split-K GEMM partials first (chapter 10).

What it computes (for each token row t, hidden size D; layers/layernorm.py is the reference):
    x_t = sum_s partials[s, t]  rounded to the model dtype     (when x comes as split-K partial sums)
    h_t = x_t + residual_t      rounded to the model dtype     (the new residual stream)
    y_t = weight * round(h_t / sqrt(mean(h_t^2) + eps))       (mean of squares in fp32)
and returns (y, h). Without a residual it is plain RMSNorm of x, and h is x itself.

Why one kernel
    A decode step at batch 1 moves a few kilobytes per norm, so each kernel costs its launch, not its bytes
    (round 2 measured ~9 small kernels a layer for norms, adds and RoPE). Reading the GEMM's split-K
    partial sums here also removes the GEMM's own reduction kernel: the o_proj and down projections
    (kernels/small_gemm.py) write fp32 partials [S, T, D] and this kernel adds them up while it loads x.

Rounding follows the reference chain op by op (see kernels/numerics.py): the GEMM output, the residual sum
and the normed value are each rounded to the model dtype before the next op reads them, so the result is
the reference's up to the order of the fp32 sums (in practice 0-1 units in the last place of bf16).

Tiling: one program per token row; the whole row (BLOCK_D = next power of two of D, masked: SmolLM2's
hidden size is 576) is one load, so the mean needs no second pass.
"""
import torch
import triton
import triton.language as tl

from nanovllm_ref.kernels.numerics import DEFINED_INTERPRETED, interpreting, pdl_launch_kwargs, round_to  # noqa: F401
from nanovllm_ref.kernels.small_gemm import preloads_weights


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, h_ptr,
    num_parts, stride_xs, stride_xt, stride_rt, stride_ot, stride_ht, D, eps,
    BLOCK_D: tl.constexpr, PARTIALS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr,
    EMULATE_ROUNDING: tl.constexpr, USE_PDL: tl.constexpr, LAUNCH_EARLY: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dtype = out_ptr.dtype.element_ty
    if USE_PDL and LAUNCH_EARLY:
        # One row: the GEMM behind (qkv or gate_up) may launch at once, as it loads its weights before its own wait
        # (kernels/small_gemm.py, GemmConfig.preload), so they stream in while this kernel waits and runs.
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if PARTIALS:
        x = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in range(num_parts):
            x += tl.load(x_ptr + s * stride_xs + row * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x, dtype, EMULATE_ROUNDING)           # what the GEMM would have written
    else:
        x = tl.load(x_ptr + row * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_rt + offs, mask=mask, other=0.0).to(tl.float32)
        h = round_to(x + r, dtype, EMULATE_ROUNDING)       # the add runs in the model dtype, as in HF
    else:
        h = x
    if STORE_H:
        tl.store(h_ptr + row * stride_ht + offs, h.to(dtype), mask=mask)
    if USE_PDL and not LAUNCH_EARLY:
        # More rows: the tl.dot GEMM behind preloads nothing and would only hold SM slots while it waits; launching
        # it at the start made 9-64-row steps 5-9 % slower (H100, bench/results/ab13_h100_2026-12-07_call4.json).
        tl.extra.cuda.gdc_launch_dependents()
    mean_sq = tl.sum(h * h, axis=0) / D
    normed = round_to(h * tl.rsqrt(mean_sq + eps), dtype, EMULATE_ROUNDING)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = round_to(w * normed, dtype, EMULATE_ROUNDING)
    tl.store(out_ptr + row * stride_ot + offs, y.to(dtype), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) in one kernel; with residual None, (rms_norm(x) * weight, x).

    x: [T, D] in the model dtype, or split-K partial sums [S, T, D] fp32 (kernels/small_gemm.py), which are
        added up and rounded to the model dtype first. Rows need stride(-1) == 1.
    residual: [T, D] in the model dtype, or None.
    weight: [D] in the model dtype; eps: float. The model dtype is residual's (x's when there is none).
    Returns (out [T, D], h [T, D]), both new tensors in the model dtype (h is x itself when x is [T, D] and
    there is no residual). Same numbers as layers/layernorm.py's add_rms_norm / rms_norm up to fp32 sum order.
    Raises ValueError on shapes, dtypes or devices that disagree (no host synchronisation: safe in a CUDA graph).
    """
    partials = x.dim() == 3
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, D] or split-K partials [S, T, D], got shape {tuple(x.shape)}")
    if partials and x.dtype != torch.float32:
        raise ValueError(f"split-K partials must be float32, got {x.dtype}")
    num_tokens, hidden = x.shape[-2], x.shape[-1]
    dtype = residual.dtype if residual is not None else (weight.dtype if partials else x.dtype)
    if residual is not None and tuple(residual.shape) != (num_tokens, hidden):
        raise ValueError(f"residual must be [T={num_tokens}, D={hidden}], got {tuple(residual.shape)}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [D={hidden}], got {tuple(weight.shape)}")
    tensors = [t for t in (x, residual, weight) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, residual and weight must be on one device")
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("x, residual and weight need stride(-1) == 1")
    out = torch.empty((num_tokens, hidden), dtype=dtype, device=x.device)
    store_h = partials or residual is not None
    h = torch.empty_like(out) if store_h else x
    if num_tokens == 0:
        return out, h
    _add_rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else out, weight, out, h,
        x.shape[0] if partials else 1, x.stride(0) if partials else 0, x.stride(-2),
        residual.stride(0) if residual is not None else 0, out.stride(0), h.stride(0), hidden, eps,
        BLOCK_D=triton.next_power_of_2(hidden), PARTIALS=partials, HAS_RESIDUAL=residual is not None,
        STORE_H=store_h, EMULATE_ROUNDING=interpreting(), USE_PDL=use_pdl, LAUNCH_EARLY=preloads_weights(num_tokens),
        num_warps=4 if hidden <= 2048 else 8, **pdl_launch_kwargs(use_pdl),
    )
    return out, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_pdl: bool = False) -> torch.Tensor:
    """Plain RMSNorm of x [T, D] (model dtype) with weight [D]: the first form of `add_rms_norm`."""
    return add_rms_norm(x, None, weight, eps, use_pdl)[0]
