"""The benchmark's workload, floor model and CPU mode."""
import json

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


def test_cpu_tiny_mode_runs_and_writes_results(tmp_path):
    assert main(["--cpu-tiny", "--num-requests", "6", "--out", str(tmp_path), "--figures", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_cpu.json").read_text())
    run = result["runs"][0]
    assert run["name"] == "nanovllm_ref[torch]"
    assert run["output_tokens"] == result["workload"]["output_tokens"] > 0
    assert run["tok_s"] > 0 and 0 < run["pct_of_floor"] < 100
    assert (tmp_path / "bench_cpu.csv").read_text().startswith("name,output_tokens")
    assert (tmp_path / "bench_throughput_cpu.png").stat().st_size > 1000


def test_cpu_tiny_mode_at_tensor_parallel_2_measures_against_two_devices_floor(tmp_path):
    """A TP=2 run reads weights and K/V on two devices at once: its % of floor is against half the one-device
    floor time (it was against one device's, which made TP=2 look twice as close to the floor as it was)."""
    assert main(["--cpu-tiny", "--num-requests", "4", "--tensor-parallel-size", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_cpu.json").read_text())
    run = result["runs"][0]
    assert run["floor_gpus"] == 2
    assert run["pct_of_floor"] == pytest.approx(100 * result["floor"]["floor_s"] / 2 / run["seconds"])


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
