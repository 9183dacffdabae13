"""A decode step's rows go to the model runner longest context first (engine/step_batch.longest_first: the decode
attention launches its programs in row order, and longest first shortens the kernel's tail), and the sampled ids
still reach the right sequences, in the sync and the async route."""
import pytest

from nanovllm_ref import SamplingParams
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.engine.step_batch import longest_first
from engine_helpers import LLM, assert_matches_hf, greedy, run_checked, tiny_dir
from test_engine_equivalence import varied_prompts


def _seq(n: int) -> Sequence:
    return Sequence(list(range(3, 3 + n)), SamplingParams(max_tokens=4))


def test_longest_first_orders_by_length_keeps_ties_in_order_and_leaves_the_input_alone():
    seqs = [_seq(n) for n in (3, 9, 1, 9, 5, 3)]
    got = longest_first(seqs)
    assert [len(s) for s in got] == [9, 9, 5, 3, 3, 1]
    assert got[0] is seqs[1] and got[1] is seqs[3]           # equal lengths: the scheduler's order
    assert got[3] is seqs[0] and got[4] is seqs[5]
    assert [len(s) for s in seqs] == [3, 9, 1, 9, 5, 3]       # a new list
    assert longest_first([]) == []


def _record_decode_rows(llm) -> list:
    """Wrap the engine's model runner so that every decode step's context lengths are kept, in row order."""
    runner = llm.model_runner
    launch = runner.launch
    rows = []

    def spy(batch):
        if not batch.is_prefill:
            rows.append(batch.inputs.metadata.context_lens.tolist())
        return launch(batch)
    runner.launch = spy
    return rows


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_rows_launch_longest_first_and_tokens_reach_their_sequences(async_scheduling):
    path = tiny_dir("qwen3")
    # Arrival order shortest first (1, 3, 7, 16, 29 tokens), so longest first reverses every decode step; greedy
    # ids per prompt must still be HF's (a row's token given to another sequence fails here).
    prompts = varied_prompts(seed=21, n=5)
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, max_num_seqs=8, async_scheduling=async_scheduling)
    rows = _record_decode_rows(llm)
    got, _ = run_checked(llm, prompts, greedy(8, ignore_eos=True), outputs=True)
    assert_matches_hf(path, prompts, got, 8)
    assert rows, "no decode step ran"
    assert rows[0] == sorted(rows[0], reverse=True) and len(set(rows[0])) == 5, rows[0]
    for lens in rows:
        assert lens == sorted(lens, reverse=True), f"a decode step's rows are not longest first: {lens}"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_seeded_samples_do_not_depend_on_the_row_order(async_scheduling):
    """Each row samples with its own seed and counter: the same request gives the same tokens whether its row
    comes first (alone, or the longest) or last in the batch."""
    path = tiny_dir("qwen3")
    prompts = varied_prompts(seed=22, n=4)
    params = [SamplingParams(temperature=0.9, max_tokens=6, seed=100 + i, ignore_eos=True) for i in range(4)]
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, max_num_seqs=8, async_scheduling=async_scheduling)
    together, _ = run_checked(llm, prompts, params)
    alone = [run_checked(llm, [p], [sp])[0][0] for p, sp in zip(prompts, params)]
    assert together == alone
