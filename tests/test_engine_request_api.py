"""The request API a server drives (add_request / abort_request / step) and vLLM's output objects."""
import pytest

from engine_helpers import LLM, hf_greedy, tiny_dir
from nanovllm_ref import CompletionOutput, RequestOutput, SamplingParams
from nanovllm_ref.engine.invariants import check_block_manager

G = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
P = [5, 6, 7, 8, 9]


@pytest.fixture
def llm():
    return LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64, num_kvcache_blocks=24)


def drain(llm):
    """Step to the end; returns {request_id: [its RequestOutputs in step order]}."""
    seen = {}
    while not llm.is_finished():
        for out in llm.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


# -- outputs --------------------------------------------------------------------------------------------------
def test_generate_returns_request_outputs_with_a_dict_view_for_one_sample(llm):
    out = llm.generate(["Hello", P], G, use_tqdm=False)
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


def test_dict_view_of_several_samples_says_to_use_outputs(llm):
    out = llm.generate([P], SamplingParams(temperature=1.0, max_tokens=3, n=2), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1]
    for access in (lambda: out["text"], lambda: dict(out), lambda: len(out)):
        with pytest.raises(TypeError, match=r"n > 1.*outputs\[i\]"):
            access()
    assert out["prompt_token_ids"] == P                  # not per sample


# -- add_request / step ---------------------------------------------------------------------------------------
def test_step_returns_the_requests_that_progressed_with_growing_outputs(llm):
    a = llm.add_request(P, G)
    b = llm.add_request(list(range(20, 33)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                        request_id="mine")
    assert (a, b) == ("0", "mine") and set(llm.requests) == {"0", "mine"}
    seen, stats = {}, []
    while not llm.is_finished():
        outs = llm.step()
        stats.append(llm.last_step)
        for out in outs:
            seen.setdefault(out.request_id, []).append(out)
    for rid, outs in seen.items():
        ids = [o.outputs[0].token_ids for o in outs]
        assert all(len(y) == len(x) + 1 and y[:len(x)] == x for x, y in zip(ids, ids[1:]))
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all(y.outputs[0].text.startswith(x.outputs[0].text) for x, y in zip(outs, outs[1:]))
    assert seen[a][-1].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), P, 6)
    assert len(seen["mine"]) == 2 and not llm.requests
    # stats: a prefill of 5 + 13 prompt tokens (budget permitting), then decodes of the batch
    stats = [s for s in stats if s is not None]     # async scheduling: the last step only finishes the one in flight
    assert stats[0].kind == "prefill" and sum(s.num_tokens for s in stats if s.is_prefill) == 5 + 13
    assert all(s.num_tokens == s.num_seqs for s in stats if not s.is_prefill)
    assert llm.step() == [] and llm.last_step is None


def test_request_ids_are_unique_and_a_live_duplicate_is_refused(llm):
    llm.add_request(P, G, request_id="x")
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        llm.add_request(P, G, request_id="x")
    with pytest.raises(TypeError, match="request_id"):
        llm.add_request(P, G, request_id=7)
    with pytest.raises(ValueError, match="request_id"):
        llm.add_request(P, G, request_id="")
    llm.add_request(P, G, request_id="0")             # the engine's own numbering skips ids in use
    assert llm.add_request(P, G) == "1" and len(llm.scheduler.waiting) == 3
    drain(llm)
    assert llm.add_request(P, G, request_id="x") == "x"   # finished ids may be used again
    drain(llm)


def test_add_request_checks_before_queuing(llm):
    with pytest.raises(ValueError, match="prompt has token ids outside"):
        llm.add_request([1, 10**6], G)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.add_request(P, {"temperature": 0})
    assert llm.is_finished() and not llm.requests
    assert llm.add_request(P) == "0"                  # default SamplingParams()
    drain(llm)


# -- abort ----------------------------------------------------------------------------------------------------
def test_abort_request_frees_its_blocks_and_the_others_finish(llm):
    bm = llm.scheduler.block_manager
    keep = llm.add_request(P, G)
    gone = llm.add_request(list(range(40, 60)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    waits = llm.add_request([3, 4], G)
    llm.step()
    llm.step()
    assert llm.abort_request(gone) is True and gone not in llm.requests
    check_block_manager(bm, list(llm.scheduler.running) + list(llm.scheduler.waiting))
    assert llm.abort_request(gone) is False and llm.abort_request("never-seen") is False
    seen = drain(llm)
    assert gone not in seen
    assert seen[keep][-1].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), P, 6)
    assert seen[waits][-1].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), [3, 4], 6)
    assert bm.num_free_blocks == len(bm.blocks) and all(b.ref_count == 0 for b in bm.blocks)


def test_abort_a_waiting_request_and_a_list_of_ids(llm):
    ids = [llm.add_request(P, G) for _ in range(3)]
    assert llm.abort_request(ids[1:]) is True
    assert list(llm.requests) == ids[:1] and len(llm.scheduler.waiting) == 1
    with pytest.raises(TypeError, match="request_id"):
        llm.abort_request(5)
    assert list(drain(llm)) == ids[:1]


def test_generate_refuses_while_add_request_work_is_pending(llm):
    llm.add_request(P, G)
    with pytest.raises(RuntimeError, match="still pending"):
        llm.generate([P], G, use_tqdm=False)
    llm.abort_all()
    assert not llm.requests and llm.is_finished()
    assert llm.generate([P], G, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(tiny_dir("qwen3"), P, 6)
