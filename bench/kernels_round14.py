#!/usr/bin/env python3
"""GPU speed round 14 (issue 29): what is left above the floor in the large decode steps (65-256 rows)?

    python3 bench/kernels_round14.py --out results.json              # the GPU run, ~2 min
    python3 bench/kernels_round14.py --dry-run --out /tmp/dry.json   # CPU: Triton interpreter, tiny shapes

Why: the bench workload's decode spends 4.67 s on the H200, of which the KV read at the copy bandwidth is 3.25 s
(profile4_ab11_new_h200_2026-12-07.json: the fit's per-KV-token cost is at 98 % of it). The rest is a fixed cost
of about 1.15 ms a step, mostly the 112 GEMMs of the layers (cuBLAS above 64 rows, 0.92 ms at 256 rows in round
8's profile, where the weights take 0.28 ms to read and the flops 0.3 ms at the matmul rate). Two questions:
- bandwidth: is the copy bandwidth the KV floor? A kernel that only reads may go faster than a copy, which also
  writes. A read-only Triton kernel (several tile sizes and programs an SM) against `copy_`, and the engine's
  decode attention at the workload's shapes, each in TB/s read (at 234 rows also other key tiles, warps and
  stages than the engine's, each with its output's largest difference from the engine's).
- prefill: one prefill step's attention (16,384 tokens of 100-1,024-token prompts), the engine's Triton kernel with
  its launch and others, against torch's FlashAttention (varlen_attn): round 8 put it at 8.5 ms of a 31.8-ms step.
- chain: can a Triton GEMM whose tiles come through TMA descriptors (bench/gemm_tma.py), with PDL, beat cuBLAS in
  round 11's decode GEMM chain at 96-256 rows? One projection changed at a time (the others as the engine runs
  them), then every projection at its winner against the engine's plan, with each plan's error against the chain
  in fp32 (kernels_round11.best_m).
- trace: torch.profiler over graph replays of the engine's chain at 128 and 256 rows: which cuBLAS kernel runs
  each projection and for how long (us a call, the mean over 28 layers).
The JSON (--out) is rewritten after every case.
"""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402


def parse_args(argv=None):
    return bench_env.parser(__doc__, budget=200.0, sections="bandwidth,prefill,chain,trace", dry_ms="2").parse_args(argv)


ARGS = parse_args()
bench_env.choose_triton_mode(ARGS.dry_run)
import kernels_round3 as r3  # noqa: E402
import kernels_round10 as r10  # noqa: E402  (make_layers)
import kernels_round11 as r11  # noqa: E402  (the chain with a plan, Ctx, best_m)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

GPU_MS = [256, 128, 192, 96]


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Grid-stride read of x (bf16), one fp32 sum a program (so the loads cannot be dropped)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        if EVICT:
            v = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
        else:
            v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def bandwidth(rec, device, shapes, dry: bool):
    """Read-only TB/s against the copy's (read + write, meta.copy_tbps_measured), then the decode attention."""
    from nanovllm_ref.kernels import attention as attn
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    n = (1 << 14) if dry else (1 << 30)                 # 2 GiB of bf16: far beyond L2
    x = torch.randn(n, device=device).to(torch.bfloat16) if dry else \
        torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    for block, per_sm, warps, evict in ([(1024, 1, 4, False)] if dry else
                                        [(2048, 4, 4, False), (4096, 4, 8, False), (4096, 8, 8, False),
                                         (8192, 4, 8, False), (8192, 8, 8, False), (4096, 8, 8, True),
                                         (16384, 2, 8, False), (2048, 16, 4, False)]):
        progs = sms * per_sm
        out = torch.empty(progs, dtype=torch.float32, device=device)
        us = r3.time_us([lambda: _read_kernel[(progs,)](x, out, n, BLOCK=block, EVICT=evict, num_warps=warps)],
                        device, reps=5, iters=7)[0]
        row = {"kind": "read", "block": block, "programs_an_sm": per_sm, "num_warps": warps, "evict_first": evict,
               "bytes": 2 * n, "us": round(us, 2), "tbps": round(2 * n / (us * 1e-6) / 1e12, 3)}
        rec.add("bandwidth", row)
        r3.log(f"  read block={block:<5d} {per_sm:2d}/SM w{warps} evict={evict!s:5s} {row['tbps']} TB/s")
    # the engine's decode attention at the workload's steps (rows, mean context as in the profile's buckets)
    import random
    hkv, d = shapes["kv_heads"], shapes["head_dim"]
    for batch, context in ([(2, 32)] if dry else [(256, 512), (234, 1024), (158, 1536), (95, 2048)]):
        rnd = random.Random(batch)
        lengths = [rnd.randint(min(100, context), context) for _ in range(batch)]
        q, k_cache, v_cache, table, lens = r3.paged_decode_inputs(lengths, context, shapes, device, torch.bfloat16,
                                                                  batch * 7 + context)
        scale = d ** -0.5
        nbytes = 2 * sum(lengths) * hkv * d * 2
        ref = attn.paged_decode(q, k_cache, v_cache, table, lens, scale).float()
        # the engine's launch (None: 64-key tiles, 4 warps, 2 stages), then other tiles, warps and stages
        variants = [None] if dry or batch != 234 else [None, (64, 4, 3), (64, 4, 4), (64, 8, 2), (64, 8, 3),
                                                        (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 4, 4)]
        for v in variants:
            kw = {} if v is None else dict(block_n=v[0], num_warps=v[1], num_stages=v[2])
            diff = float((attn.paged_decode(q, k_cache, v_cache, table, lens, scale, **kw).float() - ref).abs().max())
            us = r3.time_us([lambda: attn.paged_decode(q, k_cache, v_cache, table, lens, scale, **kw)], device,
                            reps=10, iters=7)[0]
            row = {"kind": "attention", "batch": batch, "context": context, "mean_length": sum(lengths) / batch,
                   "launch": "engine" if v is None else f"bn{v[0]} w{v[1]} st{v[2]}", "max_abs_diff": round(diff, 5),
                   "bytes": nbytes, "us": round(us, 2), "tbps": round(nbytes / (us * 1e-6) / 1e12, 3)}
            rec.add("bandwidth", row)
            r3.log(f"  attention B={batch:<3d} ctx<={context:<5d} {row['launch']:12s} {row['us']:8.1f} us "
                   f"{row['tbps']} TB/s")


def prefill(rec, device, shapes, dry: bool):
    """One prefill step of the workload (prompts of 100-1,024 tokens up to 16,384 tokens, no cached prefix): the
    engine's varlen attention kernel with its launch and others (BLOCK_M, BLOCK_N, warps, stages), each with its
    largest difference from the engine's output, and torch's FlashAttention varlen_attn as a yardstick."""
    import random
    from nanovllm_ref.kernels import attention as attn
    h, hkv, d = shapes["heads"], shapes["kv_heads"], shapes["head_dim"]
    rnd = random.Random(0)
    lengths, budget_tokens = [], 64 if dry else 16384
    while True:
        n = rnd.randint(100, 1024) if not dry else rnd.randint(5, 30)
        if sum(lengths) + n > budget_tokens:
            break
        lengths.append(n)
    t = sum(lengths)
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(t, heads, d, device=device, generator=g).to(torch.bfloat16) for heads in (h, hkv, hkv))
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(lengths)), dtype=torch.int32, device=device)
    mx, scale = max(lengths), d ** -0.5
    flops = sum(2 * 2 * n * (n + 1) / 2 * d * h for n in lengths)          # QK and PV, causal
    ref = attn.varlen_prefill(q, k, v, cu, cu, mx, mx, scale).float()
    variants = [None] if dry else [None, (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
                                   (64, 128, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4)]
    cases = [(("engine" if v_ is None else "bm%d bn%d w%d st%d" % v_),
              (lambda v_=v_: attn.varlen_prefill(q, k, v, cu, cu, mx, mx, scale, launch=v_))) for v_ in variants]
    if not dry:
        from torch.nn.attention.varlen import varlen_attn

        def torch_fa():
            try:
                return varlen_attn(q, k, v, cu, cu, mx, mx, scale=scale, window_size=(-1, 0), enable_gqa=True)
            except TypeError as exc:                     # another torch's form: say which
                import inspect
                raise TypeError(f"{exc}; varlen_attn{inspect.signature(varlen_attn)}") from None
        cases.append(("torch varlen_attn", torch_fa))
    for name, fn in cases:
        try:
            diff = float((fn().float() - ref).abs().max())
            us = r3.time_us([fn], device, reps=3, iters=5)[0]
        except Exception as exc:                         # noqa: BLE001 (a launch that does not build is a result)
            rec.add("errors", {"case": f"prefill {name}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            continue
        row = {"kind": "prefill", "launch": name, "tokens": t, "seqs": len(lengths), "us": round(us, 1),
               "tflops": round(flops / (us * 1e-6) / 1e12, 1), "max_abs_diff": round(diff, 5)}
        rec.add("prefill", row)
        r3.log(f"  prefill {t} tokens {len(lengths)} seqs {name:18s} {row['us']:9.1f} us {row['tflops']} TFLOP/s "
               f"(diff {row['max_abs_diff']})")


@dataclasses.dataclass(frozen=True)
class TmaSpec:
    """A projection run by bench/gemm_tma.py with `config` (kernels_round11.chain calls it)."""
    config: "object"

    @property
    def name(self) -> str:
        c = self.config
        return f"tma bm{c.block_m} bn{c.block_n} bk{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"

    def __call__(self, inp, w, kind, pdl):
        import gemm_tma
        return gemm_tma.gemm(inp, w, kind, self.config, use_pdl=pdl)


def tma_candidates(m: int, op: str, s: dict, sms: int, dry: bool) -> list:
    """TmaSpecs for `op` at m rows: a few tile shapes (kernels_round11.candidates' rule); partial sums with K splits
    for about 1 and 2 programs an SM."""
    if dry:
        shapes = [(16, 16, 16, 4, 2)]
    elif r11.OPS[op] == "silu":
        shapes = [(128, 64, 64, 8, 3), (64, 64, 64, 4, 4), (128, 32, 64, 4, 4), (64, 128, 64, 8, 3),
                  (128, 64, 128, 8, 3), (64, 32, 128, 4, 4)]
    else:
        shapes = [(128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 128, 4, 3),
                  (64, 64, 128, 4, 4), (128, 32, 128, 4, 4)]
    return [TmaSpec(c) for c in r11.candidates(m, op, s, sms, dry, shapes=shapes, targets=lambda j: (1, 2))]


def cublas_trace(rec, ctx):
    """Per projection at ctx.m rows in the engine's chain: the kernels that run it and us a call (mean of 28)."""
    if ctx.device.type != "cuda":
        rec.add("trace", {"m": ctx.m, "note": "no CUDA: no trace"})
        return
    kernels = ctx.profiled_kernels(ctx.engine, replays=1)
    by_name: dict = {}
    for e in kernels:
        t = by_name.setdefault(e.name, [0, 0.0])
        t[0] += 1
        t[1] += e.time_range.end - e.time_range.start
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0.0
    row = {"m": ctx.m, "span_us": round(span, 1), "kernels": len(kernels),
           "by_kernel": [{"name": k[:160], "calls": c, "us_a_call": round(t / c, 2), "us": round(t, 1)}
                         for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])]}
    rec.add("trace", row)
    r3.log(f"  trace M={ctx.m}: span {row['span_us']} us, {row['kernels']} kernels")
    for k in row["by_kernel"][:8]:
        r3.log(f"    {k['calls']:4d} x {k['us_a_call']:7.2f} us  {k['name'][:110]}")


def main(args) -> int:
    from nanovllm_ref.kernels import small_gemm
    from nanovllm_ref.kernels.numerics import pdl_available
    run = r3.begin(args, "bench/kernels_round14.py", ("bandwidth", "prefill", "chain", "chain_summary", "best", "trace"))
    if run is None:
        return 2
    device, shapes, dtype, rec, budget = run.device, run.shapes, run.dtype, run.rec, run.budget
    sections = args.sections.split(",")
    dry = args.dry_run
    pdl = pdl_available(device)
    sms = small_gemm.num_sms(device)
    small_max_m = 1 if dry else 64
    ms = bench_env.batch_sizes(args, GPU_MS)
    n_layers = 2 if dry else 28
    rec.data["meta"].update(chain_layers=n_layers, ms=ms, pdl=pdl, sms=sms, small_max_m=small_max_m)
    if "bandwidth" in sections:
        r3.log("1. bandwidth: read-only kernels and the decode attention, TB/s read")
        r3.guarded(rec, budget, "bandwidth", lambda: bandwidth(rec, device, shapes, dry), min_left=6.0)
    if "prefill" in sections:
        r3.log("1b. prefill: the varlen attention kernel's launch, and torch's FlashAttention")
        r3.guarded(rec, budget, "prefill", lambda: prefill(rec, device, shapes, dry), min_left=6.0)
    layers = r10.make_layers(shapes, n_layers, device, dtype, seed=14)
    ctxs = {m: r11.Ctx(m, layers, shapes, device, dtype, pdl, small_max_m) for m in ms}
    best: dict = {}
    if "chain" in sections:
        r3.log("2. chain: each projection as cuBLAS or a TMA Triton GEMM, one at a time, then the best plan")
        for m in ms:
            specs = (lambda op, m=m: ["default"] + tma_candidates(m, op, shapes, sms, dry))
            r3.guarded(rec, budget, f"chain M={m}",
                       lambda: r11.sweep_m(rec, ctxs[m], sms, dry, budget, best, specs_for=specs, section="chain"),
                       min_left=8.0)
        for m in ms:
            if any((m, op) in best for op in r11.OPS):
                r3.guarded(rec, budget, f"best M={m}", lambda: r11.best_m(rec, ctxs[m], best), min_left=2.0)
    if "trace" in sections:
        r3.log("3. trace: the kernels of the engine's chain, by name")
        for m in ([2] if dry else [256, 128]):
            ctx = ctxs.get(m) or r11.Ctx(m, layers, shapes, device, dtype, pdl, small_max_m)
            r3.guarded(rec, budget, f"trace M={m}", lambda: cublas_trace(rec, ctx), min_left=1.0)
    return r3.finish(run, args.out)


if __name__ == "__main__":
    sys.exit(main(ARGS))
