"""The host's speed over time: `python -m nanovllm_bench.host_watch --seconds S --every E --out FILE.json`.

`machine.host_probe` every E seconds for S seconds, in one process, with nothing else running: whether this
host's Python and op-dispatch speed moves by itself (on 2026-12-06's H100 machines the probe's loop took 78 ns at
some moments and 171-191 ns at others, within one peers call, with no CPU busy), and with it steal time, the
CPU the process ran on and that CPU's clock. `bench/gpu_run.sh host-watch` runs it on the lent GPU machine.
Writes {"machine": ..., "every_s", "samples": [{"t_s": ..., **probe}, ...], "summary": {...}}.
"""
import argparse
import json
import os
import statistics
import time

from nanovllm_bench.machine import host_probe


def summarise(samples: list[dict], slow_factor: float = 1.5) -> dict:
    """Median, min and max of the loop's ns; the samples slower than slow_factor x the fastest ('slow'), and
    for the slow and the other samples the medians of cpu_steal and cpu_mhz and the CPUs they ran on."""
    loop = [s["python_loop_ns"] for s in samples]
    fastest = min(loop)
    slow = [s for s in samples if s["python_loop_ns"] > slow_factor * fastest]
    fast = [s for s in samples if s["python_loop_ns"] <= slow_factor * fastest]

    def group(rows):
        def med(key):
            vals = [r[key] for r in rows if r.get(key) is not None]
            return statistics.median(vals) if vals else None
        return dict(n=len(rows), python_loop_ns=med("python_loop_ns"), torch_op_us=med("torch_op_us"),
                    cpu_steal=med("cpu_steal"), cpu_busy=med("cpu_busy"), cpu_mhz=med("cpu_mhz"),
                    cpus_seen=sorted({r["cpu"] for r in rows if r.get("cpu") is not None}))
    return dict(samples=len(samples), loop_ns_median=statistics.median(loop), loop_ns_min=fastest,
                loop_ns_max=max(loop), slow_factor=slow_factor, slow=group(slow), fast=group(fast))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanovllm_bench.host_watch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120.0, help="how long to watch (default 120)")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between probe starts (default 2)")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    if not args.seconds > 0:
        ap.error(f"argument --seconds: must be > 0, got {args.seconds}")
    if not args.every > 0:
        ap.error(f"argument --every: must be > 0, got {args.every}")
    samples, t0 = [], time.perf_counter()
    while True:
        t = time.perf_counter() - t0
        if t > args.seconds and samples:
            break
        samples.append(dict(t_s=round(t, 3), **host_probe()))
        time.sleep(max(0.0, args.every - (time.perf_counter() - t0 - t)))
    out = dict(every_s=args.every, seconds=args.seconds, cpus=os.cpu_count(), samples=samples,
               summary=summarise(samples))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    s = out["summary"]
    print(f"host_watch: {s['samples']} probes over {args.seconds:g} s: Python loop {s['loop_ns_min']:.0f}-"
          f"{s['loop_ns_max']:.0f} ns (median {s['loop_ns_median']:.0f}); {s['slow']['n']} slow "
          f"(> {s['slow_factor']}x the fastest)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
