"""Where does one served prefill step's time go? (issue 28: a prefill step cost 28-44 ms on the H200 whatever
its size.) Run from a project checkout on a CUDA machine: `bash bench/gpu_run.sh prefill-step`.

The engine is built as `bench/gpu_serve.sh` builds the server's (Qwen3-0.6B shape, dummy weights, bf16,
max_model_len 4096, no prefix caching). For prompts of 128, 564, 1024 and 4096 tokens, and 16 prompts of 564
at once, it times `repeat` single prefill steps (max_tokens=1, so the step is the whole request):
- wall: the core's step() until its ids are on the host;
- device: CUDA events around the model runner's execute + sample;
- host: wall time of the forward's Python (launches return before the kernels finish; a synchronize follows).
Then one torch.profiler trace (CPU + CUDA) of a 564-token prefill step: the top ops by self CPU time and by
CUDA time, and the number of kernels launched. Writes $OUT/prefill_step.json. PREFILL_GRAPHS=0: the engine with
max_prefill_graph_tokens=0 (every prefill step eager); unset or 1: the default (prefill CUDA graphs).
"""
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.getcwd())
from nanovllm_bench.workload import make_model_folder  # noqa: E402
from nanovllm_ref import LLM, SamplingParams  # noqa: E402

out_dir = os.environ.get("OUT") or tempfile.gettempdir()
graphs = os.environ.get("PREFILL_GRAPHS")
kwargs = dict(load_format="dummy", dtype="bfloat16", max_model_len=4096, enable_prefix_caching=False)
if graphs == "0":
    kwargs["max_prefill_graph_tokens"] = 0          # prefill graphs off: every prefill step eager
path = make_model_folder("qwen3-0.6b", tempfile.mkdtemp())
t0 = time.perf_counter()
llm = LLM(path, **kwargs)
start_s = time.perf_counter() - t0
engine = llm.llm_engine if hasattr(llm, "llm_engine") else llm
runner = engine.model_runner
result = {"engine_start_s": round(start_s, 2), "kwargs": kwargs, "cases": {},
          "prefill_graph_sizes": list(runner.plan.prefill_graph_sizes), "plan": runner.plan.describe()}
print(runner.plan.describe(), flush=True)

execute, sample = runner.execute, runner.sample
marks = {}


def timed_execute(message):
    marks["t_exec0"] = time.perf_counter()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    out = execute(message)
    marks["t_exec1"] = time.perf_counter()
    marks["ev"] = (ev0, ev1)
    return out


def timed_sample(*a, **k):
    out = sample(*a, **k)
    marks["ev"][1].record()
    marks["t_sample1"] = time.perf_counter()
    return out


runner.execute, runner.sample = timed_execute, timed_sample   # a probe of this script only
sp = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True)
import random  # noqa: E402
random.seed(0)


def one(lengths, repeat=6):
    rows = []
    for r in range(repeat):
        for n in lengths:
            llm.add_request([random.randint(0, 10000) for _ in range(n)], sp)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while not llm.is_finished():
            llm.step()
        wall = time.perf_counter() - t
        ev0, ev1 = marks["ev"]
        ev1.synchronize()
        rows.append(dict(wall_ms=wall * 1e3, device_ms=ev0.elapsed_time(ev1),
                         forward_host_ms=(marks["t_exec1"] - marks["t_exec0"]) * 1e3,
                         forward_sample_host_ms=(marks["t_sample1"] - marks["t_exec0"]) * 1e3))
    rows = rows[1:]       # the first of each shape may meet a first-time cost
    med = {k: round(sorted(r[k] for r in rows)[len(rows) // 2], 3) for k in rows[0]}
    return med


for name, lengths in [("128", [128]), ("564", [564]), ("1024", [1024]), ("4096", [4096]), ("16x564", [564] * 16)]:
    result["cases"][name] = one(lengths)
    print(name, json.dumps(result["cases"][name]), flush=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402
llm.add_request([random.randint(0, 10000) for _ in range(564)], sp)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    while not llm.is_finished():
        llm.step()
    torch.cuda.synchronize()
events = prof.key_averages()
kernels = sum(e.count for e in events if getattr(getattr(e, "device_type", None), "name", "") == "CUDA")
cpu_table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
cuda_table = events.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70)
print(cpu_table[:9000], flush=True)
print(cuda_table[:6000], flush=True)
result.update(kernels_564=kernels, profile_cpu=cpu_table, profile_cuda=cuda_table)
llm.exit() if hasattr(llm, "exit") else None
with open(os.path.join(out_dir, "prefill_step.json"), "w") as f:
    json.dump(result, f, indent=1)
print("kernels in one 564-token prefill step:", kernels)
