"""Async (overlap) scheduling, checked on a CPU: the engine schedules and launches step n+1 before it learns
step n's tokens (engine/llm_engine.py), with placeholders for the tokens in flight.

The outputs must be exactly those of the synchronous engine, and greedy ids exactly HF's, through chunked
prefill, prefix-cache hits, preemption by recompute, eos stops (whose extra row is dropped), max_tokens and
max_model_len cuts, seeded sampling, aborts, and the CUDA-graph data path (replayed eagerly on the CPU).
"""
import random

import pytest

from nanovllm_ref import SamplingParams
from nanovllm_ref.engine.sequence import PENDING

from engine_helpers import LLM, hf_greedy, tiny_dir
from test_thin_step import EagerReplayRunner

TIGHT = dict(kvcache_block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=16, max_num_seqs=4)


def _prompts(seed, n=9, shared=True):
    g = random.Random(seed)
    common = [g.randrange(1, 200) for _ in range(9)]
    return [(common if shared and i % 3 == 0 else []) + [g.randrange(1, 200) for _ in range(g.randrange(2, 34))]
            for i in range(n)]


def _pair(**kw):
    return LLM(tiny_dir("qwen3"), async_scheduling=True, **kw), LLM(tiny_dir("qwen3"), async_scheduling=False, **kw)


@pytest.mark.parametrize("engine_args", [dict(), TIGHT, dict(TIGHT, enable_prefix_caching=False)],
                         ids=["roomy", "tight_cache_chunked_prefill", "tight_no_prefix_cache"])
def test_async_outputs_equal_sync_and_hf(engine_args):
    path = tiny_dir("qwen3")
    a, s = _pair(**engine_args)
    assert a.async_scheduling and not s.async_scheduling
    prompts = _prompts(1)
    sp = SamplingParams(temperature=0, max_tokens=12)
    oa, os_ = a.generate(prompts, sp, use_tqdm=False), s.generate(prompts, sp, use_tqdm=False)
    assert [(o["token_ids"], o["finish_reason"]) for o in oa] == [(o["token_ids"], o["finish_reason"]) for o in os_]
    for p, o in zip(prompts, oa):
        assert o["token_ids"] == hf_greedy(path, p, len(o["token_ids"]))
    if engine_args is TIGHT:
        assert a.scheduler.num_preemptions > 0, "the tight cache must preempt, or the test checks less"
    # seeded sampling: counter-based noise gives the same tokens in both engines
    sps = [SamplingParams(temperature=0.9, max_tokens=10, seed=i) for i in range(len(prompts))]
    oa, os_ = a.generate(prompts, sps, use_tqdm=False), s.generate(prompts, sps, use_tqdm=False)
    assert [o["token_ids"] for o in oa] == [o["token_ids"] for o in os_]
    assert a.scheduler.block_manager.num_free_blocks == s.scheduler.block_manager.num_free_blocks
    a.exit(), s.exit()


def test_async_eos_stop_drops_the_token_sampled_after_it():
    """A sequence that samples eos at step n already has a row in step n+1; that row's token is not output."""
    path = tiny_dir("qwen3")
    prompts = _prompts(2, shared=False)
    free = LLM(path).generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    # make the 4th greedy token of the first prompt a stop id: the engines must stop right there
    stop_at = free[0]["token_ids"][3]
    a, s = _pair()
    for llm in (a, s):
        llm.scheduler.eos = frozenset({stop_at})
    sp = SamplingParams(temperature=0, max_tokens=16)
    oa, os_ = a.generate(prompts, sp, use_tqdm=False), s.generate(prompts, sp, use_tqdm=False)
    assert oa[0]["token_ids"] == free[0]["token_ids"][:4] and oa[0]["finish_reason"] == "stop"
    assert [(o["token_ids"], o["finish_reason"]) for o in oa] == [(o["token_ids"], o["finish_reason"]) for o in os_]
    assert all(PENDING not in o["token_ids"] for o in oa)
    assert a.scheduler.block_manager.num_free_blocks == a.config.num_kvcache_blocks - len(
        a.scheduler.block_manager.used_block_ids) and not a.scheduler.block_manager.used_block_ids
    a.exit(), s.exit()


def test_async_max_model_len_cut_equals_sync():
    a, s = _pair(kvcache_block_size=4, max_model_len=20)
    prompts = [list(range(1, 15)), list(range(3, 9))]
    sp = SamplingParams(temperature=0, max_tokens=50)
    oa, os_ = a.generate(prompts, sp, use_tqdm=False), s.generate(prompts, sp, use_tqdm=False)
    assert [len(p) + len(o["token_ids"]) for p, o in zip(prompts, oa)] == [20, 20]
    assert [o["token_ids"] for o in oa] == [o["token_ids"] for o in os_]
    a.exit(), s.exit()


def test_async_abort_mid_run_frees_every_block_and_the_engine_goes_on():
    path = tiny_dir("qwen3")
    a = LLM(path, async_scheduling=True, **TIGHT)
    for p in _prompts(3):
        a.add_request(p, SamplingParams(temperature=0, max_tokens=20))
    for _ in range(6):
        a.step()
    assert a._in_flight is not None, "a step must be in flight for the test to mean something"
    a.abort_all()
    assert a.is_finished() and not a.scheduler.block_manager.used_block_ids
    prompts = _prompts(4)
    outs = a.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(path, p, 6) for p in prompts]
    a.exit()


def test_async_graph_path_reads_pending_tokens_on_the_device():
    """The captured-graph data path (packed inputs, prev_rows, sampler in the step) with async scheduling:
    every decode row's input token is read from the last step's ids, on the device."""
    path = tiny_dir("qwen3")
    a = LLM(path, async_scheduling=True, enforce_eager=True, max_num_seqs=8, kvcache_block_size=16)
    a.model_runner.capture_cudagraph(EagerReplayRunner)
    assert a.model_runner.graph_samples
    prompts = _prompts(5, n=6)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seen = []
    orig_pack = a.model_runner.graph_runner.inputs.pack

    def pack(batch, padded):
        part = orig_pack(batch, padded)
        seen.append(0 if batch.prev_rows is None else int((batch.prev_rows >= 0).sum()))
        return part

    a.model_runner.graph_runner.inputs.pack = pack
    outs = a.generate(prompts, sp, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(path, p, 10) for p in prompts]
    assert seen and max(seen) == len(prompts), "decode rows should take their input from the device"
    a.exit()


def test_async_scheduling_true_is_refused_where_it_cannot_run():
    from nanovllm_ref import Parts
    from nanovllm_ref.engine.scheduler import Scheduler

    class MyScheduler(Scheduler):
        pass

    with pytest.raises(ValueError, match="async_scheduling=True needs the reference scheduler"):
        LLM(tiny_dir("qwen3"), async_scheduling=True, parts=Parts(scheduler=MyScheduler))
    with pytest.raises(ValueError, match="async_scheduling=True needs tensor_parallel_size=1"):
        LLM(tiny_dir("qwen3"), async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="async_scheduling must be"):
        LLM(tiny_dir("qwen3"), async_scheduling="yes")


def test_async_equals_sync_with_stops_min_tokens_and_parallel_samples():
    """The request-level features run through the async path: stop strings and stop ids (checked one step
    late, once per token), min_tokens (masked after the graph), n > 1 (forked one step late), texts."""
    path = tiny_dir("qwen3")
    prompts = _prompts(6, n=5)
    free = LLM(path).generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    sps = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[0].outputs[0].token_ids[5]]),
           SamplingParams(temperature=0, max_tokens=12, min_tokens=6),
           SamplingParams(temperature=0, max_tokens=12, stop=[free[2].outputs[0].text[3:6] or "x"]),
           SamplingParams(temperature=0.8, max_tokens=9, n=3, seed=11, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True)]
    a, s = _pair(**TIGHT)
    oa, os_ = a.generate(prompts, sps, use_tqdm=False), s.generate(prompts, sps, use_tqdm=False)
    got = [[(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs] for r in oa]
    want = [[(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs] for r in os_]
    assert got == want
    assert oa[0].outputs[0].stop_reason == free[0].outputs[0].token_ids[5]
    assert oa[4].outputs[0].token_ids == oa[4].outputs[1].token_ids == hf_greedy(path, prompts[4], 12)
    assert not a.scheduler.block_manager.used_block_ids
    a.exit(), s.exit()


def test_async_abort_request_mid_flight_leaves_the_others_exact():
    path = tiny_dir("qwen3")
    a = LLM(path, async_scheduling=True, **TIGHT)
    prompts = _prompts(7, n=4)
    ids = [a.add_request(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)) for p in prompts]
    done = {}
    for i in range(200):
        if i == 4:
            assert a._in_flight is not None
            a.abort_request(ids[1])
        done.update((o.request_id, o) for o in a.step() if o.finished)
        if a.is_finished() and a._in_flight is None:
            break
    assert ids[1] not in done and set(done) == {ids[0], ids[2], ids[3]}
    for rid, p in zip(ids, prompts):
        if rid in done:
            assert done[rid].outputs[0].token_ids == hf_greedy(path, p, 10)
    assert not a.scheduler.block_manager.used_block_ids
    a.exit()
