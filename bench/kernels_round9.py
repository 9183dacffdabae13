#!/usr/bin/env python3
"""GPU speed round 9 (issue 29): the decode attention's launch order over the workload's own contexts, and the
decode GEMMs' BLAS library.

    python3 bench/kernels_round9.py --out results.json      # the GPU run, ~1 min
    python3 bench/kernels_round9.py --dry-run --out /tmp/dry.json   # CPU: interpreter, tiny shapes

Why: round 4's fit put the workload's KV read at 91 % of the copy bandwidth, and round 5's balance splits raised
that term to 96 % (and gave it back in a merge kernel). What is lost is the kernel's tail: a decode batch holds
sequences of 100 to 2,048 tokens in arrival order, and a long sequence whose programs start in the last wave
finishes alone. Longest first (the classic LPT rule for list scheduling) lets the short ones fill in behind.
1. order: `kernels/attention.paged_decode` at the bench workload's decode steps (its 256 prompt and output
   lengths, upstream bench.py's seed; step t: the sequences still running, context prompt + t + 1), rows in
   arrival order, longest context first, and shortest first; the same rows, so the outputs agree bit for bit.
2. gemm: the decode step's five GEMMs (Qwen3-0.6B shape) at 64-256 rows, cuBLAS against cuBLASLt
   (`torch.backends.cuda.preferred_blas_library`), each over enough weight copies that L2 cannot keep them.
The JSON (--out) is rewritten after every case.
"""
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402


def parse_args(argv=None):
    return bench_env.parser(__doc__, budget=90.0, sections="order,gemm").parse_args(argv)


ARGS = parse_args()
bench_env.choose_triton_mode(ARGS.dry_run)
import kernels_round3 as r3  # noqa: E402  (its helpers; it bypasses nanovllm_ref/__init__, which imports the engine)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def workload_lengths(n: int = 256):
    """(prompt lengths, output lengths) of upstream nano-vllm's bench.py (shared/README.md, "Benchmark workload"):
    random.seed(0); the prompts' token draws interleave with their lengths, then one max_tokens each."""
    rnd = random.Random(0)
    prompts = []
    for _ in range(n):
        length = rnd.randint(100, 1024)
        for _ in range(length):
            rnd.randint(0, 10000)
        prompts.append(length)
    return prompts, [rnd.randint(100, 1024) for _ in range(n)]


def order_case(rec, step, prompts, outputs, shapes, device, dtype, scale_down: int = 1):
    """The decode attention of the workload's step `step` in three row orders (module docstring)."""
    from nanovllm_ref.kernels import attention as attn
    lengths = [(p + step + 1) // scale_down for p, o in zip(prompts, outputs) if o > step]
    if not lengths:
        return None
    hkv, d = shapes["kv_heads"], shapes["head_dim"]
    context = max(lengths)
    q, k_cache, v_cache, table, lens = r3.paged_decode_inputs(lengths, context, shapes, device, dtype, step + 7)
    scale = d ** -0.5
    ref = attn.paged_decode(q, k_cache, v_cache, table, lens, scale)
    orders = {"arrival": list(range(len(lengths))),
              "longest_first": sorted(range(len(lengths)), key=lambda i: -lengths[i]),
              "shortest_first": sorted(range(len(lengths)), key=lambda i: lengths[i])}
    row = {"step": step, "batch": len(lengths), "mean_length": round(sum(lengths) / len(lengths), 1),
           "max_length": context,
           "splits": attn.decode_num_splits(len(lengths), hkv, table.shape[1] * k_cache.shape[1], device)}
    nbytes = 2 * sum(lengths) * hkv * d * dtype.itemsize
    for name, order in orders.items():
        idx = torch.tensor(order, device=device)
        qo, to, lo = q[idx].contiguous(), table[idx].contiguous(), lens[idx].contiguous()
        out = attn.paged_decode(qo, k_cache, v_cache, to, lo, scale)
        back = torch.empty_like(out)
        back[idx] = out
        us = r3.time_us([lambda: attn.paged_decode(qo, k_cache, v_cache, to, lo, scale)], device, reps=10, iters=7)
        row[f"{name}_us"] = round(us[0], 2)
        row[f"{name}_pct_of_peak"] = r3.bandwidth(nbytes, us[0])["pct_of_peak"]
        row[f"{name}_max_abs_err_vs_arrival"] = r3.max_err(back, ref)
    rec.add("order", row)
    r3.log(f"  order step={step:<4d} B={row['batch']:<3d} mean {row['mean_length']:7.1f}  arrival {row['arrival_us']:8.1f} us "
           f"({row['arrival_pct_of_peak']:5.1f} %)  longest first {row['longest_first_us']:8.1f} "
           f"({row['longest_first_pct_of_peak']:5.1f} %)  shortest first {row['shortest_first_us']:8.1f}  "
           f"err {row['longest_first_max_abs_err_vs_arrival']:.1e}")
    return row


def blas_case(rec, op, m, n, k, device, dtype):
    """One GEMM [m, k] x [n, k]^T under cuBLAS and under cuBLASLt, over weight copies L2 cannot keep."""
    g = torch.Generator(device=device).manual_seed(m * 7 + n)
    wbytes = n * k * dtype.itemsize
    ws = [(torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype) for _ in range(r3.copies_for(wbytes, device))]
    x = torch.randn(m, k, device=device, generator=g).to(dtype)
    row = {"op": op, "m": m, "n": n, "k": k}
    outs = {}
    before = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None
    try:
        for lib in ("cublas", "cublaslt"):
            if device.type == "cuda":
                torch.backends.cuda.preferred_blas_library(lib)
            outs[lib] = F.linear(x, ws[0])
            us = r3.time_us([lambda w=w: F.linear(x, w) for w in ws], device)
            row[f"{lib}_us"] = round(us[0], 2)
            flops = 2 * m * n * k
            row[f"{lib}_tflops"] = round(flops / (us[0] * 1e-6) / 1e12, 1) if us[0] > 0 else 0.0
    finally:
        if before is not None:
            torch.backends.cuda.preferred_blas_library(before)
    row["max_abs_diff"] = r3.max_err(outs["cublaslt"], outs["cublas"])
    rec.add("gemm", row)
    r3.log(f"  gemm {op:8s} M={m:<3d} cublas {row['cublas_us']:8.2f} us  cublaslt {row['cublaslt_us']:8.2f} us  "
           f"diff {row['max_abs_diff']:.1e}")
    return row


def main(args) -> int:
    run = r3.begin(args, "bench/kernels_round9.py", ("order", "gemm"))
    if run is None:
        return 2
    device, shapes, dtype, rec, budget = run.device, run.shapes, run.dtype, run.rec, run.budget
    sections = args.sections.split(",")
    if "order" in sections:
        r3.log("1. decode attention at the workload's steps: arrival order, longest first, shortest first")
        prompts, outputs = workload_lengths()
        rec.data["meta"]["workload_tokens"] = {"prompt": sum(prompts), "output": sum(outputs)}   # 142,827 and 133,966
        if args.dry_run:
            prompts, outputs = prompts[:5], outputs[:5]
        steps = [0, 400] if args.dry_run else [0, 128, 256, 384, 512, 640, 768, 896]
        for step in steps:
            r3.guarded(rec, budget, f"order step={step}",
                       lambda: order_case(rec, step, prompts, outputs, shapes, device, dtype,
                                          scale_down=16 if args.dry_run else 1), min_left=2.0)
    if "gemm" in sections:
        r3.log("2. decode GEMMs: cuBLAS against cuBLASLt")
        s = shapes
        ops = {**{op: (n, k) for op, (n, k, _) in r3.gemm_shapes(s).items()}, "lm_head": (s["vocab"], s["hidden"])}
        for m in ([3] if args.dry_run else [64, 128, 256]):
            for op, (n, k) in ops.items():
                r3.guarded(rec, budget, f"gemm {op} M={m}", lambda: blas_case(rec, op, m, n, k, device, dtype),
                           min_left=2.0)
    return r3.finish(run, args.out)


if __name__ == "__main__":
    sys.exit(main(ARGS))
