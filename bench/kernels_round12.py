#!/usr/bin/env python3
"""GPU speed round 12 (issue 29): the add + RMSNorm moved into the next GEMM's prologue, at 1-32 decode rows.

    python3 bench/kernels_round12.py --out results.json              # the GPU run, ~1-2 min
    python3 bench/kernels_round12.py --dry-run --out /tmp/dry.json   # CPU: Triton interpreter, tiny shapes

Why: round 11's trace of the decode GEMM chain at one row (28 layers, 169 kernels a replay, 694 us on the H100)
gave 143 us of it to the 57 add + RMSNorm kernels, each moving a few kilobytes: 2.5 us a kernel of launch, wait
and memory latency, with nothing to stream. Each of them sits between a split-K GEMM (o_proj or down, which
writes fp32 partials) and the GEMM that reads the normed rows (qkv or gate_up). Here that norm runs inside the
reading GEMM instead, so a layer is four kernels, not six:

    qkv     = norm_gemm(down partials, residual, n1, W_qkv)         also writes the new residual
    o       = linear_partials(qkv[:, :q], W_o)
    act     = norm_gemm(o partials, residual, n2, W_gate_up, silu)  also writes the new residual
    down    = linear_partials(act, W_down)

`norm_gemm` makes two passes over the input row in every program: the first sums the squares of
h = round(sum of partials) + residual (rounded as the engine's add_rms_norm rounds), the second rebuilds h,
rounds h * rstd and its product with the norm weight to the model dtype, exactly where the separate kernel
does, and feeds it to the GEMM. Every column tile re-reads the row (from L2: M * D * (S + 1) fp32 values a
pass), which costs little at a few rows and grows with M; the round measures where it stops paying. Column
tile 0 stores h, the next layer's residual.

Result (H200, 2026-12-07, bench/results/kernels_round12_h200_2026-12-07.json): slower at every size, 1.14x the
engine's chain at 1 row and 2.8-3.7x at 2-32, with the engine's outputs; not kept. The two passes put chains of
dependent L2 loads in front of every program's weight stream, which costs more than the separate norm kernel.

Sections:
- chain: at each M, the chain as the engine runs it (round 11's `chain`, the engine's plan) and with the norms in
  the GEMMs (VARIANTS: both norms with choose_config's tiles, both with column tiles twice as wide, the qkv one
  only, the gate_up one only), us a layer of each (engine measured before and after), each variant's error
  against the engine's chain and against the same chain in fp32 torch.
- trace: torch.profiler over graph replays of the fused chain at 1 and 16 rows: kernels a replay and span.
The JSON (--out) is rewritten after every case.
"""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402


def parse_args(argv=None):
    return bench_env.parser(__doc__, budget=100.0, sections="chain,trace", dry_ms="1,2").parse_args(argv)


ARGS = parse_args()
bench_env.choose_triton_mode(ARGS.dry_run)
import kernels_round3 as r3  # noqa: E402
import kernels_round10 as r10  # noqa: E402  (make_layers, chain_fp32)
import kernels_round11 as r11  # noqa: E402  (chain as the engine runs it, trace)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanovllm_ref.kernels.numerics import interpreting, pdl_launch_kwargs, round_to  # noqa: E402

GPU_MS = [1, 2, 4, 8, 16, 32]


@triton.jit
def _load_h(x_ptr, res_ptr, num_parts, stride_xs, stride_xm, stride_rm, offs_m, ks, mask,
            dtype: tl.constexpr, PARTIALS: tl.constexpr, HAS_RES: tl.constexpr, EMULATE_ROUNDING: tl.constexpr):
    """h [BLOCK_M, BLOCK_K] fp32: the residual stream after the add, rounded as kernels/rms_norm.py rounds."""
    rows = offs_m.to(tl.int64)[:, None]
    if PARTIALS:
        x = tl.zeros(mask.shape, dtype=tl.float32)
        for s in range(num_parts):
            x += tl.load(x_ptr + s * stride_xs + rows * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        x = round_to(x, dtype, EMULATE_ROUNDING)
    else:
        x = tl.load(x_ptr + rows * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + rows * stride_rm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, dtype, EMULATE_ROUNDING)
    return x


@triton.jit(do_not_specialize=["M"])
def _norm_small_gemm_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, h_ptr,
    M, N, D, num_parts, stride_xs, stride_xm, stride_rm, stride_wn, stride_om, stride_hm, up_offset, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIALS: tl.constexpr, HAS_RES: tl.constexpr, STORE_H: tl.constexpr, SILU_MUL: tl.constexpr,
    USE_DOT: tl.constexpr, CAST_FP32: tl.constexpr, EMULATE_ROUNDING: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    dtype = out_ptr.dtype.element_ty
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    # pass 1: the mean of squares of each row of h (fp32, as the separate kernel sums it)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + offs_k
        mask = m_mask[:, None] & (ks < D)[None, :]
        h = _load_h(x_ptr, res_ptr, num_parts, stride_xs, stride_xm, stride_rm, offs_m, ks, mask,
                    dtype, PARTIALS, HAS_RES, EMULATE_ROUNDING)
        ss += tl.sum(h * h, axis=1)
    rstd = tl.rsqrt(ss / D + eps)
    # pass 2: the normed rows, rounded where the separate kernel rounds, into the GEMM
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < D
        mask = m_mask[:, None] & k_mask[None, :]
        h = _load_h(x_ptr, res_ptr, num_parts, stride_xs, stride_xm, stride_rm, offs_m, ks, mask,
                    dtype, PARTIALS, HAS_RES, EMULATE_ROUNDING)
        if STORE_H:
            if pid_n == 0:
                tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + ks[None, :], h.to(dtype), mask=mask)
        nw = tl.load(nw_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        xn = round_to(nw[None, :] * round_to(h * rstd[:, None], dtype, EMULATE_ROUNDING), dtype, EMULATE_ROUNDING)
        wmask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + ks[None, :], mask=wmask, other=0.0)
        if SILU_MUL:
            wu = tl.load(w_rows + up_offset + ks[None, :], mask=wmask, other=0.0)
        if USE_DOT:
            if CAST_FP32:
                xd = xn
                w = w.to(tl.float32)
                if SILU_MUL:
                    wu = wu.to(tl.float32)
            else:
                xd = xn.to(w.dtype)
            acc += tl.dot(xd, tl.trans(w), input_precision=DOT_PRECISION)
            if SILU_MUL:
                acc_up += tl.dot(xd, tl.trans(wu), input_precision=DOT_PRECISION)
        else:
            # the GEMV form (a few rows): [BLOCK_M, 1, BLOCK_K] * [1, BLOCK_N, BLOCK_K], summed along K
            acc += tl.sum(xn[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            if SILU_MUL:
                acc_up += tl.sum(xn[:, None, :] * wu.to(tl.float32)[None, :, :], axis=2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = round_to(acc, dtype, EMULATE_ROUNDING)
    if SILU_MUL:
        up = round_to(acc_up, dtype, EMULATE_ROUNDING)
        y = round_to(y * tl.sigmoid(y), dtype, EMULATE_ROUNDING)
        y = round_to(y * up, dtype, EMULATE_ROUNDING)
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], y.to(dtype), mask=out_mask)


def norm_gemm(x, residual, norm_weight, eps, weight, silu: bool, pdl: bool, config=None):
    """(y, h): h = x + residual (x: [M, D] in the model dtype, or split-K partials [S, M, D] fp32; residual None:
    h = x), y = rms_norm(h) * norm_weight @ weight.T ([M, N], weight [N, D]), or with silu the SwiGLU of the
    merged gate_up weight ([2I, D] -> [M, I]). Rounds as add_rms_norm followed by the small GEMM do."""
    from nanovllm_ref.kernels import small_gemm
    partials = x.dim() == 3
    m, d = x.shape[-2], x.shape[-1]
    dtype = weight.dtype
    n_out = weight.shape[0] // 2 if silu else weight.shape[0]
    cfg = config or small_gemm.choose_config(m, weight.shape[0], d, "silu" if silu else "full",
                                             small_gemm.num_sms(x.device))
    out = torch.empty((m, n_out), dtype=dtype, device=x.device)
    store_h = partials or residual is not None
    h = torch.empty((m, d), dtype=dtype, device=x.device) if store_h else x
    grid = (triton.cdiv(n_out, cfg.block_n), 1, triton.cdiv(m, cfg.block_m))
    _norm_small_gemm_kernel[grid](
        x, residual if residual is not None else x, norm_weight, weight, out, h,
        m, n_out, d, x.shape[0] if partials else 1, x.stride(0) if partials else 0, x.stride(-2),
        residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0), h.stride(0),
        n_out * weight.stride(0) if silu else 0, eps,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PARTIALS=partials,
        HAS_RES=residual is not None, STORE_H=store_h, SILU_MUL=silu, USE_DOT=cfg.use_dot,
        CAST_FP32=interpreting(), EMULATE_ROUNDING=interpreting(),
        DOT_PRECISION="ieee" if (dtype == torch.float32 or interpreting()) else "tf32",
        USE_PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(pdl))
    return out, h


VARIANTS = {                       # name: (the GEMMs that take the norm in, column-tile width factor)
    "fused": (("qkv", "gate_up"), 1),
    "fused_wide": (("qkv", "gate_up"), 2),   # half as many programs, so half as many re-reads of the row
    "fused_qkv": (("qkv",), 1),
    "fused_gate_up": (("gate_up",), 1),
}


def fused_chain(x, layers, s, pdl: bool, variant: str = "fused"):
    """Round 11's chain with the add + RMSNorm inside the GEMM after it (module docstring), for the GEMMs the
    variant names (VARIANTS); the others keep the engine's separate kernel. Returns [M, hidden]."""
    from nanovllm_ref.kernels import rms_norm, small_gemm
    fused, widen = VARIANTS[variant]
    eps, q_size = s["eps"], s["heads"] * s["head_dim"]
    sms = small_gemm.num_sms(x.device)

    def norm_then(inp, residual, nw, w, op):
        if op in fused:
            cfg = small_gemm.choose_config(x.shape[0], w.shape[0], w.shape[1], "silu" if op == "gate_up" else "full",
                                           sms)
            cfg = dataclasses.replace(cfg, block_n=cfg.block_n * widen)
            return norm_gemm(inp, residual, nw, eps, w, op == "gate_up", pdl, cfg)
        if residual is None:
            h, residual = rms_norm.add_rms_norm(inp, None, nw, eps, use_pdl=pdl)[0], inp
        else:
            h, residual = rms_norm.add_rms_norm(inp, residual, nw, eps, use_pdl=pdl)
        gemm = small_gemm.linear_silu_mul if op == "gate_up" else small_gemm.linear
        return gemm(h, w, use_pdl=pdl), residual

    hidden, residual = x, None
    for L in layers:
        qkv, residual = norm_then(hidden, residual, L["n1"], L["qkv"], "qkv")
        o = small_gemm.linear_partials(qkv[:, :q_size], L["o"], use_pdl=pdl)
        act, residual = norm_then(o, residual, L["n2"], L["gate_up"], "gate_up")
        hidden = small_gemm.linear_partials(act, L["down"], use_pdl=pdl)
    return rms_norm.add_rms_norm(hidden, residual, layers[-1]["n1"], eps, use_pdl=pdl)[0]


class FusedCtx(r11.Ctx):
    """Round 11's context at m rows, whose `run` takes a VARIANTS name as the plan too."""

    def run(self, plan):
        if isinstance(plan, str) and plan in VARIANTS:
            return fused_chain(self.x, self.layers, self.s, self.pdl, plan)
        return super().run(plan)


def chain_m(rec, ctx: FusedCtx):
    ref32 = r10.chain_fp32(ctx.x, ctx.layers, ctx.s)
    eng_out = ctx.run(ctx.engine)
    row = {"m": ctx.m, "engine": ctx.engine,
           "engine_max_abs_err_vs_fp32": round(float((eng_out.float() - ref32).abs().max()), 4)}
    for name in VARIANTS:
        out = ctx.run(name)
        row[f"{name}_max_abs_err_vs_fp32"] = round(float((out.float() - ref32).abs().max()), 4)
        row[f"{name}_max_abs_diff_vs_engine"] = round(float((out.float() - eng_out.float()).abs().max()), 4)
    row["engine_us_a_layer"] = ctx.us(ctx.engine)
    for name in VARIANTS:
        row[f"{name}_us_a_layer"] = ctx.us(name)
    row["engine_us_again"] = ctx.us(ctx.engine)
    eng = (row["engine_us_a_layer"] + row["engine_us_again"]) / 2
    for name in VARIANTS:
        row[f"{name}_vs_engine"] = round(row[f"{name}_us_a_layer"] / eng, 3) if eng else None
    row["fused_saves_us_a_step"] = round((eng - row["fused_us_a_layer"]) * len(ctx.layers), 1)
    rec.add("chain", row)
    r3.log(f"  M={ctx.m:<3d} engine {eng:.2f} us a layer; " + ", ".join(
        f"{n} {row[f'{n}_us_a_layer']} ({row[f'{n}_vs_engine']}x)" for n in VARIANTS) +
        f"; fused vs engine max diff {row['fused_max_abs_diff_vs_engine']}, vs fp32 {row['fused_max_abs_err_vs_fp32']} "
        f"(engine {row['engine_max_abs_err_vs_fp32']})")


def main(args) -> int:
    from nanovllm_ref.kernels import small_gemm
    from nanovllm_ref.kernels.numerics import pdl_available
    run = r3.begin(args, "bench/kernels_round12.py", ("chain", "trace"))
    if run is None:
        return 2
    device, shapes, dtype, rec, budget = run.device, run.shapes, run.dtype, run.rec, run.budget
    sections = args.sections.split(",")
    dry = args.dry_run
    pdl = pdl_available(device)
    small_max_m = 64
    ms = bench_env.batch_sizes(args, GPU_MS)
    n_layers = 2 if dry else 28
    layers = r10.make_layers(shapes, n_layers, device, dtype, seed=12)
    rec.data["meta"].update(chain_layers=n_layers, ms=ms, pdl=pdl, sms=small_gemm.num_sms(device),
                            small_max_m=small_max_m)
    ctxs = {m: FusedCtx(m, layers, shapes, device, dtype, pdl, small_max_m) for m in ms}
    if "chain" in sections:
        r3.log("1. chain: the engine's decode GEMM chain against the norms inside the GEMMs")
        for m in ms:
            r3.guarded(rec, budget, f"chain M={m}", lambda: chain_m(rec, ctxs[m]), min_left=4.0)
    if "trace" in sections:
        r3.log("2. trace: kernel time against the replay's span, the fused chain")
        for m in ([1] if dry else [1, 16]):
            ctx = FusedCtx(m, layers, shapes, device, dtype, pdl, small_max_m)
            ctx.engine = "fused"          # r11.trace_m traces ctx.engine's plan: both norms inside
            r3.guarded(rec, budget, f"trace M={m}", lambda: r11.trace_m(rec, ctx), min_left=1.0)
    return r3.finish(run, args.out)


if __name__ == "__main__":
    sys.exit(main(ARGS))
