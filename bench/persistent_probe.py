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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels_round3 as r3  # noqa: E402  (time_us; it bypasses nanovllm_ref/__init__, which imports the engine)
from nanovllm_ref.kernels.persistent_decode import _grid_sync, _reset_at_exit  # noqa: E402  (the engine's barrier)


@triton.jit
def _barrier_kernel(bar_ptr, exit_ptr, err_ptr, n_barriers, RESET: tl.constexpr):
    nprog = tl.num_programs(0)
    for b in range(n_barriers):
        _grid_sync(bar_ptr, err_ptr, nprog * (b + 1))
    if RESET:
        _reset_at_exit(bar_ptr, exit_ptr, nprog, bar_ptr, 0)


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
def _chain_step(src, w, y, N, K, pid, nprog, bar_ptr, err_ptr, n_sync, sync,
                BN: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr):
    """One projection of the chain: (the first W tile loaded before the barrier, with PREFETCH), the barrier
    (when `sync`), then the GEMV. Returns the barriers passed so far."""
    if PREFETCH:
        first = _gemv_tile(w, pid, N, K, BN, BK)
    else:
        first = pid
    if sync:
        n_sync += 1
        _grid_sync(bar_ptr, err_ptr, nprog * n_sync)
    _gemv_phase(src, w, y, N, K, pid, nprog, first, BN, BK, PREFETCH)
    return n_sync


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
        n_sync = _chain_step(src, wq + layer * NQ * KQ, yq, NQ, KQ, pid, nprog, bar_ptr, err_ptr, n_sync, layer > 0,
                             BNQ, BKQ, PREFETCH)
        n_sync = _chain_step(yq, wo + layer * NO * KO, yo, NO, KO, pid, nprog, bar_ptr, err_ptr, n_sync, True,
                             BNO, BKO, PREFETCH)
        n_sync = _chain_step(yo, wg + layer * NG * KG, yg, NG, KG, pid, nprog, bar_ptr, err_ptr, n_sync, True,
                             BNG, BKG, PREFETCH)
        n_sync = _chain_step(yg, wd + layer * ND * KD, yd, ND, KD, pid, nprog, bar_ptr, err_ptr, n_sync, True,
                             BND, BKD, PREFETCH)
        src = yd
    _reset_at_exit(bar_ptr, exit_ptr, nprog, bar_ptr, 0)


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
        t0 = r3.time_us([lambda: _barrier_kernel[(nprog,)](bar, ext, err, 0, RESET=True, num_warps=4)], device, reps=10)[0]
        t1 = r3.time_us([lambda: _barrier_kernel[(nprog,)](bar, ext, err, n, RESET=True, num_warps=4)], device, reps=10)[0]
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
        t = r3.time_us([lambda: copy[: 256 << 20].copy_(copy[256 << 20:])], device, reps=5)[0]
        tbps = (512 << 20) / (t * 1e-6) / 1e12
        nbytes = sum(t_.numel() * t_.element_size() for t_ in (wq, wo, wg, wd))
        res = {"copy_tbps": round(tbps, 3), "weights_floor_us_per_layer": round(nbytes / layers / (tbps * 1e6), 2)}
        for prefetch in (False, True):
            res[f"persistent_prefetch={prefetch}_us_per_layer"] = round(r3.time_us([lambda: chain(prefetch)], device, reps=3)[0] / layers, 2)
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
        res["engine_gemv_kernels_us_per_layer"] = round(r3.time_us([kernels], device, reps=3)[0] / layers, 2)
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
