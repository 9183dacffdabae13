"""Host time of one decode step, without a model: scheduler.schedule(), the graph inputs' pack, and
scheduler.postprocess() for a batch of running sequences (CPU only; no GPU needed).

On the GPU these run while the device is idle: schedule and postprocess between two model-runner calls,
pack before the upload. So they bound how much asynchronous scheduling (planning step n+1 while the GPU runs
step n) could hide.

    python bench/host_step.py [--batch 256] [--steps 300] [--repeats 5] [--out FILE.json]

Prints one JSON object: the median over `repeats` runs of each part's median ms per step.
"""
import argparse
import json
import platform
import random
import statistics
import tempfile
import time

from nanovllm_bench.workload import make_model_folder
from nanovllm_ref.config import Config
from nanovllm_ref.engine.cuda_graph import StaticDecodeInputs
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.sampling_params import SamplingParams


def one_run(path: str, batch: int, steps: int, seed: int) -> dict:
    cfg = Config(path, max_num_seqs=512, max_num_batched_tokens=16384, kvcache_block_size=256,
                 max_model_len=4096).derived(num_kvcache_blocks=4000)
    sched, g = Scheduler(cfg), random.Random(seed)
    for _ in range(batch):      # prompts as in the bench workload (100-1024 tokens)
        sched.add(Sequence([g.randrange(10000) for _ in range(g.randrange(100, 1025))], 256,
                           SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=10**6)))
    while True:                 # prefill everything first (no model: every sampled id is 1)
        seqs, is_prefill = sched.schedule()
        if not is_prefill:
            break
        sched.postprocess(seqs, [1] * len(seqs))
    inputs = StaticDecodeInputs(512, 16, "cpu")
    parts = {"schedule": [], "pack": [], "postprocess": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        seqs, _ = sched.schedule()
        t1 = time.perf_counter()
        inputs.pack(seqs, 256, len(seqs))
        t2 = time.perf_counter()
        sched.postprocess(seqs, [7] * len(seqs))
        t3 = time.perf_counter()
        parts["schedule"].append(t1 - t0)
        parts["pack"].append(t2 - t1)
        parts["postprocess"].append(t3 - t2)
    return {k: 1000 * statistics.median(v) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = make_model_folder("tiny", tempfile.mkdtemp())
    runs = [one_run(path, args.batch, args.steps, seed) for seed in range(args.repeats)]
    ms = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result = dict(batch=args.batch, steps=args.steps, repeats=args.repeats, ms_per_step_median=ms,
                  total_ms=sum(ms.values()), runs=runs, machine=platform.processor() or platform.machine(),
                  python=platform.python_version())
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
