#!/usr/bin/env python3
"""GPU speed round 5 (issue 29): the decode GEMMs and layers with weights asked for ahead, on one GPU (an H200).

    python3 bench/kernels_round5.py --out results.json              # the GPU run, ~3-4 min
    python3 bench/kernels_round5.py --dry-run --out /tmp/dry.json   # CPU: Triton interpreter, tiny shapes

What changed in the kernels (kernels/small_gemm.py, rms_norm.py, qk_norm_rope_store.py, attention.py):
- every decode kernel lets the next one launch at its start (PDL's launch_dependents before its wait), so a
  kernel's launch overlaps the one in front instead of its tail only;
- the small GEMM asks for its slice of W into L2 (`prefetch.global.L2`) before it waits for x: W is never
  written in a step, so it streams in while the kernel in front (the norm that makes x) still runs;
- the small GEMM cuts more rows than TILE_M into row tiles, so it can serve decode batches above 64 (where the
  engine calls cuBLAS today: 0.8-0.9 ms of GEMMs a step at 64-256 rows against a 0.28 ms weight read).

Sections, most wanted first (each case guarded as in bench/kernels_round3.py, whose helpers this reuses):
1. layer: decoder layers of the Qwen3-0.6B shape in CUDA-graph replays (context 512), per layer = (t3 - t1) / 2,
   at M = 1, 16, 64, 128, 256: `fused` (every kernel, PDL, GEMMs in Triton up to 512 rows), `cublas>64`
   (the same with max_m = 64: cuBLAS above 64 rows, today's engine route), `nopdl` (fused without PDL).
2. gemm: each projection at M = 1 .. 256, cuBLAS against the Triton kernel's default config without PDL, with
   PDL, and with PDL + the L2 prefetch; back-to-back calls over weight copies that L2 cannot hold.
3. sweep: other configs for M = 96, 128, 192, 256 (PDL + prefetch), to choose choose_config's large-M rows.
The JSON (--out) is rewritten after every case.
"""
import argparse
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, tiny shapes, no timings")
    p.add_argument("--budget", type=float, default=200.0, help="seconds before no new case starts")
    p.add_argument("--sections", default="layer,gemm,sweep")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.argv = [sys.argv[0], "--out", ARGS.out] + (["--dry-run"] if ARGS.dry_run else [])
import kernels_round3 as r3  # noqa: E402  (parses the same --out/--dry-run, bypasses nanovllm_ref/__init__)
import torch  # noqa: E402


def sweep_configs(m: int, kind: str):
    from nanovllm_ref.kernels.small_gemm import GemmConfig
    silu = kind == "silu"
    out = []
    for bm, bn, bk, warps, stages in ((64, 64, 64, 4, 4), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3),
                                      (64, 32, 128, 4, 4), (128, 128, 64, 8, 3), (64, 64, 128, 4, 3),
                                      (32, 64, 128, 4, 4), (128, 32, 128, 4, 4)):
        if bm > max(32, m) * 2 or (silu and bm * bn > 64 * 64 and warps < 8):
            continue
        splits = (1,) if kind != "partials" else (1, 2, 4)
        for sk in splits:
            out.append(GemmConfig(bm, bn, bk, split_k=sk, use_dot=True, num_warps=8 if silu else warps,
                                  num_stages=stages))
    return out


def main(args) -> int:
    from nanovllm_ref.utils.fusion import FusedKernels
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if not args.dry_run and device.type != "cuda":
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    shapes = r3.TINY if args.dry_run else r3.QWEN3
    dtype = torch.bfloat16
    rec = r3.Record(args.out, {**r3.meta_of(r3.parse_args(sys.argv[1:]), device), "script": "bench/kernels_round5.py", "budget_s": args.budget})
    budget = r3.Budget(args.budget)
    sections = args.sections.split(",")
    timer = threading.Timer(args.budget + 20, lambda: (rec.data["meta"].update(watchdog="fired"), rec.save(),
                                                       os._exit(3)))
    timer.daemon = True
    timer.start()
    pdl = device.type == "cuda" and rec.data["meta"].get("pdl_available", False)
    r3.log(f"kernels_round5: {rec.data['meta']['device']}, torch {torch.__version__}, pdl {pdl}")
    rec.data["meta"]["copy_tbps_measured"] = r3.guarded(rec, budget, "copy bandwidth",
                                                        lambda: r3.measure_copy_tbps(device))
    layer_ms = [1, 5] if args.dry_run else [1, 16, 64, 128, 256]
    gemm_ms = [1, 5] if args.dry_run else [1, 8, 16, 32, 64, 96, 128, 192, 256]
    sweep_ms = [5] if args.dry_run else [96, 128, 192, 256]
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
    if "gemm" in sections:
        r3.log("2. GEMMs: cuBLAS, Triton, Triton + PDL, Triton + PDL + L2 prefetch")
        for m in gemm_ms:
            for op, (n, k, kind) in r3.gemm_shapes(shapes).items():
                r3.guarded(rec, budget, f"gemm {op} M={m}",
                           lambda: r3.gemm_case(rec, op, m, n, k, kind, device, dtype, prefetch=False))
                if pdl:
                    for pf in (False, True):
                        r3.guarded(rec, budget, f"gemm {op} M={m} pdl prefetch={pf}",
                                   lambda: r3.gemm_case(rec, op, m, n, k, kind, device, dtype, use_pdl=True,
                                                        old=False, prefetch=pf))
    if "sweep" in sections:
        r3.log("3. large-M configs")
        for m in sweep_ms:
            for op, (n, k, kind) in r3.gemm_shapes(shapes).items():
                for cfg in sweep_configs(m, kind):
                    r3.guarded(rec, budget, f"sweep {op} M={m} {cfg}",
                               lambda: r3.gemm_case(rec, op, m, n, k, kind, device, dtype, config=cfg,
                                                    use_pdl=pdl, section="gemm_sweep", old=False), min_left=2.0)
    timer.cancel()
    rec.save()
    r3.log(f"done in {rec.data['meta']['elapsed_s']} s: {len(rec.data['errors'])} errors, "
           f"{len(rec.data['skipped'])} skipped -> {args.out}")
    return 1 if rec.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
