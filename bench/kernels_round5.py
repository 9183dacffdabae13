#!/usr/bin/env python3
"""GPU speed round 5 (issue 29): the decode GEMMs and layers with weights asked for ahead, on one GPU (an H200).

    python3 bench/kernels_round5.py --out results.json              # the GPU run, ~3-4 min
    python3 bench/kernels_round5.py --dry-run --out /tmp/dry.json   # CPU: Triton interpreter, tiny shapes

What it measures (call 1 of 2026-12-02, bench/results/kernels_round5_h200_2026-12-02.json, also tried two
kernel changes that lost and were taken out: letting the next kernel launch at each kernel's start under PDL,
and asking for W into L2 before the PDL wait; the small GEMM's row tiles above 64 rows stayed, unused by default):
1. layer: decoder layers of the Qwen3-0.6B shape in CUDA-graph replays (context 512), per layer = (t3 - t1) / 2,
   at M = 1, 16, 64, 128, 256: `fused` (every kernel, PDL, GEMMs in Triton up to 512 rows), `cublas>64`
   (the same with max_m = 64: cuBLAS above 64 rows, the engine's route), `nopdl` (fused without PDL).
2. attention: the decode attention kernel at the workload's batch/context mix, the engine's launch against
   other BLOCK_N / warps / stages and KV splits, in % of the copy bandwidth (call 2: the engine now takes
   32-key tiles, 2 warps, 3 stages from 1,024 programs on: kernels/attention.decode_launch).
3. gemm: each projection at M = 1 .. 256, cuBLAS against the Triton kernel without and with PDL.
The JSON (--out) is rewritten after every case.
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402


def parse_args(argv=None):
    p = bench_env.parser(__doc__, budget=200.0, sections="layer,attention,gemm")
    p.add_argument("--mixed-only", action="store_true", help="attention: the mixed-length cases only")
    return p.parse_args(argv)


ARGS = parse_args()
bench_env.choose_triton_mode(ARGS.dry_run)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import kernels_round3 as r3  # noqa: E402  (its helpers; it bypasses nanovllm_ref/__init__, which imports the engine)
import torch  # noqa: E402


def attention_case(rec, batch, context, cfg, shapes, device, dtype, mixed: str | None = None):
    """One decode attention call (kernels/attention.paged_decode) of `batch` sequences at `context` tokens, in
    CUDA-graph replays; cfg: dict of block_n / num_warps / num_stages / num_splits overrides (empty = the
    engine's). mixed: None (every sequence `context` long), "random" (lengths uniform in [100, context], in
    random order, as the bench workload's batches are) or "longest_first" (the same lengths, longest first).
    Bytes = the K and V it must read once; % of the copy bandwidth; max error against cfg = {}."""
    import random
    from nanovllm_ref.kernels import attention as attn
    hkv, h, d, block = shapes["kv_heads"], shapes["heads"], shapes["head_dim"], 256 if device.type == "cuda" else 16
    lengths = [context] * batch
    if mixed:
        rnd = random.Random(batch)
        lengths = [rnd.randint(min(100, context), context) for _ in range(batch)]
        if mixed == "longest_first":
            lengths.sort(reverse=True)
    q, k_cache, v_cache, table, lens = r3.paged_decode_inputs(lengths, context, shapes, device, dtype,
                                                              batch * 131 + context)
    per_seq = table.shape[1]
    scale = d ** -0.5
    ref = attn.paged_decode(q, k_cache, v_cache, table, lens, scale)
    out = attn.paged_decode(q, k_cache, v_cache, table, lens, scale, **cfg)
    us = r3.time_us([lambda: attn.paged_decode(q, k_cache, v_cache, table, lens, scale, **cfg)], device,
                    reps=10, iters=7)
    nbytes = 2 * sum(lengths) * hkv * d * dtype.itemsize
    row = {"batch": batch, "context": context, "lengths": mixed or "equal", "mean_length": sum(lengths) / batch,
           "config": cfg or "engine default",
           "default_splits": attn.decode_num_splits(batch, hkv, per_seq * block, device),
           "us": round(us[0], 2), "us_min": round(us[1], 2), "us_max": round(us[2], 2),
           "max_abs_err_vs_default": r3.max_err(out, ref), **r3.bandwidth(nbytes, us[0])}
    rec.add("attention", row)
    r3.log(f"  attention B={batch:<3d} ctx={context:<5d} {mixed or 'equal':13s} {str(cfg or 'default'):50s} "
           f"{row['us']:8.1f} us {row['pct_of_peak']:5.1f} %")
    return row


def attention_configs(batch: int):
    out = [{}]
    for bn, warps, stages in ((64, 4, 3), (64, 4, 4), (64, 8, 2), (64, 8, 3), (128, 4, 2), (128, 8, 2),
                              (128, 8, 3), (32, 4, 2), (32, 2, 3), (64, 2, 2)):
        out.append(dict(block_n=bn, num_warps=warps, num_stages=stages))
    if batch <= 64:
        out += [dict(num_splits=s) for s in (1, 2, 4, 8)]
    return out


def main(args) -> int:
    from nanovllm_ref.utils.fusion import FusedKernels
    run = r3.begin(args, "bench/kernels_round5.py")
    if run is None:
        return 2
    device, shapes, dtype, rec, budget = run.device, run.shapes, run.dtype, run.rec, run.budget
    sections = args.sections.split(",")
    pdl = device.type == "cuda" and rec.data["meta"].get("pdl_available", False)
    r3.log(f"  pdl {pdl}")
    layer_ms = [1, 5] if args.dry_run else [1, 16, 64, 128, 256]
    gemm_ms = [1, 5] if args.dry_run else [1, 8, 16, 64, 128, 256]
    depths = (1, 2) if args.dry_run else (1, 3)
    if "layer" in sections:
        r3.log("1. decoder layers")
        variants = [("fused", FusedKernels.all(pdl=pdl, max_m=512)), ("cublas>64", FusedKernels.all(pdl=pdl, max_m=64))]
        if pdl:
            variants.append(("nopdl", FusedKernels.all(pdl=False, max_m=512)))
        reference: dict = {}
        for m in layer_ms:
            for name, kernels in variants:
                if name == "cublas>64" and m <= 64:
                    continue                     # the same route as "fused" there
                r3.guarded(rec, budget, f"layer M={m} {name}",
                           lambda: r3.layer_case(rec, m, name, kernels, shapes, device, dtype, reference, depths),
                           min_left=8.0)
    if "attention" in sections:
        r3.log("2. decode attention: the engine's launch against other tile sizes, warps, stages and splits")
        rec.data.setdefault("attention", [])
        shapes_attn = [(2, 64)] if args.dry_run else [(256, 512), (128, 1024), (64, 1536), (32, 2048), (1, 1024)]
        for batch, context in ([] if args.mixed_only else shapes_attn):
            for cfg in (attention_configs(batch) if not args.dry_run else [{}, dict(block_n=32)]):
                r3.guarded(rec, budget, f"attention B={batch} ctx={context} {cfg}",
                           lambda: attention_case(rec, batch, context, cfg, shapes, device, dtype), min_left=2.0)
        # Mixed lengths, as in the bench workload: does the longest sequence's program set the kernel's time?
        mixed_shapes = [(2, 64)] if args.dry_run else [(256, 2048), (128, 2048), (64, 2048), (256, 1024)]
        for batch, context in mixed_shapes:
            for mixed in ("random", "longest_first"):
                for cfg in ({}, dict(num_splits=2), dict(num_splits=3), dict(num_splits=4)):
                    if mixed == "longest_first" and cfg:
                        continue
                    r3.guarded(rec, budget, f"attention B={batch} ctx={context} {mixed} {cfg}",
                               lambda: attention_case(rec, batch, context, cfg, shapes, device, dtype, mixed),
                               min_left=2.0)
    if "gemm" in sections:
        r3.log("3. GEMMs: cuBLAS, Triton, Triton + PDL")
        for m in gemm_ms:
            for op, (n, k, kind) in r3.gemm_shapes(shapes).items():
                r3.guarded(rec, budget, f"gemm {op} M={m}", lambda: r3.gemm_case(rec, op, m, n, k, kind, device, dtype))
                if pdl:
                    r3.guarded(rec, budget, f"gemm {op} M={m} pdl",
                               lambda: r3.gemm_case(rec, op, m, n, k, kind, device, dtype, use_pdl=True, old=False))
    return r3.finish(run, args.out)


if __name__ == "__main__":
    sys.exit(main(ARGS))
