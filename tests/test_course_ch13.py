"""Chapter 13 (capstone): E13.1 choose_parts and its mutants, the export round trip, what falls back to what,
and planted wrong parts.

- choose_parts: the reference passes its check; each realistic wrong version fails it in every run, with the
  hint of the rule it breaks;
- solutions/ exported: every part is the course's and ok, every section passes, the check says `E13.1 ok`;
- a folder whose chapter 10 is still the stub (the issue's case): the store falls back to chapter 04's on the
  CPU, not to chapter 06's Triton kernel, and the table says so; 15 of 17 parts count as the student's;
- a part that fails its own chapter's check does not run, and the table says why;
- chapters/ (unfilled): the reference's parts, every section passes, E13.1 `not done yet`;
- a planted wrong part that passed its own check: the engine sections see it and blame it, and E13.1 fails.
"""
import functools
import random
import shutil
from pathlib import Path

import nbformat
import pytest

from nanovllm_course import ch13
from nanovllm_course.common import NotDone, check
from nanovllm_ref import Parts

import ch13_mutants

REPO = Path(__file__).resolve().parents[1]
ALL_FIELDS = ["rms_norm", "add_rms_norm", "rope_cos_sin", "rotary", "qkv_weight_loader", "gate_up_weight_loader",
              "prepare_prefill", "prepare_decode", "attention_backend", "store_kvcache", "block_manager",
              "scheduler", "sampler", "graph_batch_sizes"]
SECTION = {"tiny_vs_hf": "C.1 HF", "stream_vs_reference": "C.1 stream", "tensor_parallel_2": "C.1 tp=2",
           "smollm2_vs_reference": "C.2 SmolLM2", "first_token_chi2": "C.3 sampling"}


def section_passes(cap, name, **kwargs) -> bool:
    """Run section `name` of the capstone on `cap`; True when it recorded a pass."""
    assert getattr(ch13, name)(cap, **kwargs) is None
    return cap.results[SECTION[name]][0]


_LIVE_REFERENCE: dict = {}


@pytest.fixture(autouse=True)
def one_live_smollm2_reference_per_module(monkeypatch):
    """C.2's reference side (ch13.reference_smollm2: the reference engine on SmolLM2, greedy, fp32, CPU: the same
    ids and margins on every call) runs live once per (max_tokens, checkpoint) in this module, about 5 s of CPU;
    every test that runs C.2, or calls it, reads a copy of that run. A test that replaces it still can."""
    real = ch13.reference_smollm2

    def once(max_tokens=ch13.SMOL_TOKENS, path=None):
        from nanovllm_models.download import ensure_model
        key = (max_tokens, path or str(ensure_model()))
        if key not in _LIVE_REFERENCE:
            _LIVE_REFERENCE[key] = real(*key)
        return [(list(ids), list(margins)) for ids, margins in _LIVE_REFERENCE[key]]
    monkeypatch.setattr(ch13, "reference_smollm2", once)


def stub_choose(candidates, cuda):
    raise NotImplementedError("Exercise 13.1: for each Parts field, the candidate that runs")


@functools.lru_cache(maxsize=None)
def _assembled():
    """The capstone assembled from solutions/ once per module, and what assemble printed (its table)."""
    import contextlib
    import io
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cap = ch13.assemble(ch13.SOLUTIONS, ch13.reference_choose_parts)
    return cap, printed.getvalue()


def _solved():
    return _assembled()[0]


@pytest.fixture
def solved(capsys):
    cap = _solved()
    capsys.readouterr()
    return ch13.dataclasses.replace(cap, results={})


def folder_with(tmp_path: Path, swaps: dict) -> Path:
    """A copy of solutions/ with some notebooks taken from chapters/ (the stub) or edited: swaps maps a chapter
    number to "stub" or to a function notebook -> notebook."""
    out = tmp_path / "student_chapters"
    out.mkdir()
    for path in sorted((REPO / "solutions").glob("[01][0-9]_*.ipynb")):
        how = swaps.get(path.name[:2])
        if how == "stub":
            shutil.copy(REPO / "chapters" / path.name, out / path.name)
        elif how is not None:
            nb = how(nbformat.read(path, as_version=4))
            (out / path.name).write_text(nbformat.writes(nb), encoding="utf-8")
        else:
            shutil.copy(path, out / path.name)
    return out


# -- E13.1: choose_parts --------------------------------------------------------------------------------------
def test_the_reference_choice_passes_and_the_stub_is_not_done(capsys):
    ch13.check_choose_parts(ch13.reference_choose_parts)
    with pytest.raises(NotDone):
        ch13.check_choose_parts(stub_choose)


def test_the_worked_example_of_the_spec():
    cands = [c for c in ch13._candidate_sets(ch13.fresh_generator(0))[4][1]]     # E10.3 a stub, no CUDA
    cands = [ch13.dataclasses.replace(c, status="failed") if c.name == "CachingBlockManager" else c for c in cands]
    cands = [ch13.dataclasses.replace(c, status="stub") if c.field == "sampler" else c for c in cands]
    cpu, gpu = ch13.reference_choose_parts(cands, False), ch13.reference_choose_parts(cands, True)
    assert cpu["store_kvcache"].exercise == "E4.3" and gpu["store_kvcache"].exercise == "E6.1"
    assert cpu["block_manager"].exercise == "E5.2" and "sampler" not in cpu
    assert cpu["attention_backend"].exercise == "E4.2" and gpu["attention_backend"].exercise == "E6.3"


def _rank_key(c):
    return c.rank


def choose_using_stubs(candidates, cuda):
    """Ignores the status: a stub or a failed part may be chosen."""
    chosen = {}
    for c in candidates:
        if (c.triton and not cuda):
            continue
        if c.field not in chosen or c.rank > chosen[c.field].rank:
            chosen[c.field] = c
    return chosen


def choose_triton_everywhere(candidates, cuda):
    """Forgets rule 2: the Triton kernels on a CPU (the capstone's 0.12x, 100 s)."""
    chosen = {}
    for c in candidates:
        if c.status == "ok" and (c.field not in chosen or c.rank > chosen[c.field].rank):
            chosen[c.field] = c
    return chosen


def choose_never_triton(candidates, cuda):
    """Skips Triton even on a GPU."""
    return ch13.reference_choose_parts([c for c in candidates if not c.triton], cuda)


def choose_lowest_chapter(candidates, cuda):
    chosen = {}
    for c in candidates:
        if c.status != "ok" or (c.triton and not cuda):
            continue
        if c.field not in chosen or c.rank < chosen[c.field].rank:
            chosen[c.field] = c
    return chosen


def choose_last_seen(candidates, cuda):
    """The last ok candidate in list order: right only when the list happens to be sorted."""
    chosen = {}
    for c in candidates:
        if c.status == "ok" and not (c.triton and not cuda):
            chosen[c.field] = c
    return chosen


def choose_by_chapter_only(candidates, cuda):
    """Compares the chapter alone: within chapter 05 the first one seen wins."""
    chosen = {}
    for c in candidates:
        if c.status != "ok" or (c.triton and not cuda):
            continue
        if c.field not in chosen or c.rank[0] > chosen[c.field].rank[0]:
            chosen[c.field] = c
    return chosen


def choose_no_fallback(candidates, cuda):
    """Takes the best-ranked candidate of each field and gives up on the field when that one cannot run."""
    best = {}
    for c in candidates:
        if c.field not in best or c.rank > best[c.field].rank:
            best[c.field] = c
    return {f: c for f, c in best.items() if c.status == "ok" and not (c.triton and not cuda)}


def choose_keyed_by_name(candidates, cuda):
    return {c.name: c for c in ch13.reference_choose_parts(candidates, cuda).values()}


def choose_labels(candidates, cuda):
    return {f: c.label for f, c in ch13.reference_choose_parts(candidates, cuda).items()}


def choose_sorting_in_place(candidates, cuda):
    candidates.sort(key=_rank_key)
    return choose_last_seen(candidates, cuda)


def choose_list(candidates, cuda):
    return list(ch13.reference_choose_parts(candidates, cuda).values())


def choose_with_nones(candidates, cuda):
    """Maps the fields left to the reference to None: allowed by the spec."""
    chosen = ch13.reference_choose_parts(candidates, cuda)
    return {**{c.field: None for c in candidates}, **chosen}


CHOICE_MUTANTS = [
    (choose_using_stubs, "only a candidate with status 'ok'"),
    (choose_triton_everywhere, "skip Triton candidates when cuda is False"),
    (choose_never_triton, "skip Triton candidates only when cuda is False"),
    (choose_lowest_chapter, "the highest chapter wins"),
    (choose_last_seen, "whatever order the candidates come in"),
    (choose_by_chapter_only, "within one chapter the later exercise wins"),
    (choose_no_fallback, "fall back to the next one, not straight to the reference"),
    (choose_keyed_by_name, "key the dict by each candidate's field"),
    (choose_labels, "map each field to the Candidate object itself"),
    (choose_sorting_in_place, "work on a copy"),
    (choose_list, "return a dict"),
]


@pytest.mark.parametrize("mutant,hint", CHOICE_MUTANTS, ids=[m[0].__name__ for m in CHOICE_MUTANTS])
def test_choose_parts_rejects_each_mutant_every_run_with_its_hint(mutant, hint):
    for _ in range(5):                       # fresh random candidate lists each run
        with pytest.raises(AssertionError) as info:
            ch13.check_choose_parts(mutant)
        text = str(info.value)
        assert text.startswith("E13.1: ") and hint in text, text


def test_none_for_the_reference_is_accepted(capsys):
    ch13.check_choose_parts(choose_with_nones)


def test_a_last_seen_choice_that_also_skips_triton_gets_the_order_hint():
    """On a shuffled list with CUDA, the last runnable candidate seen in list order can equal the choice that
    skips every Triton kernel; that reading is the order mistake (the never-Triton one fails on the unshuffled
    CUDA case first), so its hint must be the order one (CI once gave it the Triton hint)."""
    import random
    parts, rng = ch13.ex.all_parts(), random.Random(0)
    for _ in range(2000):
        cands = [ch13.candidate_of(p, rng.choice(("ok", "ok", "stub"))) for p in parts]
        rng.shuffle(cands)
        got, want = choose_last_seen(cands, True), ch13.reference_choose_parts(cands, True)
        if got != want and got == ch13.reference_choose_parts([c for c in cands if not c.triton], True):
            break
    else:
        raise AssertionError("no shuffled list where the two readings agree was drawn")
    message, hint = ch13._choice_problem(got, want, cands, True)
    assert "whatever order the candidates come in" in hint, (message, hint)


# -- the round trip -----------------------------------------------------------------------------------------
def test_round_trip_every_part_is_yours_and_the_check_says_ok(solved, capsys):
    assert set(solved.choice) == set(ALL_FIELDS) and solved.missing() == [] and len(solved.yours()) == 17
    assert solved.chooser == "yours"
    assert set(solved.cpu_parts.replaced()) == set(ALL_FIELDS)
    # on a CPU chapter 04's PyTorch decode replaces chapter 06's kernel, and chapter 10's store runs
    assert solved.choice["attention_backend"].exercise == "E4.2"
    assert solved.cpu_parts.attention_backend.paged_decode.__module__.endswith("ch04")
    assert solved.choice["store_kvcache"].exercise == "E10.3"
    assert solved.package.startswith("student_") and solved.cpu_parts.rms_norm.__module__ == f"{solved.package}.ch01"
    for name in SECTION:
        assert section_passes(solved, name), name
    with check("E13.1"):
        ch13.check_capstone(ch13.reference_choose_parts, solved)
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "E13.1 ok" and "still the reference's" not in out


def test_the_capstone_table_names_each_part_its_owner_and_what_did_not_run():
    cap, out = _assembled()
    assert "sampler                yours      ch08 E8.1-E8.4 sample" in out
    assert "attention_backend      yours      ch04 E4.2 paged_decode" in out
    assert ("not ch06 E6.3 paged_decode: a Triton kernel: C.1-C.3 run on the CPU, where Triton only interprets; it "
            "runs on a GPU (C.4)") in out
    assert "17 of 17 exercises have parts that are yours and pass their chapter's check" in out
    assert "which parts run: yours" in out
    assert cap.gpu_choice == cap.choice          # no CUDA here: C.4 runs what C.1-C.3 run


def test_chapter_10_a_stub_falls_back_to_chapter_04s_store_on_the_cpu_and_says_so(tmp_path, capsys):
    """The issue's case: with E10.3 the stub, the capstone used to run chapter 06's Triton store under the
    interpreter (0.12x, 100 s) and count 14 of 14 parts as the student's."""
    cap = ch13.assemble(str(folder_with(tmp_path, {"10": "stub"})), ch13.reference_choose_parts)
    out = capsys.readouterr().out
    assert cap.choice["store_kvcache"].label == "ch04 E4.3 store_kvcache"
    assert not any(c.triton for c in cap.choice.values())
    assert "graph_batch_sizes" not in cap.choice
    assert "not ch10 E10.3 store_kvcache: still a stub" in out
    assert "not ch06 E6.1 store_kvcache: a Triton kernel" in out
    assert "15 of 17 exercises have parts that are yours" in out
    assert "still the reference's: graph_batch_sizes (ch10 E10.1), store_kvcache (ch10 E10.3)" in out
    assert section_passes(cap, "tiny_vs_hf")


def _wrong_sampler(nb):
    for cell in nb.cells:
        if "def sample(" in cell.source and "### BEGIN SOLUTION E8.4" in cell.source:
            cell.source = cell.source.replace("probs = temperature_probs(logits, metadata.temperatures)",
                                              "probs = temperature_probs(logits, metadata.temperatures.clamp(max=1.0) * 0 + 1.0)")
            assert "* 0 + 1.0" in cell.source
    return nb


def test_a_part_failing_its_own_check_does_not_run_and_the_table_says_why(tmp_path, capsys):
    cap = ch13.assemble(str(folder_with(tmp_path, {"08": _wrong_sampler})), ch13.reference_choose_parts)
    out = capsys.readouterr().out
    assert "sampler" not in cap.choice and cap.cpu_parts.sampler is Parts().sampler
    sampler = next(c for c in cap.candidates if c.field == "sampler")
    assert sampler.status == "failed"
    line = next(l for l in out.splitlines() if "not ch08 E8.1-E8.4 sample" in l)
    assert line.strip().startswith("not ch08 E8.1-E8.4 sample: fails its chapter's check (") and len(line) > 80, line
    assert "16 of 17 exercises have parts that are yours" in out


def test_unfilled_chapters_run_on_reference_parts_and_e12_1_is_not_done(capsys):
    cap = ch13.assemble(str(REPO / "chapters"), stub_choose)
    out = capsys.readouterr().out
    assert cap.chooser == "the course's, because E13.1 is still a stub"
    assert "which parts run: the course's, because E13.1 is still a stub\n" in out
    assert cap.choice == {} and cap.cpu_parts == Parts() and len(cap.missing()) == 17
    assert "0 of 17 exercises have parts that are yours" in out
    assert section_passes(cap, "tiny_vs_hf") and section_passes(cap, "stream_vs_reference")
    assert section_passes(cap, "first_token_chi2")
    with pytest.raises(NotDone):
        ch13.check_capstone(stub_choose, cap)
    with check("E13.1"):
        ch13.check_capstone(stub_choose, cap)
    assert capsys.readouterr().out.splitlines()[-1] == "E13.1 not done yet"


def test_a_choice_that_breaks_a_rule_does_not_run_and_e12_1_says_why(tmp_path, capsys):
    cap = ch13.assemble(str(folder_with(tmp_path, {})), choose_triton_everywhere)
    out = capsys.readouterr().out
    assert ("which parts run: the course's, because your choose_parts cannot run as it is (it chose the Triton "
            "kernel ch06 E6.3 paged_decode") in out
    assert cap.choice == ch13.reference_choose_parts(cap.candidates, False)
    with pytest.raises(AssertionError, match="skip Triton candidates when cuda is False"):
        ch13.check_capstone(choose_triton_everywhere, cap)


def choose_lowest_rank(candidates, cuda):
    """Rules 1 and 2 kept, rule 3 reversed: the lowest-ranked runnable candidate wins (it could run)."""
    chosen = {}
    for c in candidates:
        if c.status == "ok" and not (c.triton and not cuda):
            if c.field not in chosen or c.rank < chosen[c.field].rank:
                chosen[c.field] = c
    return chosen


def test_a_wrong_ranking_falls_back_to_the_course_choice_and_the_table_says_why(tmp_path, capsys):
    """The text promises that a choose_parts which breaks a rule falls back to the course's choice; a wrong ranking
    (a choice that could run) used to run under 'which parts run: yours'."""
    cap = ch13.assemble(str(folder_with(tmp_path, {})), choose_lowest_rank)
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("which parts run: "))
    assert line.startswith("which parts run: the course's, because your choose_parts breaks a rule here ("), line
    assert "the right one is" in line, line
    assert cap.choice == ch13.reference_choose_parts(cap.candidates, False)
    with pytest.raises(AssertionError, match="compare c.rank"):
        ch13.check_capstone(choose_lowest_rank, cap)


def test_a_capstone_assembled_before_e12_1_was_done_is_stale(solved, capsys):
    stale = ch13.dataclasses.replace(solved, chooser="the course's, because E13.1 is still a stub")
    with pytest.raises(AssertionError, match=r"(?s)assembled without it \(which parts run: the course's, because "
                                             r"E13.1 is still a stub\).*run the cell"):
        ch13.check_capstone(ch13.reference_choose_parts, stale)


def test_the_check_asks_for_the_sections_to_have_run(solved):
    with pytest.raises(AssertionError, match="section C.1 HF has not run on this capstone"):
        ch13.check_capstone(ch13.reference_choose_parts, solved)


def test_two_folders_assemble_into_separate_packages(tmp_path, capsys):
    """Two students' folders (one complete, one with chapter 01 the stub) in one process: each capstone keeps its
    own package, so assembling the second overwrites nothing of the first, and the course's student/ is untouched."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    shutil.copy(REPO / "solutions" / "01_rmsnorm.ipynb", a)
    shutil.copy(REPO / "chapters" / "01_rmsnorm.ipynb", b)
    before = sorted((REPO / "student").glob("*")) if (REPO / "student").exists() else None
    mtimes = {p: p.stat().st_mtime for p in before or []}
    cap_a = ch13.assemble(str(a), ch13.reference_choose_parts)
    cap_b = ch13.assemble(str(b), ch13.reference_choose_parts)
    assert cap_a.package != cap_b.package
    assert set(cap_a.choice) == {"rms_norm", "add_rms_norm"} and cap_b.choice == {}
    assert cap_a.cpu_parts.rms_norm.__module__ == f"{cap_a.package}.ch01"
    assert section_passes(cap_a, "tiny_vs_hf")                # still A's parts, after B was assembled
    after = sorted((REPO / "student").glob("*")) if (REPO / "student").exists() else None
    assert after == before and all(p.stat().st_mtime == t for p, t in mtimes.items())
    assert not (a / "student").exists() and not (b / "student").exists()     # the capstone writes to a temp dir


# -- planted wrong parts (that passed their own checks) -------------------------------------------------------
def test_the_stream_sees_a_scheduler_that_requeues_at_the_back_and_e12_1_blames_it(solved, capsys):
    cap = solved.plant("scheduler", ch13_mutants.BackOfQueueScheduler)
    assert not section_passes(cap, "stream_vs_reference", seed=3)
    passed, blamed, message = cap.results["C.1 stream"]
    assert blamed == "scheduler (ch07 E7.1-E7.3)" and "waiting queue" in message, (blamed, message)
    # greedy ids alone cannot see it: the tiny HF comparison still passes
    assert section_passes(cap, "tiny_vs_hf")
    for name in ("tensor_parallel_2", "smollm2_vs_reference", "first_token_chi2"):
        section_passes(cap, name)
    with pytest.raises(AssertionError, match=r"C.1 stream: .*the part that does it: scheduler \(ch07 E7.1-E7.3\)"):
        ch13.check_capstone(ch13.reference_choose_parts, cap)


def test_the_chi_squared_sees_a_sampler_ignoring_temperature_and_blames_it(solved, capsys):
    cap = solved.plant("sampler", ch13_mutants.sample_ignoring_temperature)
    assert not section_passes(cap, "first_token_chi2")
    assert cap.results["C.3 sampling"][1] == "sampler (ch08 E8.1-E8.4)"
    assert "NOT consistent" in capsys.readouterr().out


def test_a_store_reading_v_with_k_strides_breaks_the_tiny_engine_and_is_blamed(solved, capsys):
    cap = solved.plant("store_kvcache", ch13_mutants.store_reading_v_with_k_strides)
    assert not section_passes(cap, "tiny_vs_hf")
    assert cap.results["C.1 HF"][1] == "store_kvcache (ch10 E10.3)"


# -- sections (unchanged by E13.1) ------------------------------------------------------------------------------
def empty_capstone():
    return ch13.Capstone("x", "student_x", [], {}, {}, "the course's", {}, {}, Parts(), Parts())


def test_c2_shows_both_engines_answers_and_their_throughput_on_this_cpu(solved, capsys):
    """The capstone shows the student's SmolLM2 answers beside the reference's (cut at the end-of-turn id that
    ignore_eos generates past), and both engines' output tok/s on this CPU."""
    import re
    assert section_passes(solved, "smollm2_vs_reference")
    out = capsys.readouterr().out.splitlines()
    i = out.index("    What is the capital of France?")
    yours, ref = out[i + 1], out[i + 2]
    assert yours.startswith("    yours:     ") and "Paris" in yours and ref == yours.replace("yours:    ", "reference:")
    assert "<|im_end|>" not in yours and "\n" not in yours
    rates = ch13.smollm2_throughput(solved, max_tokens=4, repeats=1)
    line = capsys.readouterr().out.strip()
    # the line shows the rates as computed (the printed ones are rounded: a ratio of those is not the ratio shown)
    y, r = rates["yours"], rates["reference"]
    assert y > 0 and r > 0, rates
    assert line == (f"C.2 on this CPU (4 prompts x 4 tokens, median of 1): yours {y:,.0f} output tok/s, "
                    f"reference {r:,.0f} ({y / r:.2f}x)"), line


def test_the_streams_always_preempt_and_hit_the_prefix_cache():
    path = ch13.tiny_model_dir("qwen3")
    for seed in range(3):
        prompts = ch13.random_stream(random.Random(seed))
        _, trace = ch13.run_traced(Parts(), path, prompts)
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
    ref = ch13.reference_smollm2()
    assert len(ref) == 4 and all(len(ids) == len(m) == ch13.SMOL_TOKENS == 32 for ids, m in ref)
    assert ref[0][0][:6] == [504, 3575, 282, 4649, 314, 7042]      # "The capital of France is Paris"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, (ids, margins) in zip(ch13.smollm2_prompts(path), ref):
        with torch.no_grad():
            logits = hf(torch.tensor([p + ids[:-1]])).logits[0, len(p) - 1:]
        top2 = logits.topk(2, dim=-1)
        hf_margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
        assert margins == pytest.approx(hf_margins, abs=2e-3)
        sure = [s for s, m in enumerate(margins) if m >= ch13.MARGIN]
        assert [top2.indices[s, 0].item() for s in sure] == [ids[s] for s in sure]


def test_c2_reports_how_far_each_prompt_matched_and_stops_at_a_near_tie(capsys, monkeypatch):
    """A fake 'your engine' that differs at step 5 of prompt 0 and step 3 of prompt 1; prompt 1's reference
    margin at step 3 is made a near-tie, so only prompt 0 fails."""
    ref = [(list(range(100, 132)), [1.0] * 32) for _ in range(4)]
    ref[1] = (ref[1][0], [1.0, 1.0, 5e-4] + [1.0] * 29)
    got = [list(ids) for ids, _ in ref]
    got[0][4] = 7
    got[1][2] = 7
    monkeypatch.setattr(ch13, "reference_smollm2", lambda n, path=None: ref)
    monkeypatch.setattr(ch13, "_generate", lambda *a, **k: got)
    monkeypatch.setattr(ch13, "smollm2_prompts", lambda path: [[1]] * 4)
    monkeypatch.setattr(ch13, "_blame", lambda cap, prompts=None: None)
    cap = empty_capstone()
    assert not section_passes(cap, "smollm2_vs_reference")
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("C.2")]   # not the answers
    assert lines[0] == ("C.2 prompt 0: 4/32 ids equal, then step 5 differs from the reference "
                        "(reference top-2 margin there 1, not a near-tie)")
    assert lines[1] == ("C.2 prompt 1: 2/32 ids equal; step 3's top-2 margin (0.0005) is below 0.001, "
                        "so the comparison stops there")
    assert lines[2] == "C.2 prompt 2: 32/32 ids equal the reference engine's (smallest top-2 margin 1, at step 1)"


def test_c3_prints_the_same_p_values_whatever_the_random_state(capsys):
    import torch
    cap = empty_capstone()
    outs = []
    for k in range(2):
        torch.manual_seed(100 + k)          # the section seeds its own fork of the generator
        assert section_passes(cap, "first_token_chi2")
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert outs[0].splitlines()[0].startswith("C.3 T=0.6: 20000 first tokens, chi-squared over 86 bins, p = 0.")
    assert [ch13._fmt_p(p) for p in (0.456, 0.004, 1e-9)] == ["p = 0.46", "p < 0.01", "p < 1e-06"]


def test_capstone_figure_labels_sit_above_every_timed_run(tmp_path, monkeypatch):
    """Each bar's median label is above the highest dot of its timed runs (the reference's 11,644 sat on the
    12,057 run)."""
    import json

    from nanovllm_course import figures_ch13
    data = json.loads(figures_ch13.GPU_JSON.read_text())
    seen = {}
    real_save = figures_ch13.save

    def spy(fig, path):
        ax = fig.axes[0]
        seen["labels"] = [(t.get_position(), t.get_text()) for t in ax.texts if t.get_text()[:1].isdigit()]
        seen["dots"] = [line.get_xydata() for line in ax.lines]
        seen["top"] = ax.get_ylim()[1]
        return real_save(fig, path)
    monkeypatch.setattr(figures_ch13, "save", spy)
    figures_ch13.capstone_throughput(tmp_path / "c.png", data)
    assert len(seen["labels"]) == sum(1 for rec in data["engines"].values() if rec.get("median_tok_s"))
    for (x, y), _ in seen["labels"]:
        highest = max(py for dots in seen["dots"] for px, py in dots if abs(px - x) < 1e-9)
        assert y >= highest + 0.02 * seen["top"], (x, y, highest)


def test_the_chapter_states_the_part_counts_the_code_has():
    """One count per thing, the same in the text as in the code: parts declared, the exercises they come from,
    the Parts fields they fill (the text gave 17, "14 of 15" and 14 for three different things)."""
    import re

    import nbformat
    from nanovllm_course import export as ex
    nb = nbformat.read(str(REPO / "solutions" / "13_capstone.ipynb"), as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    parts = ex.all_parts()
    stated = re.search(r"\((\d+) parts from (\d+) exercises, filling (\d+) of the (\d+) `Parts` fields", text)
    assert stated, "the E13.1 spec states the counts"
    assert [int(x) for x in stated.groups()] == [len(parts), len({(p.chapter, p.exercise) for p in parts}),
                                                len({p.field for p in parts}), len(ch13.dataclasses.fields(Parts))]
    assert "exercise parts" not in text
