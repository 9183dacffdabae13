"""Where a process's Python threads spend their time: a sampling profiler in pure Python (issue 28's front-end
profile on the lent GPU machine, which has no py-spy, perf or ptrace).

    NANOVLLM_STACK_SAMPLE=/tmp/out/stacks PYTHONPATH=bench/stack_sample:$PYTHONPATH python3 -m nanovllm_ref serve ...
    python -m nanovllm_bench.stack_sampler report /tmp/out/stacks*.json [--top 25] [--json summary.json]

With NANOVLLM_STACK_SAMPLE set, `bench/stack_sample/sitecustomize.py` calls `start()` in every Python process
that starts (the server, and the engine core it spawns: multiprocessing's spawn runs a fresh interpreter,
which reads sitecustomize too). A daemon thread wakes every `interval_s` (default 2 ms), reads every other
thread's current frame (`sys._current_frames`) and counts the stack, as "file:function" names from the
outermost frame in. Every few seconds and at exit it writes `<prefix>.<pid>.json`: the process's command
line, the interval, and per phase and thread name, the count of each stack. Phases: while the file
`<prefix>.phase` exists, samples count under the name it holds (a benchmark writes "rate-32" into it before
that rate's requests and deletes it after); without it they count under "-" (start-up, idle).

What a count means: the share of samples in which that thread was in that stack, waiting included (a thread
blocked in a socket poll, a lock or a sleep shows there). The sampler needs the GIL to read the frames, so a
sample lands at the next moment the running thread lets go of it (every `sys.getswitchinterval()`, 5 ms, at
the latest): short Python-only stretches are under-counted against calls that release the GIL. It is
coarse, and it costs the process one GIL hand-off per sample; use it for where whole milliseconds go.

`report` adds the files up and prints, per process and thread, the functions with the most samples: "self"
(the stack's innermost frame) and "total" (anywhere in the stack), with shares of that thread's samples.
"""
import argparse
import atexit
import collections
import json
import os
import sys
import threading
import time

DEFAULT_INTERVAL_S = 0.002
WRITE_EVERY_S = 3.0
MAX_DEPTH = 48


def _frame_name(code) -> str:
    """"file:function", the file named from our package down (nanovllm_ref/engine/core.py) or from below the
    library folder (fastapi/routing.py); elsewhere by its last three path parts."""
    parts = code.co_filename.replace("\\", "/").split("/")
    for root, keep_root in (("nanovllm_ref", True), ("nanovllm_bench", True), ("site-packages", False),
                            ("dist-packages", False), ("lib", False)):
        if root in parts:
            i = len(parts) - 1 - parts[::-1].index(root)       # the innermost such folder
            parts = parts[i if keep_root else i + 1:]
            break
    return f"{'/'.join(parts[-3:])}:{code.co_name}"


def _stack(frame) -> str:
    names = []
    while frame is not None and len(names) < MAX_DEPTH:
        names.append(_frame_name(frame.f_code))
        frame = frame.f_back
    return ";".join(reversed(names))


class StackSampler:
    """Counts every thread's stack every `interval_s` seconds; `write()` saves them to `path` (JSON)."""

    def __init__(self, path: str, interval_s: float = DEFAULT_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.path = path
        self.interval_s = interval_s
        self.phase_path = None
        # {phase: {thread name: Counter of stacks}}, and samples per phase
        self.counts: dict = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
        self.samples: collections.Counter = collections.Counter()
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> "StackSampler":
        self._thread.start()
        atexit.register(self.close)
        return self

    def close(self) -> None:
        """Stop sampling and write the file (at exit)."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.write()

    def _run(self) -> None:
        me = threading.get_ident()
        last_write = last_phase = time.monotonic()
        phase = self._phase()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            if now - last_phase > 0.1:
                phase, last_phase = self._phase(), now
            counts = self.counts[phase]
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    counts[names.get(ident, str(ident))][_stack(frame)] += 1
            self.samples[phase] += 1
            if now - last_write > WRITE_EVERY_S:
                self.write()
                last_write = time.monotonic()

    def _phase(self) -> str:
        if self.phase_path is None:
            return "-"
        try:
            with open(self.phase_path) as f:
                return f.read().strip() or "-"
        except OSError:
            return "-"

    def write(self) -> None:
        data = {"pid": os.getpid(), "argv": sys.argv, "interval_s": self.interval_s, "samples": dict(self.samples),
                "wall_s": time.time() - self.started,
                "phases": {phase: {name: dict(c.most_common()) for name, c in list(threads.items())}
                           for phase, threads in list(self.counts.items())}}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)


def start_from_env() -> StackSampler | None:
    """Start a sampler if NANOVLLM_STACK_SAMPLE names a path prefix (NANOVLLM_STACK_SAMPLE_INTERVAL_S: seconds)."""
    prefix = os.environ.get("NANOVLLM_STACK_SAMPLE")
    if not prefix:
        return None
    interval = float(os.environ.get("NANOVLLM_STACK_SAMPLE_INTERVAL_S", DEFAULT_INTERVAL_S))
    sampler = StackSampler(f"{prefix}.{os.getpid()}.json", interval)
    sampler.phase_path = f"{prefix}.phase"
    return sampler.start()


def summarize(paths: list[str], top: int = 25, phase: str | None = None) -> list[dict]:
    """Per (process, phase, thread): samples, and the `top` functions by self and by total share."""
    out = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        argv = " ".join(data.get("argv") or [])
        for ph, threads in data["phases"].items():
            if phase is not None and ph != phase:
                continue
            for thread, stacks in threads.items():
                n = sum(stacks.values())
                if n == 0:
                    continue
                own, total = collections.Counter(), collections.Counter()
                for stack, count in stacks.items():
                    frames = stack.split(";")
                    own[frames[-1]] += count
                    for name in set(frames):
                        total[name] += count
                out.append({"file": os.path.basename(path), "argv": argv[:160], "phase": ph, "thread": thread,
                            "samples": n, "self": [[k, round(v / n, 4)] for k, v in own.most_common(top)],
                            "total": [[k, round(v / n, 4)] for k, v in total.most_common(top)]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanovllm_bench.stack_sampler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="add up sample files and print the top functions per thread")
    rep.add_argument("paths", nargs="+")
    rep.add_argument("--top", type=int, default=25)
    rep.add_argument("--min-samples", type=int, default=50, help="leave out threads with fewer samples")
    rep.add_argument("--phase", help="only this phase")
    rep.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    rows = [r for r in summarize(args.paths, args.top, args.phase) if r["samples"] >= args.min_samples]
    for r in rows:
        print(f"\n== {r['file']} phase {r['phase']} [{r['thread']}] {r['samples']} samples: {r['argv']}")
        print("   self:")
        for name, share in r["self"]:
            print(f"     {share * 100:5.1f} %  {name}")
        print("   total:")
        for name, share in r["total"]:
            print(f"     {share * 100:5.1f} %  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
