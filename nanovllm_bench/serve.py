"""Online serving benchmark: one OpenAI-compatible server, Poisson arrivals at several request rates.

The same client and load run against our server (`python -m nanovllm_ref serve`) and against `vllm serve`
(bench/gpu_serve.sh runs both on the H200 in one call). Load: the bench workload of upstream nano-vllm's
bench.py (nanovllm_bench/workload.py: 256 requests; random.seed(0); prompt token ids randint(0, 10000) of
lengths randint(100, 1024), then max_tokens randint(100, 1024); ignore_eos; temperature 0.6), sent as token-id prompts to
/v1/completions with `stream: true` and `stream_options.include_usage` (vLLM accepts both, and `ignore_eos`
as one of its extra fields; so does our server). Request i is sent at the i-th arrival of a Poisson process
of the given rate (exponential gaps, seeded); rate "inf" sends them all at once.

Per request: TTFT (send -> first chunk with text), end-to-end latency (send -> last chunk), TPOT
((e2e - TTFT) / (output tokens - 1)), output tokens from the usage chunk. Per rate: p50 / p99 / mean of
each, request throughput (requests / s) and output token throughput (output tokens / s) over the run's
duration (first send -> last completion), and the failures. The vLLM benchmark client
(`vllm bench serve`) defines the same metrics.

    python -m nanovllm_bench serve run --base-url http://127.0.0.1:8000 --server nanovllm_ref \
        --rates 8,16,32,inf --record bench/results/serve_h200.json
    python -m nanovllm_bench serve plot --record bench/results/serve_h200.json --figure figures/serve_latency.png
    python -m nanovllm_bench serve model /tmp/qwen3-0.6b     # the model folder both servers open
    python -m nanovllm_bench serve overhead --model tiny     # host time the server adds per step (serve_overhead.py)

(`python -m nanovllm_ref bench serve ...` is the same.) `run` adds (or replaces) the server's entry in the
record, so several servers share one record and one figure. Needs httpx (and matplotlib for `plot`);
imports nothing from the engine.
"""
import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import time

from nanovllm_bench.workload import QWEN3_06B, make_workload

WORKLOAD = dict(num_requests=256, seed=0, min_len=100, max_len=1024, min_out=100, max_out=1024, max_id=10000)


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s from the start) of n requests: a Poisson process of `rate` requests/s; inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def request_metrics(sent: float, events, output_tokens: int | None, error: str | None) -> dict:
    """One streamed request's latencies, from what its client saw (times in s, on one clock).

    sent: when the request was sent. events: (time, text) of every chunk with choices, in arrival order (a
    chunk may carry no text: a chat stream's role chunk, a finish_reason chunk). output_tokens: from the
    usage chunk; None: the number of chunks with text. error: None if the request succeeded.
    TTFT = first chunk with text - sent; E2E = last chunk with text - sent; TPOT = (E2E - TTFT) /
    (output tokens - 1), for a successful request of more than one token (None otherwise, and for a failed
    one: the summary leaves failed requests out)."""
    text_times = [t for t, text in events if text]
    if error is None and not text_times:
        error = "no text arrived"
    ttft = text_times[0] - sent if text_times else None
    e2e = text_times[-1] - sent if text_times else None
    tokens = len(text_times) if output_tokens is None else output_tokens
    tpot = (e2e - ttft) / (tokens - 1) if error is None and tokens > 1 else None
    return {"sent": sent, "ttft": ttft, "e2e": e2e, "tpot": tpot, "output_tokens": tokens, "chunks": len(text_times),
            "error": error}


async def one_request(client, url: str, body: dict, start: float) -> dict:
    """Stream one completion. Returns its request_metrics (times in s from `start`)."""
    sent = time.perf_counter()
    events, tokens, error = [], None, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        error = str(msg["error"])
                        break
                    if msg.get("usage"):
                        tokens = msg["usage"]["completion_tokens"]
                    choices = msg.get("choices") or []
                    if choices:
                        events.append((time.perf_counter() - start, choices[0].get("text")))
    except Exception as exc:                                # a dropped connection counts as a failure
        error = f"{type(exc).__name__}: {exc}"
    return request_metrics(sent - start, events, tokens, error)


async def _send_requests(base_url: str, model: str, prompts, max_tokens, times, indices, start: float,
                         temperature: float, time_limit: float) -> list[dict]:
    """Requests `indices` of one rate, request i sent at `start + times[i]` (perf_counter seconds: one clock
    for every process of this machine). Requests still open after `time_limit` s are cancelled (failed)."""
    import httpx
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=len(indices) + 8, max_keepalive_connections=len(indices) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit, connect=30), limits=limits) as client:

        async def launch(i):
            await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": temperature,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            return await one_request(client, url, body, start)

        tasks = [asyncio.create_task(launch(i)) for i in indices]
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, start - time.perf_counter()) + time_limit)
        for task in pending:
            task.cancel()
    return [t.result() if t in done else {"error": f"cancelled after the time limit ({time_limit} s)",
                                          "output_tokens": 0} for t in tasks]


def _client_process(job: tuple) -> tuple[list[dict], float]:
    """One client process's share of a rate (multiprocessing): its results and its CPU seconds (imports left out)."""
    import httpx  # noqa: F401 (imported before the CPU clock starts)
    cpu = time.process_time()
    results = asyncio.run(_send_requests(*job))
    return results, time.process_time() - cpu


def run_rate(base_url: str, model: str, prompts, max_tokens, rate: float, temperature: float, seed: int,
             time_limit: float, procs: int = 1) -> dict:
    """All requests of one rate, from `procs` client processes (request i from process i % procs; one process
    is this one). A Python client streaming 256 requests at once can be the slowest party: its own event loop
    then decides when it reads a first token, and TTFT measures the client. `client_cpu_s` in the result is
    the client's CPU seconds over the run: near `duration_s` x procs means the client was saturated."""
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise ValueError(f"procs must be an int >= 1, got {procs!r}")
    times = arrival_times(len(prompts), rate, seed)
    start = time.perf_counter() + (0.0 if procs == 1 else 2.0)     # time for the processes to start
    indices = [list(range(k, len(prompts), procs)) for k in range(procs)]
    jobs = [(base_url, model, prompts, max_tokens, times, idx, start, temperature, time_limit) for idx in indices]
    if procs == 1:
        shares = [_client_process(jobs[0])]
    else:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(procs) as pool:
            shares = pool.map(_client_process, jobs)
    results = [None] * len(prompts)
    for idx, (share, _) in zip(indices, shares):
        for i, r in zip(idx, share):
            results[i] = r
    end = time.perf_counter()
    summary = summarize(results, max_tokens, rate, end - start)
    summary["client_procs"], summary["client_cpu_s"] = procs, sum(cpu for _, cpu in shares)
    return summary


def latency_summary(results: list[dict], wall_s: float) -> dict:
    """Latency and throughput of one run from its requests' request_metrics (times in s from the run's
    start). Failed requests are left out of everything but `failed`. duration: from the start to the last
    completion (wall_s when none completed); throughputs are over it. Percentiles interpolate linearly
    (numpy's default)."""
    ok = [r for r in results if r["error"] is None]
    finished = [r["sent"] + r["e2e"] for r in ok]
    duration = max(finished) if finished else wall_s           # from the first send to the last completion
    out_tokens = sum(r["output_tokens"] for r in ok)

    def stats(key, scale=1.0):
        xs = [r[key] * scale for r in ok if r[key] is not None]
        return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "mean": statistics.fmean(xs) if xs else None}

    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "request_throughput": len(ok) / duration if duration else None,
            "output_throughput": out_tokens / duration if duration else None, "output_tokens": out_tokens,
            "ttft_ms": stats("ttft", 1e3), "tpot_ms": stats("tpot", 1e3), "e2e_s": stats("e2e")}


def summarize(results: list[dict], max_tokens: list[int], rate: float, wall_s: float) -> dict:
    short = sum(1 for r, m in zip(results, max_tokens) if r["error"] is None and r["output_tokens"] != m)
    summary = latency_summary(results, wall_s)
    return {"rate": "inf" if math.isinf(rate) else rate, "num_requests": len(results),
            "completed": summary["completed"], "failed": summary["failed"], "wrong_length": short,
            "errors": sorted({r["error"] for r in results if r["error"]})[:5],
            **{k: v for k, v in summary.items() if k not in ("completed", "failed")},
            # Each request in send order: [sent, TTFT, E2E] in ms from the run's start and from its send, and its
            # output tokens (None where it failed): when the first tokens came, not only their percentiles.
            "requests": [[_ms(r.get("sent")), _ms(r.get("ttft")), _ms(r.get("e2e")), r.get("output_tokens")]
                         for r in results]}


def _ms(seconds):
    return None if seconds is None else round(seconds * 1e3, 2)


def health_snapshot(base_url: str):
    """GET /health's JSON body, or None when the server answers none (vLLM's /health has an empty body) or
    fails to answer within 5 s: a snapshot is a record's extra, never a reason for a run to fail."""
    import httpx
    try:
        res = httpx.get(base_url.rstrip("/") + "/health", timeout=5)
        body = res.json() if res.status_code == 200 and res.content else None
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def served_model(base_url: str) -> str:
    import httpx
    return httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rates takes numbers > 0 or 'inf', comma-separated; got {part!r}") from None
        if not rate > 0:
            raise ValueError(f"--rates takes numbers > 0 or 'inf'; got {part!r}")
        rates.append(rate)
    return rates


def cmd_run(args) -> int:
    rates = parse_rates(args.rates)
    workload = dict(WORKLOAD, num_requests=args.num_requests, seed=args.seed, min_len=args.min_len,
                    max_len=args.max_len, min_out=args.min_out, max_out=args.max_out, max_id=args.max_id)
    prompts, max_tokens = make_workload(**workload)
    model = args.model or served_model(args.base_url)
    warm = run_rate(args.base_url, model, [prompts[0][:16]], [16], math.inf, args.temperature, 0, args.time_limit)
    if warm["failed"]:
        print(f"warm-up request failed: {warm['errors']}", file=sys.stderr)
        return 1
    runs = []
    for rate in rates:
        before = health_snapshot(args.base_url)
        result = run_rate(args.base_url, model, prompts, max_tokens, rate, args.temperature, args.seed,
                          args.time_limit, args.client_procs)
        # Where the server spent this rate's steps, when its /health says (ours: the front end's loop timing
        # and the engine core's step timing, summed over its life, so the difference is this rate's).
        result["health"] = {"before": before, "after": health_snapshot(args.base_url)}
        runs.append(result)
        print(f"{args.server:14s} rate {result['rate']!s:>5}: {result['completed']}/{result['num_requests']} ok, "
              f"{result['output_throughput'] or 0:9.1f} out tok/s, {result['request_throughput'] or 0:6.2f} req/s, "
              f"TTFT p50 {result['ttft_ms']['p50'] or 0:8.1f} ms, TPOT p50 {result['tpot_ms']['p50'] or 0:6.2f} ms, "
              f"E2E p50 {result['e2e_s']['p50'] or 0:6.2f} s, client CPU {result['client_cpu_s']:.1f} s "
              f"in {result['client_procs']} process(es)", flush=True)
    record = {}
    if args.record and os.path.exists(args.record):
        with open(args.record) as f:
            record = json.load(f)
    record.setdefault("workload", "serve")
    record["load"] = {**workload, "temperature": args.temperature, "ignore_eos": True, "stream": True,
                      "prompt_tokens": sum(map(len, prompts)), "max_tokens_total": sum(max_tokens),
                      "rates": [r["rate"] for r in runs], "arrivals": "poisson (exponential gaps, seeded)"}
    record.setdefault("servers", {})[args.server] = {
        "model": model, "base_url": args.base_url, "notes": args.notes, "runs": runs,
        "client": {"python": platform.python_version(), "host": platform.node()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.record:
        os.makedirs(os.path.dirname(os.path.abspath(args.record)), exist_ok=True)
        with open(args.record, "w") as f:
            json.dump(record, f, indent=1)
    failed = sum(r["failed"] + r["wrong_length"] for r in runs)
    return 0 if failed == 0 else 3


def cmd_model(args) -> int:
    """A config-only Qwen3-0.6B folder both servers open, with a word-level tokenizer that knows every id of the
    vocabulary ("t0" .. "t151935", the special tokens at Qwen3's ids), so both servers detokenize every
    generated token as real servers do, and token-id prompts need no tokenizer at all."""
    import warnings

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config
    os.makedirs(args.path, exist_ok=True)
    cfg = Qwen3Config(**QWEN3_06B, pad_token_id=151643)
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(args.path)
    specials = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
    vocab = {specials.get(i, f"t{i}"): i for i in range(QWEN3_06B["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                pad_token="<|endoftext|>", unk_token="t0").save_pretrained(args.path)
    print(args.path)
    return 0


def cmd_wait(args) -> int:
    """Poll GET /health until it answers 200 (0), the server process `--pid` is gone (1) or the timeout (1)."""
    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.timeout:
        if args.pid:
            try:
                os.kill(args.pid, 0)
            except ProcessLookupError:
                print("the server exited during start-up")
                return 1
        try:
            if httpx.get(args.base_url.rstrip("/") + "/health", timeout=5).status_code == 200:
                print(f"ready after {time.monotonic() - t0:.0f} s")
                return 0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    print(f"not ready after {args.timeout} s")
    return 1


def cmd_plot(args) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(args.record) as f:
        record = json.load(f)
    panels = [("ttft_ms", "time to first token (ms)"), ("tpot_ms", "time per output token (ms)"),
              ("e2e_s", "end-to-end latency (s)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for (key, label), ax in zip(panels, axes):
        for i, (name, server) in enumerate(sorted(record["servers"].items())):
            runs = [r for r in server["runs"] if r["completed"]]
            x = [r["output_throughput"] for r in runs]
            color = f"C{i}"
            ax.plot(x, [r[key]["p50"] for r in runs], "o-", color=color, label=f"{name} p50")
            ax.plot(x, [r[key]["p99"] for r in runs], "s--", color=color, alpha=0.6, label=f"{name} p99")
            for r, xi in zip(runs, x):
                label_text = "inf" if r["rate"] == "inf" else f"{r['rate']:g}"
                ax.annotate(label_text, (xi, r[key]["p50"]), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color=color)
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    load = record.get("load", {})
    fig.suptitle(f"Online serving, Poisson arrivals (labels: requests/s), {load.get('num_requests')} requests, "
                 f"{load.get('max_tokens_total')} output tokens, {args.title}".rstrip(", "))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.figure)), exist_ok=True)
    fig.savefig(args.figure, dpi=120)
    print(args.figure)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanovllm_bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run the load at each rate against one server")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--server", required=True, help="the name the record keeps this server's results under")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--rates", default="8,16,32,inf", help="requests/s, comma-separated; inf = all at once")
    p.add_argument("--record", default=None, help="JSON record to add this server's results to")
    p.add_argument("--notes", default="", help="free text kept with the results (server flags, versions)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--time-limit", type=float, default=300, help="seconds per rate before open requests are cancelled")
    p.add_argument("--client-procs", type=int, default=1,
                   help="client processes sharing the requests (request i from process i %% N); default 1")
    for name, default in (("num-requests", 256), ("seed", 0), ("min-len", 100), ("max-len", 1024), ("min-out", 100),
                          ("max-out", 1024), ("max-id", 10000)):
        p.add_argument(f"--{name}", type=int, default=default, help="workload (default: upstream bench.py's)")
    p = sub.add_parser("wait", help="wait until a server answers /health")
    p.add_argument("--base-url", required=True)
    p.add_argument("--pid", type=int, default=0, help="give up when this process is gone")
    p.add_argument("--timeout", type=float, default=200)
    p = sub.add_parser("model", help="write the Qwen3-0.6B-shaped folder (config + full-vocab tokenizer)")
    p.add_argument("path")
    p = sub.add_parser("overhead", help="host time the server adds to an engine step (CPU; serve_overhead.py)")
    p.add_argument("--model", default="tiny", help="model folder, or 'tiny' (a tiny random Qwen3)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--record", default=None, help="JSON file to write")
    p = sub.add_parser("plot", help="draw latency against throughput from a record")
    p.add_argument("--record", required=True)
    p.add_argument("--figure", required=True)
    p.add_argument("--title", default="")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "overhead":
            from nanovllm_bench import serve_overhead
            return serve_overhead.main(args)
        return {"run": cmd_run, "wait": cmd_wait, "model": cmd_model, "plot": cmd_plot}[args.cmd](args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

