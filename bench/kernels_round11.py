#!/usr/bin/env python3
"""GPU speed round 11 (issue 29): which GEMM, with which tiles, for each decode projection at each batch size?

    python3 bench/kernels_round11.py --out results.json              # the GPU run, ~3-4 min
    python3 bench/kernels_round11.py --dry-run --out /tmp/dry.json   # CPU: Triton interpreter, tiny shapes

Why: the decode step's cost above its KV read is about 1.3 ms at every batch size of the bench workload (rounds 4
and 9: 1.31, 1.34, 1.34 and 1.46 ms a step in the 1-64, 65-128, 129-192 and 193-256 row buckets), and its GEMMs
are most of it (0.6 ms at 1 row, 0.8 at 64, 0.92 at 256). The small-GEMM table (`kernels/small_gemm.choose_config`)
was swept at M = 1 and 16 only (round 3), and the cuBLAS/Triton line at 64 rows was set from whole layers with one
Triton config above it (round 5). Kernels timed alone misled before (round 5), so every candidate here is timed
where the engine runs it: in the decode GEMM chain of round 10 (28 layers with their own weights, from HBM: add +
RMSNorm, QKV, O with split-K partials, add + RMSNorm, gate_up with the SiLU epilogue, down with partials; PDL as the
engine launches), with one projection changed at a time.

Sections:
- sweep: at each M, the chain as the engine runs it (`engine`), then each projection in turn as cuBLAS (`cublas`:
  F.linear, and for gate_up the SiLU-and-mul kernel after it) and as the Triton small GEMM with each candidate
  config; every row records us a layer and its difference from `engine` measured around it (before and after).
- best: at each M, the chain with every projection at its fastest candidate of the sweep, against `engine` and
  against all cuBLAS, with each plan's error against the same chain in fp32 torch.
- trace: torch.profiler over graph replays of the engine's chain at a few M: the kernels' summed time against the
  replay's span (the rest is the GPU between kernels: launch gaps inside the graph and PDL waits).
The JSON (--out) is rewritten after every case.
"""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402


def parse_args(argv=None):
    return bench_env.parser(__doc__, budget=230.0, sections="sweep,best,trace", dry_ms="2,5").parse_args(argv)


ARGS = parse_args()
bench_env.choose_triton_mode(ARGS.dry_run)
import kernels_round3 as r3  # noqa: E402  (its helpers; it bypasses nanovllm_ref/__init__, which imports the engine)
import kernels_round10 as r10  # noqa: E402  (make_layers, chain_fp32)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

OPS = {"qkv": "full", "o": "partials", "gate_up": "silu", "down": "partials"}
# Sweep order: the workload's big decode buckets first, so that a spent budget drops the least important sizes.
GPU_MS = [128, 256, 32, 64, 192, 96, 16, 4]


def op_shape(s: dict, op: str) -> tuple[int, int]:
    """(N, K) of a projection's weight [N, K] (gate_up: the merged gate and up rows)."""
    h, q, kv, i = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["inter"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}[op]


def engine_spec(m: int, small_max_m: int):
    """What the engine runs at m rows: "default" (the Triton small GEMM with choose_config's pick) up to
    small_max_m rows (FusedKernels.max_m), else "cublas"."""
    return "default" if m <= small_max_m else "cublas"


def _round11_shapes(m: int, kind: str, dry: bool) -> list:
    """(block_m, block_n, block_k, warps, stages) of this round's candidates at m rows for a form `kind`."""
    import triton
    from nanovllm_ref.kernels import small_gemm
    if dry:
        return [(16, 16, 16, 1, 1)]
    if m <= small_gemm.TILE_M:
        bm = max(16, triton.next_power_of_2(m))
        shapes = [(bm, 32, 128, 4, 4), (bm, 16, 256, 4, 3), (bm, 32, 256, 4, 3), (bm, 64, 128, 4, 3),
                  (bm, 32, 64, 4, 4), (bm, 64, 64, 4, 4), (bm, 16, 128, 4, 4)]
        return shapes + ([(bm, 16, 128, 8, 4), (bm, 32, 128, 8, 4)] if kind == "silu" else [])
    shapes = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 64, 64, 8, 3),
              (128, 128, 64, 8, 3), (64, 64, 128, 4, 3), (128, 32, 128, 4, 4), (64, 32, 128, 4, 4)]
    return shapes + ([(64, 64, 64, 8, 4), (128, 64, 64, 8, 4)] if kind == "silu" else [])


def candidates(m: int, op: str, s: dict, sms: int, dry: bool, shapes: list | None = None, targets=None) -> list:
    """Triton GemmConfigs to try for `op` at m rows, other than choose_config's own pick (dot form only: the GEMV
    form serves 1 row, which this round does not sweep). Partial sums get the K splits that give about 2 programs
    an SM (the default's rule) for every tile shape, and also 1 and 4 for the first shape. shapes ((block_m,
    block_n, block_k, warps, stages) a candidate) and targets (j -> the programs an SM to split K for, shape j)
    replace this round's (round 14 passes its own)."""
    import triton
    from nanovllm_ref.kernels import small_gemm
    kind = OPS[op]
    n, k = op_shape(s, op)
    n_out = n // 2 if kind == "silu" else n
    if shapes is None:
        shapes = _round11_shapes(m, kind, dry)
    default = small_gemm.choose_config(m, n, k, kind, sms)
    out = []
    for j, (bm, bn, bk, warps, stages) in enumerate(shapes):
        bk = min(bk, max(16, triton.next_power_of_2(k)))
        if kind != "partials":
            per_sm = (2,)
        else:
            per_sm = targets(j) if targets else ((2, 1, 4) if j == 0 else (2,))
        for t in per_sm:
            split = 1
            if kind == "partials":
                tiles = triton.cdiv(n_out, bn) * triton.cdiv(m, bm)
                split = max(1, min(triton.cdiv(t * sms, tiles), triton.cdiv(k, bk)))
            cfg = small_gemm.GemmConfig(block_m=bm, block_n=bn, block_k=bk, split_k=split, use_dot=True,
                                        num_warps=warps, num_stages=stages)
            if cfg != default and cfg not in out:
                out.append(cfg)
    return out


def chain(x, layers, s, plan: dict, pdl: bool):
    """x [M, hidden] through the layers' GEMMs (round 10's chain), each projection run as plan[op] says: "cublas",
    "default" (the small GEMM, choose_config's pick) or a GemmConfig (the small GEMM with it). Returns [M, hidden]."""
    from nanovllm_ref.kernels import rms_norm, silu_mul, small_gemm
    eps, q_size = s["eps"], s["heads"] * s["head_dim"]

    def gemm(inp, w, op):
        spec = plan[op]
        if callable(spec):                       # a bench kernel of a later round (e.g. kernels_round14.TmaSpec)
            return spec(inp, w, OPS[op], pdl)
        if spec == "cublas":
            y = F.linear(inp, w)
            return silu_mul.silu_and_mul(y) if OPS[op] == "silu" else y
        cfg = None if spec == "default" else spec
        fn = {"full": small_gemm.linear, "partials": small_gemm.linear_partials,
              "silu": small_gemm.linear_silu_mul}[OPS[op]]
        return fn(inp, w, config=cfg, use_pdl=pdl)

    hidden, residual = x, None
    for L in layers:
        if residual is None:
            h, residual = rms_norm.add_rms_norm(hidden, None, L["n1"], eps, use_pdl=pdl)[0], hidden
        else:
            h, residual = rms_norm.add_rms_norm(hidden, residual, L["n1"], eps, use_pdl=pdl)
        qkv = gemm(h, L["qkv"], "qkv")
        o = gemm(qkv[:, :q_size], L["o"], "o")
        h, residual = rms_norm.add_rms_norm(o, residual, L["n2"], eps, use_pdl=pdl)
        hidden = gemm(gemm(h, L["gate_up"], "gate_up"), L["down"], "down")
    return rms_norm.add_rms_norm(hidden, residual, layers[-1]["n1"], eps, use_pdl=pdl)[0]


def spec_name(spec) -> str:
    if isinstance(spec, str):
        return spec
    if hasattr(spec, "name"):
        return spec.name
    c = spec
    return f"bm{c.block_m} bn{c.block_n} bk{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def spec_record(spec):
    return spec if isinstance(spec, str) else dataclasses.asdict(spec)


class Ctx:
    """One batch size's inputs and timer: us a layer of the chain under a plan."""

    def __init__(self, m, layers, s, device, dtype, pdl, small_max_m):
        self.m, self.layers, self.s, self.device, self.pdl = m, layers, s, device, pdl
        g = torch.Generator(device=device).manual_seed(m)
        self.x = torch.randn(m, s["hidden"], device=device, generator=g).to(dtype)
        self.engine = {op: engine_spec(m, small_max_m) for op in OPS}

    def run(self, plan):
        return chain(self.x, self.layers, self.s, plan, self.pdl)

    def profiled_kernels(self, plan, replays: int) -> list:
        """The CUDA kernels torch.profiler saw over `replays` replays of one graph of the chain under `plan`, in
        start order (CUDA only)."""
        from torch.profiler import ProfilerActivity, profile
        self.run(plan)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run(plan)
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        return sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0),
                      key=lambda e: e.time_range.start)

    def us(self, plan) -> float:
        return round(r3.time_us([lambda: self.run(plan)], self.device, reps=3, iters=5)[0] / len(self.layers), 2)


def sweep_m(rec, ctx: Ctx, sms: int, dry: bool, budget, best: dict, specs_for=None, section: str = "sweep"):
    """Every candidate of every projection at ctx.m rows, one projection changed at a time (module docstring).
    specs_for(op): the specs to try for op (default: cuBLAS, choose_config's pick and `candidates`; round 14 passes
    its TMA GEMMs). Rows go to rec[section], one summary a batch size to rec[section + "_summary"]; with specs_for
    each row also holds its output's largest difference from the engine's plan (bf16 rounding: ~0.1 expected; this
    round's own sweep leaves that to `best_m`, which checks every winner against fp32)."""
    base_before = ctx.us(ctx.engine)
    ref = ctx.run(ctx.engine).float() if specs_for else None
    rec.add(section, {"m": ctx.m, "op": None, "spec": "engine", "engine": {op: spec_name(ctx.engine[op]) for op in OPS},
                      "us_a_layer": base_before})
    r3.log(f"  M={ctx.m:<3d} engine ({spec_name(ctx.engine['qkv'])}) {base_before} us a layer")
    rows = []
    for op in OPS:
        specs = specs_for(op) if specs_for else ["cublas", "default"] + candidates(ctx.m, op, ctx.s, sms, dry)
        for spec in specs:
            if spec == ctx.engine[op]:
                continue
            if budget.left() < 4.0:
                rec.add("skipped", {"case": f"{section} M={ctx.m} {op} {spec_name(spec)}", "why": "time budget"})
                continue
            plan = {**ctx.engine, op: spec}
            try:
                diff = None if ref is None else round(float((ctx.run(plan).float() - ref).abs().max()), 4)
                us = ctx.us(plan)
            except Exception as exc:                     # noqa: BLE001 (a config that does not build is a result)
                rec.add("errors", {"case": f"{section} M={ctx.m} {op} {spec_name(spec)}",
                                   "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            row = {"m": ctx.m, "op": op, "spec": spec_name(spec), "config": spec_record(spec), "us_a_layer": us}
            if diff is not None:
                row["max_abs_diff_vs_engine"] = diff
            rows.append((row, spec))
            rec.add(section, row)
    base_after = ctx.us(ctx.engine)
    base = (base_before + base_after) / 2
    rec.add(section, {"m": ctx.m, "op": None, "spec": "engine (after)", "us_a_layer": base_after})
    for row, _ in rows:
        row["vs_engine_us"] = round(row["us_a_layer"] - base, 2)
    for op in OPS:
        mine = [(row["us_a_layer"], j, spec) for j, (row, spec) in enumerate(rows) if row["op"] == op]
        win = min(mine, key=lambda t: t[:2]) if mine else None
        # a projection keeps the engine's choice unless another is faster by more than the engine's own drift
        drift = abs(base_after - base_before) / 2 + 0.05
        best[(ctx.m, op)] = win[2] if win and win[0] < base - drift else ctx.engine[op]
        if win:
            r3.log(f"    {op:8s} best {spec_name(win[2]):36s} {win[0]:7.2f} us a layer ({win[0] - base:+.2f}); "
                   f"keeps {spec_name(best[(ctx.m, op)])}")
    rec.add(f"{section}_summary", {"m": ctx.m, "engine_us_before": base_before, "engine_us_after": base_after,
                                   "best": {op: spec_record(best[(ctx.m, op)]) for op in OPS}})


def best_m(rec, ctx: Ctx, best: dict):
    """The chain with every projection at its sweep winner, against the engine's plan and all cuBLAS."""
    plans = {"engine": ctx.engine, "all_cublas": {op: "cublas" for op in OPS},
             "best": {op: best.get((ctx.m, op), ctx.engine[op]) for op in OPS}}
    ref32 = r10.chain_fp32(ctx.x, ctx.layers, ctx.s)
    row = {"m": ctx.m, "best_plan": {op: spec_name(v) for op, v in plans["best"].items()}}
    for name, plan in plans.items():
        out = ctx.run(plan)
        row[f"{name}_max_abs_err_vs_fp32"] = round(float((out.float() - ref32).abs().max()), 4)
        row[f"{name}_us_a_layer"] = ctx.us(plan)
    row["engine_us_again"] = ctx.us(plans["engine"])
    eng = (row["engine_us_a_layer"] + row["engine_us_again"]) / 2
    row["best_vs_engine"] = round(row["best_us_a_layer"] / eng, 3) if eng else None
    row["best_saves_us_a_step"] = round((eng - row["best_us_a_layer"]) * len(ctx.layers), 1)
    rec.add("best", row)
    r3.log(f"  best M={ctx.m:<3d} engine {eng:.2f}  all cuBLAS {row['all_cublas_us_a_layer']}  best "
           f"{row['best_us_a_layer']} us a layer ({row['best_vs_engine']}x): {row['best_plan']}")


def trace_m(rec, ctx: Ctx):
    """Kernel time against the replay's span for the engine's chain (torch.profiler, 3 replays of one graph)."""
    if ctx.device.type != "cuda":
        rec.add("trace", {"m": ctx.m, "note": "no CUDA: no trace"})
        return
    kernels = ctx.profiled_kernels(ctx.engine, replays=3)
    if not kernels:
        rec.add("trace", {"m": ctx.m, "note": "the profiler saw no kernels"})
        return
    per = len(kernels) // 3
    spans, busy = [], []
    for r in range(3):
        ks = kernels[r * per:(r + 1) * per]
        spans.append(ks[-1].time_range.end - ks[0].time_range.start)
        busy.append(sum(e.time_range.end - e.time_range.start for e in ks))
    fam: dict = {}
    for e in kernels[:per]:
        name = e.name
        key = ("gemm_small" if "small_gemm" in name else "add_rms_norm" if "rms" in name else
               "silu" if "silu" in name else "cublas" if ("gemm" in name.lower() or "sm90" in name or "cutlass" in name)
               else name[:40])
        fam[key] = fam.get(key, 0.0) + (e.time_range.end - e.time_range.start)
    span, b = sorted(spans)[1], sorted(busy)[1]
    row = {"m": ctx.m, "kernels_a_replay": per, "span_us": round(span, 1), "kernel_us": round(b, 1),
           "between_kernels_us": round(span - b, 1), "kernel_fraction": round(b / span, 3) if span else None,
           "families_us": {k: round(v, 1) for k, v in sorted(fam.items(), key=lambda t: -t[1])}}
    rec.add("trace", row)
    r3.log(f"  trace M={ctx.m:<3d} {per} kernels, span {row['span_us']} us, kernels {row['kernel_us']} us "
           f"({row['kernel_fraction']}), between {row['between_kernels_us']} us; {row['families_us']}")


def main(args) -> int:
    from nanovllm_ref.kernels import small_gemm
    from nanovllm_ref.kernels.numerics import pdl_available
    run = r3.begin(args, "bench/kernels_round11.py", ("sweep", "sweep_summary", "best", "trace"))
    if run is None:
        return 2
    device, shapes, dtype, rec, budget = run.device, run.shapes, run.dtype, run.rec, run.budget
    sections = args.sections.split(",")
    dry = args.dry_run
    pdl = pdl_available(device)
    sms = small_gemm.num_sms(device)
    small_max_m = 2 if dry else 64
    ms = bench_env.batch_sizes(args, GPU_MS)
    n_layers = 2 if dry else 28
    layers = r10.make_layers(shapes, n_layers, device, dtype, seed=11)
    rec.data["meta"].update(chain_layers=n_layers, ms=ms, pdl=pdl, sms=sms, small_max_m=small_max_m)
    ctxs = {m: Ctx(m, layers, shapes, device, dtype, pdl, small_max_m) for m in ms}
    best: dict = {}
    if "sweep" in sections:
        r3.log("1. sweep: each projection's GEMM and tiles in the decode GEMM chain, one at a time")
        for m in ms:
            r3.guarded(rec, budget, f"sweep M={m}", lambda: sweep_m(rec, ctxs[m], sms, dry, budget, best),
                       min_left=6.0)
    if "best" in sections:
        r3.log("2. best: every projection at its fastest, against the engine's plan and all cuBLAS")
        for m in sorted(ms):
            if any((m, op) in best for op in OPS) or "sweep" not in sections:
                r3.guarded(rec, budget, f"best M={m}", lambda: best_m(rec, ctxs[m], best), min_left=2.0)
    if "trace" in sections:
        r3.log("3. trace: kernel time against the replay's span, the engine's chain")
        for m in ([2] if dry else [1, 32, 128, 256]):
            ctx = ctxs.get(m) or Ctx(m, layers, shapes, device, dtype, pdl, small_max_m)
            r3.guarded(rec, budget, f"trace M={m}", lambda: trace_m(rec, ctx), min_left=1.0)
    return r3.finish(run, args.out)


if __name__ == "__main__":
    sys.exit(main(ARGS))
