"""One peer, in a process of its own: `python -m nanovllm_bench.peer SPEC.json ROW.json` (the harness runs it).

Every peer follows the same protocol (`measure`), on the same workload (`nanovllm_bench.workload`):
1. start-up: build the engine, then one warm-up generate of WARMUP_PROMPT (WARMUP_TOKENS new tokens); the
   seconds of both are the start-up time;
2. `repeats` timed runs of the whole workload, each finding nothing cached from an earlier run: a fresh
   engine per run (`fresh_per_run`), or one engine whose prefix cache is off or reset before each run;
3. batch-1: one prompt (the workload's first prompt cut to `batch1_prompt` tokens), `batch1_tokens` new
   tokens, ignore_eos, at the workload's temperature; median of `batch1_repeats`;
4. the host: `machine.host_probe` after the start-up and again after batch-1 (`host_before`, `host_after`),
   since a host-bound peer moves with the host's speed and load; and `machine.python_loop_ns` just before each
   batch-1 run (`batch1_host_loop_ns`), since the lent hosts' speed flips within seconds.
A spec with `start_only` runs step 1 alone and closes the engine (the harness's warm start: it fills the
compile caches that the measured process then finds).
The row keeps the median of the timed runs with min and max, every run, each start-up, the compiles counted
inside each timed run (where the peer compiles in this process), versions and the peer's own settings.

A peer module (nanovllm_bench/peers/*.py) defines `make(options, workload, model_dir) -> Peer`, and raises
`Unavailable` when its engine cannot run here (not importable, no CUDA). Exit status: 0 measured,
3 unavailable (the row says why), anything else failed (the harness keeps the last lines of stderr).
"""
import importlib
import json
import statistics
import sys
import time
from typing import Protocol

from nanovllm_bench.machine import compile_counts, compiles_between, host_probe, python_loop_ns, versions
from nanovllm_bench.workload import WARMUP_PROMPT, WARMUP_TOKENS, Workload

EXIT_UNAVAILABLE = 3


class Unavailable(Exception):
    """The peer cannot run here; the message is the row's reason."""


class Peer(Protocol):
    device: str              # "cuda" or "cpu"
    fresh_per_run: bool      # True: a new engine for every timed run; False: reset() before each run
    # optional `compiles_here = False`: the peer compiles in another process, so compiles are not counted

    def start(self) -> None: ...
    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> int: ...
    def reset(self) -> None: ...
    def info(self) -> dict: ...
    def close(self) -> None: ...


def _sync(device: str):
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def _start(peer: Peer, temperature: float) -> float:
    """Build the engine and run the warm-up generate; returns their seconds."""
    t = time.perf_counter()
    peer.start()
    peer.generate([list(WARMUP_PROMPT)], [WARMUP_TOKENS], temperature)
    _sync(peer.device)
    return time.perf_counter() - t


def measure(peer: Peer, workload: Workload, repeats: int = 3, batch1_repeats: int = 3) -> dict:
    """The protocol of the module docstring. Returns the row's measured fields."""
    prompts, max_tokens = workload.draw()
    T = workload.temperature
    startups, seconds, tokens, compiles, per_run = [], [], [], [], []
    for i in range(repeats):
        if i == 0 or peer.fresh_per_run:
            if i > 0:
                peer.close()
            startups.append(_start(peer, T))
        if i == 0:
            host_before = host_probe()
        peer.reset()
        _sync(peer.device)
        before = compile_counts()
        t = time.perf_counter()
        tokens.append(peer.generate(prompts, max_tokens, T))
        _sync(peer.device)
        seconds.append(time.perf_counter() - t)
        # None where the peer compiles in another process (vLLM's engine core): not measurable from here.
        compiles.append(compiles_between(before, compile_counts()) if getattr(peer, "compiles_here", True) else None)
        per_run.append(getattr(peer, "last_run", None))
    b1_prompt, b1, b1_host = prompts[0][:workload.batch1_prompt], [], []
    for _ in range(batch1_repeats):
        peer.reset()
        _sync(peer.device)
        b1_host.append(python_loop_ns())      # a batch-1 run lasts ~50 ms: within one of the host's spells
        t = time.perf_counter()
        n = peer.generate([b1_prompt], [workload.batch1_tokens], T)
        _sync(peer.device)
        b1.append(n / (time.perf_counter() - t))
    host_after = host_probe()
    info = peer.info()
    peer.close()
    out = tokens[0]
    run_tok_s = [n / s for n, s in zip(tokens, seconds)]
    row = dict(status="ok", output_tokens=out, expected_output_tokens=sum(max_tokens),
               seconds=statistics.median(seconds), tok_s=statistics.median(run_tok_s), min_tok_s=min(run_tok_s),
               max_tok_s=max(run_tok_s), repeats=repeats, run_seconds=seconds, run_tok_s=run_tok_s,
               run_output_tokens=tokens, startup_s=startups[0], startup_seconds=startups,
               fresh_engine_per_run=peer.fresh_per_run, compiles_in_timed_run=compiles,
               batch1_tok_s=statistics.median(b1) if b1 else None, batch1_runs=b1, batch1_host_loop_ns=b1_host,
               batch1=dict(prompt_tokens=len(b1_prompt), new_tokens=workload.batch1_tokens),
               versions=dict(versions(), **info.pop("versions", {})), info=info, host_before=host_before,
               host_after=host_after)
    if any(r is not None for r in per_run):
        row["per_run"] = per_run
    return row


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec_path, row_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    workload = Workload(**spec["workload"])
    module = importlib.import_module(spec["module"])
    try:
        peer = module.make(spec.get("options", {}), workload, spec["model_dir"])
        if spec.get("start_only"):
            row = dict(status="ok", start_only=True, startup_s=_start(peer, workload.temperature))
            peer.close()
        else:
            row = measure(peer, workload, spec.get("repeats", 3), spec.get("batch1_repeats", 3))
    except Unavailable as exc:
        with open(row_path, "w") as f:
            json.dump(dict(status="missing", reason=str(exc)), f)
        print(f"unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    with open(row_path, "w") as f:
        json.dump(row, f)
    return 0


if __name__ == "__main__":
    try:
        # Through the module's own name, so that peer modules' `Unavailable` is the class caught here (run as
        # a script this file is `__main__`, another copy of the module).
        from nanovllm_bench import peer as _peer
        code = _peer.main()
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Engines leave threads and atexit hooks (vLLM's engine core, nano-vllm's process group) that can hang
    # an ordinary exit after the row is written.
    import os
    os._exit(code)
