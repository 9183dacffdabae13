#!/usr/bin/env python3
"""Time the decode step's fused Triton kernels against today's path, on one GPU (written for an H200).

    python3 bench/kernels_round3.py --out results.json              # the GPU run, < 120 s
    python3 bench/kernels_round3.py --dry-run --out /tmp/dry.json   # CPU: Triton interpreter, tiny shapes
    python3 bench/kernels_round3.py --compile-check --out /tmp/cc.json   # CPU or GPU: compile for sm_90 only

Shapes are Qwen3-0.6B's (hidden 1024, 16 query / 8 KV heads of 128, intermediate 3072), bf16, at decode
batch sizes M = 1, 4, 16, 64, 256. Sections, most wanted first (each case is guarded: an error is recorded
and the run goes on; a case that would start after the time budget is listed as skipped):
1. layer (M = 1 and 16): whole decoder layers of a decode step (context 512, 256-token blocks) replayed from a
   CUDA graph, old route (fuse=True, no kernels: cuBLAS + Inductor-compiled norms/RoPE/SiLU + Triton
   store and attention) against the fused route (all kernels). Models of 1 and 3 layers: per layer =
   (t3 - t1) / 2, and kernels per layer from a torch.profiler trace of one eager forward, counted the same
   way (the embedding and the final norm cancel out). Max abs error and relative norm of the hidden states,
   new vs old.
2. gemm: each projection (qkv, o_proj, gate_up, down) as today (cuBLAS `F.linear`; gate_up followed by the
   Inductor-compiled SiLU-and-mul) and with kernels/small_gemm.py's default config (full K, split-K
   partials, SiLU epilogue). Weights rotate over enough copies (>= 256 MB) that the 50 MB L2 cannot hold
   them, as in a real step. Each row: µs per call replayed from a CUDA graph, bytes moved (weights + input
   + output), GB/s and % of 4.2 TB/s, max abs error against an fp32 torch product. M = 256 has cuBLAS rows
   only (the kernels serve M <= 64). Also the LM head's shape (vocab x hidden), which the engine leaves to
   cuBLAS, to see whether routing it would pay.
3. elementwise: add + RMSNorm (today: Inductor-compiled add_rms_norm on the GEMM's bf16 output; new:
   kernels/rms_norm.py summing o_proj's split-K partials) and q/k-norm + RoPE + KV store (today: the
   compiled qk_norm_rope + the Triton store; new: kernels/qk_norm_rope_store.py), with max abs errors.
4. layer at M = 4, 64, 256, then with PDL (layers at M = 1 and 16, GEMMs at M = 1 and 16) when the device
   and Triton support it.
5. gemm_sweep: a few other GemmConfigs per projection at M = 1 and 16, to choose choose_config's table.
6. compile_check (only this with --compile-check, which needs no GPU; on a GPU run too if time is left):
   every default kernel variant compiled for sm_90 by triton.compile, with registers, spills and shared
   memory (cuobjdump) and whether PDL's griddepcontrol made it into the PTX.
The JSON (--out) is rewritten after every case, so a run cut short keeps what it measured; a watchdog
ends the process 12 s after the budget (--budget, default 95 s) with the record marked.

Only nanovllm_ref's models, layers, kernels and attention modules are imported (its __init__, which pulls
in the whole engine, is bypassed), so this runs where only torch and triton are installed.
"""
import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_TBPS = 4.2                 # H200 copy bandwidth, measured 4.22-4.27 TB/s (shared/README.md)
QWEN3 = dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, inter=3072, vocab=151936, eps=1e-6, theta=1e6)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=256, eps=1e-6, theta=1e4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, tiny shapes, no timings")
    p.add_argument("--compile-check", action="store_true", help="only compile every kernel variant for sm_90")
    p.add_argument("--budget", type=float, default=95.0, help="seconds before no new case starts")
    p.add_argument("--no-sweep", action="store_true", help="skip the GemmConfig sweep")
    p.add_argument("--compile-dtypes", default="bf16,fp32", help="dtypes of the compile check (comma-separated)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # Interpreter or compiler is fixed when the kernels are defined, so before importing them.
    if ARGS.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # silences a Triton >= 3.9 notice; 3.6's default
_pkg = types.ModuleType("nanovllm_ref")           # bypass nanovllm_ref/__init__.py (imports the engine)
_pkg.__path__ = [str(ROOT / "nanovllm_ref")]
sys.modules.setdefault("nanovllm_ref", _pkg)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402


class Record:
    """The JSON record, saved after every change (atomically: a partial run still leaves valid JSON)."""

    def __init__(self, path: str, meta: dict):
        self.path, self.start = path, time.monotonic()
        self.data = {"meta": meta, "gemm": [], "elementwise": [], "layer": [], "layer_summary": [],
                     "gemm_sweep": [], "compile_check": [], "errors": [], "skipped": []}
        self.lock = threading.Lock()
        self.save()

    def add(self, section: str, row: dict) -> None:
        with self.lock:
            self.data[section].append(row)
        self.save()

    def save(self) -> None:
        with self.lock:
            self.data["meta"]["elapsed_s"] = round(time.monotonic() - self.start, 2)
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(tmp, self.path)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def log(msg: str) -> None:
    print(msg, flush=True)


def guarded(rec: Record, budget: Budget, name: str, fn, min_left: float = 3.0):
    """Run one case: skipped when the budget is spent, its exception recorded (the run goes on)."""
    if budget.left() < min_left:
        rec.add("skipped", {"case": name, "why": f"time budget ({budget.left():.1f} s left)"})
        return None
    try:
        return fn()
    except Exception as exc:                                  # noqa: BLE001 (a bench records and goes on)
        rec.add("errors", {"case": name, "error": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc()[-3000:]})
        log(f"  ERROR {name}: {type(exc).__name__}: {exc}")
        return None


# ------------------------------------------------------------------------------------------- timing

def time_us(fns, device, reps: int = 20, iters: int = 7):
    """(median, min, max) µs per call of `fns` called in turn. CUDA: `reps` calls captured in one graph,
    replayed `iters` times (the engine replays its step from a graph). CPU (dry run): wall time of one
    pass, a smoke value only."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for f in fns:
            f()
        us = (time.perf_counter() - t0) * 1e6 / len(fns)
        return us, us, us
    for f in fns:                                  # compile, allocate, autotune-free warm-up outside the graph
        f()
    torch.cuda.synchronize()
    reps = max(reps, len(fns))                     # every weight copy once per replay: L2 cannot keep them
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / reps)
    del graph
    return statistics.median(times), min(times), max(times)


def bandwidth(nbytes: int, us: float) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9 if us > 0 else 0.0
    return {"bytes": int(nbytes), "gbps": round(gbps, 1), "pct_of_peak": round(100 * gbps / (PEAK_TBPS * 1000), 1)}


def copies_for(nbytes: int, device) -> int:
    """Distinct weight copies to rotate over so that they do not fit in L2 (>= 256 MB in all)."""
    if device.type != "cuda":
        return 1
    return max(1, min(64, math.ceil(256e6 / nbytes)))


def max_err(got, ref) -> float:
    return float((got.float() - ref.float()).abs().max())


# ------------------------------------------------------------------------------------------- 1. GEMMs

def gemm_shapes(s: dict) -> dict:
    q = (s["heads"] + 2 * s["kv_heads"]) * s["head_dim"]
    return {"qkv": (q, s["hidden"], "full"), "o_proj": (s["hidden"], s["heads"] * s["head_dim"], "partials"),
            "gate_up": (2 * s["inter"], s["hidden"], "silu"), "down": (s["hidden"], s["inter"], "partials")}


def gemm_case(rec, op, m, n, k, kind, device, dtype, config=None, use_pdl=False, section="gemm", old=True):
    from nanovllm_ref.kernels import small_gemm
    from nanovllm_ref.layers.activation import silu_and_mul
    g = torch.Generator(device=device).manual_seed(m * 7 + n)
    wbytes = n * k * dtype.itemsize
    ws = [(torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype) for _ in range(copies_for(wbytes, device))]
    x = torch.randn(m, k, device=device, generator=g).to(dtype)
    exact = F.linear(x.float(), ws[0].float())
    rows = []
    if old:
        silu = silu_and_mul.compiled() if device.type == "cuda" else silu_and_mul
        old_fn = (lambda w: silu(F.linear(x, w))) if kind == "silu" else (lambda w: F.linear(x, w))
        us = time_us([lambda w=w: old_fn(w) for w in ws], device)
        out_bytes = m * (n // 2 if kind == "silu" else n) * dtype.itemsize
        rows.append({"op": op, "m": m, "n": n, "k": k, "path": "cublas" + ("+inductor_silu" if kind == "silu" else ""),
                     "us": round(us[0], 2), "us_min": round(us[1], 2), "us_max": round(us[2], 2),
                     **bandwidth(wbytes + m * k * dtype.itemsize + out_bytes, us[0])})
    if m <= small_gemm.MAX_M:
        cfg = config or small_gemm.choose_config(m, n, k, kind, small_gemm.num_sms(device))
        fn = {"full": small_gemm.linear, "partials": small_gemm.linear_partials, "silu": small_gemm.linear_silu_mul}[kind]
        out = fn(x, ws[0], config=cfg, use_pdl=use_pdl)
        if kind == "partials":
            err, out_bytes = max_err(out.sum(0), exact), out.numel() * 4
        elif kind == "silu":
            err, out_bytes = max_err(out, silu_and_mul(exact.to(dtype))), out.numel() * dtype.itemsize
        else:
            err, out_bytes = max_err(out, exact), out.numel() * dtype.itemsize
        us = time_us([lambda w=w: fn(x, w, config=cfg, use_pdl=use_pdl) for w in ws], device)
        rows.append({"op": op, "m": m, "n": n, "k": k, "path": "triton" + ("+pdl" if use_pdl else ""),
                     "kind": kind, "config": dataclasses.asdict(cfg), "splits": cfg.num_splits(k) if kind == "partials" else 1,
                     "us": round(us[0], 2), "us_min": round(us[1], 2), "us_max": round(us[2], 2), "max_abs_err": err,
                     **bandwidth(wbytes + m * k * dtype.itemsize + out_bytes, us[0])})
    for row in rows:
        rec.add(section, row)
        log(f"  {section} {op:8s} M={m:<3d} {row['path']:22s} {row['us']:8.2f} us  {row['pct_of_peak']:5.1f} % "
            f"{'err %.2e' % row['max_abs_err'] if 'max_abs_err' in row else ''}")
    return rows


def sweep_configs(m: int, kind: str):
    """A few alternatives to choose_config's pick, per formulation (GEMV at M <= 4, tl.dot above)."""
    from nanovllm_ref.kernels.small_gemm import GemmConfig
    bm = triton.next_power_of_2(m)
    if m <= 4:
        if kind == "partials":
            return [GemmConfig(bm, 16, 512, split_k=2), GemmConfig(bm, 32, 256, split_k=8),
                    GemmConfig(bm, 8, 512, split_k=4, num_warps=2)]
        return [GemmConfig(bm, 8, 1024), GemmConfig(bm, 32, 256, num_warps=8), GemmConfig(bm, 16, 256)]
    bm = max(16, bm)
    if kind == "partials":
        return [GemmConfig(bm, 32, 128, split_k=8, use_dot=True, num_stages=4),
                GemmConfig(bm, 16, 256, split_k=4, use_dot=True, num_stages=3),
                GemmConfig(bm, 64, 64, split_k=16, use_dot=True, num_stages=4)]
    return [GemmConfig(bm, 32, 128, use_dot=True, num_stages=4), GemmConfig(bm, 16, 256, use_dot=True, num_stages=3),
            GemmConfig(bm, 64, 64, use_dot=True, num_stages=5)]


# ------------------------------------------------------------------------------------------- 2. element-wise

def add_rms_norm_case(rec, m, s, device, dtype, use_pdl=False):
    from nanovllm_ref.kernels import rms_norm as k1, small_gemm
    from nanovllm_ref.layers.layernorm import add_rms_norm
    g = torch.Generator(device=device).manual_seed(m)
    d, k = s["hidden"], s["heads"] * s["head_dim"]
    splits = small_gemm.choose_config(m, d, k, "partials", small_gemm.num_sms(device)).num_splits(k) if m <= 64 else 1
    partials = torch.randn(splits, m, d, device=device, generator=g)
    y = partials.sum(0).to(dtype)                                     # what cuBLAS would have written
    residual = torch.randn(m, d, device=device, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(d, device=device, generator=g)).to(dtype)
    ref = add_rms_norm(y, residual, w, s["eps"])
    old_fn = add_rms_norm.compiled() if device.type == "cuda" else add_rms_norm
    new_out = k1.add_rms_norm(partials, residual, w, s["eps"], use_pdl=use_pdl)
    old_us = time_us([lambda: old_fn(y, residual, w, s["eps"])], device)
    new_us = time_us([lambda: k1.add_rms_norm(partials, residual, w, s["eps"], use_pdl=use_pdl)], device)
    row = {"op": "add_rms_norm", "m": m, "splits_summed": splits, "pdl": use_pdl,
           "old_path": "inductor add_rms_norm on the GEMM's bf16 output", "old_us": round(old_us[0], 2),
           "new_us": round(new_us[0], 2), "max_abs_err_out": max_err(new_out[0], ref[0]),
           "max_abs_err_residual": max_err(new_out[1], ref[1]),
           "new_bytes": partials.numel() * 4 + 3 * m * d * dtype.itemsize}
    rec.add("elementwise", row)
    log(f"  add_rms_norm M={m:<3d} old {row['old_us']:7.2f} us  new {row['new_us']:7.2f} us  err {row['max_abs_err_out']:.2e}")


def qk_inputs(m, s, device, dtype, seed):
    """(rope, qkv [m, (H + 2 Hkv) d], positions [m], slots [m] int32 (shuffled, distinct), q/k norm weights, four
    zeroed caches [blocks, 256, Hkv, d]) for the q/k norm + RoPE + store benchmarks."""
    from nanovllm_ref.layers.rotary_embedding import RotaryEmbedding
    g = torch.Generator(device=device).manual_seed(seed)
    h, hkv, d = s["heads"], s["kv_heads"], s["head_dim"]
    rope = RotaryEmbedding(d, 4096, s["theta"]).to(device)
    qkv = torch.randn(m, (h + 2 * hkv) * d, device=device, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (m,), device=device, generator=g)
    block_size = 256
    num_blocks = triton.cdiv(m, block_size) + 1
    slots = torch.randperm(num_blocks * block_size, device=device, generator=g)[:m].to(torch.int32)
    qw, kw = [(1 + 0.1 * torch.randn(d, device=device, generator=g)).to(dtype) for _ in range(2)]
    caches = [torch.zeros(num_blocks, block_size, hkv, d, device=device, dtype=dtype) for _ in range(4)]
    return rope, qkv, positions, slots, qw, kw, caches


def qk_case(rec, m, s, device, dtype, use_pdl=False):
    from nanovllm_ref.kernels import qk_norm_rope_store as k2
    from nanovllm_ref.kernels.store_kvcache import store_kvcache
    from nanovllm_ref.models.qwen3 import qk_norm_rope
    h, hkv, d = s["heads"], s["kv_heads"], s["head_dim"]
    rope, qkv, positions, slots, qw, kw, caches = qk_inputs(m, s, device, dtype, m + 1)
    fused_qk = qk_norm_rope.compiled() if device.type == "cuda" else qk_norm_rope

    def old():
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q, k = fused_qk(positions, q.reshape(m, h, d), k.reshape(m, hkv, d), qw, kw, s["eps"], rope.cos_sin_cache)
        store_kvcache(k, v.reshape(m, hkv, d), caches[0], caches[1], slots)
        return q

    def new():
        return k2.qk_norm_rope_store(qkv, positions, rope.cos_sin_cache, qw, kw, s["eps"], caches[2], caches[3],
                                     slots, h, hkv, d, use_pdl=use_pdl)
    q_old, q_new = old(), new()
    errs = {"max_abs_err_q": max_err(q_new, q_old), "max_abs_err_k_cache": max_err(caches[2], caches[0]),
            "max_abs_err_v_cache": max_err(caches[3], caches[1])}
    old_us, new_us = time_us([old], device), time_us([new], device)
    row = {"op": "qk_norm_rope_store", "m": m, "pdl": use_pdl,
           "old_path": "inductor qk_norm_rope + Triton store_kvcache", "old_us": round(old_us[0], 2),
           "new_us": round(new_us[0], 2), **errs}
    rec.add("elementwise", row)
    log(f"  qk_norm_rope_store M={m:<3d} old {row['old_us']:7.2f} us  new {row['new_us']:7.2f} us  "
        f"err q {errs['max_abs_err_q']:.2e} k {errs['max_abs_err_k_cache']:.2e}")


# ------------------------------------------------------------------------------------------- 3. layers

def model_config(s: dict, layers: int):
    return types.SimpleNamespace(
        vocab_size=min(s["vocab"], 8192), hidden_size=s["hidden"], intermediate_size=s["inter"],
        num_hidden_layers=layers, num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], max_position_embeddings=4096, rms_norm_eps=s["eps"], rope_theta=s["theta"],
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu",
        architectures=["Qwen3ForCausalLM"])


def build_layers(s, layers, kernels, device, dtype, fuse: bool):
    from nanovllm_ref.attn import FunctionBackend, get_backend
    from nanovllm_ref.parts import Parts
    from nanovllm_ref.kernels.store_kvcache import store_kvcache
    from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM
    backend = get_backend("triton")
    if kernels.pdl:        # as the engine does (Parts.resolve): the decode attention launched with PDL too
        backend = FunctionBackend(backend.varlen_prefill, backend.paged_prefill, backend.paged_decode_pdl)
    ops = Parts().model_ops(fuse=fuse, kernels=kernels, attention_backend=backend, store_kvcache=store_kvcache)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(model_config(s, layers), ops=ops)
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device=device).manual_seed(layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, device=device, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, device=device, generator=g))
    return model.eval()


def decode_inputs(s, m, layers_modules, device, dtype, context=512, block_size=256, table_width=16):
    """One decode step of m sequences at `context` tokens each: ids, positions, metadata; random caches."""
    from nanovllm_ref.utils.context import AttentionMetadata
    g = torch.Generator(device=device).manual_seed(m)
    per_seq = triton.cdiv(context + 1, block_size)
    num_blocks = m * per_seq + 1
    for a in layers_modules:
        a.k_cache = torch.randn(num_blocks, block_size, a.num_kv_heads, a.head_dim, device=device, generator=g).to(dtype)
        a.v_cache = torch.randn(num_blocks, block_size, a.num_kv_heads, a.head_dim, device=device, generator=g).to(dtype)
    table = torch.full((m, table_width), -1, dtype=torch.int32, device=device)
    table[:, :per_seq] = torch.arange(m * per_seq, dtype=torch.int32, device=device).view(m, per_seq)
    slots = (table[:, context // block_size].long() * block_size + context % block_size).to(torch.int32)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots,
                             context_lens=torch.full((m,), context + 1, dtype=torch.int32, device=device),
                             block_tables=table)
    ids = torch.randint(0, min(s["vocab"], 8192), (m,), device=device, generator=g)
    positions = torch.full((m,), context, dtype=torch.long, device=device)
    return ids, positions, meta


def count_kernels(fn, device) -> int | None:
    """CUDA kernels launched by one call of fn (torch.profiler; memcpy/memset not counted). None on a CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    names = [e.name for e in prof.events() if e.device_type == cuda]
    if not names:                       # older layouts keep device events only in the raw kineto results
        names = [e.name() for e in prof.profiler.kineto_results.events() if e.device_type() == cuda]
    return sum(1 for n in names if not n.lower().startswith(("memcpy", "memset")))


def layer_case(rec, m, variant, kernels, s, device, dtype, reference_out: dict, depths=(1, 3)):
    """Decode steps of models `depths` layers deep; per layer = the difference / (depth difference)."""
    from nanovllm_ref.layers.attention import Attention
    from nanovllm_ref.utils.context import attention_metadata
    per = {}
    low, high = depths
    for layers in depths:
        model = build_layers(s, layers, kernels, device, dtype, fuse=device.type == "cuda")
        attn = [mod for mod in model.modules() if isinstance(mod, Attention)]
        ids, positions, meta = decode_inputs(s, m, attn, device, dtype)

        def step():
            with attention_metadata(meta), torch.inference_mode():
                return model(ids, positions)
        out = step()
        route = "fused" if kernels.any() and m <= kernels.max_m else "general"   # the small GEMM serves m rows
        us = time_us([step], device, reps=1, iters=15)
        per[layers] = dict(us=us[0], kernels=count_kernels(step, device), out=out.float())
        del model, attn
    span = high - low
    row = {"m": m, "variant": variant, "route": route, "kernels_on": kernels.enabled(), "pdl": kernels.pdl,
           "depths": list(depths),
           "us_step_low": round(per[low]["us"], 2), "us_step_high": round(per[high]["us"], 2),
           "us_per_layer": round((per[high]["us"] - per[low]["us"]) / span, 2),
           "kernels_step_low": per[low]["kernels"], "kernels_step_high": per[high]["kernels"],
           "kernels_per_layer": None if per[low]["kernels"] is None
           else (per[high]["kernels"] - per[low]["kernels"]) / span}
    if variant == "old":
        reference_out[m] = per[high]["out"]
    elif m in reference_out:
        ref = reference_out[m]
        row["max_abs_err_vs_old"] = float((per[high]["out"] - ref).abs().max())
        row["rel_norm_err_vs_old"] = float((per[high]["out"] - ref).norm() / ref.norm())
    rec.add("layer", row)
    log(f"  layer M={m:<3d} {variant:8s} {row['us_per_layer']:8.2f} us/layer  kernels/layer {row['kernels_per_layer']}")
    return row


# ------------------------------------------------------------------------------------------- 5. compile check

def compile_variants(s: dict, dtypes=("bf16", "fp32")):
    """(name, kernel, signature, constexprs, options) of every kernel variant the fused route uses in `dtypes`,
    for the Qwen3-0.6B shapes at one batch size per GEMM variant (small_gemm.warm_batch_sizes), plus PDL builds."""
    from nanovllm_ref.kernels import qk_norm_rope_store as k2, rms_norm as k1, small_gemm as k3
    out = []
    for dt in dtypes:
        sig = dict(x_ptr="*fp32", residual_ptr=f"*{dt}", weight_ptr=f"*{dt}", out_ptr=f"*{dt}", h_ptr=f"*{dt}",
                   num_parts="i32", stride_xs="i32", stride_xt="i32", stride_rt="i32", stride_ot="i32",
                   stride_ht="i32", D="i32", eps="fp32")
        # early: the one-row decode form, which lets the kernel behind launch at its start (round 13)
        for partials, pdl, early in ((True, False, False), (True, True, False), (True, True, True)):
            out.append((f"add_rms_norm {dt} partials pdl={pdl} early={early}", k1._add_rms_norm_kernel, sig,
                        dict(BLOCK_D=triton.next_power_of_2(s["hidden"]), PARTIALS=partials, HAS_RESIDUAL=True,
                             STORE_H=True, EMULATE_ROUNDING=False, USE_PDL=pdl, LAUNCH_EARLY=early),
                        dict(num_warps=4)))
        out.append((f"rms_norm {dt} plain", k1._add_rms_norm_kernel, {**sig, "x_ptr": f"*{dt}"},
                    dict(BLOCK_D=triton.next_power_of_2(s["hidden"]), PARTIALS=False, HAS_RESIDUAL=False,
                         STORE_H=False, EMULATE_ROUNDING=False, USE_PDL=False, LAUNCH_EARLY=False),
                    dict(num_warps=4)))
        sig2 = dict(qkv_ptr=f"*{dt}", positions_ptr="*i64", cos_sin_ptr="*fp32", q_weight_ptr=f"*{dt}",
                    k_weight_ptr=f"*{dt}", slot_mapping_ptr="*i32", k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}",
                    q_out_ptr=f"*{dt}", num_parts="i32", stride_ps="i32", stride_t="i32", stride_cs="i32",
                    stride_qt="i32", stride_qh="i32", eps="fp32")
        block_half = triton.next_power_of_2(s["head_dim"] // 2)
        block_r = min(k2.BLOCK_ROWS, triton.next_power_of_2(s["heads"] + 2 * s["kv_heads"]))
        # to_cache False: the prefill form (qk_norm_rope), which writes k to a [T, Hkv, d] output.
        for qk, pdl, to_cache, early in ((True, False, True, False), (False, False, True, False),
                                         (True, True, True, False), (True, True, True, True), (True, False, False, False)):
            out.append((f"qk_norm_rope_store {dt} qk_norm={qk} pdl={pdl} to_cache={to_cache} early={early}",
                        k2._qk_norm_rope_store_kernel, sig2,
                        dict(NUM_HEADS=s["heads"], NUM_KV_HEADS=s["kv_heads"], HEAD_DIM=s["head_dim"],
                             HALF=s["head_dim"] // 2, BLOCK_HALF=block_half, BLOCK_R=block_r,
                             QK_NORM=qk, PARTIALS=False, EMULATE_ROUNDING=False, USE_PDL=pdl, TO_CACHE=to_cache,
                             LAUNCH_EARLY=early),
                        dict(num_warps=max(1, min(4, block_r * block_half // 256)))))
        sig3 = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", bias_ptr=f"*{dt}", out_ptr=f"*{dt}", M="i32", N="i32", K="i32",
                    stride_xm="i32", stride_wn="i32", stride_os="i32", stride_om="i32", k_per_split="i32",
                    up_offset="i32", up_rows="i32")
        for m in k3.warm_batch_sizes(k3.MAX_M):
            for op, (n, k, kind) in gemm_shapes(s).items():
                cfg = k3.choose_config(m, n, k, kind)
                pdl = m == 1 and dt == "bf16"
                out.append((f"gemm {op} {dt} M={m} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} dot={cfg.use_dot} pdl={pdl}",
                            k3._small_gemm_kernel, {**sig3, "out_ptr": "*fp32"} if kind == "partials" else sig3,
                            dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot,
                                 PARTIALS=kind == "partials", SILU_MUL=kind == "silu", HAS_BIAS=False, CAST_FP32=False,
                                 EMULATE_ROUNDING=False, DOT_PRECISION="ieee" if dt == "fp32" else "tf32", USE_PDL=pdl,
                                 PRELOAD=cfg.preload, LAUNCH_EARLY=cfg.launch_early),
                            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)))
    return out


def resource_usage(cubin: bytes) -> dict:
    """Registers, stack (spills) and shared memory of a cubin, read with Triton's bundled cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, timeout=30).stdout
    finally:
        os.unlink(f.name)
    usage = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        for token in text.replace(",", " ").split():
            if token.startswith(f"{key}:"):
                usage[key.lower()] = int(token.split(":")[1])
    return usage


def compile_check(rec, budget, s, dtypes=("bf16", "fp32")):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32)
    for name, kernel, sig, consts, opts in compile_variants(s, dtypes):
        def one():
            t0 = time.monotonic()
            # What the JIT infers at a real launch for these shapes: pointers 16-byte aligned and every
            # integer a multiple of 16, except the batch size and the split count (not specialised on).
            full = {**sig, **{k: "constexpr" for k in consts}}
            attrs = {(i,): [["tt.divisibility", 16]] for i, (arg, kind) in enumerate(full.items())
                     if kind != "constexpr" and kind != "fp32" and arg not in ("M", "num_parts")}
            src = ASTSource(kernel, full, consts, attrs=attrs)
            compiled = triton.compile(src, target=target, options=opts)
            ptx = compiled.asm.get("ptx", "")
            row = {"variant": name, "compiled": True, "seconds": round(time.monotonic() - t0, 2),
                   "griddepcontrol_in_ptx": "griddepcontrol" in ptx,
                   "dynamic_shared_bytes": getattr(compiled.metadata, "shared", None),
                   **resource_usage(compiled.asm.get("cubin", b""))}
            rec.add("compile_check", row)
            log(f"  compile {name:60s} regs {row.get('reg')} stack {row.get('stack')} pdl {row['griddepcontrol_in_ptx']}")
        guarded(rec, budget, f"compile {name}", one, min_left=1.0)


# ------------------------------------------------------------------------------------------- main

def paged_decode_inputs(lengths: list, context: int, shapes: dict, device, dtype, seed: int):
    """(q [B, H, d], k_cache, v_cache [blocks, block, Hkv, d], block table [B, blocks a sequence] int32, context
    lengths [B] int32) for a decode attention call over `lengths` tokens a sequence, the table wide enough for
    `context`; blocks of 256 tokens (16 on the CPU), shuffled, as a cache that has served a while hands them out."""
    hkv, h, d = shapes["kv_heads"], shapes["heads"], shapes["head_dim"]
    block = 256 if device.type == "cuda" else 16
    batch = len(lengths)
    g = torch.Generator(device=device).manual_seed(seed)
    per_seq = -(-context // block)
    k_cache = torch.randn(batch * per_seq, block, hkv, d, device=device, generator=g).to(dtype)
    v_cache = torch.randn(batch * per_seq, block, hkv, d, device=device, generator=g).to(dtype)
    table = torch.randperm(batch * per_seq, device=device, generator=g).to(torch.int32).view(batch, per_seq)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(batch, h, d, device=device, generator=g).to(dtype)
    return q, k_cache, v_cache, table, lens


@dataclasses.dataclass
class Run:
    """What a round script's main sets up (kernels_round5.py, kernels_round8.py): `start_run`, then `finish`."""
    device: "torch.device"
    shapes: dict
    dtype: "torch.dtype"
    rec: "Record"
    budget: "Budget"
    timer: threading.Timer


def start_run(args, script: str, **meta) -> "Run | None":
    """The device (None without CUDA unless args.dry_run: then a message and the caller returns 2), the shapes
    (TINY for a dry run, else QWEN3), bf16, the record at args.out with its meta (+ `meta`), the budget, and a
    watchdog that saves the record and exits 3 once args.budget + 20 s have passed."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if not args.dry_run and device.type != "cuda":
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return None
    r3_args = parse_args(["--out", args.out] + (["--dry-run"] if args.dry_run else []))
    rec = Record(args.out, {**meta_of(r3_args, device), "script": script, "budget_s": args.budget, **meta})
    timer = threading.Timer(args.budget + 20, lambda: (rec.data["meta"].update(watchdog="fired"), rec.save(),
                                                       os._exit(3)))
    timer.daemon = True
    timer.start()
    return Run(device, TINY if args.dry_run else QWEN3, torch.bfloat16, rec, Budget(args.budget), timer)


def begin(args, script: str, record_keys=(), **meta) -> "Run | None":
    """`start_run`, then what every round script does first: log the device, measure the copy bandwidth into the
    record's meta, and give the record an empty list for each of `record_keys`. None as start_run."""
    run = start_run(args, script, **meta)
    if run is None:
        return None
    log(f"{Path(script).stem}: {run.rec.data['meta']['device']}, torch {torch.__version__}")
    run.rec.data["meta"]["copy_tbps_measured"] = guarded(run.rec, run.budget, "copy bandwidth",
                                                         lambda: measure_copy_tbps(run.device))
    for key in record_keys:
        run.rec.data.setdefault(key, [])
    return run


def finish(run: Run, out: str) -> int:
    """Stop the watchdog, save the record, say how it went; exit status 1 if any case failed."""
    run.timer.cancel()
    run.rec.save()
    rec = run.rec
    log(f"done in {rec.data['meta']['elapsed_s']} s: {len(rec.data['errors'])} errors, "
        f"{len(rec.data['skipped'])} skipped -> {out}")
    return 1 if rec.data["errors"] else 0


def meta_of(args, device) -> dict:
    meta = {"script": "bench/kernels_round3.py", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "dry_run": args.dry_run, "compile_check_only": args.compile_check, "budget_s": args.budget,
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
            "peak_tbps_assumed": PEAK_TBPS,
            "timing": "CUDA graph replay, median of 7 replays; us per call" if device.type == "cuda"
            else "wall time in the Triton interpreter: a smoke value, not a GPU timing"}
    if device.type == "cuda":
        from nanovllm_ref.kernels.numerics import pdl_available
        meta["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
        meta["pdl_available"] = pdl_available(device)
    return meta


def measure_copy_tbps(device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.empty(256 * 2 ** 20, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    us = time_us([lambda: b.copy_(a)], device, reps=5)[0]
    return round(2 * a.numel() * 4 / (us * 1e-6) / 1e12, 3)


def summarise_layers(rec) -> None:
    rows = rec.data["layer"]
    for m in sorted({r["m"] for r in rows}):
        by = {r["variant"]: r for r in rows if r["m"] == m}
        if "old" in by and "new" in by:
            old, new = by["old"], by["new"]
            rec.add("layer_summary", {"m": m, "old_us_per_layer": old["us_per_layer"],
                                      "new_us_per_layer": new["us_per_layer"],
                                      "speedup": round(old["us_per_layer"] / new["us_per_layer"], 3)
                                      if new["us_per_layer"] > 0 else None,
                                      "old_kernels_per_layer": old["kernels_per_layer"],
                                      "new_kernels_per_layer": new["kernels_per_layer"]})


def main(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if not args.dry_run and not args.compile_check and device.type != "cuda":
        print("no CUDA device: use --dry-run (interpreter) or --compile-check", file=sys.stderr)
        return 2
    shapes = TINY if args.dry_run else QWEN3
    ms = [1, 5] if args.dry_run else [1, 4, 16, 64, 256]          # 5: the tl.dot path in the interpreter
    depths = (1, 2) if args.dry_run else (1, 3)
    layer_ms = [1] if args.dry_run else ms
    dtype = torch.bfloat16
    rec = Record(args.out, meta_of(args, device))
    rec.data["meta"].update(shapes=shapes, batch_sizes=ms)
    budget = Budget(args.budget)

    def watchdog():
        rec.data["meta"]["watchdog"] = f"fired after {args.budget + 12:.0f} s: the run was cut short"
        rec.save()
        log("watchdog: time is up, exiting")
        os._exit(3)
    timer = threading.Timer(args.budget + 12, watchdog)
    timer.daemon = True
    timer.start()
    log(f"kernels_round3: {rec.data['meta']['device']}, torch {torch.__version__}, triton {triton.__version__}")

    if args.compile_check:
        compile_check(rec, budget, QWEN3, tuple(args.compile_dtypes.split(",")))
        ok = rec.data["compile_check"] and not rec.data["errors"]
        timer.cancel()
        return 0 if ok else 1

    torch.manual_seed(0)
    pdl = device.type == "cuda" and rec.data["meta"].get("pdl_available", False)
    rec.data["meta"]["copy_tbps_measured"] = guarded(rec, budget, "copy bandwidth", lambda: measure_copy_tbps(device))
    from nanovllm_ref.utils.fusion import FusedKernels
    variants = [("old", FusedKernels()), ("new", FusedKernels.all())]
    reference_out: dict = {}

    def layers_at(batch_sizes, chosen):
        for m in batch_sizes:
            for name, kernels in chosen:
                guarded(rec, budget, f"layer M={m} {name}",
                        lambda: layer_case(rec, m, name, kernels, shapes, device, dtype, reference_out, depths),
                        min_left=6.0)
    # Most wanted first (the budget may end the run): whole layers at batch 1 and 16, then each kernel.
    first = [m for m in (1, 16) if m in layer_ms] or layer_ms[:1]
    log("1. decoder layers, old and new, batch " + ", ".join(map(str, first)))
    layers_at(first, variants)
    log("2. GEMMs")
    for m in ms:
        for op, (n, k, kind) in gemm_shapes(shapes).items():
            guarded(rec, budget, f"gemm {op} M={m}", lambda: gemm_case(rec, op, m, n, k, kind, device, dtype))
    for m in [m for m in ms if m <= 64]:       # the LM head (tied embedding, 311 MB): cuBLAS today, not routed
        guarded(rec, budget, f"gemm lm_head M={m}",
                lambda: gemm_case(rec, "lm_head", m, shapes["vocab"], shapes["hidden"], "full", device, dtype))
    log("3. element-wise")
    for m in ms:
        guarded(rec, budget, f"add_rms_norm M={m}", lambda: add_rms_norm_case(rec, m, shapes, device, dtype))
        guarded(rec, budget, f"qk_norm_rope_store M={m}", lambda: qk_case(rec, m, shapes, device, dtype))
    log("4. decoder layers at the other batch sizes, and with PDL")
    layers_at([m for m in layer_ms if m not in first], variants)
    if pdl:
        layers_at(first, [("new+pdl", FusedKernels.all(pdl=True))])
        for m in (1, 16):
            for op, (n, k, kind) in gemm_shapes(shapes).items():
                guarded(rec, budget, f"gemm {op} M={m} pdl",
                        lambda: gemm_case(rec, op, m, n, k, kind, device, dtype, use_pdl=True, old=False))
    summarise_layers(rec)
    if not args.no_sweep:
        log("5. GemmConfig sweep")
        for m in ([1] if args.dry_run else [1, 16]):
            for op, (n, k, kind) in gemm_shapes(shapes).items():
                for cfg in sweep_configs(m, kind):
                    guarded(rec, budget, f"sweep {op} M={m} {cfg}",
                            lambda: gemm_case(rec, op, m, n, k, kind, device, dtype, config=cfg, section="gemm_sweep",
                                              old=False))
    if device.type == "cuda" and budget.left() > 10:
        log("6. compile check")
        compile_check(rec, budget, shapes, tuple(args.compile_dtypes.split(",")))
    timer.cancel()
    rec.save()
    log(f"done in {rec.data['meta']['elapsed_s']} s: {len(rec.data['errors'])} errors, "
        f"{len(rec.data['skipped'])} skipped -> {args.out}")
    return 1 if rec.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
