"""How much host time the server adds to an engine step (serving chapter, "Performance sanity").

    python -m nanovllm_bench serve overhead --model tiny --streams 16 --record bench/results/serve_overhead_cpu.json
    python -m nanovllm_bench serve overhead --model ~/.cache/nanovllm_ref/models/SmolLM2-135M-Instruct \
        --max-tokens 32 --record bench/results/serve_overhead_cpu.json

One workload, four ways, on the CPU:
1. `advance` : LLMEngine.advance() until done, the bare engine step (no outputs built; what generate runs);
2. `step`    : LLMEngine.step() until done: the same step plus one RequestOutput per running request;
3. `server`  : `python -m nanovllm_ref serve --engine-core thread` in its own process, `streams` clients
   streaming the same requests at once (httpx, SSE); the server's engine loop reports its own host time (GET
   /health "loop": engine.step() seconds, whole ticks, and _deliver on the event loop);
4. `server_process`: the same with `--engine-core process` (issue 28): the core steps in a process of its
   own; the server's engine thread is the front end (detokenizing, RequestOutputs). Per step here means per
   core step (GET /health "engine": core_steps, and core_step_s, the core's own seconds in them).

Per step (milliseconds, median of `repeats` runs): the bare step, the step with outputs (their difference
is output building), and in the server: engine.step() as the loop measured it (GIL waits included: the
event loop formats SSE chunks in the same process), the whole tick, _deliver, and wall time / steps (what a
client sees). "Added by the server" = server wall per step - advance per step. The workload: `streams`
requests of random token ids (lengths 16..48), max_tokens tokens each, ignore_eos, greedy.
"""
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ENGINE = dict(device="cpu", max_model_len=256, kvcache_block_size=16, max_num_seqs=16)
FLAGS = ["--device", "cpu", "--max-model-len", "256", "--kvcache-block-size", "16", "--max-num-seqs", "16"]


def workload(streams: int, max_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(streams)]


def offline_run(engine, prompts, sp, kind: str) -> dict:
    """One run of the workload through engine.advance() or engine.step(): per-step wall and CPU ms."""
    for p in prompts:
        engine.add_request(p, sp)
    steps, start, cpu = 0, time.perf_counter(), time.thread_time()
    while not engine.is_finished():
        getattr(engine, kind)()
        steps += 1
    return {"steps": steps, "wall_ms_per_step": (time.perf_counter() - start) / steps * 1e3,
            "cpu_ms_per_step": (time.thread_time() - cpu) / steps * 1e3}


async def _stream_all(url: str, prompts, max_tokens: int) -> float:
    import httpx
    body = dict(model="m", max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)

    async def one(client, prompt):
        async with client.stream("POST", url + "/v1/completions", json={**body, "prompt": prompt}) as res:
            if res.status_code != 200:
                raise RuntimeError(f"HTTP {res.status_code}: {await res.aread()!r:.200}")
            async for _ in res.aiter_lines():
                pass

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        return time.perf_counter() - start


def start_server(model: str, port: int, log_path: str, flags=FLAGS, startup_s: float = 180):
    """`python -m nanovllm_ref serve` on 127.0.0.1:port, served as model name "m"; returns the process once
    GET /health answers. Raises RuntimeError with the log's tail if it does not come up."""
    import httpx
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm_ref", "serve", "--model", model, "--port", str(port),
                             "--served-model-name", "m", "--log-level", "warning", *flags],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    log.close()
    raise RuntimeError(f"the server did not start: {open(log_path).read()[-2000:]}")


def stop_server(proc) -> int:
    import signal
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_run(url: str, prompts, max_tokens: int) -> dict:
    """One run of the workload through the server, streamed by len(prompts) clients at once: per-step times
    from the loop's own counters (GET /health before and after). With a process core, per core step, and
    `core_step_ms_per_step` the core's own time."""
    import httpx
    h0 = httpx.get(url + "/health", timeout=10).json()
    wall = asyncio.run(_stream_all(url, prompts, max_tokens))
    h1 = httpx.get(url + "/health", timeout=10).json()
    before, after = h0["loop"], h1["loop"]
    d = {k: after[k] - before[k] for k in after}
    steps = d["steps"]
    core = {}
    if "core_steps" in h1["engine"]:
        steps = h1["engine"]["core_steps"] - h0["engine"]["core_steps"]
        core = {"front_end_calls": d["steps"],
                "core_step_ms_per_step": (h1["engine"]["core_step_s"] - h0["engine"]["core_step_s"]) / steps * 1e3}
    return {"steps": steps, "wall_ms_per_step": wall / steps * 1e3, **core,
            **{f"{k[:-2]}_ms_per_step": d[k] / steps * 1e3 for k in ("step_s", "tick_s", "busy_s", "engine_cpu_s",
                                                                        "deliver_s")},
            # CPU time of everything but the engine's ticks: the event loop (HTTP, SSE chunks), the hand-off
            "http_cpu_ms_per_step": (d["process_cpu_s"] - d["engine_cpu_s"]) / steps * 1e3}


def measure(model: str, streams: int = 16, max_tokens: int = 64, repeats: int = 3,
            engine_cores=("thread", "process")) -> dict:
    """The record: workload, offline and server per-step times (ms, medians), and what the server adds per
    step, for each `serve --engine-core` in engine_cores ("server" for thread, "server_process" for process). The three ways alternate, run after run, so a load that comes and goes on a shared machine
    falls on all of them; CPU times (thread_time / process_time) are less sensitive to it than wall times."""
    import torch
    from transformers import AutoConfig

    from nanovllm_ref import SamplingParams
    from nanovllm_ref.engine.llm_engine import LLMEngine
    prompts = workload(streams, max_tokens, AutoConfig.from_pretrained(model).vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    names = {"thread": "server", "process": "server_process"}
    servers, logs = {}, tempfile.mkdtemp(prefix="serve_overhead_")
    engine = None
    runs = {"advance": [], "step": [], **{names[c]: [] for c in engine_cores}}
    try:
        for core in engine_cores:
            port = free_port()
            servers[names[core]] = (start_server(model, port, os.path.join(logs, f"server_{core}.log"),
                                                 [*FLAGS, "--engine-core", core]), f"http://127.0.0.1:{port}")
        engine = LLMEngine(model, **ENGINE)
        for _, url in servers.values():
            asyncio.run(_stream_all(url, prompts[:1], 4))              # warm-up, all
        offline_run(engine, prompts[:1], SamplingParams(temperature=0, max_tokens=4), "advance")
        for _ in range(repeats):
            runs["advance"].append(offline_run(engine, prompts, sp, "advance"))
            runs["step"].append(offline_run(engine, prompts, sp, "step"))
            for name, (_, url) in servers.items():
                runs[name].append(served_run(url, prompts, max_tokens))
    finally:
        if engine is not None:
            engine.exit()
        for proc, _ in servers.values():
            stop_server(proc)
    med = {kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in runs.items()}
    off = {k: med[k] for k in ("advance", "step")}
    srv = med.get("server") or med["server_process"]
    split = {}
    if "server_process" in med:
        sp_ = med["server_process"]
        split = {"server_process": sp_,
                 "server_process_adds_ms_per_step": sp_["wall_ms_per_step"] - off["advance"]["wall_ms_per_step"]}
    return {"workload": "serve_overhead", "model": os.path.basename(os.path.normpath(model)), "streams": streams,
            "max_tokens": max_tokens, "prompt_tokens": sum(map(len, prompts)), "repeats": repeats,
            "engine": ENGINE, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "offline": off, "server": srv, **split,
            "output_building_ms_per_step": off["step"]["cpu_ms_per_step"] - off["advance"]["cpu_ms_per_step"],
            "engine_thread_extra_cpu_ms_per_step": srv["engine_cpu_ms_per_step"] - off["step"]["cpu_ms_per_step"],
            "server_adds_ms_per_step": srv["wall_ms_per_step"] - off["advance"]["wall_ms_per_step"],
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def summary(record: dict) -> str:
    off, srv = record["offline"], record["server"]
    return (f"{record['streams']} streams x {record['max_tokens']} tokens, {record['model']} (ms per step, wall / CPU): "
            f"advance {off['advance']['wall_ms_per_step']:.2f} / {off['advance']['cpu_ms_per_step']:.2f}, "
            f"step {off['step']['wall_ms_per_step']:.2f} / {off['step']['cpu_ms_per_step']:.2f}; server: "
            f"engine.step {srv['step_ms_per_step']:.2f}, cycle {srv['busy_ms_per_step']:.2f}, wall "
            f"{srv['wall_ms_per_step']:.2f}; CPU engine thread {srv['engine_cpu_ms_per_step']:.2f}, HTTP side "
            f"{srv['http_cpu_ms_per_step']:.2f}, deliver {srv['deliver_ms_per_step']:.3f}; "
            f"{srv['steps']:.0f} steps vs {off['advance']['steps']:.0f} offline"
            + (f"; process core: wall {record['server_process']['wall_ms_per_step']:.2f}, core step "
               f"{record['server_process']['core_step_ms_per_step']:.2f}, front-end CPU "
               f"{record['server_process']['engine_cpu_ms_per_step']:.2f}, HTTP side "
               f"{record['server_process']['http_cpu_ms_per_step']:.2f} per core step"
               if "server_process" in record else ""))


def main(args) -> int:
    model = args.model
    if model == "tiny":
        from nanovllm_models.tiny import make_tiny_model
        model = make_tiny_model(tempfile.mkdtemp(prefix="serve_overhead_tiny_"), "qwen3")
    record = measure(model, args.streams, args.max_tokens, args.repeats)
    if args.model == "tiny":
        record["model"] = "tiny (nanovllm_models.tiny, qwen3)"
    print(summary(record))
    if args.record:                # one file, one entry per (model, streams, max_tokens): a new run replaces it
        book = {"workload": "serve_overhead", "runs": []}
        if os.path.exists(args.record):
            with open(args.record) as f:
                book = json.load(f)
        key = lambda r: (r["model"], r["streams"], r["max_tokens"])      # noqa: E731
        book["runs"] = [r for r in book["runs"] if key(r) != key(record)] + [record]
        os.makedirs(os.path.dirname(os.path.abspath(args.record)), exist_ok=True)
        with open(args.record, "w") as f:
            json.dump(book, f, indent=1)
    return 0
