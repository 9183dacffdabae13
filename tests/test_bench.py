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


def test_cpu_mode_runs_and_writes_results(tmp_path):
    assert main(["--cpu", "--num-requests", "6", "--out", str(tmp_path), "--figures", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_cpu.json").read_text())
    run = result["runs"][0]
    assert run["name"] == "nanovllm_ref[torch]"
    assert run["output_tokens"] == result["workload"]["output_tokens"] > 0
    assert run["tok_s"] > 0 and 0 < run["pct_of_floor"] < 100
    assert (tmp_path / "bench_cpu.csv").read_text().startswith("name,output_tokens")
    assert (tmp_path / "bench_throughput_cpu.png").stat().st_size > 1000
