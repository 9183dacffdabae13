"""SamplingParams.n > 1: parallel samples of one prompt that share its KV blocks (engine/scheduler.py _fork,
BlockManager.fork). The prompt is prefilled once; then each sibling shares its full blocks (ref counts) and
recomputes only the partial last block into a block of its own."""
import pytest

from engine_helpers import LLM, hf_greedy, tiny_dir
from nanovllm_ref import Parts, SamplingParams
from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.engine.invariants import check_block_manager

PROMPT = list(range(30, 43))            # 13 tokens: 3 full blocks of 4 and a partial one


def greedy(n, max_tokens=6):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def step_checked(llm):
    """Step to the end, checking the block manager's invariants after every step; returns the final
    RequestOutputs by request id."""
    done, sched = {}, llm.scheduler
    while not llm.is_finished():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
        seqs = list(sched.running) + list(sched.waiting)
        check_block_manager(sched.block_manager, seqs)
    bm = sched.block_manager
    assert bm.num_free_blocks == len(bm.blocks) and all(b.ref_count == 0 for b in bm.blocks), "blocks leaked"
    return done


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("prompt_len,shared", [(13, 3), (12, 2), (1, 0)])
def test_siblings_share_the_prompts_full_blocks_and_equal_hf(caching, prompt_len, shared):
    path = tiny_dir("qwen3")
    prompt = PROMPT[:prompt_len] if prompt_len <= 13 else PROMPT
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, enable_prefix_caching=caching)
    rid = llm.add_request(prompt, greedy(3))
    parent, *children = llm.requests[rid].seqs
    llm.step()                                        # the prompt's prefill: the siblings fork after it
    bm = llm.scheduler.block_manager
    assert parent.num_completion_tokens == 1 and all(c in llm.scheduler.running for c in children)
    for child in children:
        # a block-multiple prompt shares one block fewer: its last block is recomputed for the first token
        assert child.block_table[:shared] == parent.block_table[:shared]
        assert not set(child.block_table[shared:]) & set(parent.block_table)
        assert child.num_cached_tokens == 4 * shared
    assert all(bm.blocks[b].ref_count == 3 for b in parent.block_table[:shared])
    assert len({c.block_table[-1] for c in children} | {parent.block_table[-1]}) == 3
    llm.step()                                        # the siblings' recompute of the partial block
    out = step_checked(llm)[rid]
    want = hf_greedy(path, prompt, 6)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.token_ids for o in out.outputs] == [want] * 3
    assert len({o.text for o in out.outputs}) == 1


def test_sampled_siblings_differ_and_greedy_neighbours_are_unaffected():
    path = tiny_dir("qwen3")
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, seed=3)
    sampled, plain = llm.generate([PROMPT, [5, 6, 7]], [SamplingParams(temperature=1.0, max_tokens=8, n=4,
                                                                       ignore_eos=True), greedy(1)], use_tqdm=False)
    assert len(sampled.outputs) == 4 and len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    assert all(len(o.token_ids) == 8 for o in sampled.outputs)
    assert plain.outputs[0].token_ids == hf_greedy(path, [5, 6, 7], 6)


def test_siblings_under_preemption_keep_invariants_and_hf_ids():
    path = tiny_dir("qwen3")
    # 14 blocks of 2: three samples of a 13-token prompt growing to 24 tokens cannot all stay resident
    llm = LLM(path, kvcache_block_size=2, max_model_len=64, num_kvcache_blocks=14)
    rid = llm.add_request(PROMPT, greedy(3, max_tokens=12))
    other = llm.add_request([5, 6, 7], greedy(1, max_tokens=12))
    done = step_checked(llm)
    assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in done[rid].outputs] == [hf_greedy(path, PROMPT, 12)] * 3
    assert done[other].outputs[0].token_ids == hf_greedy(path, [5, 6, 7], 12)


def test_first_token_finishes_the_first_sample_and_the_siblings_still_run():
    path = tiny_dir("qwen3")
    out = LLM(path, kvcache_block_size=4, max_model_len=64).generate([PROMPT], greedy(3, max_tokens=1),
                                                                      use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [hf_greedy(path, PROMPT, 1)] * 3
    assert all(o.finish_reason == "length" for o in out.outputs)


class NoFork(BlockManager):
    """A block manager without fork (as a course chapter's may be): siblings queue as requests of their own."""
    fork = None


def test_without_fork_siblings_queue_and_hit_the_prefix_cache():
    path = tiny_dir("qwen3")
    llm = LLM(path, parts=Parts(block_manager=NoFork), kvcache_block_size=4, max_model_len=64)
    rid = llm.add_request(PROMPT, greedy(2))
    parent, child = llm.requests[rid].seqs
    llm.step()
    assert list(llm.scheduler.waiting) == [child]
    llm.step()                                        # the child's prefill: a prefix hit on 3 blocks
    assert child.block_table[:3] == parent.block_table[:3]
    assert [o.token_ids for o in step_checked(llm)[rid].outputs] == [hf_greedy(path, PROMPT, 6)] * 2


def test_siblings_without_a_free_seat_wait_at_the_front():
    path = tiny_dir("qwen3")
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, max_num_seqs=3)
    a = llm.add_request(PROMPT, greedy(2))
    b = llm.add_request([5, 6, 7, 8], greedy(2))
    llm.step()                                        # both prompts prefill; a's sibling takes the last seat
    assert len(llm.scheduler.running) == 3 and list(llm.scheduler.waiting) == llm.requests[b].seqs[1:]
    done = step_checked(llm)
    assert [o.token_ids for o in done[a].outputs] == [hf_greedy(path, PROMPT, 6)] * 2
    assert [o.token_ids for o in done[b].outputs] == [hf_greedy(path, [5, 6, 7, 8], 6)] * 2


def test_abort_before_the_fork_drops_every_sample():
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64, max_num_batched_tokens=4)
    rid = llm.add_request(PROMPT, greedy(3))
    llm.step()                                        # the first chunk of 4 of the 13 prompt tokens
    seqs = llm.requests[rid].seqs
    assert llm.abort_request(rid)
    assert llm.is_finished() and all(s.is_finished and s.finish_reason == "abort" for s in seqs)
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == len(bm.blocks)


def test_more_samples_than_seats_is_refused_by_name():
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="n=3.*max_num_seqs=2"):
        llm.generate([PROMPT], greedy(3), use_tqdm=False)
    assert llm.is_finished()
