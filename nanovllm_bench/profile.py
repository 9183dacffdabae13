"""Where a run's time goes (chapter 11): every engine step of the workload timed, decode steps at fixed batch
sizes with CUDA graphs and eagerly (`ModelRunner.eager_steps()`), and the kernels of one eager decode step
under torch.profiler.

Everything here times whole engine steps through the public API, `llm.advance()` (one step as `generate`
runs it, without building RequestOutputs): a decode batch of `n` sequences of `context` tokens is made by
adding `n` requests and stepping until they all decode, so the numbers include the scheduler and the host
work of a step, as a user's generate pays them (a server's `step()` adds the outputs on top).
"""
import time
from collections import defaultdict

import torch

STEP_WARMUP, STEP_ITERS, PROFILE_STEPS = 3, 20, 5


def _sync_for(llm):
    return torch.cuda.synchronize if llm.model_runner.device_type == "cuda" else (lambda: None)


def fill_decode_batch(llm, n: int, context: int, new_tokens: int, temperature: float = 0.6) -> None:
    """Add `n` requests of `context` prompt tokens (`new_tokens` each, EOS ignored) and step until every one
    is decoding: from then on each `llm.step()` is one decode step of batch `n`."""
    from nanovllm_ref import SamplingParams
    for i in range(n):
        llm.add_request([(7 * i + j) % 1000 + 3 for j in range(context)],
                        SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True))
    while True:
        llm.advance()
        last = llm.last_step
        if last is not None and last.kind == "decode" and last.num_seqs == n:
            return
        if llm.is_finished():
            raise RuntimeError(f"{n} requests of {context} tokens finished before decoding together")


def time_decode_steps(llm, warmup: int = STEP_WARMUP, iters: int = STEP_ITERS) -> float:
    """Mean wall ms of one engine step (`llm.advance()`) of the running decode batch, after `warmup` untimed
    steps."""
    sync = _sync_for(llm)
    for _ in range(warmup):
        llm.advance()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        llm.advance()
    sync()
    return 1000 * (time.perf_counter() - t) / iters


def gpu_replay_ms(llm, n: int, iters: int = STEP_ITERS) -> float | None:
    """Mean ms of the captured decode graph of a batch of `n` replayed back to back with no host work between
    replays (the inputs of the last step stay in its buffers): the device's own time for the step. None
    without a graph for `n`. Replays draw new ids into the engine's last-ids buffer, so call it only on a
    batch that is about to be dropped."""
    graphs = llm.model_runner.graph_runner
    if graphs is None or graphs.padded_size(n) is None or llm.model_runner.device_type != "cuda":
        return None
    graphs.replay(n)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        graphs.replay(n)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / iters


def step_profile(path, engine_args, prompts, max_tokens, sizes=((1, 512), (64, 512), (256, 512))) -> dict:
    """Every step of the workload timed (prefill vs decode), then per decode batch size the step's wall time
    (with CUDA graphs where the engine has them) and, at tensor_parallel_size 1, from torch.profiler over the
    same step run eagerly the kernel count and GPU kernel time by family. At TP > 1 only the whole step is
    timed (the eager profile would switch graphs off on rank 0 alone)."""
    from nanovllm_ref import LLM, SamplingParams
    tp = engine_args.get("tensor_parallel_size", 1)
    llm = LLM(path, load_format="dummy", **engine_args)
    sync = _sync_for(llm)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.6, max_tokens=16), use_tqdm=False)
    for p, m in zip(prompts, max_tokens):
        llm.add_request(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m))
    sync()
    rows, t0 = [], time.perf_counter()
    while not llm.is_finished():
        t = time.perf_counter()
        llm.advance()
        last = llm.last_step
        # prefill tokens > 0, decode batch < 0 (async scheduling: the step launched by this call)
        n = 0 if last is None else (last.num_tokens if last.is_prefill else -last.num_seqs)
        rows.append((n, time.perf_counter() - t))
    sync()
    total = time.perf_counter() - t0
    pre, dec = [r for r in rows if r[0] > 0], [r for r in rows if r[0] < 0]
    result = dict(workload=dict(
        total_s=total, tok_s=sum(max_tokens) / total, prefill_steps=len(pre), prefill_s=sum(r[1] for r in pre),
        prefill_step_max_s=max((r[1] for r in pre), default=0), decode_steps=len(dec), decode_s=sum(r[1] for r in dec),
        mean_decode_batch=sum(-r[0] for r in dec) / max(len(dec), 1)), decode_steps={})
    steps_needed = STEP_WARMUP + STEP_ITERS + 2 + PROFILE_STEPS + 6     # timed steps, then the eager profile
    for n, ctx_len in sizes:
        fill_decode_batch(llm, n, ctx_len, steps_needed)
        entry = result["decode_steps"][f"bs{n}_ctx{ctx_len}"] = dict(graph_step_ms=time_decode_steps(llm))
        if tp > 1:
            entry["tensor_parallel_size"] = tp
        else:
            entry.update(_kernel_profile(llm, llm.config.hf_config.num_hidden_layers, entry["graph_step_ms"]))
            gpu = gpu_replay_ms(llm, n)
            if gpu is not None:
                # What the device spends on the step alone, and the rest of an engine step's wall time: host
                # work the device waited for (async scheduling hides the part of it that overlaps).
                entry.update(gpu_step_ms=gpu, host_not_overlapped_ms=entry["graph_step_ms"] - gpu,
                             async_scheduling=llm.async_scheduling)
        llm.abort_all()
    llm.exit()
    return result


def kernel_family(name: str) -> str:
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


def _kernel_profile(llm, num_layers: int, graph_ms: float) -> dict:
    """The running decode batch stepped eagerly under torch.profiler: kernels per step and GPU time by family."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if llm.model_runner.device_type == "cuda" else [ProfilerActivity.CPU]
    with llm.model_runner.eager_steps():
        for _ in range(2):
            llm.advance()
        _sync_for(llm)()
        with profile(activities=activities) as prof:
            for _ in range(PROFILE_STEPS):
                llm.advance()
            _sync_for(llm)()
    fam, count = defaultdict(float), defaultdict(float)
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dt <= 0 or ev.key.startswith("ProfilerStep"):
            continue
        fam[kernel_family(ev.key)] += dt / PROFILE_STEPS / 1000
        count[kernel_family(ev.key)] += ev.count / PROFILE_STEPS
    kernel_ms = sum(fam.values())
    return dict(kernel_ms=kernel_ms, host_gap_ms=graph_ms - kernel_ms, kernels_per_step=sum(count.values()),
                kernels_per_layer=sum(count.values()) / num_layers,
                kernel_ms_by_family={k: round(v, 4) for k, v in sorted(fam.items(), key=lambda x: -x[1])},
                kernels_by_family={k: round(v, 1) for k, v in sorted(count.items(), key=lambda x: -x[1])})


def graph_sweep(path, engine_args, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), context=512) -> list[dict]:
    """ms per decode step (a whole `llm.step()`) at each batch size, CUDA-graph replay vs eager, same engine
    and batch. One process only: eager_steps() switches graphs off on rank 0 alone."""
    from nanovllm_ref import LLM
    if engine_args.get("tensor_parallel_size", 1) > 1:
        raise ValueError("graph_sweep runs one process: it switches graphs off on rank 0 only")
    llm = LLM(path, load_format="dummy", **dict(engine_args, max_num_seqs=max(max(sizes), 1)))
    rows = []
    for n in sizes:
        fill_decode_batch(llm, n, context, 2 * (STEP_WARMUP + STEP_ITERS) + 4, temperature=0)
        row = dict(batch_size=n, context=context, graph_ms=time_decode_steps(llm))
        with llm.model_runner.eager_steps():
            row["eager_ms"] = time_decode_steps(llm)
        row["speedup"] = row["eager_ms"] / row["graph_ms"]
        rows.append(row)
        llm.abort_all()
    llm.exit()
    return rows
