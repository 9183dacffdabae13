"""The whole-workload profiler (nanovllm_bench/workload_profile.py, `bench/gpu_run.sh profile4`) on the CPU:
every engine step accounted for once, with the kind, tokens and rows the engine reported for it."""
import json
import tempfile

import pytest

from nanovllm_bench import workload_profile as wp


def test_cpu_tiny_profile_accounts_for_every_prompt_and_output_token(tmp_path):
    assert wp.main(["--cpu-tiny", "--num-requests", "5", "--out", str(tmp_path), "--tag", "t",
                    "--probes", "1:24,3:24"]) == 0
    result = json.loads((tmp_path / "profile4_t.json").read_text())
    s, w = result["summary"], result["workload"]
    # Run 3 shifts every prompt token, so nothing hits the prefix cache of run 2: every prompt token is
    # prefilled, and each request's first output token comes from its prefill, the rest from decode steps.
    assert s["prefill_tokens"] == w["prompt_tokens"]
    assert s["decode_tokens"] == w["output_tokens"] - w["num_requests"]
    assert sum(b["steps"] for b in s["decode_buckets"].values()) == s["decode"]["steps"]
    assert len(result["steps"]) == s["prefill"]["steps"] + s["decode"]["steps"] + s["tail_calls"]
    assert s["prefill"]["wall_s"] + s["decode"]["wall_s"] + s["tail_s"] <= s["total_s"]
    assert 0 < s["device_s"] <= s["total_s"]
    assert s["plain_s"] > 0 and result["plain_tok_s"] == pytest.approx(w["output_tokens"] / s["plain_s"])
    kinds = {row[0] for row in result["steps"]}
    assert kinds <= {"prefill", "decode", None} and {"prefill", "decode"} <= kinds
    assert [(p["rows"], p["context"]) for p in result["probes"]] == [(1, 24), (3, 24)]
    for p in result["probes"]:
        assert p["step_ms"] > 0 and p["kernels_per_step"] > 0 and p["ms_by_family"]
    assert result["prefill_probe"]["tokens"] == 256      # max_num_batched_tokens of the CPU mode


def test_recorder_times_each_launched_step_on_the_async_route():
    """With async scheduling each advance() launches one step and waits for the one before: the recorder
    still gives every launched step its own device span and the KV tokens its rows attend over."""
    from nanovllm_models.tiny import make_tiny_model
    from nanovllm_ref import LLM
    path = make_tiny_model(tempfile.mkdtemp(), "qwen3")
    llm = LLM(path, device="cpu", kvcache_block_size=4, max_model_len=64, async_scheduling=True)
    assert llm.async_scheduling
    rows, total = wp.run_instrumented(llm, [[5, 6, 7, 8], [9, 10, 11]], [6, 3], 0.6)
    launched = [r for r in rows if r["kind"] is not None]
    assert [r["kind"] for r in launched] == ["prefill"] + ["decode"] * 5
    assert [r["rows"] for r in launched] == [2, 2, 2, 1, 1, 1]
    # decode rows attend over their whole length: (4+1, 3+1), (4+2, 3+2), then the longer one alone
    assert [r["kv_tokens"] for r in launched[1:]] == [9, 11, 7, 8, 9]
    assert all(r["device_ms"] is not None and r["device_ms"] > 0 for r in launched)
    assert rows[-1]["kind"] is None                       # the last call only collects the last step's ids
    assert sum(r["wall_s"] for r in rows) <= total
    assert llm.model_runner.launch.__func__ is type(llm.model_runner).launch   # the wrappers are gone
    llm.exit()


@pytest.mark.parametrize("name, family", [
    ("_paged_decode_kernel", "attention"), ("_merge_splits_kernel", "attention"),
    ("_qk_norm_rope_store_kernel", "norm_rope_store"), ("_add_rms_norm_kernel", "norm_rope_store"),
    ("_small_gemm_kernel", "gemm"), ("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("triton_red_fused_argmax_div_0", "fused_inductor"), ("_prefill_kernel", "attention"),
    ("Memcpy HtoD (Pinned -> Device)", "copy")])
def test_kernel_families(name, family):
    assert wp.kernel_family(name) == family


def test_bad_probe_is_refused_by_name():
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match="ROWS:CONTEXT"):
        wp.parse_probes("256")


def test_ab_table_compares_two_profiles_of_one_call_and_refuses_different_workloads(tmp_path):
    from nanovllm_bench import ab

    def record(tok_s, b1, total, commit):
        part = dict(wall_s=0.1, device_s=0.09)
        return dict(run="nanovllm_ref[triton:graph]", plain_tok_s=tok_s, batch1_tok_s=b1,
                    machine=dict(device_name="NVIDIA H200", commit=commit),
                    workload=dict(output_tokens=133966, prompt_tokens=142827),
                    summary=dict(total_s=total, prefill=part, decode=part, gpu_idle_s=0.05),
                    probes=[dict(rows=1, context=512, step_ms=1.2, graph_replay_ms=1.18)])
    lines = ab.compare(record(22752, 818, 5.7, "base1"), record(25000, 900, 5.2, "new1"))
    assert "base1" in lines[0] and "new1" in lines[0]
    tput = next(line for line in lines if line.startswith("throughput"))
    assert "1.099x better" in tput
    assert "0.912x better" in next(line for line in lines if line.startswith("instrumented run"))
    other = record(1, 1, 1, "x")
    other["workload"]["output_tokens"] = 5
    with pytest.raises(ValueError, match="different workloads"):
        ab.compare(record(1, 1, 1, "a"), other)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(record(1, 1, 1, "a")))
    b.write_text(json.dumps(other))
    assert ab.main([str(a), str(b)]) == 2
