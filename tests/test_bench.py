"""The benchmark's workload, floor model and CPU mode."""
import json
import os

import pytest

from nanovllm_bench.cli import main
from nanovllm_bench.floor import model_stats, physical_floor
from nanovllm_bench.workload import QWEN3_06B, make_workload
from nanovllm_models.tiny import tiny_config


def test_default_workload_matches_upstream_bench_totals():
    prompts, max_tokens = make_workload(256)
    assert len(prompts) == 256 and len(max_tokens) == 256
    assert sum(map(len, prompts)) == 142_827
    assert sum(max_tokens) == 133_966
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(0 <= t <= 10000 for p in prompts for t in p)


def test_qwen3_06b_shape_and_physical_floor_match_hand_counts():
    stats = model_stats(tiny_config("qwen3", **QWEN3_06B))
    assert stats["kv_bytes_per_token"] == 114_688                 # 28 layers * 2 * 8 heads * 128 * 2 bytes
    assert stats["params"] == pytest.approx(596e6, rel=0.01)
    prompts, max_tokens = make_workload(256)
    floor = physical_floor(prompts, max_tokens, stats, bw_bytes_s=4.22e12, flops_s=790e12)
    assert floor["kv_bytes"] / 1e12 == pytest.approx(13.85, rel=0.01)   # decode reads ~13.9 TB of K/V
    assert floor["kv_read_s"] == pytest.approx(3.28, rel=0.01)
    assert floor["floor_s"] == pytest.approx(3.75, rel=0.03)
    assert 133_966 / floor["floor_s"] == pytest.approx(35_700, rel=0.03)


def test_cpu_tiny_mode_runs_every_peer_through_the_harness_and_writes_the_record(tmp_path):
    """The tiny CPU workload end to end: our row measured in its own process (median of 2 fresh engines, each
    timed run computing every prompt token, i.e. finding nothing cached), the GPU peers as rows with their
    reason, one record (JSON + CSV) with machine, date, floor and % of floor, and its figures."""
    assert main(["--cpu-tiny", "--num-requests", "6", "--repeats", "2", "--out", str(tmp_path),
                 "--figures", str(tmp_path), "--logs", str(tmp_path / "logs")]) == 0
    record = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert {"tag", "date", "machine", "workload", "floor", "runs"} <= set(record)
    assert record["machine"]["device"] == "cpu" and record["machine"]["torch"] and record["machine"]["transformers"]
    assert [r["name"] for r in record["runs"]] == ["vllm", "nanovllm_ref[cpu:eager]", "nano-vllm",
                                                   "hf_transformers[continuous_batching]"]
    ours = record["runs"][1]
    others = [r for r in record["runs"] if r is not ours]
    assert ours["status"] == "ok" and ours["output_tokens"] == record["workload"]["output_tokens"] > 0
    assert ours["repeats"] == 2 and len(ours["run_tok_s"]) == 2
    assert ours["min_tok_s"] <= ours["tok_s"] <= ours["max_tok_s"]
    assert ours["pct_of_floor"] == pytest.approx(100 * record["floor"]["floor_s"] / ours["seconds"])
    assert 0 < ours["pct_of_floor"] < 100
    assert ours["fresh_engine_per_run"] and len(ours["startup_seconds"]) == 2 and ours["startup_s"] > 0
    for run in ours["per_run"]:                       # nothing cached: every prompt token was computed
        assert run["preemptions"] == 0 and run["prefill_tokens"] == run["prompt_tokens"] == record["workload"]["prompt_tokens"]
    assert ours["batch1_tok_s"] > 0 and len(ours["batch1_runs"]) == 3
    assert len(ours["batch1_host_loop_ns"]) == 3 and all(0 < ns < 1e5 for ns in ours["batch1_host_loop_ns"])
    assert ours["batch1"] == dict(prompt_tokens=16, new_tokens=32)
    assert {"torch", "triton", "transformers"} <= set(ours["versions"])
    assert (tmp_path / "logs" / ours["log"]).exists()
    for r in others:
        assert r["status"] == "missing" and r["reason"] == "needs CUDA"
    csv_rows = (tmp_path / "bench_cpu.csv").read_text().splitlines()
    assert csv_rows[0].startswith("name,status,output_tokens,seconds,tok_s,min_tok_s,max_tok_s")
    assert csv_rows[1].startswith("vllm,missing,") and csv_rows[1].endswith("needs CUDA")
    for fig in ("bench_throughput_cpu.png", "bench_batch1_cpu.png"):
        assert (tmp_path / fig).stat().st_size > 1000


def test_cpu_tiny_mode_at_tensor_parallel_2_measures_against_two_devices_floor(tmp_path):
    """A TP=2 run reads weights and K/V on two devices at once: its % of floor is against half the one-device
    floor time (it was against one device's, which made TP=2 look twice as close to the floor as it was)."""
    assert main(["--cpu-tiny", "--num-requests", "4", "--repeats", "1", "--batch1-repeats", "1",
                 "--tensor-parallel-size", "2", "--peers", "nanovllm_ref", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_cpu.json").read_text())
    run = result["runs"][0]
    assert run["name"] == "nanovllm_ref[cpu:eager,tp2]" and run["floor_gpus"] == 2
    assert run["pct_of_floor"] == pytest.approx(100 * result["floor"]["floor_s"] / 2 / run["seconds"])


def test_cpu_tiny_honours_max_num_seqs_and_kvcache_block_size(tmp_path):
    assert main(["--cpu-tiny", "--num-requests", "5", "--repeats", "1", "--batch1-repeats", "0",
                 "--peers", "nanovllm_ref", "--max-num-seqs", "2", "--kvcache-block-size", "8",
                 "--max-num-batched-tokens", "512", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bench_cpu.json").read_text())
    args = record["runs"][0]["info"]["engine_args"]
    assert (args["max_num_seqs"], args["kvcache_block_size"], args["max_num_batched_tokens"]) == (2, 8, 512)
    assert record["workload"]["engine_args"]["max_num_seqs"] == 2


@pytest.mark.parametrize("argv,flag,words", [
    (["--cpu", "--workloads", "banana"], "--workloads", ["chat8", "chat32_eos"]),
    (["--cpu", "--threads", "abc"], "--threads", ["thread counts"]),
    (["--cpu-tiny", "--num-requests", "-3"], "--num-requests", [">= 1"]),
    (["--cpu-tiny", "--max-num-seqs", "0"], "--max-num-seqs", [">= 1"]),
    (["--cpu-tiny", "--kvcache-block-size", "x"], "--kvcache-block-size", ["whole number"]),
    (["--cpu-tiny", "--peers", "nanovllm_ref,sglang"], "--peers", ["sglang", "nano-vllm"]),
    (["--runs", "triton:fast"], "--runs", ["graph or eager"]),
    (["--warm-start", "vllm,sglang"], "--warm-start", ["sglang", "nano-vllm"]),
    (["--cpu", "--cpu-tiny"], "--cpu-tiny", ["not allowed"]),
])
def test_bad_flags_exit_2_naming_the_flag_and_what_is_allowed(capsys, argv, flag, words):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err
    for w in words:
        assert w in err


def test_row_names_begin_with_the_peer_family():
    from nanovllm_bench.harness import plan_peers, ref_row_name
    assert ref_row_name("triton", False) == "nanovllm_ref[triton:graph]"
    assert ref_row_name("flash_attn", True, tp=2) == "nanovllm_ref[flash_attn:eager,tp2]"
    specs = plan_peers(["nanovllm_ref", "vllm", "nano-vllm", "hf"], [("triton", False), ("flash_attn", False)],
                       dict(tensor_parallel_size=1), cuda=True, repeats=3, hf_repeats=1, batch1_repeats=3,
                       nanovllm_src="/tmp/upstream")
    assert [s.name for s in specs] == ["vllm", "nanovllm_ref[triton:graph]", "nanovllm_ref[flash_attn:graph]",
                                       "nano-vllm", "hf_transformers[continuous_batching]"]
    assert specs[3].sys_path == ("/tmp/upstream",) and specs[3].options["src"] == "/tmp/upstream"
    assert specs[0].sys_path == ()          # nothing of nano-vllm's (its flash_attn stand-in) on vLLM's path
    assert specs[4].repeats == 1 and specs[1].repeats == 3


def _fake(name, kind, **kw):
    from pathlib import Path

    from nanovllm_bench.harness import PeerSpec
    return PeerSpec(name, "fake", "bench_fake_peers", dict(kind=kind), sys_path=(str(Path(__file__).parent),),
                    repeats=2, batch1_repeats=1, **kw)


def test_a_missing_or_failing_peer_gets_a_row_with_the_reason_and_the_others_still_run(tmp_path):
    from nanovllm_bench.harness import run_all
    from nanovllm_bench.workload import cpu_tiny_workload
    specs = [_fake("vllm", "ok", needs="vllm_not_installed_anywhere"), _fake("nano-vllm", "unavailable"),
             _fake("fake[first]", "ok"), _fake("fake[raises]", "raises"), _fake("fake[dies]", "dies"),
             _fake("fake[last]", "ok")]
    wl = cpu_tiny_workload(4)
    rows = run_all(specs, wl, str(tmp_path), cuda=False, log_dir=str(tmp_path / "logs"), floor_s=0.01,
                   log=lambda _: None)
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == [s.name for s in specs]
    assert by["vllm"]["status"] == "missing" and "vllm_not_installed_anywhere" in by["vllm"]["reason"]
    assert by["nano-vllm"]["status"] == "missing" and by["nano-vllm"]["reason"] == "fake engine is not installed here"
    assert by["fake[raises]"]["status"] == "failed"
    assert "RuntimeError: fake engine blew up while starting" in by["fake[raises]"]["reason"]
    assert by["fake[dies]"]["status"] == "failed" and by["fake[dies]"]["reason"].startswith("exit 7")
    assert "fake engine: out of memory" in by["fake[dies]"]["reason"]
    _, max_tokens = wl.draw()
    for name in ("fake[first]", "fake[last]"):
        r = by[name]
        assert r["status"] == "ok" and r["output_tokens"] == sum(max_tokens) and r["repeats"] == 2
        assert r["versions"]["peer"] == "fake-1.0" and r["pct_of_floor"] > 0
        # one engine for both timed runs: reset before each timed run and each batch-1 run (2 + 1)
        assert r["info"]["starts"] == 1 and r["info"]["resets"] == 3 and not r["fresh_engine_per_run"]


def test_a_peer_past_its_time_limit_is_a_timeout_row(tmp_path):
    from nanovllm_bench.harness import run_peer
    from nanovllm_bench.workload import cpu_tiny_workload
    row = run_peer(_fake("fake[hangs]", "hangs"), cpu_tiny_workload(2), str(tmp_path), cuda=False, timeout_s=5,
                   log_dir=str(tmp_path))
    assert row["status"] == "timeout" and "ran past 5 s" in row["reason"] and row["wall_s"] < 30


def test_a_warm_start_fills_the_cache_the_measured_process_then_finds(tmp_path, monkeypatch):
    """`warm_start`: an untimed start-up in a process of its own first, so the measured process finds what it
    left (vLLM's torch.compile cache); without it the measured process starts cold. Every row says what the
    compile caches held before its process, and carries the host probes from around its timed runs."""
    from nanovllm_bench.harness import describe_row, run_peer
    from nanovllm_bench.workload import cpu_tiny_workload
    triton_cache = tmp_path / "triton_cache"
    (triton_cache / "a").mkdir(parents=True)
    (triton_cache / "b").mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "no_vllm_cache_here"))
    wl = cpu_tiny_workload(2)
    cold_dir, warm_dir = tmp_path / "cold", tmp_path / "warm"
    cold_dir.mkdir(), warm_dir.mkdir()
    cold = run_peer(_fake("fake[cold]", "cache"), wl, str(cold_dir), cuda=False, timeout_s=60, log_dir=str(tmp_path))
    warm = run_peer(_fake("fake[warm]", "cache", warm_start=True), wl, str(warm_dir), cuda=False, timeout_s=60,
                    log_dir=str(tmp_path))
    assert cold["status"] == warm["status"] == "ok"
    assert cold["info"]["found_cache"] is False and "warm_start" not in cold
    assert warm["info"]["found_cache"] is True and warm["info"]["starts"] == 1
    assert warm["warm_start"]["status"] == "ok" and warm["warm_start"]["startup_s"] >= 0
    assert (tmp_path / warm["warm_start"]["log"]).exists() and warm["warm_start"]["log"] != warm["log"]
    # the fake `cache` peer leaves one Triton entry per process that starts it: cold's, then the warm start's
    for row, triton in ((cold, 2), (warm, 4)):
        assert row["caches_before"] == dict(vllm=0, inductor=row["caches_before"]["inductor"], triton=triton)
        for probe in (row["host_before"], row["host_after"]):
            assert 0 < probe["python_loop_ns"] < 1e6 and 0 < probe["torch_op_us"] < 1e5
            assert probe["cpus"] >= 1 and (probe["cpu_busy"] is None or 0 <= probe["cpu_busy"] <= 1)
    line = describe_row(warm)
    assert "(after an untimed one of" in line and "host: torch op" in line
    assert "untimed" not in describe_row(cold)


def test_a_failed_warm_start_is_in_the_row_and_the_measured_process_still_runs(tmp_path):
    from nanovllm_bench.harness import run_peer
    from nanovllm_bench.workload import cpu_tiny_workload
    row = run_peer(_fake("fake[raises]", "raises", warm_start=True), cpu_tiny_workload(2), str(tmp_path), cuda=False,
                   timeout_s=60, log_dir=str(tmp_path))
    assert row["warm_start"]["status"] == "failed" and "blew up while starting" in row["warm_start"]["reason"]
    assert row["status"] == "failed" and "blew up while starting" in row["reason"]


def test_warm_start_names_a_peer_family():
    from nanovllm_bench.harness import plan_peers
    common = dict(cuda=True, repeats=1, hf_repeats=1, batch1_repeats=0)
    specs = plan_peers(["vllm", "nanovllm_ref"], [("triton", False)], {}, warm_start=["vllm"], **common)
    assert [(s.name, s.warm_start) for s in specs] == [("vllm", True), ("nanovllm_ref[triton:graph]", False)]
    with pytest.raises(ValueError, match="warm_start: 'sglang' is not a peer; choose from nanovllm_ref, vllm"):
        plan_peers(["vllm"], [], {}, warm_start=["sglang"], **common)


# --- warm start, caches and host probes: what each process did, and what the row says ---------------------


def _calls_by_pid(model_dir):
    """The fake peers' calls log (bench_fake_peers.CALLS_LOG) as [(pid, [what, ...]), ...] in order of first
    appearance."""
    from bench_fake_peers import read_calls
    out = {}
    for pid, what in read_calls(str(model_dir)):
        out.setdefault(pid, []).append(what)
    return list(out.items())


def _cache_env(tmp_path, monkeypatch, triton=2, vllm=1, inductor=3):
    """Compile caches of known sizes, where compile_cache_census (and the fake `cache` peer) look."""
    for name, n in (("triton", triton), ("vllm/torch_compile_cache", vllm), ("inductor", inductor)):
        folder = tmp_path / "caches" / name
        folder.mkdir(parents=True)
        for i in range(n):
            (folder / f"entry{i}").mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "caches" / "triton"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "caches" / "vllm"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "caches" / "inductor"))
    return tmp_path / "caches" / "triton"


def test_the_warm_start_is_a_start_only_process_and_the_measured_one_counts_the_caches_it_left(tmp_path,
                                                                                               monkeypatch):
    """The warm child builds the engine and runs the one warm-up generate (1 prompt, WARMUP_TOKENS), nothing
    else; the measured process is another one, with its own start, its timed runs and its batch-1 runs. The
    warm start's census is taken before it ran (2 Triton entries), the measured row's after (3: the warm
    child added one)."""
    from nanovllm_bench.harness import run_peer
    from nanovllm_bench.workload import WARMUP_TOKENS, cpu_tiny_workload
    triton = _cache_env(tmp_path, monkeypatch, triton=2, vllm=1, inductor=3)
    wl = cpu_tiny_workload(2)
    _, max_tokens = wl.draw()
    model = tmp_path / "model"
    model.mkdir()
    row = run_peer(_fake("fake[warm]", "cache", warm_start=True), wl, str(model), cuda=False, timeout_s=60,
                   log_dir=str(tmp_path / "logs"))
    assert row["status"] == "ok" and row["warm_start"]["status"] == "ok", row
    assert row["warm_start"]["caches_before"] == dict(vllm=1, inductor=3, triton=2)
    assert row["caches_before"] == dict(vllm=1, inductor=3, triton=3)
    (warm_pid, warm_calls), (measured_pid, measured_calls) = _calls_by_pid(model)
    assert warm_pid != measured_pid
    assert warm_calls == ["make cache", "start", f"generate 1 {WARMUP_TOKENS}", "close"]
    assert measured_calls == ["make cache", "start", f"generate 1 {WARMUP_TOKENS}",
                              f"generate 2 {sum(max_tokens)}", f"generate 2 {sum(max_tokens)}",    # repeats=2
                              f"generate 1 {wl.batch1_tokens}", "close"]                            # batch1=1
    assert sorted(os.listdir(triton)) == sorted(["entry0", "entry1", f"fake_kernel_{warm_pid}",
                                                 f"fake_kernel_{measured_pid}"])
    assert row["info"]["found_cache"] is True and row["info"]["starts"] == 1
    assert row["warm_start"]["log"] == "fake_warm__warm_start.log" and row["log"] == "fake_warm_.log"
    assert (tmp_path / "logs" / row["warm_start"]["log"]).exists() and (tmp_path / "logs" / row["log"]).exists()
    assert 0 <= row["warm_start"]["startup_s"] < row["warm_start"]["wall_s"] < 60


def test_without_warm_start_there_is_one_process_and_no_warm_start_in_the_row(tmp_path, monkeypatch):
    from nanovllm_bench.harness import run_peer
    from nanovllm_bench.workload import cpu_tiny_workload
    _cache_env(tmp_path, monkeypatch, triton=2, vllm=1, inductor=0)
    row = run_peer(_fake("fake[cold]", "cache"), cpu_tiny_workload(2), str(tmp_path), cuda=False, timeout_s=60,
                   log_dir=str(tmp_path / "logs"))
    assert row["status"] == "ok" and "warm_start" not in row and row["info"]["found_cache"] is False
    assert row["caches_before"] == dict(vllm=1, inductor=0, triton=2)
    assert len(_calls_by_pid(tmp_path)) == 1
    assert not (tmp_path / "logs" / "fake_cold__warm_start.log").exists()


def test_compile_cache_census_follows_each_cache_s_own_variables(tmp_path, monkeypatch):
    """vLLM: $VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm (torch_compile_cache in it);
    Inductor: $TORCHINDUCTOR_CACHE_DIR; Triton: $TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache, else
    ~/.triton/cache."""
    from nanovllm_bench.machine import compile_cache_census

    def entries(folder, n):
        folder.mkdir(parents=True)
        for i in range(n):
            (folder / f"e{i}").write_text("")
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TRITON_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    entries(tmp_path / "home" / ".cache" / "vllm" / "torch_compile_cache", 1)
    entries(tmp_path / "home" / ".triton" / "cache", 2)
    entries(tmp_path / "inductor", 5)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert compile_cache_census() == dict(vllm=1, inductor=5, triton=2)
    entries(tmp_path / "xdg" / "vllm" / "torch_compile_cache", 3)
    entries(tmp_path / "th" / ".triton" / "cache", 4)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "th"))
    assert compile_cache_census() == dict(vllm=3, inductor=5, triton=4)
    entries(tmp_path / "root" / "torch_compile_cache", 6)
    entries(tmp_path / "tdir", 7)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "tdir"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "nowhere"))
    assert compile_cache_census() == dict(vllm=6, inductor=0, triton=7)


def test_a_warm_start_that_fails_leaves_the_measured_process_to_run_cold(tmp_path):
    """`fails_once` dies in the first process that starts it (the warm start) and runs in the next."""
    from nanovllm_bench.harness import describe_row, run_peer
    from nanovllm_bench.workload import cpu_tiny_workload
    row = run_peer(_fake("fake[once]", "fails_once", warm_start=True), cpu_tiny_workload(2), str(tmp_path),
                   cuda=False, timeout_s=60, log_dir=str(tmp_path / "logs"))
    warm = row["warm_start"]
    assert warm["status"] == "failed" and warm["reason"].startswith("exit 1;"), warm
    assert "fake engine fails the first time it starts" in warm["reason"] and "startup_s" not in warm
    assert row["status"] == "ok" and row["repeats"] == 2 and row["info"]["starts"] == 1
    (p1, first), (p2, second) = _calls_by_pid(tmp_path)
    assert p1 != p2 and first == ["make fails_once", "start"] and second[:2] == ["make fails_once", "start"]
    assert second[-1] == "close" and len(second) == 7
    assert "(its untimed start-up failed)" in describe_row(row)


def test_a_warm_start_past_the_time_limit_leaves_no_time_for_the_measured_process(tmp_path):
    """The hung child is stopped at the limit (status timeout, not its own 60 s sleep's end), and the measured
    process, which has no time left, is never started."""
    from nanovllm_bench.harness import run_peer
    from nanovllm_bench.workload import cpu_tiny_workload
    row = run_peer(_fake("fake[hangs]", "hangs", warm_start=True), cpu_tiny_workload(2), str(tmp_path), cuda=False,
                   timeout_s=5, log_dir=str(tmp_path / "logs"))
    warm = row["warm_start"]
    assert warm["status"] == "timeout" and warm["reason"].startswith("ran past 5 s"), warm
    assert warm["wall_s"] >= 5
    assert row["status"] == "timeout" and row["reason"] == "not started: the warm start took the peer's time"
    assert [calls for _, calls in _calls_by_pid(tmp_path)] == [["make hangs"]]     # the measured one never ran
    assert (tmp_path / "logs" / "fake_hangs__warm_start.log").exists()
    assert not (tmp_path / "logs" / "fake_hangs_.log").exists()


def test_a_warm_start_of_a_peer_that_cannot_run_here_ends_the_row_as_missing(tmp_path):
    from nanovllm_bench.harness import describe_row, run_peer
    from nanovllm_bench.workload import cpu_tiny_workload
    row = run_peer(_fake("fake[absent]", "unavailable", warm_start=True), cpu_tiny_workload(2), str(tmp_path),
                   cuda=False, timeout_s=60, log_dir=str(tmp_path / "logs"))
    assert row["status"] == "missing" and row["reason"] == "fake engine is not installed here"
    assert row["warm_start"]["status"] == "missing" and "caches_before" in row["warm_start"]
    assert "caches_before" not in row and "log" not in row                # no measured process
    assert [calls for _, calls in _calls_by_pid(tmp_path)] == [["make unavailable"]]
    assert not (tmp_path / "logs" / "fake_absent_.log").exists()
    assert describe_row(row).endswith("missing: fake engine is not installed here")


def test_host_probe_sees_other_processes_keep_the_cpus_busy():
    import subprocess
    import sys
    import time

    from nanovllm_bench.machine import host_probe
    idle = host_probe()
    assert isinstance(idle["cpu_busy"], float) and 0 <= idle["cpu_busy"] <= 1
    assert idle["cpus"] == os.cpu_count() and 0 < idle["python_loop_ns"] < 1e6 and 0 < idle["torch_op_us"] < 1e5
    assert idle["load_1m"] >= 0
    n = os.cpu_count()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)
        busy = host_probe(window_s=0.5)
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
    assert busy["cpu_busy"] >= 0.6, busy


def test_host_probe_reads_steal_time_and_the_cpu_it_ran_on_from_proc(tmp_path):
    """/proc/stat's first line: user nice system idle iowait irq softirq steal guest guest_nice; busy counts
    steal, the total leaves out guest and guest_nice (already inside user and nice). /proc/self/stat's field 39
    is the CPU the process runs on (a process name may hold spaces and parentheses)."""
    from nanovllm_bench.machine import _cpu_times, _this_cpu
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 10 40 800 20 5 5 20 50 7\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert _cpu_times(str(stat)) == (180, 20, 1000)          # busy = 1000 - (800 + 20), steal 20
    stat.write_text("cpu  100 10 40 800\n")                     # an old kernel: no iowait .. steal fields
    assert _cpu_times(str(stat)) == (150, 0, 950)
    assert _cpu_times(str(tmp_path / "absent")) is None
    fields = ["S"] + [str(i) for i in range(4, 39)] + ["3"] + ["0"] * 13     # fields 3 .. 52; field 39 = "3"
    self_stat = tmp_path / "self_stat"
    self_stat.write_text("4242 (python (x) 2) " + " ".join(fields) + "\n")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("".join(f"processor\t: {i}\nmodel name\t: X\ncpu MHz\t\t: {1000 + i}.5\n\n" for i in range(5)))
    assert _this_cpu(str(self_stat), str(cpuinfo)) == (3, 1003.5)
    cpuinfo.write_text("processor\t: 3\nmodel name\t: X\n")      # no clock line (some VMs and arm64)
    assert _this_cpu(str(self_stat), str(cpuinfo)) == (3, None)
    assert _this_cpu(str(tmp_path / "absent"), str(cpuinfo)) == (None, None)
    cpu, _ = _this_cpu()
    assert cpu in os.sched_getaffinity(0)


def test_measure_probes_the_host_after_the_start_up_and_after_batch_1(monkeypatch):
    """host_before: after the (first) start-up and its warm-up, before the first timed generate; host_after:
    after the last batch-1 generate, before close."""
    from nanovllm_bench import peer as peer_mod
    from nanovllm_bench.workload import WARMUP_TOKENS, cpu_tiny_workload
    events = []

    def probe(window_s=0.25):
        events.append(f"probe {sum(e.startswith('probe') for e in events) + 1}")
        return dict(probe=len([e for e in events if e.startswith("probe")]))
    monkeypatch.setattr(peer_mod, "host_probe", probe)

    def loop_ns(n=100_000, best_of=1):
        events.append("loop")
        return 80.0 + sum(e == "loop" for e in events)
    monkeypatch.setattr(peer_mod, "python_loop_ns", loop_ns)

    class Recorder:
        device = "cpu"

        def __init__(self, fresh):
            self.fresh_per_run = fresh

        def start(self):
            events.append("start")

        def generate(self, prompts, max_tokens, temperature):
            events.append(f"generate {len(prompts)} {sum(max_tokens)}")
            return sum(max_tokens)

        def reset(self):
            events.append("reset")

        def info(self):
            return {}

        def close(self):
            events.append("close")
    wl = cpu_tiny_workload(3)
    _, max_tokens = wl.draw()
    warm, timed, b1 = f"generate 1 {WARMUP_TOKENS}", f"generate 3 {sum(max_tokens)}", f"generate 1 {wl.batch1_tokens}"
    row = peer_mod.measure(Recorder(False), wl, repeats=2, batch1_repeats=2)
    assert events == ["start", warm, "probe 1", "reset", timed, "reset", timed, "reset", "loop", b1, "reset", "loop",
                      b1, "probe 2", "close"]
    assert row["host_before"] == dict(probe=1) and row["host_after"] == dict(probe=2)
    assert row["batch1_host_loop_ns"] == [81.0, 82.0] and len(row["batch1_runs"]) == 2
    events.clear()
    row = peer_mod.measure(Recorder(True), wl, repeats=2, batch1_repeats=1)
    assert events == ["start", warm, "probe 1", "reset", timed, "close", "start", warm, "reset", timed, "reset",
                      "loop", b1, "probe 2", "close"]
    assert row["host_before"] == dict(probe=1) and row["host_after"] == dict(probe=2)


def test_warm_start_marks_exactly_the_named_families_rows():
    from nanovllm_bench.harness import HF_NAME, plan_peers
    common = dict(cuda=True, repeats=1, hf_repeats=1, batch1_repeats=0, nanovllm_src="/tmp/upstream")
    every = ["nanovllm_ref", "vllm", "nano-vllm", "hf"]
    runs = [("triton", False), ("triton", True)]
    rows_of = {"vllm": ["vllm"], "nanovllm_ref": ["nanovllm_ref[triton:graph]", "nanovllm_ref[triton:eager]"],
               "nano-vllm": ["nano-vllm"], "hf": [HF_NAME]}
    order = ["vllm", "nanovllm_ref[triton:graph]", "nanovllm_ref[triton:eager]", "nano-vllm", HF_NAME]
    for family in every:
        specs = plan_peers(every, runs, {}, warm_start=[family], **common)
        assert [s.name for s in specs] == order
        assert [s.name for s in specs if s.warm_start] == rows_of[family], family
    specs = plan_peers(every, runs, {}, warm_start=["hf", "nano-vllm"], **common)
    assert [s.name for s in specs if s.warm_start] == ["nano-vllm", HF_NAME]
    assert not any(s.warm_start for s in plan_peers(every, runs, {}, **common))
    assert all(s.warm_start for s in plan_peers(every, runs, {}, warm_start=every, **common))
    with pytest.raises(ValueError, match=r"warm_start: 'vllm' is not among the peers this call runs \(nanovllm_ref\)"):
        plan_peers(["nanovllm_ref"], runs, {}, warm_start=["vllm"], **common)
    with pytest.raises(ValueError, match=r"'hf', 'vllm' is not among the peers this call runs \(none\)"):
        plan_peers([], runs, {}, warm_start=["hf", "vllm"], **common)


def test_describe_row_gives_the_probes_in_order_and_the_warm_start():
    from nanovllm_bench.harness import describe_row
    row = dict(name="fake[x]", status="ok", output_tokens=12_345, seconds=2.0, tok_s=6172.5, min_tok_s=6000,
               max_tok_s=6300, repeats=3, batch1_tok_s=55.0, startup_s=3.4,
               warm_start=dict(status="ok", startup_s=12.34),
               host_before=dict(torch_op_us=1.5, cpu_busy=0.1), host_after=dict(torch_op_us=2.5, cpu_busy=0.9))
    line = describe_row(row)
    assert line.startswith("fake[x]".ljust(40) + "    12,345 tok     2.00 s      6,172 tok/s (6,000-6,300, median of 3)")
    assert line.endswith("; batch-1 55 tok/s; start-up 3.4 s (after an untimed one of 12.3 s); host: torch op "
                         "1.50-2.50 us, CPUs busy 10-90 %")
    row.update(warm_start=dict(status="failed", reason="exit 1"), host_before=dict(torch_op_us=4.0, cpu_busy=None))
    line = describe_row(row)
    assert line.endswith("; start-up 3.4 s (its untimed start-up failed); host: torch op 4.00-2.50 us")
    row.update(warm_start=dict(status="timeout", reason="ran past 5 s"))
    assert "(its untimed start-up timed out)" in describe_row(row)
    row.pop("warm_start")
    assert "untimed" not in describe_row(row)


def test_cpu_tiny_warm_start_end_to_end_then_merge_and_a_warm_start_of_a_peer_left_out(tmp_path, capsys):
    """--warm-start through the CLI: the record's machine carries the call's host probe, our row its warm
    start and caches; --merge adds a later call's rows and says which call they came from (merged_calls);
    --warm-start of a peer that --peers leaves out is refused by name, before anything runs."""
    out1, out2, out3, logs = (tmp_path / d for d in ("one", "two", "three", "logs"))
    assert main(["--cpu-tiny", "--num-requests", "4", "--repeats", "1", "--batch1-repeats", "1",
                 "--peers", "nanovllm_ref,vllm", "--warm-start", "nanovllm_ref", "--out", str(out1),
                 "--figures", str(tmp_path / "figs"), "--logs", str(logs)]) == 0
    record = json.loads((out1 / "bench_cpu.json").read_text())
    assert set(record["machine"]["host_probe"]) == {"python_loop_ns", "torch_op_us", "cpu_busy", "cpu_steal",
                                                    "load_1m", "cpus", "cpu", "cpu_mhz"}
    assert record["machine"]["host_probe"]["cpus"] == os.cpu_count()
    from nanovllm_bench.machine import source_digest
    assert record["machine"]["sources"] == source_digest() and all(record["machine"]["sources"].values())
    vllm, ours = record["runs"]
    assert vllm["name"] == "vllm" and vllm["status"] == "missing" and "warm_start" not in vllm
    assert ours["name"] == "nanovllm_ref[cpu:eager]" and ours["status"] == "ok"
    assert ours["warm_start"]["status"] == "ok" and ours["warm_start"]["startup_s"] > 0
    assert (logs / ours["warm_start"]["log"]).exists() and (logs / ours["log"]).exists()
    for caches in (ours["caches_before"], ours["warm_start"]["caches_before"]):
        assert set(caches) == {"vllm", "inductor", "triton"} and all(isinstance(v, int) and v >= 0
                                                                     for v in caches.values())
    assert ours["host_before"]["torch_op_us"] > 0 and ours["host_after"]["torch_op_us"] > 0
    assert "warm_start" in record["protocol"]
    capsys.readouterr()

    # a later call of the vLLM row alone (missing on a CPU: it exits 1, nothing measured) merged in
    assert main(["--cpu-tiny", "--num-requests", "4", "--repeats", "1", "--peers", "vllm",
                 "--merge", str(out1 / "bench_cpu.json"), "--out", str(out2)]) == 1
    merged = json.loads((out2 / "bench_cpu.json").read_text())
    assert [r["name"] for r in merged["runs"]] == ["nanovllm_ref[cpu:eager]", "vllm"]
    assert merged["runs"][1]["note"].startswith("measured in a separate call on ")
    assert merged["machine"] == record["machine"] and merged["date"] == record["date"]
    (call,) = merged["merged_calls"]
    assert set(call) == {"date", "time_utc", "machine", "protocol", "rows"} and call["rows"] == ["vllm"]
    assert call["protocol"] == record["protocol"] and call["machine"]["host_probe"]["cpus"] == os.cpu_count()
    assert call["machine"] != record["machine"]                 # this call's own probe and measurements
    assert len(call["date"]) == 10 and len(call["time_utc"]) == 8
    capsys.readouterr()

    assert main(["--cpu-tiny", "--num-requests", "4", "--peers", "nanovllm_ref", "--warm-start", "vllm",
                 "--out", str(out3)]) == 2
    err = capsys.readouterr().err
    assert "--warm-start: 'vllm' is not among the peers this call runs (nanovllm_ref)" in err
    assert "Traceback" not in err and not out3.exists()


def test_the_bench_commands_forward_from_the_engine_cli():
    """`python -m nanovllm_ref bench|download` reach the packages that register them (entry points)."""
    import subprocess
    import sys
    for cmd, text in (("bench", "nanovllm_bench"), ("download", "fetch and convert")):
        out = subprocess.run([sys.executable, "-m", "nanovllm_ref", cmd, "--help"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and text in out.stdout, out.stderr[-1000:]


def test_cpu_bench_records_median_min_max_load_and_equality_with_hf(tmp_path):
    """`bench --cpu` on a tiny checkpoint (the real run uses SmolLM2): engine and HF generate interleaved."""
    from engine_helpers import tiny_dir
    path = tiny_dir("llama")
    assert main(["--cpu", "--model", path, "--threads", "1", "--repeats", "2", "--workloads", "chat8,chat32_eos",
                 "--max-tokens-eos", "8", "--out", str(tmp_path), "--tag", "t"]) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert [w["name"] for w in result["workloads"]] == ["chat8", "chat32_eos"]
    chat8, eos = result["workloads"]
    assert chat8["num_prompts"] == 8 and chat8["ignore_eos"] and eos["num_prompts"] == 32 and not eos["ignore_eos"]
    for w in result["workloads"]:
        row = w["rows"][0]
        assert row["threads"] == 1 and len(row["loadavg_before"]) == 3
        for peer in ("engine_tok_s", "hf_tok_s"):
            cell = row[peer]
            assert len(cell["runs"]) == 2 and cell["min"] <= cell["median"] <= cell["max"]
        assert row["completions_equal_hf"] == f"{w['num_prompts']}/{w['num_prompts']}"
    assert chat8["rows"][0]["engine_output_tokens"] == chat8["rows"][0]["hf_output_tokens"] == 8 * 64
    assert result["engine"]["backend"] == "cpu"


def test_tp_comm_cpu_smoke_counts_one_decode_steps_collectives(tmp_path):
    """bench/tp_comm.py (TP=2 communication per decode step) over gloo: the counts and sizes it reports are
    those of one decode step of its shape (1 embedding + 2 per layer all-reduces, a vocab/2 logits gather)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "bench" / "tp_comm.py"), "--cpu-smoke", "--out", str(tmp_path)],
                          cwd=repo, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "tp_comm.json").read_text())
    shape = data["shape"]
    assert (data["backend"], data["world_size"]) == ("gloo", 2)
    assert [r["batch"] for r in data["rows"]] == [1, 4]
    for r in data["rows"]:
        assert r["all_reduces_per_step"] == 1 + 2 * shape["layers"]
        assert r["all_reduce_bytes"] == r["batch"] * shape["hidden"] * 2             # bf16
        assert r["gather_bytes_per_rank"] == r["batch"] * shape["vocab"] // 2 * 2
        assert r["all_reduces_eager_ms"] > 0 and r["gather_ms"] > 0
        assert "all_reduces_graph_ms" not in r                                       # CUDA graphs: GPU only


def test_step_profile_at_tensor_parallel_2_times_whole_steps_over_gloo():
    """--profile at TP=2 (the H200 pair's breakdown): every workload step is timed and each decode batch gets
    its whole-step time; the eager kernel profile, which would switch graphs off on rank 0 alone, is left out."""
    from nanovllm_bench.profile import step_profile
    import tempfile
    from nanovllm_models.tiny import make_tiny_model
    path = make_tiny_model(tempfile.mkdtemp(), "qwen3")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    res = step_profile(path, dict(tensor_parallel_size=2, device="cpu", enforce_eager=True, max_model_len=64,
                                  kvcache_block_size=4), prompts, [6, 3], sizes=((1, 16), (3, 16)))
    w = res["workload"]
    assert w["prefill_steps"] >= 1 and w["decode_steps"] == 5            # the longer request decodes 5 tokens
    assert w["mean_decode_batch"] == pytest.approx((2 * 2 + 3 * 1) / 5)  # 2 steps of two rows, 3 of one
    assert set(res["decode_steps"]) == {"bs1_ctx16", "bs3_ctx16"}
    for v in res["decode_steps"].values():
        assert v["tensor_parallel_size"] == 2 and v["graph_step_ms"] > 0 and "kernel_ms" not in v


def test_run_options_set_engine_arguments_and_name_the_row():
    """`--runs triton:graph:sync:nokernels` measures the same engine with async scheduling and the decode
    kernels off, in a row of its own; an unknown option is refused by name."""
    import argparse
    from nanovllm_bench.cli import _runs
    from nanovllm_bench.harness import plan_peers
    runs = _runs("triton:graph,triton:graph:sync:nokernels")
    assert runs == [("triton", False, ()), ("triton", False, ("sync", "nokernels"))]
    specs = plan_peers(["nanovllm_ref"], runs, {"max_num_seqs": 8}, cuda=True, repeats=1, hf_repeats=1, batch1_repeats=0)
    assert [s.name for s in specs] == ["nanovllm_ref[triton:graph]", "nanovllm_ref[triton:graph:sync:nokernels]"]
    assert specs[1].options["engine_args"] == {"max_num_seqs": 8, "async_scheduling": False, "decode_kernels": "off"}
    assert specs[0].options["engine_args"] == {"max_num_seqs": 8}
    assert _runs("triton:graph:persistent") == [("triton", False, ("persistent",))]
    from nanovllm_bench.harness import RUN_OPTIONS
    assert RUN_OPTIONS["persistent"] == {"decode_kernels": "persistent"}
    with pytest.raises(argparse.ArgumentTypeError, match="OPTION one of sync, nokernels, persistent"):
        _runs("triton:graph:fast")


def test_vllm_peer_passes_the_workload_as_vllm_expects_it():
    """The vLLM peer against a stand-in `vllm` module: token-id prompts in order, one SamplingParams per request
    with its max_tokens, ignore_eos and the temperature, no detokenizing, dummy weights, prefix caching off (a
    later timed run must find nothing cached), and the output tokens counted from what comes back."""
    import types

    from nanovllm_bench.peers.vllm import VllmPeer
    calls = []

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class FakeLLM:
        def __init__(self, model, **kw):
            calls.append(("init", model, kw))

        def generate(self, inputs, params, use_tqdm=True):
            calls.append(("generate", inputs, params, use_tqdm))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=list(range(p.kw["max_tokens"])))])
                    for p in params]

        def reset_prefix_cache(self):
            calls.append(("reset",))

    fake = types.SimpleNamespace(LLM=FakeLLM, SamplingParams=SamplingParams, __version__="0.0-standin")
    peer = VllmPeer(fake, "/models/qwen3", dict(max_model_len=4096, dtype="bfloat16", tensor_parallel_size=2))
    peer.start()
    prompts, max_tokens = [[5, 6, 7], [8] * 10, [9]], [4, 2, 7]
    assert peer.generate(prompts, max_tokens, 0.6) == sum(max_tokens)
    peer.reset()
    (_, model, init), (_, inputs, params, use_tqdm), reset = calls
    assert model == "/models/qwen3" and init["load_format"] == "dummy" and init["skip_tokenizer_init"] is True
    assert init["enable_prefix_caching"] is False and init["tensor_parallel_size"] == 2
    assert [i["prompt_token_ids"] for i in inputs] == prompts
    assert [p.kw["max_tokens"] for p in params] == max_tokens
    assert all(p.kw == dict(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False)
               for p, m in zip(params, max_tokens))
    assert use_tqdm is False and reset == ("reset",)
    assert peer.info()["versions"]["peer"] == "0.0-standin"


def test_source_digest_names_the_files_a_record_ran_not_the_commit_it_was_told(tmp_path):
    """A device call copies the working tree, uncommitted edits included, and is told its commit: the digest is
    what tells a planted or edited harness from the committed one."""
    import shutil
    from pathlib import Path

    from nanovllm_bench.machine import source_digest
    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "nanovllm_bench", tmp_path / "nanovllm_bench",
                    ignore=shutil.ignore_patterns("__pycache__"))
    here = source_digest(str(tmp_path))
    assert here["nanovllm_ref"] is None and here["nanovllm_models"] is None
    assert here["nanovllm_bench"] == source_digest()["nanovllm_bench"] and len(here["nanovllm_bench"]) == 16
    (tmp_path / "nanovllm_bench" / "__pycache__").mkdir(exist_ok=True)
    (tmp_path / "nanovllm_bench" / "__pycache__" / "x.py").write_text("ignored")
    (tmp_path / "nanovllm_bench" / "notes.txt").write_text("not source")
    assert source_digest(str(tmp_path)) == here
    cli = tmp_path / "nanovllm_bench" / "cli.py"
    text = cli.read_text()
    cli.write_text(text.replace("return 2", "return 0", 1))
    assert source_digest(str(tmp_path))["nanovllm_bench"] != here["nanovllm_bench"]
    cli.write_text(text)
    assert source_digest(str(tmp_path)) == here
    cli.rename(tmp_path / "nanovllm_bench" / "cli2.py")              # a file's name counts, not just its bytes
    assert source_digest(str(tmp_path))["nanovllm_bench"] != here["nanovllm_bench"]


def test_host_watch_summary_splits_slow_probes_from_fast_ones():
    from nanovllm_bench.host_watch import summarise

    def probe(ns, op, cpu, steal=0.0):
        return dict(python_loop_ns=ns, torch_op_us=op, cpu_busy=0.0, cpu_steal=steal, cpu=cpu, cpu_mhz=2000.0)
    samples = [probe(78, 1.0, 15), probe(170, 2.2, 15, 0.5), probe(80, 1.1, 3), probe(190, 2.4, 15, 0.25),
               probe(116, 1.5, 15)]                                  # 116 < 1.5 x 78 = 117: fast
    s = summarise(samples)
    assert (s["samples"], s["loop_ns_min"], s["loop_ns_max"], s["loop_ns_median"]) == (5, 78, 190, 116)
    assert s["slow"] == dict(n=2, python_loop_ns=180.0, torch_op_us=2.3, cpu_steal=0.375, cpu_busy=0.0,
                             cpu_mhz=2000.0, cpus_seen=[15])
    assert s["fast"]["n"] == 3 and s["fast"]["python_loop_ns"] == 80 and s["fast"]["cpus_seen"] == [3, 15]
    none_slow = summarise([probe(78, 1.0, 1)])
    assert none_slow["slow"]["n"] == 0 and none_slow["slow"]["python_loop_ns"] is None


@pytest.mark.parametrize("argv, flag", [(["--seconds", "0"], "--seconds"), (["--every", "-1"], "--every")])
def test_host_watch_refuses_a_window_it_cannot_watch(tmp_path, capsys, argv, flag):
    from nanovllm_bench.host_watch import main as watch
    with pytest.raises(SystemExit) as exc:
        watch(argv + ["--out", str(tmp_path / "w.json")])
    assert exc.value.code == 2 and f"argument {flag}: must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "w.json").exists()


def test_host_watch_writes_every_probe_and_the_summary(tmp_path, capsys):
    from nanovllm_bench.host_watch import main as watch
    assert watch(["--seconds", "0.5", "--every", "0.2", "--out", str(tmp_path / "w.json")]) == 0
    rec = json.loads((tmp_path / "w.json").read_text())
    assert rec["every_s"] == 0.2 and len(rec["samples"]) >= 2 and rec["summary"]["samples"] == len(rec["samples"])
    assert [s["t_s"] for s in rec["samples"]] == sorted(s["t_s"] for s in rec["samples"])
    assert {"python_loop_ns", "cpu_steal", "cpu", "cpu_mhz"} <= set(rec["samples"][0])
    assert capsys.readouterr().out.startswith(f"host_watch: {len(rec['samples'])} probes over 0.5 s")


def test_python_loop_ns_is_host_probes_first_figure(monkeypatch):
    """host_probe's python_loop_ns is machine.python_loop_ns, best of 3 (the figure peer.measure also takes
    before each batch-1 run, one run each)."""
    from nanovllm_bench import machine
    asked = []
    monkeypatch.setattr(machine, "python_loop_ns", lambda n=100_000, best_of=1: asked.append(best_of) or 123.0)
    assert machine.host_probe(window_s=0.01)["python_loop_ns"] == 123.0 and asked == [3]
    monkeypatch.undo()
    assert 1 < machine.python_loop_ns(n=20_000) < 1e5 and isinstance(machine.python_loop_ns(n=10), float)
