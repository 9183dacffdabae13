"""nanovllm_bench/stack_sampler.py, the pure-Python sampling profiler of `bench/gpu_run.sh serve-profile`: it
counts the stacks of the threads that run, by phase, and its report finds the function a thread was in."""
import json
import threading
import time

import pytest

from nanovllm_bench.stack_sampler import StackSampler, summarize


def _spin_here(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2000))                     # Python work, so the thread is seen in this function


def _wait_for_samples(sampler, phase: str, count: int) -> None:
    """Until the sampler has `count` samples in `phase` (a busy machine gives fewer a second: no fixed sleep),
    at most 6,000 polls; then the count itself is checked."""
    for _ in range(6000):
        if sampler.samples[phase] >= count:
            break
        time.sleep(0.01)
    assert sampler.samples[phase] >= count, f"the sampler took {sampler.samples[phase]} samples in phase {phase!r}"


def test_samples_count_each_thread_in_its_function_and_phase(tmp_path):
    path, phase = tmp_path / "stacks.json", tmp_path / "stacks.phase"
    sampler = StackSampler(str(path), interval_s=0.002)
    sampler.phase_path = str(phase)
    stop = threading.Event()
    worker = threading.Thread(target=_spin_here, args=(stop,), name="spinner")
    worker.start()
    sampler.start()
    _wait_for_samples(sampler, "-", 10)      # phase "-": no phase file
    phase.write_text("rate-inf\n")
    _wait_for_samples(sampler, "rate-inf", 21)
    phase.unlink()
    _wait_for_samples(sampler, "-", sampler.samples["-"] + 5)
    stop.set()
    worker.join()
    sampler.close()
    data = json.loads(path.read_text())
    assert set(data["phases"]) == {"-", "rate-inf"} and data["samples"]["rate-inf"] > 20
    rows = {(r["phase"], r["thread"]): r for r in summarize([str(path)], top=50)}
    spin = rows[("rate-inf", "spinner")]
    share = {name: v for name, v in spin["total"] if name.endswith("tests/test_bench_stack_sampler.py:_spin_here")}
    assert len(share) == 1 and list(share.values())[0] > 0.9, spin["total"][:5]
    assert ("rate-inf", "stack-sampler") not in rows          # the sampler leaves itself out
    assert summarize([str(path)], phase="-") and all(r["phase"] == "-" for r in summarize([str(path)], phase="-"))


def test_interval_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="interval_s"):
        StackSampler(str(tmp_path / "x.json"), interval_s=0)
