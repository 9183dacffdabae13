#!/usr/bin/env python3
"""Issue 29, round 6, first look: what a persistent decode kernel could save at batch 1, on one GPU (an H200).

    python3 bench/persistent_probe.py --out probe.json            # the GPU run, ~1 min
    python3 bench/persistent_probe.py --dry-run --out /tmp/p.json  # CPU: Triton interpreter, tiny shapes

The batch-1 decode step is ~270 dependent kernels (9 a layer); its weights take 0.28 ms to read and the step
1.02 ms (bench/results/README.md, round 5). A persistent kernel keeps one program per SM resident for the
whole chain and puts a grid-wide barrier where a kernel boundary was. Two numbers decide whether that pays:
1. barrier: the cost of one grid barrier among one program per SM (atomic counter, release/acquire), as the
   slope of kernels doing 0 and `--barriers` barriers.
2. gemv_chain: Qwen3-0.6B's four projections per layer (qkv 4096x1024, o 1024x2048, gate_up 6144x1024,
   down 1024x3072) for 28 layers at M = 1 in bf16, as (a) one persistent kernel with a barrier between
   projections, without and with the next projection's first W tile loaded before the barrier, and (b) the
   engine's small GEMMs (kernels/small_gemm.linear), one kernel each, in a CUDA graph. Per layer, and the
   weights' read time at the copy bandwidth.
The interpreter runs programs one after another, so a barrier would wait forever there: the dry run checks
the chain's values with one program (barriers then pass at once) and times nothing.
"""
import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--barriers", type=int, default=280)
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_SPIN = tl.constexpr(1 << 18)  # a barrier gives up after this many polls (then err counts it)


@triton.jit
def _grid_sync(bar_ptr, err_ptr, target):
    """Wait until the counter at bar_ptr reaches `target` (one arrival per program per barrier)."""
    tl.debug_barrier()                                   # every thread's writes are in before the release
    tl.atomic_add(bar_ptr, 1, sem="release")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
    spins = 0
    while (seen < target) & (spins < MAX_SPIN):
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
        spins += 1
    if spins >= MAX_SPIN:
        tl.atomic_add(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _exit(bar_ptr, exit_ptr, nprog):
    """The last program out resets both counters, so the next launch (a graph replay) starts from 0."""
    last = tl.atomic_add(exit_ptr, 1, sem="acq_rel")
    if last == nprog - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_xchg(exit_ptr, 0)


@triton.jit
def _barrier_kernel(bar_ptr, exit_ptr, err_ptr, n_barriers, RESET: tl.constexpr):
    nprog = tl.num_programs(0)
    for b in range(n_barriers):
        _grid_sync(bar_ptr, err_ptr, nprog * (b + 1))
    if RESET:
        _exit(bar_ptr, exit_ptr, nprog)


@triton.jit
def _gemv_tile(w_ptr, tile, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W's rows tile * BLOCK_N ... as a [BLOCK_N, BLOCK_K] tile (zeros past N and K)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    return tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _gemv_phase(x_ptr, w_ptr, y_ptr, N, K, pid, nprog, w_first,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAVE_FIRST: tl.constexpr):
    """y[N] = W[N, K] @ x[K] (K <= BLOCK_K, one load a tile); tiles pid, pid + nprog, ...; fp32 out.
    HAVE_FIRST: the first tile's W was loaded before the barrier (w_first)."""
    offs_k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    n_tiles = tl.cdiv(N, BLOCK_N)
    start = pid
    if HAVE_FIRST:
        if pid < n_tiles:
            acc = tl.sum(w_first.to(tl.float32) * x[None, :], axis=1)
            tl.store(y_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N), acc)
        start = pid + nprog
    for t in range(start, n_tiles, nprog):
        w = _gemv_tile(w_ptr, t, N, K, BLOCK_N, BLOCK_K)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(y_ptr + t * BLOCK_N + tl.arange(0, BLOCK_N), acc)


@triton.jit
def _chain_kernel(x_ptr, wq, wo, wg, wd, yq, yo, yg, yd, bar_ptr, exit_ptr, err_ptr, n_layers,
                  NQ, KQ, NO, KO, NG, KG, ND, KD,
                  BNQ: tl.constexpr, BKQ: tl.constexpr, BNO: tl.constexpr, BKO: tl.constexpr,
                  BNG: tl.constexpr, BKG: tl.constexpr, BND: tl.constexpr, BKD: tl.constexpr,
                  PREFETCH: tl.constexpr):
    """28 layers of qkv -> o -> gate_up -> down GEMVs, each reading the last one's fp32 output (its first K
    entries; the values are only for the check). One barrier between projections."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_sync = 0
    src = x_ptr
    for layer in range(n_layers):
        wq_l = wq + layer * NQ * KQ
        wo_l = wo + layer * NO * KO
        wg_l = wg + layer * NG * KG
        wd_l = wd + layer * ND * KD
        if PREFETCH:
            w1 = _gemv_tile(wq_l, pid, NQ, KQ, BNQ, BKQ)
        else:
            w1 = pid
        if layer > 0:
            n_sync += 1
            _grid_sync(bar_ptr, err_ptr, nprog * n_sync)
        _gemv_phase(src, wq_l, yq, NQ, KQ, pid, nprog, w1, BNQ, BKQ, PREFETCH)
        if PREFETCH:
            w2 = _gemv_tile(wo_l, pid, NO, KO, BNO, BKO)
        else:
            w2 = pid
        n_sync += 1
        _grid_sync(bar_ptr, err_ptr, nprog * n_sync)
        _gemv_phase(yq, wo_l, yo, NO, KO, pid, nprog, w2, BNO, BKO, PREFETCH)
        if PREFETCH:
            w3 = _gemv_tile(wg_l, pid, NG, KG, BNG, BKG)
        else:
            w3 = pid
        n_sync += 1
        _grid_sync(bar_ptr, err_ptr, nprog * n_sync)
        _gemv_phase(yo, wg_l, yg, NG, KG, pid, nprog, w3, BNG, BKG, PREFETCH)
        if PREFETCH:
            w4 = _gemv_tile(wd_l, pid, ND, KD, BND, BKD)
        else:
            w4 = pid
        n_sync += 1
        _grid_sync(bar_ptr, err_ptr, nprog * n_sync)
        _gemv_phase(yg, wd_l, yd, ND, KD, pid, nprog, w4, BND, BKD, PREFETCH)
        src = yd
    _exit(bar_ptr, exit_ptr, nprog)


def time_graph(fn, reps=10, iters=7):
    """Median µs of one call of fn, from CUDA-graph replays of `reps` calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / reps)
    return sorted(times)[len(times) // 2]


def main(args):
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    nprog = 1 if dry else torch.cuda.get_device_properties(0).multi_processor_count
    rec = {"device": "cpu" if dry else torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": triton.__version__, "programs": nprog}
    bar = torch.zeros(1, dtype=torch.int32, device=device)
    ext = torch.zeros(1, dtype=torch.int32, device=device)
    err = torch.zeros(1, dtype=torch.int32, device=device)

    # 1. barrier cost: one launch with RESET off leaves the counter at nprog * n (the arrivals counted once
    # per program, not once per thread), then timed launches with reset.
    n = 3 if dry else args.barriers
    _barrier_kernel[(nprog,)](bar, ext, err, n, RESET=False, num_warps=4)
    rec["barrier_count_check"] = {"counter": int(bar.item()), "expected": nprog * n}
    bar.zero_()
    if not dry:
        t0 = time_graph(lambda: _barrier_kernel[(nprog,)](bar, ext, err, 0, RESET=True, num_warps=4))
        t1 = time_graph(lambda: _barrier_kernel[(nprog,)](bar, ext, err, n, RESET=True, num_warps=4))
        rec["barrier"] = {"launch_us": round(t0, 2), f"with_{n}_us": round(t1, 2),
                          "per_barrier_us": round((t1 - t0) / n, 3), "errors": int(err.item())}
        print("barrier", rec["barrier"], flush=True)

    # 2. the GEMV chain
    if dry:
        layers, shp = 2, dict(NQ=64, KQ=32, NO=32, KO=64, NG=96, KG=32, ND=32, KD=48)
    else:
        layers, shp = 28, dict(NQ=4096, KQ=1024, NO=1024, KO=2048, NG=6144, KG=1024, ND=1024, KD=3072)
    # tile rows chosen so that every projection has ~1-3 tiles per program
    blocks = dict(BNQ=32, BNO=8, BNG=16, BND=8) if not dry else dict(BNQ=16, BNO=8, BNG=16, BND=8)
    for key in ("Q", "O", "G", "D"):
        blocks[f"BK{key}"] = triton.next_power_of_2(shp[f"K{key}"])
    g = torch.Generator(device=device).manual_seed(0)

    def w(n_, k_):
        return (torch.randn(layers, n_, k_, generator=g, device=device) * k_ ** -0.5).to(dtype)

    wq, wo, wg, wd = w(shp["NQ"], shp["KQ"]), w(shp["NO"], shp["KO"]), w(shp["NG"], shp["KG"]), w(shp["ND"], shp["KD"])
    x = torch.randn(shp["KD"], generator=g, device=device).to(torch.float32)
    ys = [torch.zeros(shp[k], dtype=torch.float32, device=device) for k in ("NQ", "NO", "NG", "ND")]

    def chain(prefetch):
        _chain_kernel[(nprog,)](x, wq, wo, wg, wd, *ys, bar, ext, err, layers, *shp.values(), **blocks,
                                PREFETCH=prefetch, num_warps=8)

    def reference():
        src = x
        for i in range(layers):
            yq = wq[i].float() @ src[:shp["KQ"]]
            yo = wo[i].float() @ yq[:shp["KO"]]
            yg = wg[i].float() @ yo[:shp["KG"]]
            src = wd[i].float() @ yg[:shp["KD"]]
        return src

    ref = reference()
    for prefetch in (False, True):
        ys[3].zero_()
        chain(prefetch)
        got = ys[3]
        rel = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        rec.setdefault("chain_check", {})[f"prefetch={prefetch}"] = round(rel, 6)
    if not dry:
        copy = torch.empty(512 << 20, dtype=torch.uint8, device=device)
        t = time_graph(lambda: copy[: 256 << 20].copy_(copy[256 << 20:]), reps=5)
        tbps = (512 << 20) / (t * 1e-6) / 1e12
        nbytes = sum(t_.numel() * t_.element_size() for t_ in (wq, wo, wg, wd))
        res = {"copy_tbps": round(tbps, 3), "weights_floor_us_per_layer": round(nbytes / layers / (tbps * 1e6), 2)}
        for prefetch in (False, True):
            res[f"persistent_prefetch={prefetch}_us_per_layer"] = round(time_graph(lambda: chain(prefetch), reps=3) / layers, 2)
        from nanovllm_ref.kernels import small_gemm
        xb = torch.randn(1, shp["KD"], generator=g, device=device).to(dtype)

        def kernels():
            src = xb
            for i in range(layers):
                yq = small_gemm.linear(src[:, :shp["KQ"]], wq[i])
                yo = small_gemm.linear(yq[:, :shp["KO"]], wo[i])
                yg = small_gemm.linear(yo[:, :shp["KG"]].contiguous(), wg[i])
                src = small_gemm.linear(yg[:, :shp["KD"]].contiguous(), wd[i])
            return src
        res["engine_gemv_kernels_us_per_layer"] = round(time_graph(kernels, reps=3) / layers, 2)
        res["errors"] = int(err.item())
        rec["gemv_chain"] = res
        print("gemv_chain", res, flush=True)
    print(json.dumps(rec, indent=1))
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    t = time.time()
    rc = main(ARGS)
    print(f"probe done in {time.time() - t:.1f} s")
    sys.exit(rc)
