#!/usr/bin/env python3
"""GPU speed round 10 (issue 29): do the decode GEMMs wait on HBM, and does a side stream's L2 prefetch help?

    python3 bench/kernels_round10.py --out results.json      # the GPU run, ~1 min
    python3 bench/kernels_round10.py --dry-run --out /tmp/dry.json   # CPU: interpreter, tiny shapes, no prefetch

Why: at batch 1 a Qwen3-0.6B layer's four GEMMs take ~24 us in a CUDA graph where reading their 31.5 MB at the
copy bandwidth takes 7.5 (round 6), and removing kernels between them saved almost nothing (round 5: the norm in
the GEMM's prologue, 9 us a step). So the time is each GEMM's own ramp: too few requests in flight in a kernel of a
few microseconds. The weights depend on nothing the step computes, so another stream can fetch the next GEMM's
weights into L2 while the current GEMM runs (bench/l2_prefetch.py).

chain: the decode step's GEMM chain without attention, 28 layers in one CUDA graph, the engine's kernels as the
engine runs them at M rows (<= 64: add + RMSNorm, the small GEMMs with split-K partials and the SiLU epilogue, PDL;
above: cuBLAS, the SiLU-and-mul kernel, add + RMSNorm), in four variants:
- dram: 28 layers of their own weights (the engine's case);
- l2_hot: one layer's weights 28 times (they stay in L2): the most any prefetch can give;
- prefetch_bulk / prefetch_line: 28 layers, each GEMM's weights asked for into L2 from a side stream just before
  the GEMM in front of it runs (bulk copy engine, or 128-byte line requests); prefetch_bulk_2: two GEMMs ahead.
Every variant's output is compared with dram's (the prefetch is a hint: it must change nothing, bit for bit).
The JSON (--out) is rewritten after every case.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_env  # noqa: E402


def parse_args(argv=None):
    return bench_env.parser(__doc__, budget=90.0, sections="chain,overlap").parse_args(argv)


ARGS = parse_args()
bench_env.choose_triton_mode(ARGS.dry_run)
import kernels_round3 as r3  # noqa: E402  (its helpers; it bypasses nanovllm_ref/__init__, which imports the engine)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VARIANTS = ("dram", "l2_hot", "prefetch_bulk", "prefetch_bulk_2", "prefetch_line")
# the prefetch variants: (bulk form?, how many GEMMs ahead)
PREFETCH = {"prefetch_bulk": (True, 1), "prefetch_bulk_2": (True, 2), "prefetch_line": (False, 1)}


def make_layers(s, n_layers, device, dtype, seed=0):
    """n_layers dicts of the four projections' weights (qkv, o, gate_up, down) and the two norms' weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, q, kv, i = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["inter"]

    def w(n, k):
        return (torch.randn(n, k, device=device, generator=g) * k ** -0.5).to(dtype)
    return [dict(qkv=w(q + 2 * kv, h), o=w(h, q), gate_up=w(2 * i, h), down=w(h, i),
                 n1=(1 + 0.1 * torch.randn(h, device=device, generator=g)).to(dtype),
                 n2=(1 + 0.1 * torch.randn(h, device=device, generator=g)).to(dtype)) for _ in range(n_layers)]


def chain(x, layers, s, small: bool, pdl: bool, prefetcher=None, distance: int = 1, attn=None):
    """x [M, hidden] through the layers' GEMMs; returns [M, hidden]. attn: None (attention's place taken by q
    itself), or (k_cache, v_cache, block table, context lengths) of the M rows: the decode attention of q against
    them (`kernels/attention.paged_decode`; one cache for every layer: it is far larger than L2 either way)."""
    from nanovllm_ref.kernels import rms_norm, silu_mul, small_gemm
    eps, q_size = s["eps"], s["heads"] * s["head_dim"]
    order = [(L, name) for L in layers for name in ("qkv", "o", "gate_up", "down")]
    # each GEMM asks for the weights of the GEMM `distance` places after it (the first asks for the first few too)
    ahead = {id(L[name]): [order[j + distance]] for j, (L, name) in enumerate(order[:-distance])}
    if order:
        ahead.setdefault(id(order[0][0][order[0][1]]), []).extend(order[1:distance])

    def gemm(inp, L, name, form):
        if prefetcher is not None and id(L[name]) in ahead:
            for nxt_L, nxt in ahead[id(L[name])]:
                prefetcher.ahead(nxt_L[nxt])
        w = L[name]
        if not small:
            y = F.linear(inp, w)
            return silu_mul.silu_and_mul(y) if form == "silu" else y
        if form == "partials":
            return small_gemm.linear_partials(inp, w, use_pdl=pdl)
        if form == "silu":
            return small_gemm.linear_silu_mul(inp, w, use_pdl=pdl)
        return small_gemm.linear(inp, w, use_pdl=pdl)

    hidden, residual = x, None
    for L in layers:
        if residual is None:
            h, residual = rms_norm.add_rms_norm(hidden, None, L["n1"], eps, use_pdl=pdl)[0], hidden
        else:
            h, residual = rms_norm.add_rms_norm(hidden, residual, L["n1"], eps, use_pdl=pdl)
        qkv = gemm(h, L, "qkv", "full")
        if attn is None:
            a_out = qkv[:, :q_size].contiguous() if not small else qkv[:, :q_size]
        else:
            from nanovllm_ref.kernels.attention import paged_decode
            q = qkv[:, :q_size].view(-1, s["heads"], s["head_dim"])
            a_out = paged_decode(q, *attn, s["head_dim"] ** -0.5, use_pdl=pdl).view(-1, q_size)
        o = gemm(a_out, L, "o", "partials")
        h, residual = rms_norm.add_rms_norm(o, residual, L["n2"], eps, use_pdl=pdl)
        hidden = gemm(gemm(h, L, "gate_up", "silu"), L, "down", "partials")
    out = rms_norm.add_rms_norm(hidden, residual, layers[-1]["n1"], eps, use_pdl=pdl)[0]
    if prefetcher is not None:
        prefetcher.join()
    return out


def chain_fp32(x, layers, s):
    """The same chain in plain fp32 torch (the engine's kernels must agree within bf16 rounding)."""
    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + s["eps"]) * w.float()
    q_size = s["heads"] * s["head_dim"]
    hidden, residual = x.float(), None
    for L in layers:
        residual = hidden if residual is None else hidden + residual
        h = rms(residual, L["n1"])
        o = F.linear(F.linear(h, L["qkv"].float())[:, :q_size], L["o"].float())
        residual = o + residual
        gate, up = F.linear(rms(residual, L["n2"]), L["gate_up"].float()).chunk(2, -1)
        hidden = F.linear(F.silu(gate) * up, L["down"].float())
    return rms(hidden + residual, layers[-1]["n1"])


def chain_case(rec, m, layers, hot, s, device, dtype, small_max_m=64):
    """The four variants at M = m rows (module docstring)."""
    from nanovllm_ref.kernels.numerics import pdl_available
    small, pdl = m <= small_max_m, pdl_available(device)
    g = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, s["hidden"], device=device, generator=g).to(dtype)
    row = {"m": m, "path": "triton small GEMMs" + (" + PDL" if pdl else "") if small else "cuBLAS",
           "layers": len(layers), "weight_mb_a_layer": round(sum(
               layers[0][k].numel() * layers[0][k].element_size() for k in ("qkv", "o", "gate_up", "down")) / 2 ** 20, 2)}
    prefetchers = {}
    if device.type == "cuda":
        from l2_prefetch import L2Prefetcher
        prefetchers = {name: (L2Prefetcher(device, bulk=bulk), d) for name, (bulk, d) in PREFETCH.items()}
    runs = {"dram": lambda: chain(x, layers, s, small, pdl),
            "l2_hot": lambda: chain(x, hot, s, small, pdl),
            **{name: (lambda p=p, d=d: chain(x, layers, s, small, pdl, p, d)) for name, (p, d) in prefetchers.items()}}
    ref = runs["dram"]()
    row["dram_max_abs_err_vs_fp32"] = round(float((ref.float() - chain_fp32(x, layers, s)).abs().max()), 4)
    for name in VARIANTS:
        if name not in runs:
            row[f"{name}_us_a_layer"] = None      # the interpreter cannot run inline PTX: no prefetch on a CPU
            continue
        out = runs[name]()
        if name.startswith("prefetch"):
            row[f"{name}_equal_to_dram"] = bool(torch.equal(out, ref))
        us = r3.time_us([runs[name]], device, reps=3, iters=7)
        row[f"{name}_us_a_layer"] = round(us[0] / len(layers), 2)
    base = row["dram_us_a_layer"]
    for name in VARIANTS[1:]:
        v = row[f"{name}_us_a_layer"]
        row[f"{name}_vs_dram"] = round(v / base, 3) if v is not None and base else None
    rec.add("chain", row)
    r3.log("  chain M={:<3d} {:22s} ".format(m, row["path"]) + "  ".join(
        f"{name} {row[f'{name}_us_a_layer']}" for name in VARIANTS) + " us a layer")
    return row


def overlap_case(rec, step, layers, s, device, dtype, small_max_m=64, scale_down=1):
    """The workload's decode step `step` as 28 layers of GEMMs and attention (no q/k norm, RoPE or KV store):
    the whole batch on one stream, against its rows cut in two halves (alternate rows of the longest-first order,
    so each half holds half the KV) run on two streams at once, and the same halves one after the other."""
    import kernels_round9 as r9
    from nanovllm_ref.kernels.numerics import pdl_available
    prompts, outputs = r9.workload_lengths()
    lengths = sorted(((p + step + 1) // scale_down for p, o in zip(prompts, outputs) if o > step), reverse=True)
    if scale_down > 1:
        lengths = lengths[:5]
    m = len(lengths)
    pdl = pdl_available(device)
    q, k_cache, v_cache, table, lens = r3.paged_decode_inputs(lengths, max(lengths), s, device, dtype, step + 3)
    g = torch.Generator(device=device).manual_seed(step)
    x = torch.randn(m, s["hidden"], device=device, generator=g).to(dtype)
    halves = [torch.arange(i, m, 2, device=device) for i in (0, 1)]
    parts = [(x[h].contiguous(), (k_cache, v_cache, table[h].contiguous(), lens[h].contiguous())) for h in halves]
    streams = [torch.cuda.Stream(device=device) for _ in halves] if device.type == "cuda" else []

    def full():
        return chain(x, layers, s, m <= small_max_m, pdl, attn=(k_cache, v_cache, table, lens))

    def one(part):
        xh, at = part
        return chain(xh, layers, s, xh.shape[0] <= small_max_m, pdl, attn=at)

    def serial():
        return [one(p) for p in parts]

    def two_streams():
        if not streams:
            return serial()
        cur = torch.cuda.current_stream(device)
        outs = []
        for st, part in zip(streams, parts):
            st.wait_stream(cur)
            with torch.cuda.stream(st):
                outs.append(one(part))
        for st in streams:
            cur.wait_stream(st)
        return outs

    def merged(outs):
        y = torch.empty(m, s["hidden"], device=device, dtype=dtype)
        for h, o in zip(halves, outs):
            y[h] = o
        return y
    ref = full()
    row = {"step": step, "batch": m, "mean_length": round(sum(lengths) / m, 1), "layers": len(layers),
           "paths": "full {} / halves {}".format(*("small" if n <= small_max_m else "cuBLAS"
                                                   for n in (m, parts[0][0].shape[0])))}
    for name, fn in (("full", full), ("halves_serial", serial), ("halves_two_streams", two_streams)):
        out = fn()
        if name != "full":
            row[f"{name}_max_abs_err_vs_full"] = r3.max_err(merged(out), ref)
        row[f"{name}_us_a_layer"] = round(r3.time_us([fn], device, reps=2, iters=5)[0] / len(layers), 2)
    base = row["full_us_a_layer"]
    for name in ("halves_serial", "halves_two_streams"):
        row[f"{name}_vs_full"] = round(row[f"{name}_us_a_layer"] / base, 3) if base else None
    rec.add("overlap", row)
    r3.log(f"  overlap step={step:<4d} B={m:<3d} {row['paths']:24s} full {base} us a layer  halves one stream "
           f"{row['halves_serial_us_a_layer']}  two streams {row['halves_two_streams_us_a_layer']}")
    return row


def main(args) -> int:
    run = r3.begin(args, "bench/kernels_round10.py", ("chain", "overlap"))
    if run is None:
        return 2
    device, shapes, dtype, rec, budget = run.device, run.shapes, run.dtype, run.rec, run.budget
    if "chain" in args.sections.split(","):
        r3.log("1. the decode GEMM chain (no attention): weights from HBM, from L2, and prefetched from a side stream")
        n_layers = 2 if args.dry_run else 28
        layers = make_layers(shapes, n_layers, device, dtype)
        hot = [layers[0]] * n_layers
        rec.data["meta"]["chain_layers"] = n_layers
        for m in ([1, 3] if args.dry_run else [1, 4, 16, 64, 128, 256]):
            r3.guarded(rec, budget, f"chain M={m}",
                       lambda: chain_case(rec, m, layers, hot, shapes, device, dtype,
                                          small_max_m=2 if args.dry_run else 64), min_left=3.0)
    if "overlap" in args.sections.split(","):
        r3.log("2. a decode step's layers with attention: the whole batch, or two halves on two streams at once")
        n_layers = 2 if args.dry_run else 28
        layers = make_layers(shapes, n_layers, device, dtype, seed=1)
        for step in ([0] if args.dry_run else [0, 256, 512, 640]):
            r3.guarded(rec, budget, f"overlap step={step}",
                       lambda: overlap_case(rec, step, layers, shapes, device, dtype,
                                            small_max_m=2 if args.dry_run else 64,
                                            scale_down=16 if args.dry_run else 1), min_left=3.0)
    return r3.finish(run, args.out)


if __name__ == "__main__":
    sys.exit(main(ARGS))
