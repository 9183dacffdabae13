"""Stand-in peers for the harness tests (tests/test_bench.py), run by `python -m nanovllm_bench.peer` in a
child process like the real ones: one that measures (no engine: it "generates" every requested token after
a short sleep), one that is unavailable, one that raises, one that dies, one that hangs."""
import os
import sys
import time

from nanovllm_bench.peer import Unavailable


class CountingPeer:
    device, fresh_per_run = "cpu", False

    def __init__(self):
        self.started = self.resets = 0

    def start(self):
        self.started += 1

    def generate(self, prompts, max_tokens, temperature):
        time.sleep(0.001 * len(prompts))
        return sum(max_tokens)

    def reset(self):
        self.resets += 1

    def info(self):
        return dict(versions=dict(peer="fake-1.0"), starts=self.started, resets=self.resets)

    def close(self):
        pass


def make(options, workload, model_dir):
    kind = options.get("kind", "ok")
    if kind == "unavailable":
        raise Unavailable("fake engine is not installed here")
    if kind == "raises":
        raise RuntimeError("fake engine blew up while starting")
    if kind == "dies":
        print("fake engine: out of memory", file=sys.stderr, flush=True)
        os._exit(7)
    if kind == "hangs":
        time.sleep(60)
    return CountingPeer()
