"""Where the whole benchmark workload's time goes, step by step (issue 29; chapter 11).

    python -m nanovllm_bench.workload_profile --out DIR [--runs triton:graph] [--cpu-tiny]

One engine (one nanovllm_ref run, e.g. `triton:graph`, the bench's engine arguments) on the bench workload
(nanovllm_bench/workload.py), in this order:
1. start-up and the bench's one warm-up generate;
2. the workload timed as the bench times it (`generate`, nothing instrumented): `plain_s`;
3. the workload again (every prompt token shifted by one, so nothing hits the prefix cache of run 2), stepped
   with `llm.advance()` and instrumented: per engine step its kind, tokens, rows, the KV tokens its rows attend
   over, its wall time (one `advance()`), the host time inside `ModelRunner.launch`, the time the host waited
   for the previous step's ids (`PendingStep.token_ids`), and its device time: CUDA events recorded when
   `ModelRunner.execute` starts and after `ModelRunner.sample` returns, so a step's device span starts when
   the GPU reaches it (after the step before) and ends when its sampler is done. The GPU is idle for the
   rest of the run's wall time: the host work that async scheduling did not hide;
4. probes at fixed decode batches (`--probes BATCH:CONTEXT,...`): the engine step's wall time with CUDA
   graphs, the graph replayed back to back (device time), and one eager step under torch.profiler: kernels per
   step and device time by family (attention, GEMM, norm/RoPE/KV store, sampler, other), the top kernels;
   the LM head alone; one full prefill step (`max_num_batched_tokens` prompt tokens) under torch.profiler.

Summary: prefill steps against decode steps, decode steps by batch-size bucket (steps, wall, device, GPU
idle, host busy per step), a least-squares fit of each decode step's device time to `a + b * rows + c * KV
tokens` (c against the bandwidth floor of reading one token's K/V), and the sum set against the plain run
and the physical floor (nanovllm_bench/floor.py). Written to DIR/profile4_<tag>.json with a printed table.

The instrumentation wraps three methods of this engine's runner instance (`launch`, `execute`, `sample`);
the engine itself is unchanged. On a CPU (`--cpu-tiny`: the tiny model, a small workload) every step is
synchronous, so "device" time is the host time of execute + sample; the mode exists to test this module.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict

import numpy as np

BUCKETS = ((1, 1), (2, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256), (257, 10**9))
GPU_PROBES = ((1, 512), (64, 512), (128, 1024), (256, 512), (256, 1024))
CPU_PROBES = ((1, 32), (4, 32))
PROFILE_STEPS = 4


def bucket_name(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else (f"{lo}+" if hi >= 10**9 else f"{lo}-{hi}")


def kernel_family(name: str) -> str:
    """The family of a kernel, from its name: attention (decode, split merge, prefill), gemm (cuBLAS,
    CUTLASS, our small GEMM), norm_rope_store (RMSNorm, add+RMSNorm, q/k-norm+RoPE+KV store, the KV store),
    sampler (Inductor's fused kernels of the sampler and element-wise ops, argmax), copy, other."""
    n = name.lower()
    rules = (("qk_norm_rope_store", "norm_rope_store"), ("rms_norm", "norm_rope_store"),
             ("store_kvcache", "norm_rope_store"), ("_store_kernel", "norm_rope_store"),
             ("paged", "attention"), ("attn", "attention"), ("attention", "attention"), ("prefill", "attention"),
             ("merge_splits", "attention"), ("flash", "attention"), ("fmha", "attention"),
             ("small_gemm", "gemm"), ("gemm", "gemm"), ("cutlass", "gemm"), ("sm90", "gemm"), ("nvjet", "gemm"),
             ("matmul", "gemm"), ("splitk", "gemm"), ("gemv", "gemm"), ("cublas", "gemm"),
             ("aten::mm", "gemm"), ("aten::addmm", "gemm"), ("aten::bmm", "gemm"), ("onednn", "gemm"),
             ("mkldnn", "gemm"), ("scaled_dot_product", "attention"),
             ("triton_", "fused_inductor"), ("argmax", "sampler"), ("softmax", "sampler"),
             ("memcpy", "copy"), ("copy", "copy"), ("fill", "copy"), ("nccl", "nccl"))
    for key, fam in rules:
        if key in n:
            return fam
    return "other"


class StepRecorder:
    """Wraps one runner's launch / execute / sample (instance attributes: the class is untouched) to record
    each launched step's host and device time (module docstring). `steps` gets one dict per launch."""

    def __init__(self, runner):
        import torch
        self.runner, self.cuda = runner, runner.device_type == "cuda"
        self.steps, self._open, self.waited_s = [], None, 0.0
        self._orig = {name: getattr(runner, name) for name in ("launch", "execute", "sample")}
        self._torch = torch
        runner.launch, runner.execute, runner.sample = self._launch, self._execute, self._sample

    def close(self):
        for name in self._orig:
            delattr(self.runner, name)           # the class's methods again

    def _mark(self):
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _execute(self, *args, **kwargs):
        if self._open is not None and self._open.get("start") is None:
            self._open["start"] = self._mark()
        return self._orig["execute"](*args, **kwargs)

    def _sample(self, *args, **kwargs):
        out = self._orig["sample"](*args, **kwargs)
        if self._open is not None and self._open.get("start") is not None:
            self._open["end"] = self._mark()
        return out

    def _launch(self, *args, **kwargs):
        step = dict(kv_tokens=_kv_tokens(args[0]) if args else 0)
        self._open = step
        t = time.perf_counter()
        pending = self._orig["launch"](*args, **kwargs)
        step["launch_s"] = time.perf_counter() - t
        self._open = None
        self.steps.append(step)
        token_ids = pending.token_ids

        def timed_token_ids():
            t0 = time.perf_counter()
            ids = token_ids()
            self.waited_s += time.perf_counter() - t0
            return ids
        pending.token_ids = timed_token_ids
        return pending

    def device_ms(self, step) -> float | None:
        start, end = step.get("start"), step.get("end")
        if start is None or end is None:
            return None
        return start.elapsed_time(end) if self.cuda else 1000 * (end - start)


def _kv_tokens(batch) -> int:
    """KV tokens the rows of a launched step attend over: sum of the rows' lengths (a decode row of length n
    attends over n tokens; a prefill row over its cached prefix and its chunk). `batch`: the runner's launch
    argument (an engine/step_batch.StepBatch, or, before issue 29's record, a list of sequences)."""
    meta = getattr(getattr(batch, "inputs", None), "metadata", None)
    if meta is not None:
        if meta.context_lens is not None:
            return int(meta.context_lens.sum())
        cu = meta.cu_seqlens_k
        return int(cu[-1]) if cu is not None and len(cu) else 0
    try:
        return sum(len(s) for s in batch)
    except TypeError:
        return 0


def run_instrumented(llm, prompts, max_tokens, temperature: float) -> tuple[list[dict], float]:
    """The workload stepped with llm.advance() under a StepRecorder. Returns (one dict per advance() call, wall
    seconds of the whole run). Each dict: wall_s, kind / tokens / rows of the step it launched (kind None: it
    launched nothing), kv_tokens, device_ms and launch_ms of that step, wait_ms (the host's wait inside this
    call for a step's ids: with async scheduling the step launched one call earlier)."""
    import torch
    from nanovllm_ref import SamplingParams
    cuda = llm.model_runner.device_type == "cuda"
    for p, m in zip(prompts, max_tokens):
        llm.add_request(p, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m))
    rec = StepRecorder(llm.model_runner)
    if cuda:
        torch.cuda.synchronize()
    calls, t0 = [], time.perf_counter()
    try:
        while not llm.is_finished():
            n_before, waited = len(rec.steps), rec.waited_s
            t = time.perf_counter()
            llm.advance()
            wall = time.perf_counter() - t
            last = llm.last_step
            calls.append((wall, rec.waited_s - waited, last, rec.steps[n_before] if len(rec.steps) > n_before else None))
        if cuda:
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
    finally:
        rec.close()
    out = []
    for wall, wait, last, step in calls:
        out.append(dict(wall_s=wall, wait_ms=1000 * wait, kind=None if last is None else last.kind,
                        tokens=0 if last is None else last.num_tokens, rows=0 if last is None else last.num_seqs,
                        kv_tokens=step["kv_tokens"] if step else 0,
                        device_ms=rec.device_ms(step) if step else None,
                        launch_ms=1000 * step["launch_s"] if step else 0.0))
    return out, total


def summarize(rows: list[dict], total_s: float, plain_s: float | None, floor: dict | None,
              kv_bytes_per_token: int | None, bw: float | None) -> dict:
    """The workload's steps (run_instrumented) -> prefill vs decode, decode by bucket, the fit, the sums."""
    def agg(rs):
        dev = [r["device_ms"] for r in rs if r["device_ms"] is not None]
        wall = sum(r["wall_s"] for r in rs)
        device_s = sum(dev) / 1000
        return dict(steps=len(rs), wall_s=wall, device_s=device_s, gpu_idle_s=wall - device_s,
                    mean_wall_ms=1000 * wall / max(len(rs), 1), mean_device_ms=(sum(dev) / len(dev)) if dev else None,
                    mean_launch_ms=statistics.fmean(r["launch_ms"] for r in rs) if rs else 0.0,
                    mean_host_busy_ms=(statistics.fmean(1000 * r["wall_s"] - r["wait_ms"] for r in rs)
                                       if rs else 0.0),
                    mean_rows=statistics.fmean(r["rows"] for r in rs) if rs else 0.0,
                    mean_kv_tokens_per_row=(sum(r["kv_tokens"] for r in rs) / max(sum(r["rows"] for r in rs), 1)))
    prefill = [r for r in rows if r["kind"] == "prefill"]
    decode = [r for r in rows if r["kind"] == "decode"]
    idle = [r for r in rows if r["kind"] is None]
    out = dict(total_s=total_s, plain_s=plain_s, prefill=agg(prefill), decode=agg(decode),
               tail_s=sum(r["wall_s"] for r in idle), tail_calls=len(idle),
               prefill_tokens=sum(r["tokens"] for r in prefill),
               decode_tokens=sum(r["tokens"] for r in decode))
    out["prefill"]["tokens_per_step"] = out["prefill_tokens"] / max(len(prefill), 1)
    out["decode_buckets"] = {}
    for lo, hi in BUCKETS:
        rs = [r for r in decode if lo <= r["rows"] <= hi]
        if rs:
            out["decode_buckets"][bucket_name(lo, hi)] = agg(rs)
    device_s = out["prefill"]["device_s"] + out["decode"]["device_s"]
    out["device_s"] = device_s
    out["gpu_idle_s"] = total_s - device_s
    fit_rows = [r for r in decode if r["device_ms"] is not None and r["rows"] > 0]
    if len(fit_rows) >= 4:
        X = np.array([[1.0, r["rows"], r["kv_tokens"]] for r in fit_rows])
        y = np.array([r["device_ms"] for r in fit_rows])
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        a, b, c = (float(v) for v in coef)
        resid = y - X @ coef
        fit = dict(fixed_ms=a, per_row_ms=b, per_kv_token_ns=1e6 * c, rms_residual_ms=float(np.sqrt(np.mean(resid ** 2))),
                   steps=len(fit_rows), fixed_s=a * len(fit_rows) / 1000,
                   per_row_s=b * sum(r["rows"] for r in fit_rows) / 1000,
                   kv_s=c * sum(r["kv_tokens"] for r in fit_rows) / 1000)
        if kv_bytes_per_token and bw:
            fit["kv_floor_ns_per_token"] = 1e9 * kv_bytes_per_token / bw
            if fit["per_kv_token_ns"] > 0:          # a noisy fit (a busy CPU) can come out negative
                fit["kv_bandwidth_fraction"] = fit["kv_floor_ns_per_token"] / fit["per_kv_token_ns"]
        out["decode_fit"] = fit
    if floor:
        out["floor"] = {k: floor[k] for k in ("floor_s", "kv_read_s", "weight_read_s", "prefill_s") if k in floor}
    return out


def probe_decode(llm, n: int, context: int, num_layers: int, kernel_profile: bool = True) -> dict:
    """A running decode batch of `n` rows of `context` tokens: the engine step's wall ms (CUDA graphs where the
    engine has them), the graph replayed alone (device ms), and one eager step's kernels by family."""
    from nanovllm_bench.profile import STEP_ITERS, STEP_WARMUP, fill_decode_batch, gpu_replay_ms, time_decode_steps
    need = STEP_WARMUP + STEP_ITERS + 2 + PROFILE_STEPS + 6
    fill_decode_batch(llm, n, context, need)
    entry = dict(rows=n, context=context, step_ms=time_decode_steps(llm))
    if kernel_profile:
        entry.update(eager_kernels(llm, num_layers))
    gpu = gpu_replay_ms(llm, n)
    if gpu is not None:
        entry.update(graph_replay_ms=gpu, host_not_hidden_ms=entry["step_ms"] - gpu)
    llm.abort_all()
    return entry


def _family_table(prof, steps: int, cuda: bool) -> dict:
    """torch.profiler's events of `steps` steps -> per step: kernels (CUDA; on a CPU, operators by their self
    time) and their ms by family, and the top kernels."""
    fam, count, per_kernel = defaultdict(float), defaultdict(float), defaultdict(lambda: [0.0, 0.0])
    for ev in prof.key_averages():
        if cuda:
            dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        else:
            dt = getattr(ev, "self_cpu_time_total", 0)
        if dt <= 0 or ev.key.startswith("ProfilerStep"):
            continue
        f = kernel_family(ev.key)
        fam[f] += dt / steps / 1000
        count[f] += ev.count / steps
        per_kernel[ev.key][0] += dt / steps / 1000
        per_kernel[ev.key][1] += ev.count / steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]
    return dict(kernel_ms=sum(fam.values()), kernels_per_step=sum(count.values()),
                ms_by_family={k: round(v, 4) for k, v in sorted(fam.items(), key=lambda x: -x[1])},
                kernels_by_family={k: round(v, 1) for k, v in sorted(count.items(), key=lambda x: -x[1])},
                top_kernels=[dict(name=k[:90], family=kernel_family(k), ms=round(v[0], 4), count=round(v[1], 1))
                             for k, v in top])


def eager_kernels(llm, num_layers: int) -> dict:
    """One running decode batch stepped eagerly under torch.profiler (CUDA: kernels; CPU: operators)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = llm.model_runner.device_type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with llm.model_runner.eager_steps():
        for _ in range(2):
            llm.advance()
        sync()
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILE_STEPS):
                llm.advance()
            sync()
    table = _family_table(prof, PROFILE_STEPS, cuda)
    table["kernels_per_layer"] = table["kernels_per_step"] / num_layers
    return table


def probe_prefill(llm, num_tokens: int, prompt_len: int) -> dict:
    """One prefill step of `num_tokens` prompt tokens (prompts of `prompt_len`), eager as every prefill is,
    under torch.profiler: device time by family."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from nanovllm_ref import SamplingParams
    cuda = llm.model_runner.device_type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = max(1, num_tokens // prompt_len)
    for i in range(n):
        llm.add_request([(11 * i + j) % 1000 + 5 for j in range(prompt_len)],
                        SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True))
    sync()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        llm.advance()
        sync()
    wall = time.perf_counter() - t
    last = llm.last_step
    llm.abort_all()
    out = _family_table(prof, 1, cuda)
    out.update(tokens=last.num_tokens if last else None, rows=last.num_seqs if last else None,
               wall_ms_profiled=1000 * wall)
    return out


def lm_head_ms(llm, sizes=(1, 64, 256), iters: int = 30) -> dict:
    """The LM head alone (`model.compute_logits`) at each batch size: ms a call (CUDA events)."""
    import torch
    runner = llm.model_runner
    if runner.device_type != "cuda":
        return {}
    hidden = runner.config.hf_config.hidden_size
    out = {}
    with torch.inference_mode():
        for n in sizes:
            h = torch.randn(n, hidden, device=runner.device, dtype=runner.dtype)
            for _ in range(3):
                runner.model.compute_logits(h)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                runner.model.compute_logits(h)
            end.record()
            torch.cuda.synchronize()
            out[str(n)] = start.elapsed_time(end) / iters
    return out


def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def print_table(result: dict, file=sys.stdout) -> None:
    s, p = result["summary"], print
    fl = s.get("floor", {})
    p(f"\nprofile4: {result['run']} on {result['machine']['device_name']}; {result['workload']['output_tokens']:,} "
      f"output tokens", file=file)
    p(f"plain generate {_fmt(s['plain_s'])} s ({_fmt(result.get('plain_tok_s'), ',.0f')} tok/s); batch-1 "
      f"{_fmt(result.get('batch1_tok_s'), ',.0f')} tok/s; instrumented "
      f"{s['total_s']:.2f} s; floor {_fmt(fl.get('floor_s'))} s (KV {_fmt(fl.get('kv_read_s'))}, weights "
      f"{_fmt(fl.get('weight_read_s'))}, prefill {_fmt(fl.get('prefill_s'))})", file=file)
    p(f"{'steps':>22} {'n':>6} {'wall s':>8} {'device s':>9} {'gpu idle s':>10} {'ms/step':>8} {'dev ms':>7} "
      f"{'host busy':>9} {'rows':>6} {'kv/row':>7}", file=file)

    def line(name, a):
        p(f"{name:>22} {a['steps']:>6} {a['wall_s']:>8.3f} {a['device_s']:>9.3f} {a['gpu_idle_s']:>10.3f} "
          f"{a['mean_wall_ms']:>8.3f} {_fmt(a['mean_device_ms'], '.3f'):>7} {a['mean_host_busy_ms']:>9.3f} "
          f"{a['mean_rows']:>6.1f} {a['mean_kv_tokens_per_row']:>7.0f}", file=file)
    line("prefill", s["prefill"])
    line("decode", s["decode"])
    for name, a in s["decode_buckets"].items():
        line(f"decode rows {name}", a)
    p(f"{'sum':>22} {'':>6} {s['prefill']['wall_s'] + s['decode']['wall_s'] + s['tail_s']:>8.3f} {s['device_s']:>9.3f} "
      f"{s['gpu_idle_s']:>10.3f}   (total {s['total_s']:.3f} s incl. {s['tail_s']:.3f} s of {s['tail_calls']} "
      "calls that launched nothing)", file=file)
    fit = s.get("decode_fit")
    if fit:
        p(f"decode device ms = {fit['fixed_ms']:.3f} + {fit['per_row_ms'] * 1000:.2f} us/row + "
          f"{fit['per_kv_token_ns']:.2f} ns/KV token (floor {_fmt(fit.get('kv_floor_ns_per_token'))} ns, "
          f"{_fmt(100 * fit['kv_bandwidth_fraction'] if 'kv_bandwidth_fraction' in fit else None, '.0f')} % of "
          f"bandwidth); over the run: fixed {fit['fixed_s']:.3f} s, rows {fit['per_row_s']:.3f} s, KV "
          f"{fit['kv_s']:.3f} s (rms residual {fit['rms_residual_ms']:.3f} ms)", file=file)
    if fit:
        p(f"where the instrumented run's {s['total_s']:.2f} s go: prefill {s['prefill']['wall_s']:.2f} (device "
          f"{s['prefill']['device_s']:.2f}); decode device {s['decode']['device_s']:.2f} = fixed {fit['fixed_s']:.2f} + "
          f"rows {fit['per_row_s']:.2f} + KV {fit['kv_s']:.2f}; GPU idle {s['gpu_idle_s']:.2f}; floor "
          f"{_fmt(fl.get('floor_s'))} = KV {_fmt(fl.get('kv_read_s'))} + weights {_fmt(fl.get('weight_read_s'))} + "
          f"prefill {_fmt(fl.get('prefill_s'))}", file=file)
    if result.get("probes"):
        p(f"\n{'probe rows:ctx':>15} {'step ms':>8} {'replay ms':>9} {'not hidden':>10} {'kernels':>8} "
          "device ms by family (one eager step)", file=file)
        for e in result["probes"]:
            fams = ", ".join(f"{k} {v:.3f}" for k, v in e.get("ms_by_family", {}).items())
            p(f"{str(e['rows']) + ':' + str(e['context']):>15} {e['step_ms']:>8.3f} {_fmt(e.get('graph_replay_ms'), '.3f'):>9} "
              f"{_fmt(e.get('host_not_hidden_ms'), '.3f'):>10} {_fmt(e.get('kernels_per_step'), '.0f'):>8} {fams}",
              file=file)
    pf = result.get("prefill_probe")
    if pf:
        fams = ", ".join(f"{k} {v:.2f}" for k, v in pf.get("ms_by_family", {}).items())
        p(f"prefill step of {pf.get('tokens')} tokens ({pf.get('rows')} rows): {pf['kernel_ms']:.2f} ms of kernels: {fams}",
          file=file)
    if result.get("lm_head_ms"):
        p("LM head alone, ms: " + ", ".join(f"batch {k}: {v:.3f}" for k, v in result["lm_head_ms"].items()), file=file)


def _shifted(prompts, vocab_limit: int):
    """The prompts with every token id moved up by one (mod vocab_limit): same lengths, no prefix-cache hit."""
    return [[(t + 1) % vocab_limit for t in p] for p in prompts]


def parse_probes(text: str):
    out = []
    for item in text.split(","):
        try:
            n, ctx = (int(x) for x in item.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: each probe is ROWS:CONTEXT, e.g. 256:512") from None
        if n < 1 or ctx < 2:
            raise argparse.ArgumentTypeError(f"{item!r}: ROWS >= 1 and CONTEXT >= 2")
        out.append((n, ctx))
    return out


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(prog="python -m nanovllm_bench.workload_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for profile4_<tag>.json")
    ap.add_argument("--run", default=None, help="the nanovllm_ref run, BACKEND:MODE[:OPTION...] as the bench's "
                                                "--runs (default triton:graph on CUDA, cpu:eager on a CPU)")
    ap.add_argument("--cpu-tiny", action="store_true", help="the tiny model and a small workload on the CPU")
    ap.add_argument("--num-requests", type=int, default=None, help="default 256 (GPU), 8 (--cpu-tiny)")
    ap.add_argument("--probes", type=parse_probes, default=None, help="decode probes ROWS:CONTEXT,... "
                    "(default 1:512,64:512,128:1024,256:512,256:1024 on CUDA)")
    ap.add_argument("--no-kernel-profile", action="store_true", help="probes time steps only (no torch.profiler)")
    ap.add_argument("--no-probes", action="store_true", help="the workload run only")
    ap.add_argument("--batch1", type=int, default=0, help="batch-1 runs as the bench makes them (the workload's "
                    "first prompt cut to its batch1_prompt tokens, batch1_tokens new tokens): how many (median)")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)

    import torch
    from nanovllm_bench.cli import _runs
    from nanovllm_bench.floor import model_stats, physical_floor
    from nanovllm_bench.harness import RUN_OPTIONS, ref_row_name
    from nanovllm_bench.machine import device_name, measure_machine, project_commit, versions
    from nanovllm_bench.workload import (WARMUP_PROMPT, WARMUP_TOKENS, cpu_tiny_workload, gpu_workload,
                                         make_model_folder)
    from nanovllm_ref import LLM, SamplingParams
    from transformers import AutoConfig

    cuda = torch.cuda.is_available() and not args.cpu_tiny
    if cuda:
        workload = gpu_workload(args.num_requests or 256)
        engine_args = dict(max_model_len=4096, max_num_seqs=512, max_num_batched_tokens=16384, kvcache_block_size=256)
    else:
        workload = cpu_tiny_workload(args.num_requests or 8)
        engine_args = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, kvcache_block_size=16,
                           device="cpu")
    (backend, eager, options), = _runs(args.run or ("triton:graph" if cuda else "cpu:eager"))
    for o in options:
        engine_args.update(RUN_OPTIONS[o])
    engine_args.update(attention_backend=backend, enforce_eager=eager)
    run_name = ref_row_name(backend, eager, 1, options)
    prompts, max_tokens = workload.draw()
    tmp = tempfile.mkdtemp(prefix="profile4_")
    path = make_model_folder(workload.model, os.path.join(tmp, "model"))
    hf = AutoConfig.from_pretrained(path)
    stats = model_stats(hf)
    device = "cuda" if cuda else "cpu"
    machine = measure_machine(device)
    machine.update(device=device, device_name=device_name(device), commit=project_commit(), **versions())
    floor = physical_floor(prompts, max_tokens, stats, machine["copy_bandwidth_Bps"], machine["matmul_flops"])
    budget_t0 = time.perf_counter()
    print(f"profile4: {run_name}, {len(prompts)} requests, {sum(max_tokens):,} output tokens; floor "
          f"{floor['floor_s']:.2f} s", flush=True)

    t = time.perf_counter()
    llm = LLM(path, load_format="dummy", **engine_args)
    T = workload.temperature
    llm.generate([list(WARMUP_PROMPT)], SamplingParams(temperature=T, max_tokens=WARMUP_TOKENS, ignore_eos=True),
                 use_tqdm=False)
    startup_s = time.perf_counter() - t
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, [SamplingParams(temperature=T, ignore_eos=True, max_tokens=m) for m in max_tokens],
                        use_tqdm=False)
    sync()
    plain_s = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"plain generate: {plain_s:.3f} s, {produced / plain_s:,.0f} tok/s (start-up {startup_s:.1f} s)", flush=True)

    rows, total_s = run_instrumented(llm, _shifted(prompts, min(hf.vocab_size, 10001)), max_tokens, T)
    batch1 = []
    for _ in range(args.batch1):
        sync()
        t = time.perf_counter()
        out = llm.generate([prompts[0][:workload.batch1_prompt]], SamplingParams(
            temperature=T, max_tokens=workload.batch1_tokens, ignore_eos=True), use_tqdm=False)
        sync()
        batch1.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - t))
    summary = summarize(rows, total_s, plain_s, floor, stats["kv_bytes_per_token"], machine["copy_bandwidth_Bps"])
    runner = llm.model_runner
    import nanovllm_ref
    result = dict(tag=args.tag or ("h200" if "H200" in machine["device_name"] else device), run=run_name,
                  engine_path=os.path.dirname(os.path.abspath(nanovllm_ref.__file__)),
                  engine_args=engine_args, machine=machine, startup_s=startup_s, plain_tok_s=produced / plain_s,
                  batch1_tok_s=statistics.median(batch1) if batch1 else None, batch1_runs=batch1,
                  workload=dict(workload.to_dict(), prompt_tokens=sum(map(len, prompts)), output_tokens=produced),
                  engine=dict(backend=runner.backend_name, cuda_graphs=runner.graph_runner is not None,
                              async_scheduling=llm.async_scheduling,
                              decode_kernels=getattr(getattr(runner.model, "kernels", None), "enabled", lambda: [])()),
                  summary=summary,
                  steps=[[r["kind"], r["tokens"], r["rows"], r["kv_tokens"], round(1000 * r["wall_s"], 4),
                          None if r["device_ms"] is None else round(r["device_ms"], 4), round(r["launch_ms"], 4),
                          round(r["wait_ms"], 4)] for r in rows],
                  steps_columns=["kind", "tokens", "rows", "kv_tokens", "wall_ms", "device_ms", "launch_ms",
                                 "wait_ms"])
    if not args.no_probes:
        layers = hf.num_hidden_layers
        result["probes"] = []
        for n, ctx in args.probes or (GPU_PROBES if cuda else CPU_PROBES):
            if n > llm.config.max_num_seqs or ctx + 64 > llm.config.max_model_len:
                continue
            result["probes"].append(probe_decode(llm, n, ctx, layers, kernel_profile=not args.no_kernel_profile))
            print(f"probe {n}:{ctx}: step {result['probes'][-1]['step_ms']:.3f} ms", flush=True)
        if not args.no_kernel_profile:
            result["prefill_probe"] = probe_prefill(llm, llm.config.max_num_batched_tokens,
                                                    min(1024, llm.config.max_model_len // 2))
        result["lm_head_ms"] = lm_head_ms(llm)
    llm.exit()
    result["profile_wall_s"] = time.perf_counter() - budget_t0
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, f"profile4_{result['tag']}.json")
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    print(f"\nwritten: {out_path} ({result['profile_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
