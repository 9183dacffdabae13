"""The engine is the last word (nanovllm_course/engine_check.py): an engine-part exercise's check cell runs the
part inside the tiny engine, and a part that passes a unit check but breaks the engine fails its exercise.

- every declared part of the solutions passes `in_the_engine` (the seconds each took are recorded);
- realistic wrong parts that a unit check can miss fail inside the engine, with what differed: a store reading
  V with K's strides (the issue's case), a store that skips slot 0, a sampler that samples greedy rows in a
  mixed batch, a block manager that leaks blocks (the engine stops instead of hanging), a part that raises;
- in a check cell the unit check's `E4.3 ok` is not printed above the engine's failure;
- a part built over several exercises still partly a stub runs later, with a note;
- the tight setting really preempts.
"""
import importlib
import time
from pathlib import Path

import pytest
import torch

from nanovllm_course import export as ex
from nanovllm_course.common import check
from nanovllm_course.engine_check import PROMPTS, TIGHT, in_the_engine, run_engine
from nanovllm_ref import Parts, SamplingParams
from nanovllm_ref.attn.torch_backend import store_kvcache as reference_store
from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.layers.sampler import SamplingMetadata, sample

import ch13_mutants

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def solution_parts(tmp_path_factory):
    out = ex.fresh_package_dir()
    ex.export(REPO / "solutions", out)
    package = ex.import_package(out).__name__
    by_tag = {}
    for part in ex.all_parts():
        module = importlib.import_module(f"{package}.ch{part.chapter}")
        by_tag.setdefault(part.graded_by, {})[part.name] = getattr(module, part.name)
    return by_tag


def test_every_solution_part_runs_inside_the_engine(solution_parts, capsys, record_property):
    assert sorted(solution_parts, key=lambda t: [int(n) for n in t[1:].split(".")]) == [
        "E1.1", "E1.2", "E2.1", "E2.2", "E3.3", "E4.1", "E4.2", "E4.3", "E5.2", "E5.3", "E6.1", "E6.3", "E7.3",
        "E8.4", "E9.1", "E10.1", "E10.3"]
    seconds = {}
    for tag, functions in solution_parts.items():
        start = time.perf_counter()
        in_the_engine(tag, **functions)
        seconds[tag] = round(time.perf_counter() - start, 2)
    record_property("in_the_engine_seconds", seconds)   # what each check cell's engine run costs: a report
    assert capsys.readouterr().out == ""              # success prints nothing: the check's ok line is the verdict


def test_the_tight_setting_preempts_and_still_equals_hf():
    from nanovllm_course.common import tiny_model_dir
    from nanovllm_course.engine_check import _hf_greedy
    path = tiny_model_dir("qwen3")
    ids, preemptions = run_engine(Parts(), path, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                  **TIGHT)
    assert preemptions > 0
    assert ids == [_hf_greedy(path, p) for p in PROMPTS]


def test_a_store_reading_v_with_k_strides_fails_its_exercise(capsys):
    """The issue's case. Whether the chapter's unit check or the engine run catches it, E4.3 fails; the engine run
    alone catches it too, and says how the ids differ."""
    from nanovllm_course import ch04
    with check("E4.3"):
        ch04.check_store_kvcache(ch13_mutants.store_reading_v_with_k_strides)
        in_the_engine("E4.3", store_kvcache=ch13_mutants.store_reading_v_with_k_strides)
    out = capsys.readouterr().out
    assert out.startswith("E4.3 failed: ") and "E4.3 ok" not in out, out
    for tag in ("E4.3", "E10.3"):
        with pytest.raises(AssertionError) as info:
            in_the_engine(tag, store_kvcache=ch13_mutants.store_reading_v_with_k_strides)
        text = str(info.value)
        assert text.startswith(f"{tag}: your store_kvcache passes the check above, but inside the tiny engine the "
                               "greedy ids differ from HF transformers' on "), text
        assert "(prompt 0: new token" in text and "`value` is a strided view of the fused QKV projection" in text


def store_skipping_slot_0(key, value, k_cache, v_cache, slot_mapping):
    """`if slot > 0`: slot 0, the first block's first token, is never written."""
    slots = slot_mapping.clone()
    slots[slots == 0] = -1
    reference_store(key, value, k_cache, v_cache, slots)


def test_a_store_skipping_slot_0_fails_inside_the_engine():
    with pytest.raises(AssertionError, match=r"^E4\.3: your store_kvcache passes the check above, but inside"):
        in_the_engine("E4.3", store_kvcache=store_skipping_slot_0)


def sample_greedy_rows_too(logits, metadata):
    """Samples every row at T = 1 when the batch is not all greedy: the greedy rows of a mixed batch drift."""
    if metadata.all_greedy:
        return sample(logits, metadata)
    t = torch.ones_like(metadata.temperatures)
    return sample(logits, SamplingMetadata(temperatures=t, all_greedy=False, top_k=metadata.top_k, top_p=metadata.top_p))


def test_a_sampler_that_samples_the_greedy_rows_of_a_mixed_batch_fails():
    with pytest.raises(AssertionError) as info:
        in_the_engine("E8.4", sample=sample_greedy_rows_too)
    text = str(info.value)
    assert "under a tight KV cache" in text and "greedy ids differ from the reference engine's" in text, text
    assert "rows with temperature 0 must stay argmax" in text


class LeakyBlockManager(BlockManager):
    """Never gives blocks back: under a tight cache the engine runs out and preempts forever."""

    def deallocate(self, seq):
        seq.block_table.clear()
        seq.num_cached_tokens = 0


def test_a_block_manager_that_leaks_stops_the_engine_instead_of_hanging():
    """The check returns with the engine's failure under the tight cache. (What bounds the run is the engine
    check's step limit, MAX_STEPS, and a hang would be pytest-timeout's failure: no bound in seconds here.)"""
    with pytest.raises(AssertionError, match=r"^E5\.2: inside the tiny engine \(a tight KV cache[^)]*\) your "
                                             r"BlockManager raised "):
        in_the_engine("E5.2", BlockManager=LeakyBlockManager)


def store_raising(key, value, k_cache, v_cache, slot_mapping):
    return key[10_000]


def test_a_part_that_raises_inside_the_engine_names_its_line():
    with pytest.raises(AssertionError) as info:
        in_the_engine("E10.3", store_kvcache=store_raising)
    text = str(info.value)
    assert text.startswith("E10.3: inside the tiny engine (4 prompts, greedy) your store_kvcache raised IndexError")
    assert "(in store_raising, line " in text


def test_a_part_built_over_exercises_still_partly_a_stub_runs_later(capsys):
    class Scheduler:
        def schedule(self):
            raise NotImplementedError("Exercise 7.1: schedule prefill")
    in_the_engine("E7.3", Scheduler=Scheduler)
    assert capsys.readouterr().out == "(your Scheduler (E7.1-E7.3) runs inside the engine once every exercise it is built from is done)\n"


def test_a_check_cell_naming_the_wrong_parts_is_an_authors_error():
    with pytest.raises(ValueError, match=r"chapter 04 declares \['store_kvcache'\] for E4.3"):
        in_the_engine("E4.3", paged_decode=reference_store)
    with pytest.raises(ValueError, match="declares no part for E4.9|declares 'no part' for E4.9"):
        in_the_engine("E4.9", store_kvcache=reference_store)


def test_graph_batch_sizes_runs_in_the_engine_only_where_graphs_are_captured(capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the run happens (covered by the GPU notebook run)")
    in_the_engine("E10.1", graph_batch_sizes=lambda n: [])      # a CPU captures no graph: nothing runs
    assert capsys.readouterr().out == ""
