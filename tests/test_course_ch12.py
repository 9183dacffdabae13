"""Chapter 12 (capstone): the export round trip, the unfilled chapters, and planted wrong parts.

- solutions/ 01-10 exported: every part is the course's, every section passes, the check says `E12.1 ok`;
- chapters/ (unfilled): the capstone runs on the reference's parts, every section passes, and the check lists
  what is still the reference's and says `not done yet`;
- one planted wrong part at a time (a scheduler re-queueing at the back, a sampler ignoring T, a store writing
  slot -1): the check fails and names the part; the engine sections that can see the bug fail and blame it.
"""
import functools
import random

import pytest

from nanovllm_course import ch12
from nanovllm_course.common import NotDone, check
from nanovllm_ref import Parts

import ch12_mutants

ALL_FIELDS = ["rms_norm", "add_rms_norm", "rope_cos_sin", "rotary", "qkv_weight_loader", "gate_up_weight_loader",
              "prepare_prefill", "prepare_decode", "attention_backend", "store_kvcache", "block_manager",
              "scheduler", "sampler", "graph_batch_sizes"]


SECTION = {"tiny_vs_hf": "C.1 HF", "stream_vs_reference": "C.1 stream", "tensor_parallel_2": "C.1 tp=2",
           "smollm2_vs_reference": "C.2 SmolLM2", "first_token_chi2": "C.3 sampling"}


def passes(cap, name, **kwargs) -> bool:
    """Run section `name` of the capstone on `cap`; True when it recorded a pass."""
    assert getattr(ch12, name)(cap, **kwargs) is None
    return cap.results[SECTION[name]][0]


def solutions():
    return ch12.SOLUTIONS


@functools.lru_cache(maxsize=None)
def _solved(out):
    return ch12.assemble(solutions, out=out)


@pytest.fixture
def solved(tmp_path_factory, capsys):
    cap = _solved(str(tmp_path_factory.getbasetemp() / "solved" / "student"))
    capsys.readouterr()
    return ch12.Capstone(cap.folder, cap.rows, cap.parts, cap.cpu_parts, dict(cap.objects), {}, cap.stub)


def test_round_trip_every_part_is_yours_and_the_check_says_ok(solved, capsys):
    assert set(solved.parts.replaced()) == set(ALL_FIELDS) and solved.missing() == []
    # on a CPU chapter 04's PyTorch decode replaces chapter 06's kernel, and nothing else changes
    assert solved.cpu_parts.attention_backend.paged_decode.__module__.endswith("ch04")
    assert passes(solved, "tiny_vs_hf") and passes(solved, "stream_vs_reference", seed=1) and passes(solved, "tensor_parallel_2")
    assert passes(solved, "first_token_chi2") and passes(solved, "smollm2_vs_reference")
    with check("E12.1"):
        ch12.check_capstone(solutions, solved)
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "E12.1 ok" and "still the reference's" not in out


def test_c2_shows_both_engines_answers_and_their_throughput_on_this_cpu(solved, capsys):
    """The capstone shows the student's SmolLM2 answers beside the reference's (cut at the end-of-turn id that
    ignore_eos generates past), and both engines' output tok/s on this CPU."""
    import re
    assert passes(solved, "smollm2_vs_reference")
    out = capsys.readouterr().out.splitlines()
    i = out.index("    What is the capital of France?")
    yours, ref = out[i + 1], out[i + 2]
    assert yours.startswith("    yours:     ") and "Paris" in yours and ref == yours.replace("yours:    ", "reference:")
    assert "<|im_end|>" not in yours and "\n" not in yours
    ch12.smollm2_throughput(solved, max_tokens=4, repeats=1)
    line = capsys.readouterr().out.strip()
    m = re.fullmatch(r"C\.2 on this CPU \(4 prompts x 4 tokens, median of 1\): yours ([\d,]+) output tok/s, "
                     r"reference ([\d,]+) \((\d+\.\d\d)x\)", line)
    assert m, line
    y, r = (float(m[k].replace(",", "")) for k in (1, 2))
    assert y > 0 and r > 0 and float(m[3]) == pytest.approx(y / r, abs=0.01 + 0.01 * y / r)


def test_the_capstone_table_names_each_part_its_owner_and_chapter(tmp_path, capsys):
    ch12.assemble(solutions, out=str(tmp_path / "student"))
    out = capsys.readouterr().out
    assert "sampler                yours      ch08 E8.1-E8.4 sample" in out
    # C.1-C.3 run on the CPU: the table names chapter 04's decode, which runs there, and says where 06's does
    assert "attention_backend      yours      ch04 E4.2 paged_decode" in out and "ch06 E6.3 paged_decode\n" not in out
    assert "your ch06 E6.3 paged_decode kernel is checked on its own there and runs in the engine in C.4" in out
    assert "14 of 14 exercise parts are yours" in out


def test_without_chapter_04s_decode_the_cpu_table_says_the_reference_runs_in_place_of_the_kernel(solved):
    rows = [dict(r, status="stub", source="reference") if (r["field"], r["chapter"]) == ("attention_backend", "04")
            else r for r in solved.rows]
    cap = ch12.Capstone(solved.folder, rows, solved.parts, ch12._cpu_parts(rows, solved.parts), solved.objects)
    assert cap.cpu_parts.attention_backend is None
    table = ch12.ex.part_table(ch12.cpu_rows(cap))
    assert "attention_backend      reference  ch06 E6.3 paged_decode (ch06 kernel: GPU only)" in table


def test_unfilled_chapters_run_on_reference_parts_and_say_what_is_missing(tmp_path, capsys):
    def stub():
        raise NotImplementedError("Exercise 12.1: return the folder of your filled chapter notebooks")
    ch12.STUB_FOLDER, old = str(ch12.REPO / "chapters"), ch12.STUB_FOLDER
    try:
        cap = ch12.assemble(stub, out=str(tmp_path / "student"))
    finally:
        ch12.STUB_FOLDER = old
    assert cap.stub and cap.parts == Parts() and cap.cpu_parts == Parts() and not cap.objects
    assert "sampler (ch08 E8.1-E8.4)" in cap.missing() and len(cap.missing()) == 14
    assert passes(cap, "tiny_vs_hf") and passes(cap, "stream_vs_reference") and passes(cap, "first_token_chi2")
    capsys.readouterr()
    with pytest.raises(NotDone):
        ch12.check_capstone(stub, cap)
    with check("E12.1"):
        ch12.check_capstone(stub, cap)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "E12.1 not done yet"
    assert lines[-2].startswith("still the reference's: rms_norm (ch01 E1.1), add_rms_norm (ch01 E1.2)")
    assert "scheduler (ch07 E7.1-E7.3)" in lines[-2] and "sampler (ch08 E8.1-E8.4)" in lines[-2]


def test_one_missing_part_is_listed_and_the_rest_still_checked(solved, capsys):
    row = dict(solved.shown()["sampler"], status="stub", source="reference")
    cap = ch12.Capstone(solved.folder, [r for r in solved.rows if r["field"] != "sampler"] + [row],
                        solved.parts, solved.cpu_parts, {k: v for k, v in solved.objects.items() if k != "sampler"})
    with check("E12.1"):
        ch12.check_capstone(solutions, cap)
    assert capsys.readouterr().out.splitlines()[-2:] == ["still the reference's: sampler (ch08 E8.1-E8.4)",
                                                        "E12.1 not done yet"]


# -- planted wrong parts ----------------------------------------------------------------------------------------
MUTANTS = [("scheduler", ch12_mutants.BackOfQueueScheduler, "scheduler (ch07 E7.1-E7.3)"),
           ("sampler", ch12_mutants.sample_ignoring_temperature, "sampler (ch08 E8.1-E8.4)"),
           ("store_kvcache", ch12_mutants.store_writing_slot_minus_one, "store_kvcache (ch10 E10.3)")]


@pytest.mark.parametrize("field,mutant,label", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_a_planted_wrong_part_fails_the_check_and_is_named(solved, field, mutant, label, capsys):
    cap = solved.plant(field, mutant)
    with pytest.raises(AssertionError) as info:
        ch12.check_capstone(solutions, cap)
    assert str(info.value).startswith(f"E12.1: your {label} fails its chapter's check"), str(info.value)
    with check("E12.1"):
        ch12.check_capstone(solutions, cap)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(f"E12.1 failed: your {label} fails its chapter's check"), line


def test_the_stream_sees_a_scheduler_that_requeues_at_the_back_and_blames_it(solved, capsys):
    cap = solved.plant("scheduler", ch12_mutants.BackOfQueueScheduler)
    assert not passes(cap, "stream_vs_reference", seed=3)
    passed, blamed, message = cap.results["C.1 stream"]
    assert blamed == "scheduler (ch07 E7.1-E7.3)" and "waiting queue" in message, (blamed, message)
    # greedy ids alone cannot see it: the tiny HF comparison still passes
    assert passes(cap, "tiny_vs_hf")
    # and the check, with the part checks out of the way, reports the section and the part
    ch12_checks = ch12._part_checks
    try:
        ch12._part_checks = lambda: {}
        with pytest.raises(AssertionError, match=r"C.1 stream: .*the part that does it: scheduler \(ch07"):
            ch12.check_capstone(solutions, cap)
    finally:
        ch12._part_checks = ch12_checks


def test_the_chi_squared_sees_a_sampler_ignoring_temperature_and_blames_it(solved, capsys):
    cap = solved.plant("sampler", ch12_mutants.sample_ignoring_temperature)
    assert not passes(cap, "first_token_chi2")
    assert cap.results["C.3 sampling"][1] == "sampler (ch08 E8.1-E8.4)"
    assert "NOT consistent" in capsys.readouterr().out


def test_the_streams_always_preempt_and_hit_the_prefix_cache():
    path = ch12.tiny_model_dir("qwen3")
    for seed in range(3):
        prompts = ch12.random_stream(random.Random(seed))
        _, trace = ch12.run_traced(Parts(), path, prompts)
        assert trace[-1][2] > 0, seed
        assert prompts[0][:8] == prompts[1][:8] and prompts[2][:8] == prompts[3][:8]


def test_the_live_smollm2_reference_agrees_with_hf_scoring_its_ids():
    """C.2's reference side (the reference engine with a margin-recording sampler): 4 chats x 32 tokens, and
    HF transformers scoring those ids in one forward picks the same argmax wherever the margin is not a
    near-tie, with margins within 2e-3 of the engine's."""
    from transformers import AutoModelForCausalLM
    from nanovllm_models.download import ensure_model
    import torch
    path = str(ensure_model())
    ref = ch12.reference_smollm2()
    assert len(ref) == 4 and all(len(ids) == len(m) == ch12.SMOL_TOKENS == 32 for ids, m in ref)
    assert ref[0][0][:6] == [504, 3575, 282, 4649, 314, 7042]      # "The capital of France is Paris"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, (ids, margins) in zip(ch12.smollm2_prompts(path), ref):
        with torch.no_grad():
            logits = hf(torch.tensor([p + ids[:-1]])).logits[0, len(p) - 1:]
        top2 = logits.topk(2, dim=-1)
        hf_margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
        assert margins == pytest.approx(hf_margins, abs=2e-3)
        sure = [s for s, m in enumerate(margins) if m >= ch12.MARGIN]
        assert [top2.indices[s, 0].item() for s in sure] == [ids[s] for s in sure]


def test_c2_reports_how_far_each_prompt_matched_and_stops_at_a_near_tie(capsys, monkeypatch):
    """A fake 'your engine' that differs at step 5 of prompt 0 and step 3 of prompt 1; prompt 1's reference
    margin at step 3 is made a near-tie, so only prompt 0 fails."""
    ref = [(list(range(100, 132)), [1.0] * 32) for _ in range(4)]
    ref[1] = (ref[1][0], [1.0, 1.0, 5e-4] + [1.0] * 29)
    got = [list(ids) for ids, _ in ref]
    got[0][4] = 7
    got[1][2] = 7
    monkeypatch.setattr(ch12, "reference_smollm2", lambda n, path=None: ref)
    monkeypatch.setattr(ch12, "_generate", lambda *a, **k: got)
    monkeypatch.setattr(ch12, "smollm2_prompts", lambda path: [[1]] * 4)
    monkeypatch.setattr(ch12, "_blame", lambda cap, prompts=None: None)
    cap = ch12.Capstone("x", [], Parts(), Parts(), {})
    assert not passes(cap, "smollm2_vs_reference")
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("C.2")]   # not the answers
    assert lines[0] == ("C.2 prompt 0: 4/32 ids equal, then step 5 differs from the reference "
                        "(reference top-2 margin there 1, not a near-tie)")
    assert lines[1] == ("C.2 prompt 1: 2/32 ids equal; step 3's top-2 margin (0.0005) is below 0.001, "
                        "so the comparison stops there")
    assert lines[2] == "C.2 prompt 2: 32/32 ids equal the reference engine's (smallest top-2 margin 1, at step 1)"


def test_c3_prints_the_same_p_values_whatever_the_random_state(capsys):
    import torch
    cap = ch12.Capstone("x", [], Parts(), Parts(), {})
    outs = []
    for k in range(2):
        torch.manual_seed(100 + k)          # the section seeds its own fork of the generator
        assert passes(cap, "first_token_chi2")
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert outs[0].splitlines()[0].startswith("C.3 T=0.6: 20000 first tokens, chi-squared over 86 bins, p = 0.")
    assert [ch12._fmt_p(p) for p in (0.456, 0.004, 1e-9)] == ["p = 0.46", "p < 0.01", "p < 1e-06"]
