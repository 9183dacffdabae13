#!/usr/bin/env python3
"""Check and time the Triton attention kernels on a CUDA GPU (written for one H200).

    python3 bench/gpu_kernels.py --out results.json

(a) Correctness at real sizes: every kernel against the pure-PyTorch reference (`torch_backend`) with the
    shapes of Qwen3-0.6B (16 query heads, 8 KV heads, head_dim 128, bf16) and KV-cache block sizes 256
    (the engine default; one block-table load per tile) and 16 (the per-token gather path). Also a small
    fp32 check, and paged_decode captured in a CUDA graph and replayed with new lengths (it must not
    synchronise with the host). Prints max abs error and PASS/FAIL.
(b) Timing: paged_decode for batch 1/64/256 at context 512/4096, prefill of 8 x 1024 tokens, and the KV
    store, in µs (CUDA events; decode also replayed from a CUDA graph, as the engine runs it), with the
    achieved GB/s (bytes that must move: the K/V read plus q/out) and, for prefill, TFLOP/s.
(c) Writes everything as JSON to --out. Exits 1 if any check fails.

Only `nanovllm_ref.attn` and `nanovllm_ref.kernels` are imported (the package's __init__, which pulls in
the whole engine, is bypassed), so this runs on a machine that has just torch and triton.
"""
import argparse
import json
import os
import platform
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.pop("TRITON_INTERPRET", None)
_pkg = types.ModuleType("nanovllm_ref")           # bypass nanovllm_ref/__init__.py (imports the engine)
_pkg.__path__ = [str(ROOT / "nanovllm_ref")]
sys.modules.setdefault("nanovllm_ref", _pkg)

import torch  # noqa: E402
import triton  # noqa: E402

from nanovllm_ref.attn import torch_backend as ref  # noqa: E402
from nanovllm_ref.attn import triton_backend as tb  # noqa: E402
from nanovllm_ref.kernels import attention as kattn  # noqa: E402
from nanovllm_ref.kernels.store_kvcache import store_kvcache, store_kvcache_torch  # noqa: E402

H, HKV, D = 16, 8, 128                              # Qwen3-0.6B
SCALE = D ** -0.5
DEV = "cuda"
TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-3, 1e-3)}   # (atol, rtol)
RESULTS = {"checks": [], "timings": [], "errors": []}


def log(msg):
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------- helpers

def paged_cache(context_lens, block_size, dtype, pad_blocks=3, seed=0):
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    needed = [triton.cdiv(n, block_size) for n in context_lens]
    num_blocks = sum(needed) + 4
    k_cache = torch.randn(num_blocks, block_size, HKV, D, device=DEV, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, HKV, D, device=DEV, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, device=DEV, generator=g).to(torch.int32)
    table = torch.full((len(context_lens), max(needed) + pad_blocks), -1, dtype=torch.int32, device=DEV)
    used = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[used:used + n]
        used += n
    return k_cache, v_cache, table


def cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)


def check(name, got, expected, dtype, **info):
    atol, rtol = TOL[dtype]
    got, expected = got.float(), expected.float()
    err = (got - expected).abs()
    max_err = err.max().item()
    finite = bool(torch.isfinite(got).all())
    ok = finite and bool((err <= atol + rtol * expected.abs()).all())
    rec = dict(name=name, max_abs_err=max_err, mean_abs_err=err.mean().item(),
               max_abs_ref=expected.abs().max().item(), atol=atol, rtol=rtol, passed=ok, **info)
    RESULTS["checks"].append(rec)
    log(f"[{'PASS' if ok else 'FAIL'}] {name:58s} max|err| {max_err:.3e}  (max|ref| {rec['max_abs_ref']:.3f})")
    return ok


def guarded(fn):
    """Run one check/timing group; an exception is recorded as a failure, the rest still runs."""
    def wrapper(*a, **k):
        try:
            return fn(*a, **k)
        except Exception as e:  # noqa: BLE001
            tb_text = traceback.format_exc()
            log(f"[FAIL] {fn.__name__}{a}: {type(e).__name__}: {e}\n{tb_text}")
            RESULTS["errors"].append(dict(group=fn.__name__, args=repr(a), error=f"{type(e).__name__}: {e}",
                                          traceback=tb_text[-4000:]))
    return wrapper


def time_eager(fn, iters=50, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def time_graph(fn, calls_per_graph=20, replays=10):
    """µs per call with `calls_per_graph` calls captured back to back in one CUDA graph (launch overhead
    gone, as in the engine's decode). Also proves fn has no host synchronisation (capture would fail)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (replays * calls_per_graph)


# ------------------------------------------------------------------------------------------- checks

@guarded
def check_store(block_size):
    num_tokens = 8192
    g = torch.Generator(device=DEV)
    g.manual_seed(1)
    qkv = torch.randn(num_tokens, (H + 2 * HKV) * D, device=DEV, generator=g).to(torch.bfloat16)
    _, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    k, v = k.view(-1, HKV, D), v.view(-1, HKV, D)          # strided views, as in the engine
    num_blocks = triton.cdiv(num_tokens, block_size) + 8
    slots = torch.randperm(num_blocks * block_size, device=DEV, generator=g)[:num_tokens].to(torch.int32)
    slots[::7] = -1
    k_cache = torch.zeros(num_blocks, block_size, HKV, D, dtype=torch.bfloat16, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slots)
    store_kvcache_torch(k, v, k_ref, v_ref, slots)
    ok = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    RESULTS["checks"].append(dict(name=f"store_kvcache bs={block_size} N={num_tokens} (exact)", passed=ok,
                                  max_abs_err=(k_cache.float() - k_ref.float()).abs().max().item()))
    log(f"[{'PASS' if ok else 'FAIL'}] store_kvcache bs={block_size} N={num_tokens} bit-exact vs torch")


@guarded
def check_decode(block_size, context_lens, dtype=torch.bfloat16, num_splits=None, label=""):
    k_cache, v_cache, table = paged_cache(context_lens, block_size, dtype, seed=len(context_lens))
    q = torch.randn(len(context_lens), H, D, device=DEV).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEV)
    splits = num_splits or kattn.decode_num_splits(len(context_lens), HKV, table.shape[1] * block_size, q.device)
    got = kattn.paged_decode(q, k_cache, v_cache, table, lens, SCALE, num_splits=num_splits)
    expected = ref.paged_decode(q, k_cache, v_cache, table, lens, SCALE)
    check(f"paged_decode bs={block_size} B={len(context_lens)} max_ctx={max(context_lens)} "
          f"splits={splits} {str(dtype)[6:]}{label}", got, expected, dtype, num_splits=splits)


@guarded
def check_decode_cuda_graph(block_size):
    """Capture paged_decode once, then replay with new lengths and block tables in the same buffers."""
    batch, max_ctx = 32, 2048
    k_cache, v_cache, table = paged_cache([max_ctx] * batch, block_size, torch.bfloat16, seed=5)
    q = torch.randn(batch, H, D, device=DEV).to(torch.bfloat16)
    lens = torch.full((batch,), max_ctx, dtype=torch.int32, device=DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tb.paged_decode(q, k_cache, v_cache, table, lens, SCALE)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tb.paged_decode(q, k_cache, v_cache, table, lens, SCALE)
    new_lens = torch.randint(1, max_ctx + 1, (batch,), device=DEV, dtype=torch.int32)
    new_lens[-3:] = 0                                    # padding rows of a graph batch
    lens.copy_(new_lens)
    table.copy_(table[torch.randperm(batch, device=DEV)])
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    live = slice(0, batch - 3)
    expected = ref.paged_decode(q[live], k_cache, v_cache, table[live], lens[live], SCALE)
    ok_pad = bool(torch.isfinite(out[batch - 3:]).all())
    check(f"paged_decode in CUDA graph, replayed bs={block_size} B={batch}", out[live], expected, torch.bfloat16,
          padding_rows_finite=ok_pad)
    if not ok_pad:
        RESULTS["checks"].append(dict(name="decode graph padding rows finite", passed=False))
        log("[FAIL] decode graph padding rows are not finite")


@guarded
def check_prefill(block_size, q_lens, k_lens, dtype=torch.bfloat16):
    k_cache, v_cache, table = paged_cache(k_lens, block_size, dtype, seed=sum(q_lens))
    q = torch.randn(sum(q_lens), H, D, device=DEV).to(dtype)
    args = (q, k_cache, v_cache, table, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), SCALE)
    check(f"paged_prefill bs={block_size} seqs={len(q_lens)} q<={max(q_lens)} k<={max(k_lens)} {str(dtype)[6:]}",
          tb.paged_prefill(*args), ref.paged_prefill(*args), dtype)


@guarded
def check_varlen(lens, dtype=torch.bfloat16):
    qkv = torch.randn(sum(lens), (H + 2 * HKV) * D, device=DEV).to(dtype)
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(-1, H, D), k.view(-1, HKV, D), v.view(-1, HKV, D)
    c = cu(lens)
    args = (q, k, v, c, c, max(lens), max(lens), SCALE)
    expected = ref.varlen_prefill(*args)
    check(f"varlen_prefill[triton kernel] seqs={len(lens)} max={max(lens)} {str(dtype)[6:]}",
          kattn.varlen_prefill(*args), expected, dtype)
    torch_out = tb._torch_varlen_prefill(*args)
    RESULTS.setdefault("varlen_prefill_uses_torch_flash", {})[str(dtype)] = torch_out is not None
    if torch_out is not None:
        check(f"varlen_prefill[torch varlen_attn] seqs={len(lens)} max={max(lens)} {str(dtype)[6:]}",
              torch_out, expected, dtype)
    else:
        log(f"  (torch varlen_attn not used for {dtype}: backend falls back to the Triton kernel)")


# ------------------------------------------------------------------------------------------- timings

def record(kind, name, us, nbytes=None, flops=None, **info):
    rec = dict(kind=kind, name=name, us=us, **info)
    line = f"  {name:64s} {us:9.1f} µs"
    if nbytes is not None:
        rec["bytes"] = nbytes
        rec["GBps"] = nbytes / (us * 1e-6) / 1e9
        line += f"  {rec['GBps']:7.0f} GB/s"
    if flops is not None:
        rec["TFLOPs"] = flops / (us * 1e-6) / 1e12
        line += f"  {rec['TFLOPs']:6.1f} TFLOP/s"
    RESULTS["timings"].append(rec)
    log(line)


@guarded
def time_decode(batch, ctx, block_size=256, block_n=None, with_ref=False, num_splits=None):
    dtype = torch.bfloat16
    k_cache, v_cache, table = paged_cache([ctx] * batch, block_size, dtype, pad_blocks=0, seed=batch)
    q = torch.randn(batch, H, D, device=DEV).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    nbytes = batch * ctx * HKV * D * 2 * 2 + 2 * q.numel() * 2
    splits = num_splits or kattn.decode_num_splits(batch, HKV, table.shape[1] * block_size, q.device)
    tag = f"paged_decode B={batch:3d} ctx={ctx:4d} bs={block_size:3d} splits={splits:2d}"
    if block_n:
        tag += f" block_n={block_n}"
    if num_splits:
        tag += " (forced)"

    def fn():
        kattn.paged_decode(q, k_cache, v_cache, table, lens, SCALE, block_n=block_n, num_splits=num_splits)
    info = dict(batch=batch, ctx=ctx, block_size=block_size, num_splits=splits, block_n=block_n or 64,
                heuristic=num_splits is None and block_n is None)
    record("decode", tag + " [graph]", time_graph(fn), nbytes, mode="graph", **info)
    if block_n is None and num_splits is None:
        record("decode", tag + " [eager]", time_eager(fn), nbytes, mode="eager", **info)
    if with_ref:
        record("decode_ref", f"torch_backend.paged_decode B={batch} ctx={ctx}",
               time_eager(lambda: ref.paged_decode(q, k_cache, v_cache, table, lens, SCALE), iters=5, warmup=1),
               nbytes, batch=batch, ctx=ctx)
    fa = getattr(__import__("torch.nn.attention.varlen", fromlist=["varlen_attn"]), "varlen_attn", None)
    if with_ref and fa is not None and block_size % 256 == 0:
        try:                                              # FlashAttention-2 paged decode, as a yardstick
            cu_q = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
            q1 = q.contiguous()

            import inspect
            params = inspect.signature(fa).parameters
            if "block_table" not in params:
                raise TypeError("this torch's varlen_attn has no block_table (paged KV) argument")
            extra = {"enable_gqa": True} if "enable_gqa" in params else {}

            def fa_fn():
                return fa(q1, k_cache, v_cache, cu_q, None, 1, ctx, scale=SCALE, seqused_k=lens,
                          block_table=table, **extra)
            torch.testing.assert_close(fa_fn().float(), kattn.paged_decode(q, k_cache, v_cache, table, lens,
                                                                           SCALE).float(), atol=2e-2, rtol=2e-2)
            record("decode_flash", f"torch varlen_attn(block_table) B={batch} ctx={ctx}", time_graph(fa_fn),
                   nbytes, batch=batch, ctx=ctx)
        except Exception as e:  # noqa: BLE001  (a yardstick only: older torch has no paged varlen_attn)
            log(f"  (flash paged decode yardstick unavailable: {type(e).__name__}: {str(e)[:120]})")


@guarded
def time_prefill(num_seqs=8, seq_len=1024):
    dtype = torch.bfloat16
    lens = [seq_len] * num_seqs
    tokens = sum(lens)
    qkv = torch.randn(tokens, (H + 2 * HKV) * D, device=DEV).to(dtype)
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(-1, H, D), k.view(-1, HKV, D), v.view(-1, HKV, D)
    c = cu(lens)
    flops = num_seqs * 2 * 2 * H * D * seq_len * (seq_len + 1) / 2      # QK^T and PV, causal half
    nbytes = tokens * (2 * H + 2 * HKV) * D * 2                           # q, out, k, v once each
    info = dict(num_seqs=num_seqs, seq_len=seq_len)
    record("prefill", f"varlen_prefill[triton] {num_seqs}x{seq_len}",
           time_eager(lambda: kattn.varlen_prefill(q, k, v, c, c, seq_len, seq_len, SCALE)), nbytes, flops, **info)
    if tb._torch_varlen_prefill(q, k, v, c, c, seq_len, seq_len, SCALE) is not None:
        record("prefill", f"varlen_prefill[torch flash] {num_seqs}x{seq_len}",
               time_eager(lambda: tb._torch_varlen_prefill(q, k, v, c, c, seq_len, seq_len, SCALE)),
               nbytes, flops, **info)
    for block_size in (256, 16):
        k_cache, v_cache, table = paged_cache(lens, block_size, dtype, pad_blocks=0, seed=block_size)
        record("prefill", f"paged_prefill[triton] {num_seqs}x{seq_len} bs={block_size}",
               time_eager(lambda: kattn.paged_prefill(q, k_cache, v_cache, table, c, c, seq_len, seq_len, SCALE)),
               nbytes, flops, block_size=block_size, **info)
    # Chunked prefill / prefix hit: 8 x 256 new tokens after a 3840-token cached prefix.
    q_lens, k_lens = [256] * num_seqs, [4096] * num_seqs
    k_cache, v_cache, table = paged_cache(k_lens, 256, dtype, pad_blocks=0, seed=9)
    q2 = torch.randn(sum(q_lens), H, D, device=DEV).to(dtype)
    cq, ck = cu(q_lens), cu(k_lens)
    flops2 = num_seqs * 2 * 2 * H * D * 256 * (4096 - 128)
    nbytes2 = num_seqs * (4096 * HKV * D * 2 + 256 * H * D * 2) * 2
    record("prefill", f"paged_prefill[triton] {num_seqs}x256 new after 3840 cached bs=256",
           time_eager(lambda: kattn.paged_prefill(q2, k_cache, v_cache, table, cq, ck, 256, 4096, SCALE)),
           nbytes2, flops2, block_size=256, num_seqs=num_seqs, q_len=256, k_len=4096)


@guarded
def time_store(num_tokens=8192, block_size=256):
    dtype = torch.bfloat16
    qkv = torch.randn(num_tokens, (H + 2 * HKV) * D, device=DEV).to(dtype)
    _, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    k, v = k.view(-1, HKV, D), v.view(-1, HKV, D)
    num_blocks = triton.cdiv(num_tokens, block_size) + 8
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:num_tokens].to(torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, HKV, D, dtype=dtype, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    nbytes = num_tokens * HKV * D * 2 * 2 * 2                              # read + write, K and V
    record("store", f"store_kvcache N={num_tokens}",
           time_eager(lambda: store_kvcache(k, v, k_cache, v_cache, slots)), nbytes, num_tokens=num_tokens)
    record("store", f"store_kvcache_torch N={num_tokens}",
           time_eager(lambda: store_kvcache_torch(k, v, k_cache, v_cache, slots)), nbytes, num_tokens=num_tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="path of the JSON report")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_kernels.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    RESULTS["env"] = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                          triton=triton.__version__, python=platform.python_version(),
                          model_shape=dict(num_heads=H, num_kv_heads=HKV, head_dim=D, dtype="bfloat16"))
    log(f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}")
    t0 = time.time()
    torch.manual_seed(0)
    try:
        log("== correctness ==")
        for bs in (256, 16):
            check_store(bs)
        gen = torch.Generator().manual_seed(0)
        mixed = torch.randint(1, 4097, (64,), generator=gen).tolist()
        mixed[:4] = [1, 17, 255, 257]
        for bs in (256, 16):
            check_decode(bs, [4096])                                  # batch 1: many splits
            check_decode(bs, [4096, 3000, 1, 77], num_splits=1, label=" (forced 1 split)")
            check_decode(bs, mixed)
            check_decode(bs, torch.randint(1, 513, (256,), generator=gen).tolist())
            check_decode_cuda_graph(bs)
            check_prefill(bs, [1024, 1, 17, 700, 333], [1024, 1, 17, 700, 333])             # no prefix
            check_prefill(bs, [256, 5, 100, 1], [3000, 261, 612, 4096])                    # prefix / chunks
        check_varlen([1024] * 4 + [1, 17, 333])
        check_decode(16, [100, 33, 1], dtype=torch.float32)
        check_decode(256, [700, 1], dtype=torch.float32, num_splits=3)
        check_prefill(16, [40, 5], [40, 90], dtype=torch.float32)
        check_varlen([40, 17], dtype=torch.float32)
        RESULTS["check_seconds"] = time.time() - t0
        if not args.skip_timing:
            log("== timing (bf16, Qwen3-0.6B attention shapes, one layer) ==")
            time_store()
            for batch in (1, 64, 256):
                for ctx in (512, 4096):
                    time_decode(batch, ctx, with_ref=(batch == 64))
            for batch, ctx in ((1, 4096), (64, 4096)):
                time_decode(batch, ctx, block_size=16)                 # per-token gather, BLOCK_N 64
                time_decode(batch, ctx, block_size=16, block_n=16)     # one block per tile, BLOCK_N 16
                for bn in (32, 128):
                    time_decode(batch, ctx, block_n=bn)
            log("-- split-count sweep (the heuristic's choice is the un-forced line above) --")
            for batch, ctx, sweep in ((1, 512, (1, 2, 8)), (1, 4096, (8, 16, 64)), (64, 4096, (2, 4)),
                                      (256, 4096, (2,))):
                for splits in sweep:
                    time_decode(batch, ctx, num_splits=splits)
            time_prefill()
    finally:
        failed = [c["name"] for c in RESULTS["checks"] if not c.get("passed")]
        RESULTS["failed"] = failed + [e["group"] for e in RESULTS["errors"]]
        RESULTS["passed"] = not RESULTS["failed"]
        RESULTS["seconds"] = time.time() - t0
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(RESULTS, indent=1))
        log(f"== {'ALL PASSED' if RESULTS['passed'] else 'FAILED: ' + ', '.join(RESULTS['failed'])} "
            f"({RESULTS['seconds']:.0f} s) -> {args.out}")
    sys.exit(0 if RESULTS["passed"] else 1)


if __name__ == "__main__":
    main()
