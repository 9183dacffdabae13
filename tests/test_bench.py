"""The benchmark's workload, floor model and CPU mode."""
import json

import pytest

from nanovllm_ref.bench import QWEN3_06B, main, make_workload, model_stats, physical_floor
from nanovllm_ref.tiny import tiny_config


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


def test_cpu_tiny_mode_runs_and_writes_results(tmp_path):
    assert main(["--cpu-tiny", "--num-requests", "6", "--out", str(tmp_path), "--figures", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_cpu.json").read_text())
    run = result["runs"][0]
    assert run["name"] == "nanovllm_ref[torch]"
    assert run["output_tokens"] == result["workload"]["output_tokens"] > 0
    assert run["tok_s"] > 0 and 0 < run["pct_of_floor"] < 100
    assert (tmp_path / "bench_cpu.csv").read_text().startswith("name,output_tokens")
    assert (tmp_path / "bench_throughput_cpu.png").stat().st_size > 1000


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
