"""Stand-in peers for the harness tests (tests/test_bench.py), run by `python -m nanovllm_bench.peer` in a
child process like the real ones: one that measures (no engine: it "generates" every requested token after
a short sleep), one that is unavailable, one that raises, one that dies, one that hangs, and one with a compile
cache (`cache`: its start-up looks for a marker in the model folder, as vLLM looks for its torch.compile cache,
and leaves one; `info` says whether it found it)."""
import os
import sys
import time

from nanovllm_bench.peer import Unavailable


class CountingPeer:
    device, fresh_per_run = "cpu", False

    def __init__(self, cache_marker=None):
        self.started = self.resets = 0
        self.cache_marker, self.found_cache = cache_marker, None

    def start(self):
        self.started += 1
        if self.cache_marker:
            self.found_cache = os.path.exists(self.cache_marker)
            open(self.cache_marker, "w").close()

    def generate(self, prompts, max_tokens, temperature):
        time.sleep(0.001 * len(prompts))
        return sum(max_tokens)

    def reset(self):
        self.resets += 1

    def info(self):
        return dict(versions=dict(peer="fake-1.0"), starts=self.started, resets=self.resets,
                    found_cache=self.found_cache)

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
    if kind == "cache":
        return CountingPeer(os.path.join(model_dir, "fake_compile_cache"))
    return CountingPeer()
