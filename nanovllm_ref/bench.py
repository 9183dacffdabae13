"""Throughput benchmark: `python -m nanovllm_ref bench` (chapter 11).

Default workload = upstream nano-vllm's bench.py: a Qwen3-0.6B-shaped model with random weights, 256
requests, `random.seed(0)`, prompt lengths and max_tokens uniform in [100, 1024], ignore_eos, temperature
0.6, one warm-up generate first. It totals 142,827 prompt and 133,966 output tokens (checked).
Throughput = output tokens / wall seconds of the timed generate.

Peers in the same run (each skipped with a recorded reason when it cannot run):
- nanovllm_ref with each available attention back-end, with CUDA graphs and eager;
- HF transformers continuous batching (`init_continuous_batching`, paged|sdpa, CUDA graphs on);
- vLLM, when `import vllm` works.

The physical floor of the workload: decode must read every cached K/V once per step, every step reads the
weights once, and prefill does 2 * params FLOPs per token plus attention. With the copy bandwidth and the
matmul rate measured on this machine, floor = KV bytes / bw + steps * weight bytes / bw + prefill FLOPs /
rate. Each result is reported as a % of that floor.

`--cpu` runs the CPU benchmark on the real model instead (SmolLM2-135M against HF `generate`, in one process;
see nanovllm_ref/bench_cpu.py). `--cpu-tiny` runs a tiny version of this one (tiny random model, 16 short
requests) in well under a minute.
Results go to bench/results/*.json and *.csv; `--figures` draws figures/bench_*.png.
"""
import argparse
import csv
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings

import torch

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                 eos_token_id=151645)
EXPECTED_TOTALS = {256: (142_827, 133_966)}


def make_workload(num_requests=256, seed=0, min_len=100, max_len=1024, min_out=100, max_out=1024):
    """Upstream bench.py's draw order: all prompts first, then all max_tokens."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))]
               for _ in range(num_requests)]
    max_tokens = [random.randint(min_out, max_out) for _ in range(num_requests)]
    return prompts, max_tokens


def make_model_folder(kind: str, path: str) -> str:
    """A folder the engine can open: config.json (+ a small tokenizer). Weights come from load_format='dummy'."""
    from nanovllm_ref.tiny import make_tokenizer, tiny_config
    os.makedirs(path, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "qwen3-0.6b":
            cfg = tiny_config("qwen3", **QWEN3_06B)
            cfg.dtype = torch.bfloat16
        else:
            cfg = tiny_config("qwen3", vocab_size=10240, max_position_embeddings=4096)
        cfg.save_pretrained(path)
        make_tokenizer(path)
    return path


def model_stats(hf_config) -> dict:
    h, L = hf_config.hidden_size, hf_config.num_hidden_layers
    hd = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    H, Hkv, I, V = hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.intermediate_size, hf_config.vocab_size
    per_layer = h * (H + 2 * Hkv) * hd + H * hd * h + 3 * h * I
    params = L * per_layer + V * h * (1 if hf_config.tie_word_embeddings else 2)
    return dict(params=params, layer_params=L * per_layer, kv_bytes_per_token=2 * L * Hkv * hd * 2,
                attn_flops_coef=4 * L * H * hd, weight_bytes=2 * params, lm_head_params=V * h)


def physical_floor(prompts, max_tokens, stats, bw_bytes_s, flops_s) -> dict:
    """Seconds the workload needs at least, on a machine with copy bandwidth bw and matmul rate flops_s."""
    kv_tok = stats["kv_bytes_per_token"]
    # Decode token t (1 .. M-1; token 0 comes from prefill) attends over P + t cached positions.
    kv_bytes = sum(kv_tok * ((m - 1) * len(p) + (m - 1) * m // 2) for p, m in zip(prompts, max_tokens))
    steps = max(max_tokens) - 1                     # all requests decode together; the longest sets the count
    weight_bytes = steps * stats["weight_bytes"]
    lens = [len(p) for p in prompts]
    prefill_flops = 2 * (stats["layer_params"]) * sum(lens) + 2 * stats["lm_head_params"] * len(lens) \
        + stats["attn_flops_coef"] * sum(n * n / 2 for n in lens)
    parts = dict(kv_read_s=kv_bytes / bw_bytes_s, weight_read_s=weight_bytes / bw_bytes_s,
                 prefill_s=prefill_flops / flops_s)
    parts["floor_s"] = sum(parts.values())
    parts.update(kv_bytes=kv_bytes, weight_bytes=weight_bytes, prefill_flops=prefill_flops)
    return parts


def measure_machine(device: str) -> dict:
    """Copy bandwidth (read + write bytes / s) and bf16 (GPU) or fp32 (CPU) matmul FLOP/s."""
    if device == "cuda":
        x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            y.copy_(x)
        torch.cuda.synchronize()
        bw = 2 * x.numel() * 20 / (time.perf_counter() - t)
        del x, y
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        flops = 2 * 8192**3 * 20 / (time.perf_counter() - t)
        del a, b
        torch.cuda.empty_cache()
    else:
        x = torch.empty(256 * 2**20, dtype=torch.uint8)
        y = torch.empty_like(x)
        y.copy_(x)
        t = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        bw = 2 * x.numel() * 5 / (time.perf_counter() - t)
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        a @ b
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        flops = 2 * 1024**3 * 10 / (time.perf_counter() - t)
    return dict(copy_bandwidth_Bps=bw, matmul_flops=flops)


def compile_counts() -> dict:
    """Compiles so far in this process: torch.compile graphs (Dynamo's unique_graphs) and compiled binaries of
    our Triton kernels (their per-device caches). A difference across a timed run means it paid a compile."""
    from torch._dynamo.utils import counters
    out = dict(dynamo_graphs=int(counters["stats"]["unique_graphs"]), triton_kernels=None)
    try:
        from nanovllm_ref.kernels import attention, store_kvcache
        n = 0
        for mod in (attention, store_kvcache):
            for fn in vars(mod).values():
                caches = getattr(fn, "device_caches", None)
                if isinstance(caches, dict):
                    n += sum(len(c[0]) for c in caches.values())
        out["triton_kernels"] = n
    except Exception:                                   # another Triton layout: count Dynamo only
        pass
    return out


def _compiles_between(before: dict, after: dict) -> dict:
    return {k: (after[k] - before[k]) if after[k] is not None and before[k] is not None else None for k in before}


def pct_of_floor(floor_s: float, seconds: float, gpus: int = 1) -> float:
    """A run's time as % of the physical floor of the GPUs it used. `floor_s` is one GPU's floor (seconds);
    `gpus` GPUs read the weights and K/V in parallel (tensor parallel), so theirs is floor_s / gpus."""
    return 100 * floor_s / gpus / seconds


def _engine_run(path, prompts, max_tokens, temperature, engine_args, repeats: int = 1):
    """`repeats` timed runs, each in a fresh engine (a second run in the same engine would hit its own
    prefix cache). Returns (output tokens, median seconds, info with every run, start-up seconds and the
    compiles counted inside each timed run)."""
    from nanovllm_ref import LLM, SamplingParams
    times, startups, compiles, info = [], [], [], {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm = LLM(path, load_format="dummy", **engine_args)
        sps = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m) for m in max_tokens]
        llm.generate(["Benchmark: "], SamplingParams(temperature=temperature, max_tokens=16), use_tqdm=False)
        startups.append(time.perf_counter() - t0)
        if llm.model_runner.device_type == "cuda":
            torch.cuda.synchronize()
        before = compile_counts()
        t = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        if llm.model_runner.device_type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        compiles.append(_compiles_between(before, compile_counts()))
        out_tokens = sum(len(o["token_ids"]) for o in outs)
        info = dict(backend=llm.model_runner.backend_name, cuda_graphs=not llm.model_runner.enforce_eager,
                    graph_samples=llm.model_runner.graph_samples,
                    num_kvcache_blocks=llm.config.num_kvcache_blocks, preemptions=llm.scheduler.num_preemptions)
        llm.exit()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    seconds = statistics.median(times)
    info.update(repeats=repeats, run_seconds=times, run_tok_s=[out_tokens / s for s in times],
                min_tok_s=out_tokens / max(times), max_tok_s=out_tokens / min(times),
                startup_seconds=startups, compiles_in_timed_run=compiles)
    return out_tokens, seconds, info


def _decode_batch(block_manager, n: int, context: int, block_size: int, temperature: float) -> list:
    """`n` sequences of `context` tokens with their blocks allocated and all but the last token cached: one
    decode step's batch, built without running prefill (for timing decode steps on their own)."""
    from nanovllm_ref import SamplingParams
    from nanovllm_ref.engine.sequence import Sequence
    seqs = []
    for i in range(n):
        seq = Sequence([(7 * i + j) % 1000 for j in range(context)], block_size, SamplingParams(temperature=temperature))
        block_manager.allocate(seq)
        seq.num_cached_tokens = context - 1
        seqs.append(seq)
    return seqs


def _step_ms(runner, seqs, sync, warmup: int = 3, iters: int = 20) -> float:
    """Mean wall ms of one decode step of `seqs` through `runner.run` (graphs or eager, whichever the runner
    has), after `warmup` untimed steps; `sync` waits for the device before each clock read."""
    for _ in range(warmup):
        runner.run(seqs, False)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        runner.run(seqs, False)
    sync()
    return 1000 * (time.perf_counter() - t) / iters


def step_profile(path, engine_args, prompts, max_tokens, sizes=((1, 512), (64, 512), (256, 512))) -> dict:
    """Where a run's time goes (CUDA): every engine step of the workload timed (prefill vs decode, host time
    outside the model runner), then per decode step at a few batch sizes: CUDA-graph step wall time, and
    from torch.profiler over the same step run eagerly the kernel count and GPU kernel time by family.
    With tensor_parallel_size > 1 only the step times are recorded (rank 0's wall time of the whole step,
    all ranks included); the kernel profile would run rank 0 eagerly and the workers from their graphs.
    With enforce_eager (or on a CPU) `graph_step_ms` is the eager step's time."""
    from nanovllm_ref import LLM, SamplingParams
    tp = engine_args.get("tensor_parallel_size", 1)
    llm = LLM(path, load_format="dummy", **engine_args)
    runner = llm.model_runner
    sync = torch.cuda.synchronize if runner.device_type == "cuda" else (lambda: None)   # CPU: tests of TP > 1
    llm.generate(["warm up"], SamplingParams(temperature=0.6, max_tokens=16), use_tqdm=False)
    orig_run, run_s = runner.run, [0.0]

    def timed_run(seqs, is_prefill):
        t = time.perf_counter()
        r = orig_run(seqs, is_prefill)
        run_s[0] = time.perf_counter() - t
        return r

    runner.run = timed_run
    for p, m in zip(prompts, max_tokens):
        llm.add_request(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m))
    sync()
    rows, t0 = [], time.perf_counter()
    while not llm.is_finished():
        t = time.perf_counter()
        llm.step(); n = llm.last_step.num_tokens * (1 if llm.last_step.is_prefill else -1)  # noqa: E702
        rows.append((n, time.perf_counter() - t, run_s[0]))
    total = time.perf_counter() - t0
    runner.run = orig_run
    pre, dec = [r for r in rows if r[0] > 0], [r for r in rows if r[0] < 0]
    result = dict(workload=dict(
        total_s=total, tok_s=sum(max_tokens) / total, prefill_steps=len(pre), prefill_s=sum(r[1] for r in pre),
        prefill_step_max_s=max((r[1] for r in pre), default=0), decode_steps=len(dec), decode_s=sum(r[1] for r in dec),
        host_outside_run_s=sum(r[1] - r[2] for r in rows), mean_decode_batch=sum(-r[0] for r in dec) / max(len(dec), 1)))

    bm, bs = llm.scheduler.block_manager, llm.config.kvcache_block_size
    result["decode_steps"] = {}
    for n, ctx_len in sizes:
        seqs = _decode_batch(bm, n, ctx_len, bs, temperature=0.6)
        # At TP > 1 rank 0 returns once its sampled ids are on the host, and they need every rank's
        # all-reduces, so this times the whole tensor-parallel step.
        entry = result["decode_steps"][f"bs{n}_ctx{ctx_len}"] = dict(graph_step_ms=_step_ms(runner, seqs, sync))
        if tp > 1:
            # The eager kernel profile below would switch graphs off on rank 0 alone: step time only.
            entry["tensor_parallel_size"] = tp
        else:
            entry.update(_kernel_profile(runner, seqs, llm.config.hf_config.num_hidden_layers,
                                         entry["graph_step_ms"]))
        for seq in seqs:
            bm.deallocate(seq)
    llm.exit()
    return result


def _kernel_family(name: str) -> str:
    """The family of a CUDA kernel, from its name (the step profile's columns)."""
    n = name.lower()
    for key, fam in (("paged", "attention"), ("attn", "attention"), ("attention", "attention"),
                     ("merge_splits", "attention"), ("store", "kv_store"), ("gemm", "gemm"), ("cutlass", "gemm"),
                     ("sm90", "gemm"), ("nvjet", "gemm"), ("matmul", "gemm"), ("splitk", "gemm"),
                     ("triton_poi", "fused_pointwise"), ("triton_red", "fused_reduction"),
                     ("triton_per", "fused_reduction"), ("elementwise", "elementwise"), ("copy", "copy"),
                     ("fill", "fill"), ("reduce", "reduce"), ("argmax", "sampler"), ("nccl", "nccl")):
        if key in n:
            return fam
    return "other"


def _kernel_profile(runner, seqs, num_layers: int, graph_ms: float) -> dict:
    """The same decode step run eagerly under torch.profiler: kernel count and GPU kernel time by family."""
    from collections import defaultdict
    from torch.profiler import ProfilerActivity, profile
    with runner.eager_steps():
        for _ in range(2):
            runner.run(seqs, False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.run(seqs, False)
            torch.cuda.synchronize()
    fam, count = defaultdict(float), defaultdict(float)
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dt <= 0 or ev.key.startswith("ProfilerStep"):
            continue
        fam[_kernel_family(ev.key)] += dt / 5 / 1000
        count[_kernel_family(ev.key)] += ev.count / 5
    kernel_ms = sum(fam.values())
    return dict(kernel_ms=kernel_ms, host_gap_ms=graph_ms - kernel_ms, kernels_per_step=sum(count.values()),
                kernels_per_layer=sum(count.values()) / num_layers,
                kernel_ms_by_family={k: round(v, 4) for k, v in sorted(fam.items(), key=lambda x: -x[1])},
                kernels_by_family={k: round(v, 1) for k, v in sorted(count.items(), key=lambda x: -x[1])})


def _hf_cb_run(path, prompts, max_tokens, temperature) -> tuple[int, float, dict]:
    """HF transformers continuous batching on the same workload, per-request max_new_tokens, EOS off."""
    from transformers import AutoConfig, AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="paged|sdpa")
    model = model.cuda().eval()
    gc = GenerationConfig(do_sample=True, temperature=temperature, max_new_tokens=max(max_tokens),
                          eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(use_cuda_graph=True)

    def run(ps, ms):
        manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
        manager.start()
        try:
            for i, (p, m) in enumerate(zip(ps, ms)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
            done, tokens = 0, 0
            while done < len(ps):
                r = manager.get_result(timeout=120)
                if r is None:
                    raise RuntimeError("HF continuous batching timed out")
                if r.is_finished():
                    done += 1
                    tokens += len(r.generated_tokens)
        finally:
            manager.stop(block=True)
        return tokens

    run([[1, 2, 3]], [8])                                    # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    tokens = run(prompts, max_tokens)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return tokens, seconds, dict(attn_implementation="paged|sdpa", use_cuda_graph=True)


def decode_batch1(path, engine_args, prompt_len=128, new_tokens=512) -> dict:
    """Batch-1 decode speed: one request, timed after its prefill (tokens 2..N over their wall time)."""
    from nanovllm_ref import LLM, SamplingParams
    llm = LLM(path, load_format="dummy", **engine_args)
    prompt = list(range(1000, 1000 + prompt_len))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    llm.step()                                               # prefill (first token)
    sync = torch.cuda.synchronize if llm.model_runner.device_type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    steps = 0
    while not llm.is_finished():
        llm.step()
        steps += 1
    sync()
    seconds = time.perf_counter() - t
    res = dict(backend=llm.model_runner.backend_name, cuda_graphs=not llm.model_runner.enforce_eager,
               decode_steps=steps, seconds=seconds, tok_s=steps / seconds, ms_per_step=1000 * seconds / steps)
    llm.exit()
    return res


def graph_sweep(path, engine_args, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), context=512, iters=20) -> list[dict]:
    """ms per decode step at each batch size, CUDA graph replay vs eager, same engine and inputs."""
    from nanovllm_ref import LLM
    if engine_args.get("tensor_parallel_size", 1) > 1:
        raise ValueError("graph_sweep runs one process: it switches graphs off on rank 0 only")
    args = dict(engine_args, max_num_seqs=max(sizes))
    llm = LLM(path, load_format="dummy", **args)
    runner, bm, bs = llm.model_runner, llm.scheduler.block_manager, llm.config.kvcache_block_size
    rows = []
    for n in sizes:
        seqs = _decode_batch(bm, n, context, bs, temperature=0)
        row = dict(batch_size=n, context=context)
        row["graph_ms"] = _step_ms(runner, seqs, torch.cuda.synchronize, iters=iters)
        with runner.eager_steps():
            row["eager_ms"] = _step_ms(runner, seqs, torch.cuda.synchronize, iters=iters)
        row["speedup"] = row["eager_ms"] / row["graph_ms"]
        rows.append(row)
        for seq in seqs:
            bm.deallocate(seq)
    llm.exit()
    return rows


def draw_figures(result: dict, outdir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(outdir, exist_ok=True)
    paths = []

    def save(fig, stem):
        fig.tight_layout()
        paths.append(os.path.join(outdir, f"{stem}{result['tag']}.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    runs = [r for r in result["runs"] if r.get("tok_s")]
    if runs:
        fig, ax = plt.subplots(figsize=(8, 4))
        names = [r["name"] for r in runs]
        vals = [r["tok_s"] for r in runs]
        # A run timed several times shows its median, with min-max as an error bar.
        err = [[r["tok_s"] - r.get("min_tok_s", r["tok_s"]) for r in runs],
               [r.get("max_tok_s", r["tok_s"]) - r["tok_s"] for r in runs]]
        ax.barh(names, vals, xerr=err if any(map(any, err)) else None, capsize=3,
                color=["#4c72b0" if r["name"].startswith("nanovllm") else "#dd8452" for r in runs])
        floor = result.get("floor", {}).get("floor_tok_s")
        if floor:
            ax.axvline(floor, color="k", ls="--", lw=1)
            ax.text(floor, len(runs) - 0.5, f" floor {floor:,.0f}", va="top", fontsize=8)
        for i, (v, r) in enumerate(zip(vals, runs)):
            label = f" {v:,.0f}" + (f" (median of {r['repeats']})" if r.get("repeats", 1) > 1 else "")
            ax.text(r.get("max_tok_s", v), i + 0.25, label, va="center", fontsize=8)
        ax.set_xlabel("output tokens / s")
        ax.set_title(f"{result['workload']['num_requests']} requests, {result['workload']['output_tokens']:,} output "
                     f"tokens, on {result['machine']['device_name']}", fontsize=10)
        save(fig, "bench_throughput_")
    fl = result.get("floor")
    if fl and runs:
        fig, ax = plt.subplots(figsize=(6, 4))
        parts = ["kv_read_s", "weight_read_s", "prefill_s"]
        bottom = 0.0
        for part, color in zip(parts, ["#55a868", "#c44e52", "#8172b2"]):
            ax.bar(["physical floor"], [fl[part]], bottom=bottom, color=color, label=part.replace("_s", ""))
            bottom += fl[part]
        best = max(runs, key=lambda r: r["tok_s"] if r["name"].startswith("nanovllm") else 0)
        ax.bar([best["name"]], [best["seconds"]], color="#4c72b0")
        ax.set_ylabel("seconds for the workload")
        ax.legend(fontsize=8)
        ax.set_title("Where the floor comes from (roofline of the workload)", fontsize=10)
        save(fig, "bench_floor_")
    sweep = result.get("graph_sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["batch_size"] for r in sweep]
        ax.plot(xs, [r["eager_ms"] for r in sweep], "o-", label="eager")
        ax.plot(xs, [r["graph_ms"] for r in sweep], "o-", label="CUDA graph")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch size")
        ax.set_ylabel("ms per decode step")
        for r in sweep:
            ax.annotate(f"{r['speedup']:.1f}x", (r["batch_size"], r["graph_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(0, -10), ha="center")
        ax.legend()
        ax.set_title("CUDA-graph speedup of one decode step", fontsize=10)
        save(fig, "cuda_graph_speedup_")
    return paths


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(prog="python -m nanovllm_ref bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true",
                    help="CPU run on the real model: SmolLM2-135M fp32 against HF generate (nanovllm_ref/bench_cpu.py)")
    ap.add_argument("--cpu-tiny", action="store_true", help="tiny CPU run: tiny random model, 16 short requests")
    ap.add_argument("--threads", default="1,2", help="--cpu: torch thread counts to measure, e.g. 2,1")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per cell (median, min and max are kept); on a GPU each in a fresh engine")
    ap.add_argument("--workloads", default="chat8,chat32_eos", help="--cpu: comma list of chat8, chat32_eos")
    ap.add_argument("--budget-s", type=float, default=150,
                    help="--cpu: stop repeating a cell after this many seconds (busy machine); 0 = never")
    ap.add_argument("--max-tokens-eos", type=int, default=96, help="--cpu: max tokens of the eos-on workload")
    ap.add_argument("--model", default=None, help="--cpu: model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--backends", default="auto", help="comma list of nanovllm_ref back-ends, or 'auto' = all available")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager (no CUDA graph) runs")
    ap.add_argument("--runs", default=None, help="explicit nanovllm_ref runs, e.g. triton:graph,triton:eager,torch:eager "
                                                 "(overrides --backends/--no-eager)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    ap.add_argument("--peers", default="nanovllm,hf", help="comma list of peers to run: nanovllm, hf")
    ap.add_argument("--merge", default=None, help="add this run's rows to an earlier result JSON (same workload)")
    ap.add_argument("--batch1", action="store_true", help="also measure batch-1 decode tok/s")
    ap.add_argument("--profile", action="store_true",
                    help="also time every step of the workload and count kernels per decode step (CUDA)")
    ap.add_argument("--graph-sweep", action="store_true", help="also measure CUDA-graph speedup per batch size")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--kvcache-block-size", type=int, default=None, help="default: 256 on GPU, the engine's on CPU")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (or CPU ranks) per engine")
    ap.add_argument("--out", default="bench/results", help="folder for JSON/CSV (CPU runs are git-ignored there)")
    ap.add_argument("--figures", default=None, help="folder for PNG figures (default: none)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    if args.cpu:
        from nanovllm_ref import bench_cpu
        return bench_cpu.main(args)

    cuda = torch.cuda.is_available() and not args.cpu_tiny
    device = "cuda" if cuda else "cpu"
    tmp = tempfile.mkdtemp(prefix="nanovllm_bench_")
    if cuda:
        n = args.num_requests or 256
        prompts, max_tokens = make_workload(n)
        path = make_model_folder("qwen3-0.6b", tmp)
        workload = f"upstream bench.py: Qwen3-0.6B shape, random weights, {n} requests"
        engine_args = dict(max_model_len=4096, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           kvcache_block_size=args.kvcache_block_size or 256,
                           tensor_parallel_size=args.tensor_parallel_size)
    else:
        n = args.num_requests or 16
        prompts, max_tokens = make_workload(n, min_len=16, max_len=64, min_out=16, max_out=48)
        prompts = [[t % 10000 for t in p] for p in prompts]
        path = make_model_folder("tiny", tmp)
        workload = f"CPU mode: tiny random Qwen3, {n} requests"
        engine_args = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=1024, kvcache_block_size=16,
                           device="cpu", tensor_parallel_size=args.tensor_parallel_size)
    n_prompt, n_out = sum(map(len, prompts)), sum(max_tokens)
    if n in EXPECTED_TOTALS and cuda and EXPECTED_TOTALS[n] != (n_prompt, n_out):
        print(f"workload totals {n_prompt}/{n_out} differ from upstream's {EXPECTED_TOTALS[n]}", file=sys.stderr)
        return 2
    print(f"workload: {workload}: {n_prompt:,} prompt tokens, {n_out:,} output tokens")

    from nanovllm_ref.attn import flash_attn_available, triton_available
    from transformers import AutoConfig
    hf_config = AutoConfig.from_pretrained(path)
    machine = measure_machine(device)
    machine.update(device=device, device_name=torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
                   torch=torch.__version__, python=platform.python_version())
    try:
        import triton
        machine["triton"] = triton.__version__
    except Exception:
        machine["triton"] = None
    import transformers
    machine["transformers"] = transformers.__version__
    stats = model_stats(hf_config)
    floor = physical_floor(prompts, max_tokens, stats, machine["copy_bandwidth_Bps"], machine["matmul_flops"])
    floor["floor_tok_s"] = n_out / floor["floor_s"]
    print(f"machine: {machine['device_name']}, copy {machine['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, matmul "
          f"{machine['matmul_flops'] / 1e12:.1f} TFLOP/s; floor {floor['floor_s']:.2f} s = {floor['floor_tok_s']:,.0f} tok/s")

    if args.backends == "auto":
        backends = ["torch"] + (["triton"] if cuda and triton_available() else []) + \
                   (["flash_attn"] if cuda and flash_attn_available() else [])
    else:
        backends = args.backends.split(",")
    runs = []

    def record(name, fn):
        try:
            tokens, seconds, info = fn()
            gpus = args.tensor_parallel_size if name.startswith("nanovllm") else 1
            row = dict(name=name, output_tokens=tokens, seconds=seconds, tok_s=tokens / seconds,
                       pct_of_floor=pct_of_floor(floor["floor_s"], seconds, gpus), floor_gpus=gpus, **info)
            spread = (f" (min {info['min_tok_s']:,.0f}, max {info['max_tok_s']:,.0f}, median of {info['repeats']})"
                      if info.get("repeats", 1) > 1 else "")
            print(f"{name:38s} {tokens:>9,} tok {seconds:8.2f} s {row['tok_s']:>10,.0f} tok/s "
                  f"{row['pct_of_floor']:.3g}% of floor{spread}")
            if info.get("compiles_in_timed_run"):
                print(f"{'':38s} compiles inside each timed run: {info['compiles_in_timed_run']}")
        except Exception as exc:                   # a peer that cannot run is reported, not fatal
            row = dict(name=name, error=f"{type(exc).__name__}: {exc}"[:500])
            print(f"{name:38s} skipped: {row['error']}")
        runs.append(row)
        return row

    peers = set(args.peers.split(","))
    if args.no_hf:
        peers.discard("hf")
    modes = [False] if not cuda else ([False] if args.no_eager else [False, True])
    plan = [(b, e) for b in backends for e in modes]
    if args.runs:
        plan = [(r.split(":")[0], r.split(":")[1] == "eager") for r in args.runs.split(",")]
        backends = list(dict.fromkeys(b for b, _ in plan))
    for backend, eager in (plan if "nanovllm" in peers else []):
        tp = f",tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
        name = f"nanovllm_ref[{backend}{'' if not cuda else (',eager' if eager else ',cudagraph')}{tp}]"
        record(name, lambda b=backend, e=eager: _engine_run(
            path, prompts, max_tokens, 0.6, dict(engine_args, attention_backend=b, enforce_eager=e),
            repeats=args.repeats if cuda else 1))
    try:
        import vllm  # noqa: F401
        vllm_status = "importable, but not run by this script"
    except Exception as exc:
        vllm_status = f"not importable here ({type(exc).__name__})"
    print(f"vllm: {vllm_status}")

    result = dict(tag=args.tag or ("h200" if cuda and "H200" in machine["device_name"] else device),
                  date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"), machine=machine,
                  workload=dict(name=workload, num_requests=n, prompt_tokens=n_prompt, output_tokens=n_out,
                                temperature=0.6, ignore_eos=True, engine_args=engine_args),
                  floor=floor, runs=runs, vllm=vllm_status)
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
        if earlier["workload"]["output_tokens"] != n_out or earlier["workload"]["prompt_tokens"] != n_prompt:
            print("--merge: the earlier result has another workload", file=sys.stderr)
            return 2
        names = {r["name"] for r in runs}
        for r in runs:
            r["note"] = f"measured in a separate call on {result['date']}, same machine kind"
            r["pct_of_floor"] = r.get("seconds") and pct_of_floor(earlier["floor"]["floor_s"], r["seconds"],
                                                                  r.get("floor_gpus", 1))
        earlier["runs"] = [r for r in earlier["runs"] if r["name"] not in names] + runs
        result, runs = earlier, earlier["runs"]
    def save():
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"bench_{result['tag']}")
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=2)
        with open(stem + ".csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["name", "output_tokens", "seconds", "tok_s", "pct_of_floor", "error"])
            for r in runs:
                w.writerow([r["name"], r.get("output_tokens"), r.get("seconds"), r.get("tok_s"), r.get("pct_of_floor"),
                            r.get("error", "")])
        return stem

    save()
    if args.batch1:
        b = backends[0]
        result["decode_batch1"] = decode_batch1(path, dict(engine_args, attention_backend=b))
        print(f"batch-1 decode ({b}): {result['decode_batch1']['tok_s']:,.0f} tok/s "
              f"({result['decode_batch1']['ms_per_step']:.2f} ms/step)")
    if args.graph_sweep and args.tensor_parallel_size > 1:
        print("--graph-sweep measures one process; skipped with --tensor-parallel-size > 1")
    if args.profile and cuda:
        result["step_profile"] = step_profile(path, dict(engine_args, attention_backend=backends[0]), prompts, max_tokens)
        print("step profile:", json.dumps(result["step_profile"]["workload"]))
        for k, v in result["step_profile"]["decode_steps"].items():
            if "kernel_ms" not in v:
                print(f"decode {k}: graph step {v['graph_step_ms']:.3f} ms (TP={v['tensor_parallel_size']}, whole step)")
                continue
            print(f"decode {k}: graph step {v['graph_step_ms']:.3f} ms, kernels {v['kernel_ms']:.3f} ms, "
                  f"{v['kernels_per_step']:.0f} kernels/step ({v['kernels_per_layer']:.1f}/layer)")
    if args.graph_sweep and cuda and args.tensor_parallel_size == 1:
        result["graph_sweep"] = graph_sweep(path, dict(engine_args, attention_backend=backends[0]))
        for r in result["graph_sweep"]:
            print(f"decode bs {r['batch_size']:4d}: eager {r['eager_ms']:7.2f} ms, graph {r['graph_ms']:7.2f} ms, "
                  f"{r['speedup']:.1f}x")

    save()
    if not cuda and "hf" in peers:
        runs.append(dict(name="hf_transformers[continuous_batching]", error="skipped: needs CUDA"))
        print(f"{'hf_transformers[continuous_batching]':38s} skipped: needs CUDA")
    if cuda and "hf" in peers:
        record("hf_transformers[continuous_batching]", lambda: _hf_cb_run(path, prompts, max_tokens, 0.6))
    best = [r for r in result["runs"] if r.get("tok_s") and r["name"].startswith("nanovllm")]
    hf = [r for r in result["runs"] if r.get("tok_s") and r["name"].startswith("hf_")]
    if best and hf:
        result["speedup_vs_hf"] = max(r["tok_s"] for r in best) / hf[0]["tok_s"]
        print(f"best nanovllm_ref / HF continuous batching: {result['speedup_vs_hf']:.1f}x")
    print(f"wrote {save()}.json and .csv")
    if args.figures:
        for p in draw_figures(result, args.figures):
            print(f"wrote {p}")
    return 0 if best else 1


if __name__ == "__main__":
    sys.exit(main())
