"""The online benchmark client (nanovllm_bench/serve.py, `python -m nanovllm_bench serve`): its workload and
arrivals, and a small run against the server with the fake engine, record and figure included."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from serve_helpers import ROOT, ServerProcess, child_env, make_tokenizer_dir

from nanovllm_bench import serve as serve_bench


def test_workload_is_upstream_bench_workload():
    prompts, max_tokens = serve_bench.make_workload()
    assert len(prompts) == len(max_tokens) == 256
    assert (sum(map(len, prompts)), sum(max_tokens)) == (142_827, 133_966)      # shared/README.md totals
    assert all(0 <= t <= 10000 for p in prompts for t in p)


def test_arrivals_are_poisson_at_the_rate_and_inf_is_all_at_once():
    times = serve_bench.arrival_times(4000, 20.0, seed=1)
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps > 0).all()
    assert abs(gaps.mean() - 1 / 20) < 0.1 / 20                 # mean gap 1/rate
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1              # exponential: std = mean
    assert serve_bench.arrival_times(5, 20.0, seed=1) == times[:5]
    assert serve_bench.arrival_times(3, math.inf) == [0.0, 0.0, 0.0]


def test_percentile_matches_numpy():
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 50, 90, 99, 100):
        assert serve_bench.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert serve_bench.percentile([], 50) is None


def test_rates_flag_is_checked():
    assert serve_bench.parse_rates("2, 8.5,inf") == [2.0, 8.5, math.inf]
    for bad in ("0", "-1", "fast", ""):
        with pytest.raises(ValueError, match="--rates"):
            serve_bench.parse_rates(bad)


def test_client_runs_the_rates_against_the_fake_server_and_plots(tmp_path):
    model_dir = make_tokenizer_dir(tmp_path / "tok")
    record, figure = tmp_path / "serve_fake.json", tmp_path / "serve_fake.png"
    workload = dict(num_requests=6, seed=0, min_len=4, max_len=12, min_out=3, max_out=8, max_id=300)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in workload.items()]
    with ServerProcess(tmp_path, model_dir, {"step_delay": 0.002}) as srv:
        run = subprocess.run([sys.executable, "-m", "nanovllm_bench", "serve", "run", "--base-url", srv.url, "--server", "fake",
                              "--rates", "20,inf", "--record", str(record), "--time-limit", "60", "--client-procs", "2", *flags],
                             cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
        adds = srv.events("add")
    data = json.loads(record.read_text())
    assert data["workload"] == "serve"
    _, max_tokens = serve_bench.make_workload(**workload)
    runs = data["servers"]["fake"]["runs"]
    assert [r["rate"] for r in runs] == [20.0, "inf"]
    for r in runs:
        assert (r["completed"], r["failed"], r["wrong_length"]) == (6, 0, 0)
        assert r["output_tokens"] == sum(max_tokens)
        assert 0 < r["ttft_ms"]["p50"] <= r["e2e_s"]["p50"] * 1e3
        assert r["tpot_ms"]["p50"] > 0 and r["output_throughput"] > 0 and r["request_throughput"] > 0
        assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        # two client processes shared the requests; each request's [sent, TTFT, E2E] (ms) and tokens, in order
        assert r["client_procs"] == 2 and r["client_cpu_s"] > 0
        assert [q[3] for q in r["requests"]] == max_tokens
        assert all(q[0] >= 0 and 0 < q[1] <= q[2] for q in r["requests"])
        # /health before and after the rate: the server's loop counted this rate's steps
        before, after = r["health"]["before"], r["health"]["after"]
        assert after["loop"]["steps"] > before["loop"]["steps"] and after["loop"]["step_s"] > before["loop"]["step_s"]
    assert serve_bench.health_snapshot("http://127.0.0.1:9") is None        # nothing listens: no snapshot, no error
    # Token-id prompts reach the engine as they are, with max_tokens and ignore_eos (plus the warm-up request).
    prompts, _ = serve_bench.make_workload(**workload)
    sent = sorted((a["prompt_token_ids"], a["max_tokens"], a["ignore_eos"]) for a in adds[1:])
    assert sent == sorted([(p, m, True) for p, m in zip(prompts, max_tokens)] * 2)
    # the bench's own command (as `run` above): `python -m nanovllm_ref bench` would import the engine's torch first
    # (2.5 s) only to forward; test_bench.py::test_the_bench_commands_forward_from_the_engine_cli holds the forwarding
    plot = subprocess.run([sys.executable, "-m", "nanovllm_bench", "serve", "plot", "--record", str(record), "--figure",
                           str(figure)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overhead_measures_the_same_workload_offline_and_through_the_server(tmp_path):
    from nanovllm_bench import serve_overhead
    from nanovllm_models.tiny import make_tiny_model
    model = make_tiny_model(str(tmp_path / "tiny"), "qwen3")
    record = serve_overhead.measure(model, streams=3, max_tokens=6, repeats=1)
    off, srv = record["offline"], record["server"]
    assert off["advance"]["steps"] == off["step"]["steps"] == 6          # one prefill, then 5 decode steps
    assert srv["steps"] >= 6                                              # requests may join over several steps
    for r in (off["advance"], off["step"]):
        assert 0 < r["cpu_ms_per_step"] and 0 < r["wall_ms_per_step"]
    assert 0 < srv["step_ms_per_step"] <= srv["tick_ms_per_step"] and srv["http_cpu_ms_per_step"] > 0
    assert "ms per step" in serve_overhead.summary(record)
