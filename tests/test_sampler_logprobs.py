"""Logprobs (SamplingParams.logprobs, prompt_logprobs) in vLLM's shape, of the model's raw distribution
(layers/logprobs.py), against HF transformers' logits of the same tokens:

- per generated token, a dict {token_id: Logprob(logprob, rank, decoded_token)} with the token itself and the
  top-n; cumulative_logprob their sum; logprobs to atol 1e-4 of log_softmax(HF's raw logits) (fp32 engine and
  oracle; their logits differ by float rounding only), ranks and top sets exact away from near-ties;
- prompt logprobs: None for the first token, then the same dicts per prompt token, through chunked prefill,
  and with prefix caching (a request with prompt_logprobs takes no hit and recomputes, as in vLLM; others
  still hit);
- async scheduling equals sync exactly; tokens dropped after a stop have no logprobs; n > 1; the CPU graph
  data path (logprobs need no route change); bad values refused by name.
"""
import math
import random

import pytest
import torch

from nanovllm_ref import Logprob, SamplingParams
from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.engine.token_bytes import token_bytes_for
from nanovllm_ref.layers.logprobs import gather_logprobs

from engine_helpers import LLM, hf_model, tiny_dir
from test_thin_step import CountingSampler, EagerReplayRunner

ATOL = 1e-4


def _prompts(seed, n, lo=3, hi=20):
    g = random.Random(seed)
    return [[g.randrange(1, 300) for _ in range(g.randrange(lo, hi))] for _ in range(n)]


def hf_step_logprobs(path, prompt, completion):
    """log_softmax of HF's logits at every position of prompt + completion: [len - 1, V] (row i predicts
    token i + 1)."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1]


def assert_entry_matches(entry: dict, token: int, want: torch.Tensor, k: int, tokenizer, what: str):
    """One position's dict against HF's logprobs `want` [V] at that position."""
    assert isinstance(entry, dict) and all(isinstance(v, Logprob) for v in entry.values()), what
    assert token in entry and len(entry) in (k, k + 1), what
    assert abs(entry[token].logprob - float(want[token])) <= ATOL, what
    rank = int((want >= want[token]).sum())
    gap = (want - want[token]).abs()
    if not ((gap > 0) & (gap <= 1e-3)).any():                 # no near-tie to blur the rank
        assert entry[token].rank == rank, what
    top = want.topk(k + 1)
    if k and float(top.values[k - 1] - top.values[k]) > 1e-3:
        chosen_only = set(entry) - set(top.indices[:k].tolist())
        assert chosen_only <= {token}, f"{what}: top-{k} set differs"
        for t in top.indices[:k].tolist():
            assert abs(entry[t].logprob - float(want[t])) <= ATOL, what
        for r, t in enumerate(top.indices[:k].tolist(), start=1):
            assert entry[t].rank == r, what
    for t, lp in entry.items():
        assert lp.decoded_token == token_bytes_for(tokenizer).text(t), what   # == decode([t]) but for a piece of a character


def assert_close_entries(got, want, atol=1e-5):
    """Two logprobs lists (None, or per position None or {token_id: Logprob}): same tokens, ranks and texts,
    logprobs within atol."""
    assert (got is None) == (want is None)
    assert got is None or len(got) == len(want)
    for a, b in zip(got or [], want or []):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys()
            for t in a:
                assert (a[t].rank, a[t].decoded_token) == (b[t].rank, b[t].decoded_token)
                assert abs(a[t].logprob - b[t].logprob) <= atol


def test_gather_logprobs_shape_and_ranks():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    out = gather_logprobs(logits, 2, torch.tensor([1, 3]))
    assert out.token_ids.tolist()[0][0] == 1 and out.token_ids.tolist()[1][:2] == [3, 2]
    assert out.token_ids.shape == (2, 3) and out.logprobs.shape == (2, 3) and out.ranks.tolist() == [3, 4]
    want = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs[:, 0], want[[0, 1], [1, 3]])
    assert gather_logprobs(logits, 0, torch.tensor([0, 2])).token_ids.shape == (2, 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_completion_logprobs_equal_hfs_raw_distribution(async_scheduling):
    path = tiny_dir("qwen3")
    prompts = _prompts(1, 4)
    sps = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
           SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True, logprobs=0),
           # penalties and a temperature change what is sampled, not the logprobs reported (raw, as vLLM)
           SamplingParams(temperature=1.3, seed=6, max_tokens=8, ignore_eos=True, logprobs=5, repetition_penalty=1.5,
                          min_p=0.05, top_k=30),
           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, sps, use_tqdm=False)
    for prompt, sp, out in zip(prompts, sps, outs):
        c = out.outputs[0]
        if sp.logprobs is None:
            assert c.logprobs is None and c.cumulative_logprob is None
            continue
        assert len(c.logprobs) == len(c.token_ids) == 8
        want = hf_step_logprobs(path, prompt, c.token_ids)[len(prompt) - 1:]
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert_entry_matches(entry, token, want[i], sp.logprobs, llm.tokenizer, f"{sp} token {i}")
        assert math.isclose(c.cumulative_logprob, sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                            abs_tol=1e-9)
        assert out.prompt_logprobs is None
    assert outs[0].outputs[0].logprobs[0][outs[0].outputs[0].token_ids[0]].rank == 1, "greedy picks rank 1"
    llm.exit()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_logprobs_zero_alone_keys_each_entry_by_its_own_token(async_scheduling):
    """logprobs=0 in every row: the chosen token's column is then the whole result, no top-k copy is made,
    and on the CPU it once viewed the runner's id buffer, which the next (async) step overwrote before the
    host read it: each entry was keyed by the next token (a reported fault). Keys and values must be each
    token's own, equal to logprobs=1's chosen entry (to ATOL: the two runs batch differently)."""
    path = tiny_dir("qwen3")
    prompts = _prompts(7, 3)
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, async_scheduling=async_scheduling)
    zero = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    one = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1),
                       use_tqdm=False)
    for z, o in zip(zero, one):
        cz, co = z.outputs[0], o.outputs[0]
        assert cz.token_ids == co.token_ids
        assert [list(e) for e in cz.logprobs] == [[t] for t in cz.token_ids]
        for t, ez, eo in zip(cz.token_ids, cz.logprobs, co.logprobs):
            assert ez[t].rank == eo[t].rank and abs(ez[t].logprob - eo[t].logprob) <= ATOL
            assert ez[t].decoded_token == token_bytes_for(llm.tokenizer).text(t)
    llm.exit()


@pytest.mark.parametrize("engine_args", [dict(), dict(max_num_batched_tokens=8, max_num_seqs=3)],
                         ids=["one_chunk", "chunked_prefill"])
def test_prompt_logprobs_equal_hfs_per_position(engine_args):
    path = tiny_dir("qwen3")
    prompts = _prompts(2, 3, 9, 30)
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, **engine_args)
    sps = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in (2, 0, 4)]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    for prompt, sp, out in zip(prompts, sps, outs):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        want = hf_step_logprobs(path, prompt, [])
        for i in range(1, len(prompt)):
            assert_entry_matches(out.prompt_logprobs[i], prompt[i], want[i - 1], sp.prompt_logprobs, llm.tokenizer,
                                 f"prompt token {i}")
        assert out.outputs[0].logprobs is None
    llm.exit()


def test_prompt_logprobs_take_no_prefix_cache_hit_and_others_still_do():
    path = tiny_dir("qwen3")
    prompt = _prompts(3, 1, 21, 22)[0]
    llm = LLM(path, kvcache_block_size=4, max_model_len=64)
    cached = []
    orig = llm.scheduler.block_manager.allocate

    def allocate(seq):
        orig(seq)
        cached.append(seq.num_cached_tokens)

    llm.scheduler.block_manager.allocate = allocate
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], plain, use_tqdm=False)
    with_lp = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1),
                           use_tqdm=False)[0]
    llm.generate([prompt], plain, use_tqdm=False)
    assert cached == [0, 0, 20], "the prompt_logprobs request must recompute; the next one hits again"
    fresh = LLM(path, kvcache_block_size=4, max_model_len=64, enable_prefix_caching=False)
    want = fresh.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1),
                          use_tqdm=False)[0]
    assert len(with_lp.prompt_logprobs) == len(prompt)
    assert_close_entries(with_lp.prompt_logprobs, want.prompt_logprobs)
    llm.exit(), fresh.exit()


def test_async_equals_sync_with_stops_preemption_and_parallel_samples():
    """Logprobs line up with token_ids exactly: a token sampled after a stop (async) has none; a preempted,
    recomputed sequence keeps one entry per token; each of n samples has its own; prompt ones once."""
    path = tiny_dir("qwen3")
    prompts = _prompts(4, 5, 5, 24)
    free = LLM(path).generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    sps = [SamplingParams(temperature=0, max_tokens=12, logprobs=2, stop_token_ids=[free[0].outputs[0].token_ids[4]]),
           SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1, n=3, prompt_logprobs=2),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=4, presence_penalty=1.0),
           SamplingParams(temperature=0.7, seed=4, max_tokens=12, ignore_eos=True, prompt_logprobs=0),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    tight = dict(kvcache_block_size=4, num_kvcache_blocks=16, max_num_batched_tokens=16, max_num_seqs=4)
    a, s = LLM(path, async_scheduling=True, **tight), LLM(path, async_scheduling=False, **tight)
    oa, os_ = a.generate(prompts, sps, use_tqdm=False), s.generate(prompts, sps, use_tqdm=False)
    assert a.scheduler.num_preemptions > 0, "the tight cache must preempt, or the test checks less"

    # The two routes batch steps differently, so float rounding may differ (1e-6 here): ids and ranks exact.
    for x, y in zip(oa, os_):
        for o, p in zip(x.outputs, y.outputs):
            assert o.token_ids == p.token_ids
            assert_close_entries(o.logprobs, p.logprobs)
            assert (o.cumulative_logprob is None) == (p.cumulative_logprob is None)
            assert o.cumulative_logprob is None or abs(o.cumulative_logprob - p.cumulative_logprob) <= 1e-4
        assert_close_entries(x.prompt_logprobs, y.prompt_logprobs)
    assert oa[0].outputs[0].finish_reason == "stop" and len(oa[0].outputs[0].logprobs) == 5
    for r in oa:
        for o in r.outputs:
            assert o.logprobs is None or len(o.logprobs) == len(o.token_ids)
    assert len(oa[1].outputs) == 3 and len(oa[1].prompt_logprobs) == len(prompts[1])
    a.exit(), s.exit()


def test_streamed_snapshots_only_grow_and_end_equal_to_generate():
    path = tiny_dir("qwen3")
    prompt = _prompts(5, 1)[0]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, async_scheduling=True)
    llm.add_request(prompt, sp)
    seen = []
    while not llm.is_finished() or llm._in_flight is not None:
        seen += [o.outputs[0] for o in llm.step()]
    assert [len(o.logprobs) for o in seen] == list(range(1, 7))
    for earlier, later in zip(seen, seen[1:]):
        assert later.logprobs[:len(earlier.logprobs)] == earlier.logprobs
    final = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert final.outputs[0].logprobs == seen[-1].logprobs
    llm.exit()


def test_graph_path_keeps_in_graph_sampling_and_reports_logprobs():
    path = tiny_dir("qwen3")
    llm = LLM(path, enforce_eager=True, max_num_seqs=8, kvcache_block_size=16)
    runner = llm.model_runner
    runner.capture_cudagraph(EagerReplayRunner)
    outside = CountingSampler(runner)
    prompts = _prompts(6, 2)
    sps = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.8, seed=2, max_tokens=8, ignore_eos=True, logprobs=1)]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert outside.calls <= 1, "logprobs must not send decode rows to the sampler after the graph"
    for prompt, sp, out in zip(prompts, sps, outs):
        c = out.outputs[0]
        want = hf_step_logprobs(path, prompt, c.token_ids)[len(prompt) - 1:]
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert_entry_matches(entry, token, want[i], sp.logprobs, llm.tokenizer, f"token {i}")
    llm.exit()


def test_bad_logprobs_requests_are_refused_by_name_before_queuing():
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"sampling_params\[0\]: SamplingParams.logprobs=21 .*max_logprobs"):
        llm.generate([[5, 6]], SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs=100"):
        llm.add_request([5, 6], SamplingParams(prompt_logprobs=100))
    assert llm.is_finished() and not llm.requests
    llm.exit()

    class MyBlockManager(BlockManager):
        pass

    from nanovllm_ref import Parts
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64, parts=Parts(block_manager=MyBlockManager))
    with pytest.raises(ValueError, match="prompt_logprobs with prefix caching needs the reference BlockManager"):
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=1), use_tqdm=False)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=1), use_tqdm=False)[0].outputs[0].logprobs
    llm.exit()
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64, parts=Parts(block_manager=MyBlockManager),
              enable_prefix_caching=False)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=1),
                            use_tqdm=False)[0].prompt_logprobs) == 3
    llm.exit()


def test_a_block_manager_that_hits_anyway_is_caught_not_silently_wrong():
    """If a block manager gave a prompt_logprobs request a prefix hit, positions would have no logits: the
    model runner raises instead of returning fewer entries."""
    path = tiny_dir("qwen3")
    llm = LLM(path, kvcache_block_size=4, max_model_len=64)
    prompt = _prompts(7, 1, 13, 14)[0]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    bm = llm.scheduler.block_manager
    orig = bm._match_prefix

    def hit_anyway(seq):                             # matches as if the sequence wanted no prompt logprobs
        wanted, seq.num_prompt_logprobs = seq.num_prompt_logprobs, None
        try:
            return orig(seq)
        finally:
            seq.num_prompt_logprobs = wanted

    bm._match_prefix = hit_anyway
    with pytest.raises(RuntimeError, match="prefix-cache hit"):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    llm.exit()


def test_tensor_parallel_prompt_and_completion_logprobs_equal_one_rank():
    path = tiny_dir("qwen3")
    prompts = _prompts(8, 2, 6, 18)
    sps = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=2,
                          repetition_penalty=1.3),
           SamplingParams(temperature=0.9, seed=1, max_tokens=5, ignore_eos=True, logprobs=1, min_p=0.1)]
    one = LLM(path, kvcache_block_size=4, max_model_len=64)
    want = one.generate(prompts, sps, use_tqdm=False)
    one.exit()
    with LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64) as tp:
        got = tp.generate(prompts, sps, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert_close_entries(a.outputs[0].logprobs, b.outputs[0].logprobs)
        assert_close_entries(a.prompt_logprobs, b.prompt_logprobs)
    assert got[0].prompt_logprobs is not None and got[1].prompt_logprobs is None
