"""The harness: every peer in a process of its own, on the same workload, into one record (chapter 11).

`plan_peers` turns the command line into `PeerSpec`s; `run_peer` runs one as
`python -m nanovllm_bench.peer SPEC ROW` (protocol in nanovllm_bench/peer.py) with its own PYTHONPATH, a
time limit and a log file; `run_all` runs them one after another. A peer that cannot run still gets its row:
status "missing" (its engine is not importable, or needs CUDA) or "failed" / "timeout" with the last lines
of its stderr; the others run all the same. `make_record` adds the machine, the date and the floor, and
`pct_of_floor` to every measured row; `save_record` writes JSON + CSV.

Row names: `nanovllm_ref[<backend>:<graph|eager>]` (`,tpN` added for tensor parallel), `vllm`,
`nano-vllm`, `hf_transformers[continuous_batching]`.
"""
import csv
import datetime as dt
import importlib.machinery
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from nanovllm_bench.floor import pct_of_floor
from nanovllm_bench.machine import compile_cache_census

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = ("nanovllm_ref", "vllm", "nano-vllm", "hf")
HF_NAME = "hf_transformers[continuous_batching]"
STDERR_TAIL = 15


@dataclass(frozen=True)
class PeerSpec:
    """One row to measure. module: a nanovllm_bench.peers module (or any with `make`); options: what its
    `make` takes; sys_path: folders put first on the child's PYTHONPATH; needs: a top-level module that must
    be findable there for the peer to be tried at all (else the row says "missing"); needs_cuda: likewise.
    warm_start: run the peer's start-up once, untimed, in a process of its own before the measured one
    (run_peer)."""
    name: str
    peer: str
    module: str
    options: dict = field(default_factory=dict)
    sys_path: tuple = ()
    needs: str | None = None
    needs_cuda: bool = False
    repeats: int = 3
    batch1_repeats: int = 3
    gpus: int = 1
    warm_start: bool = False


# Options of a nanovllm_ref run (`--runs triton:graph:sync`) -> the engine arguments they set.
RUN_OPTIONS = {"sync": dict(async_scheduling=False), "nokernels": dict(decode_kernels="off"),
               "persistent": dict(decode_kernels="persistent")}


def ref_row_name(backend: str, eager: bool, tp: int = 1, options: tuple[str, ...] = ()) -> str:
    opts = "".join(f":{o}" for o in options)
    return f"nanovllm_ref[{backend}:{'eager' if eager else 'graph'}{opts}{f',tp{tp}' if tp > 1 else ''}]"


def plan_peers(peers, runs, engine_args: dict, *, cuda: bool, repeats: int, hf_repeats: int,
               batch1_repeats: int, nanovllm_src: str | None = None, hf_batch1_repeats: int = 1,
               warm_start=()) -> list[PeerSpec]:
    """The rows of one call, in order: vllm first (the measuring stick, and the slowest to start: on the H200
    on 2026-12-01 it took 100 s to its first request and timed out when it ran after our rows), then
    nanovllm_ref's runs (backend, eager), nano-vllm, HF (~180 s a run: it goes last). warm_start: the peer
    families (as in `peers`) whose rows get an untimed start first (PeerSpec.warm_start)."""
    specs, tp = [], engine_args.get("tensor_parallel_size", 1)
    bad = [p for p in warm_start if p not in PEERS]
    if bad:
        raise ValueError(f"warm_start: {', '.join(map(repr, bad))} is not a peer; choose from {', '.join(PEERS)}")
    idle = [p for p in warm_start if p not in peers]
    if idle:
        raise ValueError(f"warm_start: {', '.join(map(repr, idle))} is not among the peers this call runs "
                         f"({', '.join(peers) or 'none'})")
    if "vllm" in peers:
        specs.append(PeerSpec("vllm", "vllm", "nanovllm_bench.peers.vllm", needs="vllm", needs_cuda=True,
                              repeats=repeats, batch1_repeats=batch1_repeats, warm_start="vllm" in warm_start))
    if "nanovllm_ref" in peers:
        for backend, eager, *rest in runs:
            options = tuple(rest[0]) if rest else ()
            args = dict(engine_args)
            for o in options:
                args.update(RUN_OPTIONS[o])
            specs.append(PeerSpec(ref_row_name(backend, eager, tp, options), "nanovllm_ref", "nanovllm_bench.peers.ref",
                                  dict(backend=backend, eager=eager, engine_args=args),
                                  repeats=repeats, batch1_repeats=batch1_repeats, gpus=tp,
                                  warm_start="nanovllm_ref" in warm_start))
    if "nano-vllm" in peers:
        src = (os.path.abspath(nanovllm_src),) if nanovllm_src else ()
        specs.append(PeerSpec("nano-vllm", "nano-vllm", "nanovllm_bench.peers.upstream",
                              dict(src=src[0] if src else None), sys_path=src, needs="nanovllm", needs_cuda=True,
                              repeats=repeats, batch1_repeats=batch1_repeats, warm_start="nano-vllm" in warm_start))
    if "hf" in peers:
        specs.append(PeerSpec(HF_NAME, "hf", "nanovllm_bench.peers.hf", needs_cuda=True, repeats=hf_repeats,
                              batch1_repeats=hf_batch1_repeats, warm_start="hf" in warm_start))
    return specs


def _findable(module: str, sys_path) -> bool:
    """Whether a top-level module is on sys_path + this process's path, without importing it."""
    return importlib.machinery.PathFinder.find_spec(module, list(sys_path) + sys.path) is not None


def _tail(text: str, n: int = STDERR_TAIL) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and "DEBUG" not in ln]
    return "\n".join(lines[-n:])


def _run_child(spec: PeerSpec, workload, model_dir: str, timeout_s: float, log_path: str,
               start_only: bool = False) -> tuple[int | None, dict | None, str]:
    """One `python -m nanovllm_bench.peer` process: (exit code or None past timeout_s, its row or None, the last
    lines of its output). Its output goes to log_path."""
    tmp = tempfile.mkdtemp(prefix="peer_")
    spec_path, row_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "row.json")
    with open(spec_path, "w") as f:
        json.dump(dict(module=spec.module, options=spec.options, workload=workload.to_dict(), model_dir=model_dir,
                       repeats=spec.repeats, batch1_repeats=spec.batch1_repeats, start_only=start_only), f)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([*spec.sys_path, ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with open(log_path, "w") as log:
        # A session of its own, so that a timeout ends the peer's own children too (TP workers, vLLM's
        # engine core), not the peer alone.
        proc = subprocess.Popen([sys.executable, "-m", "nanovllm_bench.peer", spec_path, row_path], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        # Whatever the peer left running (vLLM's engine core holds most of the GPU memory) goes with it, so
        # the next peer starts on an empty GPU.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    with open(log_path) as f:
        tail = _tail(f.read())
    row = None
    if code is not None and os.path.exists(row_path):
        with open(row_path) as f:
            row = json.load(f)
    return code, row, tail


def run_peer(spec: PeerSpec, workload, model_dir: str, *, cuda: bool, timeout_s: float, log_dir: str) -> dict:
    """Measure one peer in a child process; always returns a row (with `status` and, unless ok, `reason`).

    The row also says what the peer could find cached from earlier processes (`caches_before`:
    machine.compile_cache_census just before its process started). With `spec.warm_start` an untimed process
    first runs the peer's start-up alone (its start-up seconds and caches go in the row's `warm_start`), so
    that the measured process starts as it would on a machine that has run it before; both share timeout_s
    (a timeout reason then gives the time that was left). wall_s is the measured process's, the warm start's
    is its own. A warm start that finds the peer cannot run here ends the row as "missing".
    """
    base = dict(name=spec.name, peer=spec.peer, floor_gpus=spec.gpus)
    if spec.needs_cuda and not cuda:
        return dict(base, status="missing", reason="needs CUDA")
    if spec.needs and not _findable(spec.needs, spec.sys_path):
        return dict(base, status="missing", reason=f"not importable: no module {spec.needs!r} on this Python's path")
    if timeout_s <= 1:
        return dict(base, status="timeout", reason="not started: the call's time budget was spent")
    os.makedirs(log_dir, exist_ok=True)
    stem = os.path.join(log_dir, "".join(c if c.isalnum() or c in "-_" else "_" for c in spec.name))
    name = os.path.basename(stem)
    if spec.warm_start:
        caches, t = compile_cache_census(), time.perf_counter()
        code, wrow, tail = _run_child(spec, workload, model_dir, timeout_s, stem + "_warm_start.log", start_only=True)
        warm = dict(caches_before=caches, wall_s=time.perf_counter() - t, log=name + "_warm_start.log")
        if code is None:
            warm.update(status="timeout", reason=f"ran past {timeout_s:.0f} s; last lines:\n{tail}")
        elif code == 0 and wrow and wrow.get("status") == "ok":
            warm.update(status="ok", startup_s=wrow["startup_s"])
        elif wrow and wrow.get("status") == "missing":        # it cannot run here: no measured process either
            return dict(base, status="missing", reason=wrow.get("reason", ""), warm_start=dict(warm, status="missing"))
        else:
            # The measured process still runs (its own start-up is then a cold one, and the row says so).
            warm.update(status="failed", reason=f"exit {code}; last lines of its output:\n{tail}")
        base["warm_start"] = warm
        timeout_s -= warm["wall_s"]
        if timeout_s <= 1:
            return dict(base, status="timeout", reason="not started: the warm start took the peer's time")
    caches, t = compile_cache_census(), time.perf_counter()
    code, row, tail = _run_child(spec, workload, model_dir, timeout_s, stem + ".log")
    out = dict(base, wall_s=time.perf_counter() - t, log=name + ".log", caches_before=caches)
    if code is None:
        left = " (the time left after the warm start)" if spec.warm_start else ""
        return dict(out, status="timeout", reason=f"ran past {timeout_s:.0f} s{left}; last lines:\n{tail}")
    if row is not None:                              # measured (exit 0), or the child said why it cannot run (3)
        return dict(out, **row)
    return dict(out, status="failed", reason=f"exit {code}; last lines of its output:\n{tail}")


def run_all(specs, workload, model_dir: str, *, cuda: bool, log_dir: str, peer_timeout_s: float = 600,
            deadline_s: float | None = None, floor_s: float | None = None, log=print) -> list[dict]:
    """run_peer for each spec in order, within `deadline_s` seconds in all (None: no limit)."""
    rows, t0 = [], time.perf_counter()
    for spec in specs:
        left = peer_timeout_s if deadline_s is None else min(peer_timeout_s, deadline_s - (time.perf_counter() - t0))
        row = run_peer(spec, workload, model_dir, cuda=cuda, timeout_s=left, log_dir=log_dir)
        if row.get("status") == "ok" and floor_s:
            row["pct_of_floor"] = pct_of_floor(floor_s, row["seconds"], spec.gpus)
        rows.append(row)
        log(describe_row(row))
    return rows


def describe_row(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row['name']:40s} {row.get('status')}: {row.get('reason', '')}"
    spread = f" ({row['min_tok_s']:,.0f}-{row['max_tok_s']:,.0f}, median of {row['repeats']})"
    floor = f", {row['pct_of_floor']:.3g}% of floor" if row.get("pct_of_floor") else ""
    b1 = f"; batch-1 {row['batch1_tok_s']:,.0f} tok/s" if row.get("batch1_tok_s") else ""
    warm = row.get("warm_start")
    if warm:
        warm = (f" (after an untimed one of {warm['startup_s']:.1f} s)" if warm.get("status") == "ok" else
                f" (its untimed start-up {'timed out' if warm.get('status') == 'timeout' else warm.get('status')})")
    host = ""
    hb, ha = row.get("host_before"), row.get("host_after")
    if hb and ha:
        busy = "" if hb.get("cpu_busy") is None or ha.get("cpu_busy") is None else \
            f", CPUs busy {100 * hb['cpu_busy']:.0f}-{100 * ha['cpu_busy']:.0f} %"
        host = f"; host: torch op {hb['torch_op_us']:.2f}-{ha['torch_op_us']:.2f} us{busy}"
    return (f"{row['name']:40s} {row['output_tokens']:>9,} tok {row['seconds']:8.2f} s {row['tok_s']:>10,.0f} tok/s"
            f"{spread}{floor}{b1}; start-up {row['startup_s']:.1f} s{warm or ''}{host}")


def make_record(tag: str, machine: dict, workload, totals: tuple, floor: dict, rows: list[dict],
                engine_args: dict, **extra) -> dict:
    """The call's record: machine, date, workload, floor and every row."""
    n_prompt, n_out = totals
    return dict(tag=tag, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
                time_utc=dt.datetime.now(dt.timezone.utc).strftime("%H:%M:%S"), machine=machine,
                workload=dict(workload.to_dict(), name=workload_name(workload), num_requests=workload.num_requests,
                              prompt_tokens=n_prompt, output_tokens=n_out, ignore_eos=True, engine_args=engine_args),
                floor=floor, runs=rows,
                protocol=("each peer in its own process; one warm-up generate; median of N timed runs with min and "
                          "max, none finding anything cached from an earlier run; batch-1: one prompt, ignore_eos, "
                          "median of its runs; the host probed before the timed runs and after batch-1, and its "
                          "Python loop timed before each batch-1 run; a row with warm_start had its start-up run "
                          "once before, untimed, in a process of its own"),
                **extra)


def workload_name(workload) -> str:
    if workload.model == "qwen3-0.6b":
        return f"upstream bench.py: Qwen3-0.6B shape, random weights, {workload.num_requests} requests"
    return f"CPU mode: tiny random Qwen3, {workload.num_requests} requests"


CSV_COLUMNS = ("name", "status", "output_tokens", "seconds", "tok_s", "min_tok_s", "max_tok_s", "repeats",
               "pct_of_floor", "batch1_tok_s", "startup_s", "peer_version", "reason")


def save_record(record: dict, out_dir: str) -> str:
    """Write `bench_<tag>.json` and `.csv` into out_dir; returns the path stem."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"bench_{record['tag']}")
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=2)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in record["runs"]:
            peer_version = (r.get("versions") or {}).get("peer") or (r.get("versions") or {}).get("commit")
            w.writerow([r.get("name"), r.get("status", "ok" if r.get("tok_s") else "failed"), r.get("output_tokens"),
                        r.get("seconds"), r.get("tok_s"), r.get("min_tok_s"), r.get("max_tok_s"), r.get("repeats"),
                        r.get("pct_of_floor"), r.get("batch1_tok_s"), r.get("startup_s"), peer_version,
                        (r.get("reason") or r.get("error") or "").replace("\n", " | ")])
    return stem

