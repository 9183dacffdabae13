"""bench/kernels_round3.py runs end to end here: the dry run (Triton interpreter, tiny shapes) and the sm_90
compile check (Triton's own compiler and ptxas, no GPU needed). The GPU numbers come from the lead's H200
run; these tests prove the script, its checks and its record before that run."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "kernels_round3.py"


def _run(tmp_path, *flags, timeout=600):
    out = tmp_path / "record.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}       # the script chooses itself
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *flags], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, json.loads(out.read_text())


def test_dry_run_covers_every_case_and_the_fused_route_matches_the_old_one(tmp_path):
    proc, rec = _run(tmp_path, "--dry-run", "--no-sweep")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rec["errors"] == [] and rec["skipped"] == []
    assert rec["meta"]["dry_run"] and rec["meta"]["batch_sizes"] == [1, 5]
    gemm = {(r["op"], r["m"], r["path"]) for r in rec["gemm"]}
    for op in ("qkv", "o_proj", "gate_up", "down"):
        for m in (1, 5):
            assert {(op, m, "triton")} <= gemm and any(k[:2] == (op, m) and k[2].startswith("cublas") for k in gemm)
    # Errors against an fp32 product: within bf16 rounding of outputs of size ~1 (K = 64 or 128).
    assert all(r["max_abs_err"] < 2e-2 for r in rec["gemm"] if "max_abs_err" in r)
    assert {r["op"] for r in rec["elementwise"]} == {"add_rms_norm", "qk_norm_rope_store"}
    assert all(r["max_abs_err_out"] <= 2e-2 for r in rec["elementwise"] if r["op"] == "add_rms_norm")
    assert all(r["max_abs_err_k_cache"] <= 2e-2 and r["max_abs_err_v_cache"] == 0
               for r in rec["elementwise"] if r["op"] == "qk_norm_rope_store")
    new = [r for r in rec["layer"] if r["variant"] == "new"]
    assert [r["m"] for r in new] == [1] and all(r["rel_norm_err_vs_old"] < 2e-2 for r in new)
    assert [r["m"] for r in rec["layer_summary"]] == [1]


def _nvidia_compiler_available() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    import triton
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _nvidia_compiler_available(), reason="Triton without its NVIDIA back-end and ptxas")
def test_every_bf16_kernel_variant_compiles_for_sm90_pipelined_and_with_pdl_where_asked(tmp_path):
    proc, rec = _run(tmp_path, "--compile-check", "--compile-dtypes", "bf16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = rec["compile_check"]
    from nanovllm_ref.kernels import small_gemm
    # one build per GEMM variant (4 projections x warm_batch_sizes; at M=1 the preloading whole-K GEMV of round 13)
    # and 9 element-wise/PDL builds (the q/k kernel with and without its store; the norm and the q/k kernel also in
    # their one-row form, which launches the kernel behind at its start)
    assert len(rows) == 4 * len(small_gemm.warm_batch_sizes()) + 9 and all(r["compiled"] for r in rows)
    assert sum("early=True" in r["variant"] for r in rows) == 2
    for r in rows:
        assert r["griddepcontrol_in_ptx"] == ("pdl=True" in r["variant"]), r["variant"]
        if "dot=True" in r["variant"]:
            # tl.dot steps are software-pipelined: >= 3 stages of the x and W tiles in shared memory.
            bm, bn, bk = (int(v) for v in r["variant"].split()[4].split("x"))
            assert r["dynamic_shared_bytes"] >= 3 * (bm + bn) * bk * 2, r
    assert max(r.get("stack", 0) for r in rows) <= 16, "a kernel variant spills registers"


def test_round5_dry_run_records_layers_attention_and_gemms_with_real_errors(tmp_path):
    """bench/kernels_round5.py (the round-5 record's script) end to end in the interpreter: every section
    recorded, no case skipped, and the numbers it compares are close to their references."""
    out = tmp_path / "round5.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_round5.py"), "--dry-run", "--out", str(out),
                           "--sections", "layer,attention,gemm"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["errors"] == [] and rec["skipped"] == []
    assert {(r["m"], r["variant"]) for r in rec["layer"]} == {(1, "fused"), (5, "fused")}
    lengths = {r["lengths"] for r in rec["attention"]}
    assert lengths == {"equal", "random", "longest_first"}
    assert all(r["max_abs_err_vs_default"] < 2e-2 for r in rec["attention"])
    assert {r["op"] for r in rec["gemm"]} == {"qkv", "o_proj", "gate_up", "down"}
    assert all(r["max_abs_err"] < 2e-2 for r in rec["gemm"] if "max_abs_err" in r)


def _dry(tmp_path, script, *args):
    out = tmp_path / f"{script}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_round6_dry_runs_check_the_persistent_step_against_the_layers(tmp_path):
    """bench/persistent_step.py and persistent_probe.py (round 6's scripts) in the interpreter: the persistent step's
    hidden state and KV rows equal the layers' (fp32), and the probe's barrier counts one arrival per program."""
    rec = _dry(tmp_path, "persistent_step.py")
    assert [r["context"] for r in rec["cases"]] == [6, 38]
    for row in rec["cases"]:
        assert row["hidden_rel_norm_diff"] < 1e-5 and row["k_rows_max_abs_diff"] < 1e-5, row
    probe = _dry(tmp_path, "persistent_probe.py")
    assert probe["barrier_count_check"]["counter"] == probe["barrier_count_check"]["expected"]
    assert max(probe["chain_check"].values()) < 1e-5


@pytest.mark.skipif(not _nvidia_compiler_available(), reason="Triton without its NVIDIA back-end and ptxas")
def test_the_persistent_kernel_for_sm90_loads_its_weights_as_16_byte_vectors(tmp_path):
    """The weight offsets' alignment hint (persistent_decode._weight): without it Triton proves no alignment
    and issues one 16-bit load per bf16 weight (677 of the 4-warp build's global loads were, at da3dbc7)."""
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "persistent_step.py"), "--compile-check", "--out",
                           str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    builds = json.loads(out.read_text())["builds"]
    assert [b["num_warps"] for b in builds] == [4, 8]
    for b in builds:
        loads = {int(k): v for k, v in b["global_loads_by_bits"].items()}
        assert loads.get(128, 0) >= 40, b
        assert loads.get(16, 0) <= 8, f"scalar 16-bit loads are back: {b}"
        # 8 warps: no spill; 4 warps (255 registers a thread at most) spill a few bytes at most.
        assert b["stack"] <= (0 if b["num_warps"] == 8 else 16), f"the kernel spills registers: {b}"


def test_round9_dry_run_times_three_row_orders_with_the_same_outputs(tmp_path):
    """bench/kernels_round9.py (round 9's record) in the interpreter: the decode attention at the workload's steps
    in arrival order, longest first and shortest first gives the same outputs bit for bit (the rows are only
    reordered), over the rows the workload has at that step; both BLAS libraries give the same GEMM."""
    rec = _dry(tmp_path, "kernels_round9.py")
    assert rec["errors"] == [] and rec["skipped"] == []
    assert rec["meta"]["workload_tokens"] == {"prompt": 142827, "output": 133966}   # upstream bench.py's totals
    assert [r["step"] for r in rec["order"]] == [0, 400]
    for row in rec["order"]:
        for name in ("arrival", "longest_first", "shortest_first"):
            assert row[f"{name}_max_abs_err_vs_arrival"] == 0.0, row
    assert [r["batch"] for r in rec["order"]] == [5, 4]     # the second of the first five asks for 312 tokens
    assert {r["op"] for r in rec["gemm"]} == {"qkv", "o_proj", "gate_up", "down", "lm_head"}
    assert all(r["max_abs_diff"] == 0.0 for r in rec["gemm"])


def test_round10_dry_run_runs_the_gemm_chain_on_both_paths_and_agrees_with_fp32_and_halves(tmp_path):
    """bench/kernels_round10.py (round 10's record) in the interpreter: the decode GEMM chain runs through the small
    GEMMs (1 row) and cuBLAS's path (3 rows), from 'HBM' and 'L2-hot', and the engine's kernels agree with the
    same chain in fp32 torch within bf16 rounding (2 layers, outputs of size ~1). The prefetch variants need the
    GPU (inline PTX): here they are recorded as not run, never as a time."""
    rec = _dry(tmp_path, "kernels_round10.py")
    assert rec["errors"] == [] and rec["skipped"] == [] and rec["meta"]["chain_layers"] == 2
    assert [(r["m"], r["path"]) for r in rec["chain"]] == [(1, "triton small GEMMs"), (3, "cuBLAS")]
    for row in rec["chain"]:
        assert 0 < row["dram_max_abs_err_vs_fp32"] < 5e-2, row
        assert row["dram_us_a_layer"] > 0 and row["l2_hot_us_a_layer"] > 0
        for name in ("prefetch_bulk", "prefetch_bulk_2", "prefetch_line"):
            assert row[f"{name}_us_a_layer"] is None and f"{name}_equal_to_dram" not in row
    # the overlap section: the same step's rows as one batch and as two halves (one stream, two streams) agree
    [row] = rec["overlap"]
    assert (row["step"], row["batch"]) == (0, 5)
    assert row["halves_serial_max_abs_err_vs_full"] < 5e-2 and row["halves_two_streams_max_abs_err_vs_full"] < 5e-2


def test_round11_dry_run_sweeps_every_projection_both_ways_and_every_plan_agrees_with_fp32(tmp_path):
    """bench/kernels_round11.py (round 11's record) in the interpreter: at each batch size the chain is timed as the
    engine runs it (before and after the sweep), each projection as cuBLAS and as a Triton config other than the
    engine's, the best plan is made of specs the sweep measured, and every plan's output agrees with the chain in
    fp32 torch within bf16 rounding (2 layers, outputs of size ~1). At 2 rows the engine runs the small GEMMs
    (small_max_m = 2 in a dry run), at 5 cuBLAS, so both sides of the line are swept."""
    rec = _dry(tmp_path, "kernels_round11.py")
    assert rec["errors"] == [] and rec["skipped"] == [] and rec["meta"]["ms"] == [2, 5]
    for m, engine in ((2, "default"), (5, "cublas")):
        rows = [r for r in rec["sweep"] if r["m"] == m]
        assert [r["spec"] for r in rows if r["op"] is None] == ["engine", "engine (after)"]
        assert rows[0]["engine"] == {op: engine for op in ("qkv", "o", "gate_up", "down")}
        for op in ("qkv", "o", "gate_up", "down"):
            specs = [r["spec"] for r in rows if r["op"] == op]
            assert engine not in specs and ("cublas" in specs or "default" in specs), (m, op, specs)
            assert any(s.startswith("bm") for s in specs), (m, op, specs)
            assert all(r["us_a_layer"] > 0 and "vs_engine_us" in r for r in rows if r["op"] == op)
        [summary] = [r for r in rec["sweep_summary"] if r["m"] == m]
        measured = {(r["op"], r["spec"]) for r in rows if r["op"]}
        for op, spec in summary["best"].items():
            name = spec if isinstance(spec, str) else "bm{block_m} bn{block_n} bk{block_k} s{split_k} w{num_warps} " \
                "st{num_stages}".format(**spec)
            assert name == engine or (op, name) in measured, (m, op, name)
    assert [r["m"] for r in rec["best"]] == [2, 5]
    for row in rec["best"]:
        for plan in ("engine", "all_cublas", "best"):
            assert 0 < row[f"{plan}_max_abs_err_vs_fp32"] < 5e-2, row
    assert rec["trace"] == [{"m": 2, "note": "no CUDA: no trace"}]


def test_round12_dry_run_norms_inside_the_gemms_give_the_engines_chain(tmp_path):
    """bench/kernels_round12.py (round 12) in the interpreter: the decode GEMM chain with each add + RMSNorm inside
    the next GEMM's prologue (GEMV form at 1 row, tl.dot at 2) rounds where the engine's separate kernels round,
    so each variant's output (both norms inside, with wider column tiles, the qkv or the gate_up one alone)
    equals the engine's chain (max difference 0 in the interpreter's emulated bf16) and both agree
    with the chain in fp32 torch within bf16 rounding (2 layers, outputs of size ~1)."""
    rec = _dry(tmp_path, "kernels_round12.py")
    assert rec["errors"] == [] and rec["skipped"] == [] and rec["meta"]["ms"] == [1, 2]
    assert [r["m"] for r in rec["chain"]] == [1, 2]
    for row in rec["chain"]:
        assert row["engine"] == {op: "default" for op in ("qkv", "o", "gate_up", "down")}
        assert 0 < row["engine_max_abs_err_vs_fp32"] < 5e-2 and row["engine_us_a_layer"] > 0, row
        for name in ("fused", "fused_wide", "fused_qkv", "fused_gate_up"):
            assert row[f"{name}_max_abs_diff_vs_engine"] == 0.0, (name, row)
            assert 0 < row[f"{name}_max_abs_err_vs_fp32"] < 5e-2 and row[f"{name}_us_a_layer"] > 0, (name, row)
    assert rec["trace"] == [{"m": 1, "note": "no CUDA: no trace"}]


def test_round13_dry_run_preloaded_weights_give_the_same_chain(tmp_path):
    """bench/kernels_round13.py (round 13) in the interpreter: the decode GEMM chain whose small GEMMs load their
    first weight tile before the PDL wait (the engine's plan at 1 row now, with whole-K steps), with the next kernel
    launched early, or preloading the tl.dot tiles too, gives the chain of the engine before the round (max
    difference 0 in the interpreter's emulated bf16, whose K steps here are one step either way), and all agree
    with the chain in fp32 torch within bf16 rounding (2 layers, outputs of size ~1)."""
    rec = _dry(tmp_path, "kernels_round13.py")
    assert rec["errors"] == [] and rec["skipped"] == [] and rec["meta"]["ms"] == [1, 2]
    assert [r["m"] for r in rec["chain"]] == [1, 2]
    for row in rec["chain"]:
        names = ["engine", "no_preload", "early"] + (["preload_dot"] if row["m"] > 1 else [])
        assert sorted(row["configs"]) == sorted(names + ["before"]), row["configs"]
        engine, before = row["configs"]["engine"], row["configs"]["before"]
        assert all(c.endswith(" pre") for c in engine.values()) == (row["m"] == 1), engine
        assert not any("pre" in c for c in before.values())
        assert not any("pre" in c for c in row["configs"]["no_preload"].values())
        assert all(c.endswith("pre early") for c in row["configs"]["early"].values())
        if row["m"] > 1:
            assert engine == before and all(c.endswith(" pre") for c in row["configs"]["preload_dot"].values())
        assert 0 < row["before_max_abs_err_vs_fp32"] < 5e-2 and row["before_us_a_layer"] > 0, row
        for name in names:
            assert row[f"{name}_max_abs_diff_vs_before"] == 0.0, (name, row)
            assert 0 < row[f"{name}_max_abs_err_vs_fp32"] < 5e-2 and row[f"{name}_us_a_layer"] > 0, (name, row)
    assert [(t["m"], t["plan"]) for t in rec["trace"]] == [(1, "before"), (1, "engine")]


def test_round14_dry_run_tma_gemms_give_the_engines_chain(tmp_path):
    """bench/kernels_round14.py (round 14) in the interpreter: every projection run by the TMA-descriptor Triton GEMM
    (bench/gemm_tma.py: the full, split-K partials and SiLU forms) gives the chain of the engine's cuBLAS plan within
    bf16 rounding (here 0: the interpreter's cuBLAS stand-in and the kernel round alike), and the read, decode and
    prefill attention cases report their sizes."""
    rec = _dry(tmp_path, "kernels_round14.py")
    assert rec["errors"] == [] and rec["skipped"] == [] and rec["meta"]["ms"] == [2]
    kinds = [r["kind"] for r in rec["bandwidth"]]
    assert kinds == ["read", "attention"] and all(r["bytes"] > 0 and r["us"] > 0 for r in rec["bandwidth"])
    assert rec["bandwidth"][1]["max_abs_diff"] == 0.0
    assert [(r["launch"], r["max_abs_diff"]) for r in rec["prefill"]] == [("engine", 0.0)]
    assert rec["prefill"][0]["seqs"] >= 2 and rec["prefill"][0]["tokens"] <= 64
    rows = [r for r in rec["chain"] if r["op"]]
    assert {r["op"] for r in rows if r["spec"].startswith("tma ")} == {"qkv", "o", "gate_up", "down"}
    assert {r["spec"] for r in rows if r["op"] == "o" and r["spec"].startswith("tma ")} == {"tma bm16 bn16 bk16 s4 w4 st2"}
    for row in rows:
        assert row["max_abs_diff_vs_engine"] < 2e-2 and row["us_a_layer"] > 0, row
    assert [r["m"] for r in rec["best"]] == [2] and rec["best"][0]["best_max_abs_err_vs_fp32"] < 5e-2
    assert rec["trace"] == [{"m": 2, "note": "no CUDA: no trace"}]
