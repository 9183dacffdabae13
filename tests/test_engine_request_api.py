"""The request API a server drives (add_request / abort_request / step) and vLLM's output objects."""
import pytest

from engine_helpers import hf_greedy, tiny_dir
from nanovllm_ref import CompletionOutput, RequestOutput, SamplingParams
from nanovllm_ref.engine.invariants import check_block_manager

G = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
P = [5, 6, 7, 8, 9]


LLM_ARGS = dict(kvcache_block_size=4, max_model_len=64, num_kvcache_blocks=24)     # a fresh_llm per test


def drain(fresh_llm):
    """Step to the end; returns {request_id: [its RequestOutputs in step order]}."""
    seen = {}
    while not fresh_llm.is_finished():
        for out in fresh_llm.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


# -- outputs --------------------------------------------------------------------------------------------------
def test_generate_returns_request_outputs_with_a_dict_view_for_one_sample(fresh_llm):
    out = fresh_llm.generate(["Hello", P], G, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in out)
    a, b = out
    assert a.prompt == "Hello" and b.prompt is None and b.prompt_token_ids == P
    assert isinstance(b.outputs[0], CompletionOutput) and b.outputs[0].index == 0
    assert b.outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), P, 6)
    assert (b.outputs[0].finish_reason, b.outputs[0].stop_reason, b.outputs[0].logprobs) == ("length", None, None)
    assert dict(b) == {"text": b.outputs[0].text, "token_ids": b.outputs[0].token_ids, "prompt_token_ids": P,
                       "finish_reason": "length"}
    assert a.request_id != b.request_id and isinstance(a.request_id, str)
    with pytest.raises(KeyError, match="outputs"):
        b["logprobs"]


def test_dict_view_of_several_samples_says_to_use_outputs(fresh_llm):
    out = fresh_llm.generate([P], SamplingParams(temperature=1.0, max_tokens=3, n=2), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1]
    for access in (lambda: out["text"], lambda: dict(out), lambda: len(out)):
        with pytest.raises(TypeError, match=r"n > 1.*outputs\[i\]"):
            access()
    assert out["prompt_token_ids"] == P                  # not per sample


# -- add_request / step ---------------------------------------------------------------------------------------
def test_step_returns_the_requests_that_progressed_with_growing_outputs(fresh_llm):
    a = fresh_llm.add_request(P, G)
    b = fresh_llm.add_request(list(range(20, 33)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                        request_id="mine")
    assert (a, b) == ("0", "mine") and set(fresh_llm.requests) == {"0", "mine"}
    seen, stats = {}, []
    while not fresh_llm.is_finished():
        outs = fresh_llm.step()
        stats.append(fresh_llm.last_step)
        for out in outs:
            seen.setdefault(out.request_id, []).append(out)
    for rid, outs in seen.items():
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(len(y) == len(x) + 1 and y[:len(x)] == x for x, y in zip(ids, ids[1:]))
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all(y.outputs[0].text.startswith(x.outputs[0].text) for x, y in zip(outs, outs[1:]))
    assert seen[a][-1].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), P, 6)
    assert len(seen["mine"]) == 2 and not fresh_llm.requests
    # stats: a prefill of 5 + 13 prompt tokens (budget permitting), then decodes of the batch
    stats = [s for s in stats if s is not None]     # async scheduling: the last step only finishes the one in flight
    assert stats[0].kind == "prefill" and sum(s.num_tokens for s in stats if s.is_prefill) == 5 + 13
    assert all(s.num_tokens == s.num_seqs for s in stats if not s.is_prefill)
    assert fresh_llm.step() == [] and fresh_llm.last_step is None


def test_request_ids_are_unique_and_a_live_duplicate_is_refused(fresh_llm):
    fresh_llm.add_request(P, G, request_id="x")
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        fresh_llm.add_request(P, G, request_id="x")
    with pytest.raises(TypeError, match="request_id"):
        fresh_llm.add_request(P, G, request_id=7)
    with pytest.raises(ValueError, match="request_id"):
        fresh_llm.add_request(P, G, request_id="")
    fresh_llm.add_request(P, G, request_id="0")             # the engine's own numbering skips ids in use
    assert fresh_llm.add_request(P, G) == "1" and len(fresh_llm.scheduler.waiting) == 3
    drain(fresh_llm)
    assert fresh_llm.add_request(P, G, request_id="x") == "x"   # finished ids may be used again
    drain(fresh_llm)


def test_add_request_checks_before_queuing(fresh_llm):
    with pytest.raises(ValueError, match="prompt has token ids outside"):
        fresh_llm.add_request([1, 10**6], G)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        fresh_llm.add_request(P, {"temperature": 0})
    assert fresh_llm.is_finished() and not fresh_llm.requests
    assert fresh_llm.add_request(P) == "0"                  # default SamplingParams()
    drain(fresh_llm)


# -- abort ----------------------------------------------------------------------------------------------------
def test_abort_request_frees_its_blocks_and_the_others_finish(fresh_llm):
    bm = fresh_llm.scheduler.block_manager
    keep = fresh_llm.add_request(P, G)
    gone = fresh_llm.add_request(list(range(40, 60)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    waits = fresh_llm.add_request([3, 4], G)
    fresh_llm.step()
    fresh_llm.step()
    assert fresh_llm.abort_request(gone) is True and gone not in fresh_llm.requests
    check_block_manager(bm, list(fresh_llm.scheduler.running) + list(fresh_llm.scheduler.waiting))
    assert fresh_llm.abort_request(gone) is False and fresh_llm.abort_request("never-seen") is False
    seen = drain(fresh_llm)
    assert gone not in seen
    assert seen[keep][-1].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), P, 6)
    assert seen[waits][-1].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), [3, 4], 6)
    assert bm.num_free_blocks == len(bm.blocks) and all(b.ref_count == 0 for b in bm.blocks)


def test_abort_a_waiting_request_and_a_list_of_ids(fresh_llm):
    ids = [fresh_llm.add_request(P, G) for _ in range(3)]
    assert fresh_llm.abort_request(ids[1:]) is True
    assert list(fresh_llm.requests) == ids[:1] and len(fresh_llm.scheduler.waiting) == 1
    with pytest.raises(TypeError, match="request_id"):
        fresh_llm.abort_request(5)
    assert list(drain(fresh_llm)) == ids[:1]


def test_generate_refuses_while_add_request_work_is_pending(fresh_llm):
    fresh_llm.add_request(P, G)
    with pytest.raises(RuntimeError, match="still pending"):
        fresh_llm.generate([P], G, use_tqdm=False)
    fresh_llm.abort_all()
    assert not fresh_llm.requests and fresh_llm.is_finished()
    assert fresh_llm.generate([P], G, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), P, 6)
