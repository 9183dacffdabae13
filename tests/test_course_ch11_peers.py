"""Chapter 11's table of peers, read from a benchmark record (nanovllm_bench's JSON)."""
import json

from nanovllm_course import ch11

RECORD = dict(
    date="2026-12-01", machine=dict(device_name="NVIDIA H200"),
    workload=dict(num_requests=256, output_tokens=133_966),
    runs=[dict(name="nanovllm_ref[triton:graph]", peer="nanovllm_ref", status="ok", tok_s=18_995, min_tok_s=18_762,
               max_tok_s=19_433, repeats=3, batch1_tok_s=523, pct_of_floor=52.9, startup_s=14.2,
               versions=dict(torch="2.11.0", transformers="5.17.0", peer="0.1.0", commit="45c6c05")),
          dict(name="vllm", peer="vllm", status="ok", tok_s=18_770, min_tok_s=18_610, max_tok_s=19_386, repeats=3,
               batch1_tok_s=506, pct_of_floor=52.3, startup_s=77, versions=dict(torch="2.11.0", peer="0.20.2")),
          dict(name="nano-vllm", peer="nano-vllm", status="failed", reason="exit 1; last lines:\nImportError: x"),
          dict(name="hf_transformers[continuous_batching]", tok_s=734, min_tok_s=734, max_tok_s=734, repeats=1,
               startup_s=9.0, versions=dict(torch="2.11.0"))])


def test_peer_rows_carry_family_version_and_date():
    rows = {r["name"]: r for r in ch11.peer_rows(RECORD)}
    assert rows["nanovllm_ref[triton:graph]"]["version"] == "45c6c05"      # ours: the commit
    assert rows["vllm"]["version"] == "0.20.2" and rows["vllm"]["family"] == "vllm"
    assert rows["hf_transformers[continuous_batching]"]["family"] == "hf"   # an older record: no "peer" key
    assert rows["nano-vllm"]["status"] == "failed" and "ImportError" in rows["nano-vllm"]["reason"]
    assert {r["date"] for r in rows.values()} == {"2026-12-01"}


def test_peers_markdown_shows_every_peer_with_spread_and_reasons():
    text = ch11.peers_markdown(RECORD)
    assert text.splitlines()[0] == "NVIDIA H200, 2026-12-01, 256 requests, 133,966 output tokens"
    assert "| vllm | 0.20.2 | 18,770 (18,610-19,386) | 52.3 % | 506 | 77 s |" in text
    assert "| nano-vllm |  | failed: exit 1: ImportError: x | | | |" in text


def test_a_failed_peer_shows_the_exception_line_of_its_traceback():
    reason = ('exit 1; last lines of its output:\n  File "x.py", line 3, in f\n    raise RuntimeError(\n'
              'RuntimeError: Engine core initialization failed. See root cause above.')
    assert ch11.reason_line(reason) == "exit 1: RuntimeError: Engine core initialization failed. See root cause above."
    assert ch11.reason_line("ran past 141 s; last lines:\nCapturing CUDA graphs") == "ran past 141 s; last lines:"
    assert ch11.reason_line(None) == "" and len(ch11.reason_line("x" * 500)) == 90


def test_the_committed_peers_record_names_its_vllm_failure():
    import json
    record = json.loads((ch11.RESULTS / ch11.PEERS_RECORD).read_text())
    rows = {r["name"]: r for r in ch11.peer_rows(record)}
    assert rows["vllm"]["status"] == "failed" and rows["nano-vllm"]["version"] == "bb823b3"
    assert "| vllm |  | failed: exit 1: RuntimeError: Engine core initialization failed." in ch11.peers_markdown(record)


def test_the_same_call_numbers_are_the_committed_records_own():
    # VLLM_SAME_CALL restates one peers record: every number must be that record's, rounded as printed.
    v = ch11.VLLM_SAME_CALL
    record = json.loads((ch11.RESULTS / v["record"]).read_text())
    rows = {r["name"]: r for r in record["runs"]}
    vllm, ours, nano = rows["vllm"], rows["nanovllm_ref[triton:graph]"], rows["nano-vllm"]
    assert (v["tok_s"], v["min_tok_s"], v["max_tok_s"], v["batch1_tok_s"]) == tuple(
        round(vllm[k]) for k in ("tok_s", "min_tok_s", "max_tok_s", "batch1_tok_s"))
    assert (v["ours"], v["ours_min"], v["ours_max"], v["ours_batch1"]) == tuple(
        round(ours[k]) for k in ("tok_s", "min_tok_s", "max_tok_s", "batch1_tok_s"))
    assert (v["nano_vllm"], v["nano_vllm_batch1"]) == (round(nano["tok_s"]), round(nano["batch1_tok_s"]))
    assert v["date"] == record["date"]
