#!/usr/bin/env python3
"""GPU speed round 13 (issue 29): each small GEMM asks for its first weight tile before it waits for the kernel in
front (PDL), at 1-64 decode rows.

    python3 bench/kernels_round13.py --out results.json              # the GPU run, ~1-2 min
    python3 bench/kernels_round13.py --dry-run --out /tmp/dry.json   # CPU: Triton interpreter, tiny shapes

Why: at one row the decode GEMM chain takes 22.2 us a layer on the H200 (round 12's call), 15.6 when its weights
are L2-hot (round 10), while reading them once takes about 7. Round 12 showed that the chain of dependent memory
round trips, not the count of kernels, is the lever. Every small GEMM so far waited (`gdc_wait`) before its first
load, weights included, though the weights depend on nothing the step computes: only x does. With
`GemmConfig.preload` the first K step's weight tiles are loaded before the wait, so that HBM round trip runs
under the tail of the kernel in front (an add + RMSNorm that lets its dependents launch half-way, or the GEMM
before). The same tiles are summed in the same order: the outputs are bit for bit the same.

Plans, at each M (round 11's chain: 28 layers with their own weights, from HBM, PDL as the engine launches):
- `before`: the engine before this round (loads after the wait; at 1 row K steps of 512, or 256 for the partial
  sums);
- `engine`: choose_config's pick now: at 1 row each program's whole K range in one step, preloaded; at 2-64 rows
  the same as `before`;
- `no_preload`: the engine's tiles with the loads after the wait;
- `early`: the engine's tiles, preloaded, and every GEMM lets the next kernel launch right after its preload
  (`launch_early`);
- `preload_dot` (2-64 rows): the engine's tl.dot tiles with the first tile preloaded.
Each plan's us a layer (`before` measured before and after), its max difference from `before`'s outputs (0 expected
for every plan at 2-64 rows; at 1 row the whole-K step sums K in another order: one bf16 step) and its error
against the chain in fp32.
First call (H100, 2026-12-07, kernels_round13_h100_2026-12-07_call1.json; then the engine preloaded at every size
with choose_config's old tiles): at 1 row the preload took 24.57 -> 23.80 us a layer, the whole-K step 22.90, the
early launch 23.07; at 2-64 rows the preload was 8-21 % slower. So the engine preloads at 1 row only, with whole-K
steps.
- trace: torch.profiler over graph replays at 1 and 16 rows, for `before` and `engine`: kernels a replay,
  kernel time and span.
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
import kernels_round11 as r11  # noqa: E402  (chain with a plan of GemmConfigs, Ctx, trace_m)

GPU_MS = [1, 2, 8, 32, 64]
PLANS = ("before", "engine", "no_preload", "early", "preload_dot")
BASE = "before"


def plan_for(name: str, m: int, s: dict, sms: int) -> dict | None:
    """op -> GemmConfig for plan `name` at m rows (module docstring), or None where it does not apply."""
    from nanovllm_ref.kernels import small_gemm
    plan = {}
    for op, kind in r11.OPS.items():
        n, k = r11.op_shape(s, op)
        cfg = small_gemm.choose_config(m, n, k, kind, sms)
        if name == "before":
            cfg = dataclasses.replace(cfg, preload=False)
            if not cfg.use_dot:
                cfg = dataclasses.replace(cfg, block_k=min(cfg.block_k, 256 if kind == "partials" else 512))
        elif name == "no_preload":
            cfg = dataclasses.replace(cfg, preload=False, launch_early=False)
        elif name == "early":
            cfg = dataclasses.replace(cfg, preload=True, launch_early=True)
        elif name == "preload_dot":
            if not cfg.use_dot:
                return None
            cfg = dataclasses.replace(cfg, preload=True)
        plan[op] = cfg
    return plan


def chain_m(rec, ctx, sms: int):
    plans = {name: plan_for(name, ctx.m, ctx.s, sms) for name in PLANS}
    plans = {name: p for name, p in plans.items() if p is not None}
    ref32 = r10.chain_fp32(ctx.x, ctx.layers, ctx.s)
    base_out = ctx.run(plans[BASE])
    row = {"m": ctx.m, "configs": {name: {op: r11.spec_name(c) + (" pre" if c.preload else "") +
                                          (" early" if c.launch_early else "") for op, c in p.items()}
                                   for name, p in plans.items()}}
    for name, plan in plans.items():
        out = ctx.run(plan)
        row[f"{name}_max_abs_err_vs_fp32"] = round(float((out.float() - ref32).abs().max()), 4)
        row[f"{name}_max_abs_diff_vs_before"] = round(float((out.float() - base_out.float()).abs().max()), 4)
    row["before_us_a_layer"] = ctx.us(plans[BASE])
    for name, plan in plans.items():
        if name != BASE:
            row[f"{name}_us_a_layer"] = ctx.us(plan)
    row["before_us_again"] = ctx.us(plans[BASE])
    base = (row["before_us_a_layer"] + row["before_us_again"]) / 2
    for name in plans:
        if name != BASE:
            row[f"{name}_vs_before"] = round(row[f"{name}_us_a_layer"] / base, 3) if base else None
    row["engine_saves_us_a_step"] = round((base - row["engine_us_a_layer"]) * len(ctx.layers), 1)
    rec.add("chain", row)
    r3.log(f"  M={ctx.m:<3d} before {base:.2f} us a layer; " + ", ".join(
        f"{n} {row[f'{n}_us_a_layer']} ({row[f'{n}_vs_before']}x, diff {row[f'{n}_max_abs_diff_vs_before']})"
        for n in plans if n != BASE))


def trace_named(rec, ctx, name: str):
    before = len(rec.data["trace"])
    r11.trace_m(rec, ctx)
    for row in rec.data["trace"][before:]:
        row["plan"] = name


def main(args) -> int:
    from nanovllm_ref.kernels import small_gemm
    from nanovllm_ref.kernels.numerics import pdl_available
    run = r3.begin(args, "bench/kernels_round13.py", ("chain", "trace"))
    if run is None:
        return 2
    device, shapes, dtype, rec, budget = run.device, run.shapes, run.dtype, run.rec, run.budget
    sections = args.sections.split(",")
    dry = args.dry_run
    pdl = pdl_available(device)
    sms = small_gemm.num_sms(device)
    small_max_m = 64
    ms = bench_env.batch_sizes(args, GPU_MS)
    n_layers = 2 if dry else 28
    layers = r10.make_layers(shapes, n_layers, device, dtype, seed=13)
    rec.data["meta"].update(chain_layers=n_layers, ms=ms, pdl=pdl, sms=sms, small_max_m=small_max_m)
    ctxs = {m: r11.Ctx(m, layers, shapes, device, dtype, pdl, small_max_m) for m in ms}
    if "chain" in sections:
        r3.log("1. chain: the decode GEMM chain with the first weight tiles loaded before the wait, and without")
        for m in ms:
            r3.guarded(rec, budget, f"chain M={m}", lambda: chain_m(rec, ctxs[m], sms), min_left=4.0)
    if "trace" in sections:
        r3.log("2. trace: kernel time against the replay's span, without the preload and with it")
        for m in ([1] if dry else [1, 16]):
            for name in (BASE, "engine"):
                ctx = r11.Ctx(m, layers, shapes, device, dtype, pdl, small_max_m)
                ctx.engine = plan_for(name, m, shapes, sms)     # r11.trace_m traces ctx.engine's plan
                r3.guarded(rec, budget, f"trace M={m} {name}", lambda: trace_named(rec, ctx, name), min_left=1.0)
    return r3.finish(run, args.out)


if __name__ == "__main__":
    sys.exit(main(ARGS))
