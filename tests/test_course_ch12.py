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


def test_the_capstone_table_names_each_part_its_owner_and_chapter(tmp_path, capsys):
    ch12.assemble(solutions, out=str(tmp_path / "student"))
    out = capsys.readouterr().out
    assert "sampler                yours      ch08 E8.1-E8.4 sample" in out
    assert "attention_backend      yours      ch06 E6.3 paged_decode" in out
    assert "14 of 14 exercise parts are yours" in out


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


def test_recorded_smollm2_reference_is_what_the_reference_engine_gives():
    fresh = ch12.reference_smollm2()
    assert [ids for ids, _ in fresh] == [ids for ids, _ in ch12.REFERENCE_SMOLLM2]
    for (_, got), (_, want) in zip(fresh, ch12.REFERENCE_SMOLLM2):
        assert got == pytest.approx(want, abs=2e-3)
