"""bench/ch13_gpu.py (chapter 13's C.4 on the H200) on the CPU: its --cpu-smoke mode runs the same code path
with the tiny model and 4 requests; a failing engine is recorded, not fatal; the figure draws from the JSON."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from nanovllm_ref import Parts

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "ch13_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("ch13_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_smoke_writes_the_json_and_the_figure(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore")
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "ch13_gpu_h200.json").read_text())
    assert data["mode"] == "cpu-smoke" and data["torch"] and len(data["date"]) == 10 and "triton" in data
    w = data["workload"]
    assert (w["requests"], w["temperature"], w["ignore_eos"], w["timed_runs"]) == (4, 0.6, True, 3)
    assert set(data["engines"]) == {"reference", "yours"}
    for who, rec in data["engines"].items():
        assert rec["error"] is None, (who, rec.get("traceback"))
        assert len(rec["tok_s"]) == 3 and all(x > 0 for x in rec["tok_s"])
        assert rec["median_tok_s"] == sorted(rec["tok_s"])[1]
        assert rec["output_tokens"] == w["output_tokens"]          # ignore_eos: every request ran to max_tokens
        assert [round(rec["output_tokens"] / s, 6) for s in rec["seconds"]] == [round(x, 6) for x in rec["tok_s"]]
    assert data["engines"]["reference"]["students_parts"] == []
    yours = data["engines"]["yours"]["students_parts"]
    assert len(yours) == 14 and "sampler (ch08 E8.1-E8.4)" in yours
    assert "attention_backend (ch04 E4.2)" in yours            # the CPU runs chapter 04's decode, and says so
    png = (tmp_path / "ch13_capstone_h200.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def boom(logits, metadata):
    raise RuntimeError("planted sampler failure")


def test_a_failing_engine_is_recorded_with_its_error_and_the_figure_still_draws(tmp_path):
    mod = load_script()
    from nanovllm_bench.workload import make_model_folder
    from nanovllm_course.figures_ch13 import capstone_throughput
    path = make_model_folder("tiny", str(tmp_path / "model"))
    prompts, max_tokens = mod.workload(dict(mod.SMOKE, requests=2))
    rec = mod.run_engine(path, Parts(sampler=boom), prompts, max_tokens, mod.SMOKE)
    assert rec["error"] == "RuntimeError: planted sampler failure" and rec["tok_s"] == [] and rec["median_tok_s"] is None
    assert "boom" in rec["traceback"]
    data = dict(date="2026-12-01", device="test GPU", model="m", workload=dict(requests=2, temperature=0.6),
                engine_args=dict(enforce_eager=False),
                engines=dict(reference=dict(tok_s=[10.0, 12.0, 11.0], median_tok_s=11.0, error=None),
                             yours=dict(students_parts=["x"], **rec)))
    out = capstone_throughput(tmp_path / "f.png", data)
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_the_time_budget_stops_timed_runs_early(tmp_path):
    mod = load_script()
    import time
    from nanovllm_bench.workload import make_model_folder
    path = make_model_folder("tiny", str(tmp_path / "model"))
    prompts, max_tokens = mod.workload(dict(mod.SMOKE, requests=2))
    rec = mod.run_engine(path, Parts(), prompts, max_tokens, mod.SMOKE, deadline=time.monotonic())
    assert rec["error"] is None and len(rec["tok_s"]) == 1 and "time budget" in rec["note"]
