"""Stand-in peers for the harness tests (tests/test_bench.py), run by `python -m nanovllm_bench.peer` in a
child process like the real ones: one that measures (no engine: it "generates" every requested token after
a short sleep), one that is unavailable, one that raises, one that dies, one that hangs, one that fails in
the first process that starts it and runs in every later one (`fails_once`: a marker in the model folder),
and one with a compile cache (`cache`: its start-up looks for a marker in the model folder, as vLLM looks for
its torch.compile cache, and leaves one; it also adds one entry, named after its pid, to $TRITON_CACHE_DIR
where that is set; `info` says whether it found the marker).

Every process appends what it does to CALLS_LOG in the model folder, one line each: "<pid> make <kind>",
"<pid> start", "<pid> generate <n_prompts> <sum of max_tokens>", "<pid> close"; `read_calls` reads it back."""
import os
import sys
import time

from nanovllm_bench.peer import Unavailable

CALLS_LOG = "fake_calls.log"


def _log(model_dir, what):
    if model_dir:
        with open(os.path.join(model_dir, CALLS_LOG), "a") as f:
            f.write(f"{os.getpid()} {what}\n")


def read_calls(model_dir) -> list[tuple[int, str]]:
    """(pid, what) for every line of model_dir's CALLS_LOG, in order ([] when there is none)."""
    path = os.path.join(model_dir, CALLS_LOG)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(pid), what) for pid, what in (ln.rstrip("\n").split(" ", 1) for ln in f if ln.strip())]


class CountingPeer:
    device, fresh_per_run = "cpu", False

    def __init__(self, cache_marker=None, model_dir=None, fail_marker=None):
        self.started = self.resets = 0
        self.cache_marker, self.found_cache = cache_marker, None
        self.model_dir, self.fail_marker = model_dir, fail_marker

    def start(self):
        _log(self.model_dir, "start")
        self.started += 1
        if self.fail_marker and not os.path.exists(self.fail_marker):
            open(self.fail_marker, "w").close()
            raise RuntimeError("fake engine fails the first time it starts")
        if self.cache_marker:
            self.found_cache = os.path.exists(self.cache_marker)
            open(self.cache_marker, "w").close()
            if os.environ.get("TRITON_CACHE_DIR"):
                os.makedirs(os.environ["TRITON_CACHE_DIR"], exist_ok=True)
                open(os.path.join(os.environ["TRITON_CACHE_DIR"], f"fake_kernel_{os.getpid()}"), "w").close()

    def generate(self, prompts, max_tokens, temperature):
        _log(self.model_dir, f"generate {len(prompts)} {sum(max_tokens)}")
        time.sleep(0.001 * len(prompts))
        return sum(max_tokens)

    def reset(self):
        self.resets += 1

    def info(self):
        return dict(versions=dict(peer="fake-1.0"), starts=self.started, resets=self.resets,
                    found_cache=self.found_cache)

    def close(self):
        _log(self.model_dir, "close")


def make(options, workload, model_dir):
    kind = options.get("kind", "ok")
    _log(model_dir, f"make {kind}")
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
        return CountingPeer(os.path.join(model_dir, "fake_compile_cache"), model_dir)
    if kind == "fails_once":
        return CountingPeer(model_dir=model_dir, fail_marker=os.path.join(model_dir, "fake_failed_once"))
    return CountingPeer(model_dir=model_dir)
