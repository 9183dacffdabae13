#!/usr/bin/env python3
"""GPU speed round 8 (issue 29): kernels of the large-batch decode step and of prefill, new against old.

    python3 bench/kernels_round8.py --out results.json [--base /tmp/ab_base]   # the GPU run, ~1 min
    python3 bench/kernels_round8.py --dry-run --out /tmp/dry.json              # CPU: interpreter, tiny shapes

Why: at 65-256 rows a decode step spends 1.7-2.0 ms outside the KV read at bandwidth (ab6 of 2026-12-03, base
side, by batch bucket), and those steps are three quarters of the bench workload's decode time. Two of its
kernels are measured here against what they replace:
1. attention: `kernels/attention.paged_decode` with the KV heads of a sequence launched side by side
   (head_major, grid (Hkv, B, splits)) against the earlier order (B, Hkv, splits), at the workload's batch and
   context mix (lengths uniform in [100, context], blocks shuffled), in % of the copy bandwidth.
2. qk: `kernels/qk_norm_rope_store` with several head rows a program (block_rows) against the earlier kernel
   of one program per head (the --base tree's module, when given: `bash bench/make_ab_base.sh` unpacked).
3. prefill: the same kernel without the store (`qk_norm_rope`) against Inductor's compiled q/k norm + RoPE,
   the earlier prefill route, at 2,048 and 14,336 tokens.
4. sampler: the row draw with per-lane running bests against the base tree's block reduction per step.
5. silu: SiLU-and-mul after cuBLAS (prefill, decode above max_m rows), Inductor against kernels/silu_mul.py.
The JSON (--out) is rewritten after every case.
"""
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402


def parse_args(argv=None):
    p = bench_env.parser(__doc__, budget=90.0, sections="attention,qk,prefill,sampler,silu")
    p.add_argument("--base", default=None, help="an unpacked base tree (its nanovllm_ref/kernels/qk_norm_rope_store.py "
                   "is the old kernel)")
    return p.parse_args(argv)


ARGS = parse_args()
bench_env.choose_triton_mode(ARGS.dry_run)
import kernels_round3 as r3  # noqa: E402  (its helpers; it bypasses nanovllm_ref/__init__, which imports the engine)
import torch  # noqa: E402


def _module_from(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attention_case(rec, batch, context, head_major, shapes, device, dtype, mixed: bool):
    """One decode attention call of `batch` sequences (lengths `context`, or uniform in [100, context] when
    mixed), blocks shuffled; head_major True (this tree's default) or False (the earlier launch order)."""
    import random
    from nanovllm_ref.kernels import attention as attn
    hkv, h, d = shapes["kv_heads"], shapes["heads"], shapes["head_dim"]
    block = 256 if device.type == "cuda" else 16
    rnd = random.Random(batch)
    lengths = [rnd.randint(min(100, context), context) if mixed else context for _ in range(batch)]
    q, k_cache, v_cache, table, lens = r3.paged_decode_inputs(lengths, context, shapes, device, dtype,
                                                              batch * 131 + context)
    per_seq = table.shape[1]
    scale = d ** -0.5
    ref = attn.paged_decode(q, k_cache, v_cache, table, lens, scale, head_major=False)
    out = attn.paged_decode(q, k_cache, v_cache, table, lens, scale, head_major=head_major)
    us = r3.time_us([lambda: attn.paged_decode(q, k_cache, v_cache, table, lens, scale, head_major=head_major)],
                    device, reps=10, iters=7)
    nbytes = 2 * sum(lengths) * hkv * d * dtype.itemsize
    row = {"batch": batch, "context": context, "lengths": "random" if mixed else "equal",
           "mean_length": sum(lengths) / batch, "head_major": head_major,
           "splits": attn.decode_num_splits(batch, hkv, per_seq * block, device),
           "us": round(us[0], 2), "us_min": round(us[1], 2), "us_max": round(us[2], 2),
           "max_abs_err_vs_batch_major": r3.max_err(out, ref), **r3.bandwidth(nbytes, us[0])}
    rec.add("attention", row)
    r3.log(f"  attention B={batch:<3d} ctx={context:<5d} {row['lengths']:6s} head_major={head_major!s:5s} "
           f"{row['us']:8.1f} us {row['pct_of_peak']:5.1f} % of peak")
    return row


def qk_case(rec, m, shapes, device, dtype, block_rows, old_module=None):
    """q/k norm + RoPE + KV store of m tokens: this tree's kernel at `block_rows` (None = its default), or
    (block_rows "old") the base tree's kernel; errors against this tree's default."""
    from nanovllm_ref.kernels import qk_norm_rope_store as k2
    h, hkv, d = shapes["heads"], shapes["kv_heads"], shapes["head_dim"]
    rope, qkv, positions, slots, qw, kw, caches = r3.qk_inputs(m, shapes, device, dtype, m + 1)
    args = (positions, rope.cos_sin_cache, qw, kw, shapes["eps"])
    tail = (slots, h, hkv, d)

    def run():
        if block_rows == "old":
            return old_module.qk_norm_rope_store(qkv, *args, caches[2], caches[3], *tail)
        return k2.qk_norm_rope_store(qkv, *args, caches[2], caches[3], *tail, block_rows=block_rows)
    q_ref = k2.qk_norm_rope_store(qkv, *args, caches[0], caches[1], *tail)
    q = run()
    errs = {"max_abs_err_q": r3.max_err(q, q_ref), "max_abs_err_k_cache": r3.max_err(caches[2], caches[0]),
            "max_abs_err_v_cache": r3.max_err(caches[3], caches[1])}
    us = r3.time_us([run], device)
    row = {"m": m, "block_rows": block_rows if block_rows is not None else "default", "us": round(us[0], 2),
           "us_min": round(us[1], 2), **errs}
    rec.add("qk", row)
    r3.log(f"  qk_norm_rope_store M={m:<3d} block_rows={row['block_rows']!s:8s} {row['us']:7.2f} us  "
           f"err q {errs['max_abs_err_q']:.1e} k {errs['max_abs_err_k_cache']:.1e} v {errs['max_abs_err_v_cache']:.1e}")
    return row


def prefill_qk_case(rec, m, shapes, device, dtype, variant):
    """q/k norm + RoPE of a prefill step of m tokens: "inductor" (models/qwen3.qk_norm_rope compiled, the earlier
    prefill route) or this tree's kernel without the store at block_rows `variant` (None = its default)."""
    from nanovllm_ref.kernels import qk_norm_rope_store as k2
    from nanovllm_ref.models.qwen3 import qk_norm_rope
    h, hkv, d = shapes["heads"], shapes["kv_heads"], shapes["head_dim"]
    rope, qkv, positions, _, qw, kw, _ = r3.qk_inputs(m, shapes, device, dtype, m + 3)
    compiled = qk_norm_rope.compiled() if device.type == "cuda" else qk_norm_rope

    def inductor():
        q, k, _ = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        return compiled(positions, q.reshape(m, h, d), k.reshape(m, hkv, d), qw, kw, shapes["eps"], rope.cos_sin_cache)

    def kernel():
        return k2.qk_norm_rope(qkv, positions, rope.cos_sin_cache, qw, kw, shapes["eps"], h, hkv, d, block_rows=variant)
    q_ref, k_ref = inductor()
    q, k = inductor() if variant == "inductor" else kernel()
    us = r3.time_us([inductor if variant == "inductor" else kernel], device, reps=10)
    row = {"m": m, "variant": variant if variant is not None else "default", "us": round(us[0], 2),
           "max_abs_err_q_vs_inductor": r3.max_err(q, q_ref), "max_abs_err_k_vs_inductor": r3.max_err(k, k_ref)}
    rec.add("prefill_qk", row)
    r3.log(f"  prefill q/k norm + RoPE M={m:<6d} {row['variant']!s:9s} {row['us']:8.2f} us  "
           f"err q {row['max_abs_err_q_vs_inductor']:.1e} k {row['max_abs_err_k_vs_inductor']:.1e}")
    return row


def sampler_case(rec, batch, shapes, device, variant, old_module=None, launch=None):
    """The sampler's row draw (kernels/sampler.sample_rows) over `batch` rows of the vocabulary, temperature 0.6:
    this tree's kernel ("new", per-lane running bests) or the base tree's ("old", a block reduction a step)."""
    from nanovllm_ref.kernels import sampler
    g = torch.Generator(device=device).manual_seed(batch)
    vocab = shapes["vocab"]
    logits = torch.randn(batch, vocab, device=device, generator=g).to(torch.bfloat16)
    temps = torch.full((batch,), 0.6, device=device)
    seeds = torch.randint(0, 2**31, (batch,), device=device, generator=g)
    counters = torch.arange(batch, device=device)
    module = old_module if variant == "old" else sampler

    def run():
        return module.sample_rows(logits, temps, seeds=seeds, counters=counters, **(launch or {}))
    same = bool(torch.equal(run(), sampler.sample_rows(logits, temps, seeds=seeds, counters=counters)))
    us = r3.time_us([run], device, reps=10)
    row = {"batch": batch, "variant": variant, "launch": launch or "default", "us": round(us[0], 2),
           "same_tokens_as_new": same}
    rec.add("sampler", row)
    r3.log(f"  sampler B={batch:<4d} {variant:4s} {str(launch or 'default'):38s} {row['us']:8.2f} us  "
           f"same tokens as new: {same}")
    return row


def silu_case(rec, m, shapes, device, dtype, variant):
    """SiLU-and-mul of m rows of [gate | up] (the MLP's intermediate size): "inductor" (layers/activation's
    silu_and_mul compiled, the earlier route after cuBLAS) or "kernel" (kernels/silu_mul.py); errors against
    the eager reference."""
    from nanovllm_ref.kernels import silu_mul
    from nanovllm_ref.layers.activation import silu_and_mul
    g = torch.Generator(device=device).manual_seed(m + 5)
    x = (3 * torch.randn(m, 2 * shapes["inter"], device=device, generator=g)).to(dtype)
    fn = (silu_and_mul.compiled() if device.type == "cuda" else silu_and_mul) if variant == "inductor" \
        else silu_mul.silu_and_mul
    ref = silu_and_mul(x)
    out = fn(x)
    us = r3.time_us([lambda: fn(x)], device, reps=10)
    row = {"m": m, "variant": variant, "us": round(us[0], 2), "max_abs_err_vs_eager": r3.max_err(out, ref),
           "bit_identical_fraction": round((out == ref).float().mean().item(), 6),
           **r3.bandwidth(3 * m * shapes["inter"] * dtype.itemsize, us[0])}
    rec.add("silu", row)
    r3.log(f"  silu_and_mul M={m:<6d} {variant:8s} {row['us']:8.2f} us {row['pct_of_peak']:5.1f} % of peak  "
           f"err {row['max_abs_err_vs_eager']:.1e}, {row['bit_identical_fraction']:.4f} identical")
    return row


def main(args) -> int:
    run = r3.begin(args, "bench/kernels_round8.py", ("attention", "qk", "prefill_qk", "sampler", "silu"), base=args.base)
    if run is None:
        return 2
    device, shapes, dtype, rec, budget = run.device, run.shapes, run.dtype, run.rec, run.budget
    sections = args.sections.split(",")
    if "attention" in sections:
        r3.log("1. decode attention: KV heads of a sequence side by side (head_major) or not")
        cases = [(2, 64, True), (3, 40, False)] if args.dry_run else \
            [(256, 1024, True), (256, 512, False), (128, 2048, True), (128, 1024, False), (64, 2048, True),
             (32, 2048, True), (8, 2048, True), (1, 2048, False)]
        for batch, context, mixed in cases:
            for head_major in (False, True):
                r3.guarded(rec, budget, f"attention B={batch} ctx={context} head_major={head_major}",
                           lambda: attention_case(rec, batch, context, head_major, shapes, device, dtype, mixed),
                           min_left=2.0)
    if "qk" in sections:
        r3.log("2. q/k norm + RoPE + KV store: head rows a program")
        old = None
        if args.base:
            old = _module_from(Path(args.base) / "nanovllm_ref/kernels/qk_norm_rope_store.py", "base_qk_norm_rope_store")
        rows = ["old"] if old is not None else []
        rows += [None, 2, 8, 32]
        for m in ([1, 5, 40] if args.dry_run else [1, 8, 16, 64, 128, 256]):
            for block_rows in rows:
                r3.guarded(rec, budget, f"qk M={m} block_rows={block_rows}",
                           lambda: qk_case(rec, m, shapes, device, dtype, block_rows, old), min_left=2.0)
    if "prefill" in sections:
        r3.log("3. prefill: q/k norm + RoPE, Inductor against the kernel without its store")
        for m in ([40] if args.dry_run else [2048, 14336]):
            for variant in ("inductor", None, 32):
                r3.guarded(rec, budget, f"prefill qk M={m} {variant}",
                           lambda: prefill_qk_case(rec, m, shapes, device, dtype, variant), min_left=2.0)
    if "sampler" in sections:
        r3.log("4. the sampler's row draw: per-lane running bests against a block reduction a step")
        old_sampler = None
        if args.base and (Path(args.base) / "nanovllm_ref/kernels/sampler.py").exists():
            old_sampler = _module_from(Path(args.base) / "nanovllm_ref/kernels/sampler.py", "base_sampler")
        launches = [None] if args.dry_run else [None, dict(block_v=2048), dict(block_v=2048, num_warps=8),
                                                dict(block_v=512), dict(block_v=4096, num_warps=8)]
        for batch in ([1, 3] if args.dry_run else [1, 64, 256]):
            for variant in (["old"] if old_sampler is not None else []) + ["new"]:
                for launch in (launches if variant == "new" else [None]):
                    r3.guarded(rec, budget, f"sampler B={batch} {variant} {launch}",
                               lambda: sampler_case(rec, batch, shapes, device, variant, old_sampler, launch),
                               min_left=2.0)
    if "silu" in sections:
        r3.log("5. SiLU-and-mul after cuBLAS: Inductor against kernels/silu_mul.py")
        for m in ([3] if args.dry_run else [128, 256, 2048, 14336]):
            for variant in ("inductor", "kernel"):
                r3.guarded(rec, budget, f"silu M={m} {variant}",
                           lambda: silu_case(rec, m, shapes, device, dtype, variant), min_left=2.0)
    return r3.finish(run, args.out)


if __name__ == "__main__":
    sys.exit(main(ARGS))
