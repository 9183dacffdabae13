"""Presence, frequency and repetition penalties and min_p (layers/logits_processors.py), with HF transformers'
logits processors as the oracle where HF has the feature, vLLM's definitions elsewhere:

- the processors on fresh random logits: the repetition penalty exactly HF's RepetitionPenaltyLogitsProcessor
  (same fp32 ops, so torch.equal), presence / frequency the OpenAI formula in float64 (atol 1e-5), applied in
  vLLM's order (repetition, frequency, presence); min_p's kept set exactly HF's MinPLogitsWarper after
  TemperatureLogitsWarper, and the whole filter chain in vLLM's order (temperature, min_p, top-k, top-p)
  equal to HF's warpers run in that order (probabilities to atol 1e-6);
- end to end on tiny models: greedy ids equal to HF `generate` with the same processors (its built-in
  repetition_penalty, and the OpenAI penalties as a LogitsProcessor), min_p = 1 on a sampled row is greedy;
- routes: penalties and min_p send a row to the sampler after the graph, on the CPU graph data path
  (EagerReplayRunner); async scheduling equals sync token for token, the pending token counted on the device.
"""
import random

import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from nanovllm_ref import SamplingParams
from nanovllm_ref.engine.sampling_inputs import needs_sampler_after_graph
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.layers.logits_processors import apply_min_p, apply_penalties, bin_counts, min_p_keep
from nanovllm_ref.layers.sampler import top_k_top_p_filter

from engine_helpers import LLM, hf_model, sampling_batch, tiny_dir
from test_thin_step import CountingSampler, EagerReplayRunner


# -- the oracles ------------------------------------------------------------------------------------------------
class OpenAIPenalties(LogitsProcessor):
    """presence / frequency penalties as OpenAI defines them (vLLM too), over the generated ids only:
    z[j] -= c[j] * frequency + (c[j] > 0) * presence. A logits processor for HF's generate."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for b in range(scores.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_len:], minlength=scores.shape[-1])[:scores.shape[-1]]
            out[b] -= self.frequency * counts.to(scores.dtype) + self.presence * (counts > 0).to(scores.dtype)
        return out


def _random_case(g, rows, vocab, prompt_len, output_len):
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, :3] = torch.tensor([0.0, -0.0, 2.5])              # a zero, a negative zero, and a positive logit
    logits[0, 5] = float("-inf")                               # a token masked earlier (min_tokens)
    prompts = torch.randint(0, vocab, (rows, prompt_len), generator=g)
    outputs = torch.randint(0, min(vocab, 12), (rows, output_len), generator=g)   # few ids: many repeats
    return logits, prompts, outputs


def _masks(prompts, outputs, vocab):
    rows = prompts.shape[0]
    r = torch.arange(rows)
    prompt_mask = bin_counts(r.repeat_interleave(prompts.shape[1]), prompts.reshape(-1), rows, vocab) > 0
    counts = bin_counts(r.repeat_interleave(outputs.shape[1]), outputs.reshape(-1), rows, vocab)
    return prompt_mask, counts


@pytest.mark.parametrize("vocab,output_len", [(17, 0), (64, 9), (301, 30)])
def test_repetition_penalty_is_exactly_hfs_processor(vocab, output_len):
    g = torch.Generator().manual_seed(vocab)
    rows = 6
    logits, prompts, outputs = _random_case(g, rows, vocab, 7, output_len)
    penalties = [1.0, 1.3, 0.7, 2.0, 1.05, 1e-3]
    prompt_mask, counts = _masks(prompts, outputs, vocab)
    before = logits.clone()
    got = apply_penalties(logits, prompt_mask, counts, torch.zeros(rows), torch.zeros(rows), torch.tensor(penalties))
    assert torch.equal(logits, before), "the logits must come back unchanged"
    for b, r in enumerate(penalties):
        ids = torch.cat([prompts[b], outputs[b]]).unsqueeze(0)
        want = RepetitionPenaltyLogitsProcessor(r)(ids, logits[b:b + 1].clone())[0]
        assert torch.equal(got[b], want), f"row {b}, penalty {r}"


def test_presence_and_frequency_follow_openai_over_output_tokens_only():
    g = torch.Generator().manual_seed(2)
    rows, vocab = 8, 90
    logits, prompts, outputs = _random_case(g, rows, vocab, 11, 25)
    presence = torch.tensor([0.0, 0.5, -0.5, 2.0, 0.0, -2.0, 1.0, 0.3])
    frequency = torch.tensor([0.0, 0.0, 0.3, -1.0, 1.5, 2.0, 0.0, -0.7])
    prompt_mask, counts = _masks(prompts, outputs, vocab)
    got = apply_penalties(logits, prompt_mask, counts, presence, frequency, torch.ones(rows))
    want = logits.double().clone()
    for b in range(rows):
        c = torch.bincount(outputs[b], minlength=vocab).double()
        want[b] -= float(frequency[b]) * c + float(presence[b]) * (c > 0).double()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert torch.equal(got[0], logits[0]), "a row with every penalty off is unchanged"
    # prompt tokens that never occur in the output get no presence / frequency penalty
    only_prompt = prompt_mask[1] & (counts[1] == 0)
    assert only_prompt.any() and torch.equal(got[1][only_prompt], logits[1][only_prompt])


def test_penalties_apply_in_vllms_order_repetition_first():
    # z = 2 seen once in the output, r = 2, f = 1: vLLM's order gives 2 / 2 - 1 = 0, the other (2 - 1) / 2 = 0.5
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    counts = torch.tensor([[1, 1, 0]], dtype=torch.int32)
    got = apply_penalties(logits, None, counts, torch.tensor([0.25]), torch.tensor([1.0]), torch.tensor([2.0]))
    assert got.tolist() == [[2 / 2 - 1 - 0.25, -2 * 2 - 1 - 0.25, 1.0]]
    hf = OpenAIPenalties(0, 0.25, 1.0)(torch.tensor([[0, 1]]), RepetitionPenaltyLogitsProcessor(2.0)(
        torch.tensor([[0, 1]]), logits.clone()))
    assert torch.equal(got, hf)


def test_bin_counts_counts_on_the_device_shape():
    counts = bin_counts(torch.tensor([0, 0, 0, 2, 2]), torch.tensor([3, 3, 1, 0, 3]), 3, 5)
    assert counts.dtype == torch.int32 and counts.tolist() == [[0, 1, 0, 2, 0], [0] * 5, [1, 0, 0, 1, 0]]


# -- min_p ------------------------------------------------------------------------------------------------------
def hf_chain(row: torch.Tensor, t: float, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF's warpers in vLLM's order: temperature, min_p, top-k, top-p (those that are off skipped)."""
    scores = TemperatureLogitsWarper(t)(None, row.float().unsqueeze(0).clone())
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores[0]


@pytest.mark.parametrize("vocab", [2, 9, 500])
def test_min_p_keeps_exactly_what_hfs_warper_keeps(vocab):
    g = torch.Generator().manual_seed(vocab + 1)
    rows = 12
    logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g).mul(5)
    logits[3, :2] = logits[3].max() + 1                        # a tie at the top: both kept
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.3] * 2)
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.3, 0.5, 1.0, 0.9, 0.01, 0.2, 1e-6, 0.6, 0.999])
    before = logits.clone()
    keep = min_p_keep(logits, temps, min_p)
    masked = apply_min_p(logits, temps, min_p)
    assert torch.equal(logits, before)
    for b in range(rows):
        want = torch.isfinite(MinPLogitsWarper(float(min_p[b]))(None, TemperatureLogitsWarper(float(temps[b]))(
            None, logits[b:b + 1].clone())))[0] if min_p[b] > 0 else torch.ones(vocab, dtype=torch.bool)
        assert torch.equal(keep[b], want), f"row {b}, min_p {float(min_p[b])}"
        assert torch.equal(torch.isfinite(masked[b]), want)
        assert torch.equal(masked[b][want], logits[b][want]), "kept logits are not changed"
    assert keep[3, :2].all() and keep[5].sum() == 1


def test_min_p_leaves_greedy_rows_alone():
    logits = torch.tensor([[3.0, 0.0, 2.9], [3.0, 0.0, 2.9]])
    got = apply_min_p(logits, torch.tensor([0.0, 1.0]), torch.tensor([0.9, 0.9]))
    assert torch.equal(got[0], logits[0]) and torch.isinf(got[1, 1]) and torch.isfinite(got[1, 2])


def test_filter_chain_in_vllms_order_equals_hf_warpers_in_that_order():
    """temperature -> min_p -> top-k -> top-p: our min_p mask on the logits, then the sampler's filter, gives
    HF's warpers' distribution. (HF's own generate runs min_p last; min_p and top-p do not commute.)"""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 24, 200
    logits = torch.randn(rows, vocab, generator=g) * 2.5
    temps = [0.6, 1.0, 1.7] * 8
    min_ps = [0.05, 0.2, 0.0, 0.5] * 6
    top_ks = [0, 5, 40, 0, 3, 0] * 4
    top_ps = [0.9, 1.0, 0.5, 0.7] * 6
    t = torch.tensor(temps)
    masked = apply_min_p(logits, t, torch.tensor(min_ps))
    ours = top_k_top_p_filter(masked / t.unsqueeze(-1), torch.tensor(top_ks), torch.tensor(top_ps, dtype=torch.float64))
    differ_from_hf_default_order = 0
    for b in range(rows):
        want = hf_chain(logits[b], temps[b], min_ps[b], top_ks[b], top_ps[b])
        assert torch.equal(torch.isfinite(ours[b]), torch.isfinite(want)), f"row {b}"
        torch.testing.assert_close(ours[b].softmax(-1), want.softmax(-1), rtol=0, atol=1e-6)
        # HF's generate order (min_p after top-p) would keep a different set in some rows
        hf_default = TemperatureLogitsWarper(temps[b])(None, logits[b:b + 1].clone())
        for w in ([TopKLogitsWarper(top_ks[b])] if top_ks[b] else []) + (
                [TopPLogitsWarper(top_ps[b])] if top_ps[b] < 1 else []) + (
                [MinPLogitsWarper(min_ps[b])] if min_ps[b] else []):
            hf_default = w(None, hf_default)
        differ_from_hf_default_order += not torch.equal(torch.isfinite(hf_default[0]), torch.isfinite(want))
    assert differ_from_hf_default_order > 0, "the cases must tell the two orders apart"


# -- routes -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,after", [
    (dict(temperature=0), False), (dict(temperature=0.8), False),
    (dict(temperature=0, repetition_penalty=1.2), True), (dict(temperature=0, presence_penalty=0.1), True),
    (dict(temperature=0.7, frequency_penalty=-0.5), True), (dict(temperature=0.7, min_p=0.1), True),
    (dict(temperature=0, min_p=0.1), False),          # greedy: min_p cannot change the argmax
])
def test_rows_with_processors_take_the_sampler_after_the_graph(kwargs, after):
    assert needs_sampler_after_graph(Sequence([1, 2, 3], 4, SamplingParams(**kwargs))) is after


def test_pending_token_is_counted_from_the_previous_steps_ids_on_the_device():
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)
    runner = llm.model_runner
    seq = Sequence([5, 6, 7], 4, SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5))
    seq.append_token(9)
    seq.append_pending(row=1)                       # the previous step samples its next token in row 1
    other = Sequence([8], 4, SamplingParams(temperature=0))
    runner.last_ids[:2] = torch.tensor([100, 9])
    proc = runner.processing(sampling_batch(llm, [other, seq]))
    assert proc.output_counts[1, 9] == 2 and proc.output_counts[1].sum() == 2, "the pending 9 must count"
    assert proc.output_counts[0].sum() == 0 and proc.prompt_mask[1, [5, 6, 7]].all() and proc.prompt_mask[1].sum() == 3
    assert runner.processing(sampling_batch(llm, [other])) is None
    llm.exit()


# -- end to end against HF generate -----------------------------------------------------------------------------
def hf_generate(path, prompt, n, processors=(), **kw):
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             logits_processor=LogitsProcessorList(processors), **kw)
    return out[0, len(prompt):].tolist()


def _prompts(seed, n):
    g = random.Random(seed)
    return [[g.randrange(1, 60) for _ in range(g.randrange(3, 20))] for _ in range(n)]


PENALTY_CASES = [
    dict(repetition_penalty=1.4), dict(repetition_penalty=0.8), dict(presence_penalty=1.5),
    dict(frequency_penalty=0.9), dict(presence_penalty=-0.4, frequency_penalty=0.6, repetition_penalty=1.2),
    # a negative presence penalty invites repeats, so tokens reach counts > 1: presence applied per count (as
    # frequency is) would show here
    dict(presence_penalty=-1.0),
]


def _hf_for(path, prompt, n, case):
    procs = []
    if case.get("presence_penalty") or case.get("frequency_penalty"):
        procs.append(OpenAIPenalties(len(prompt), case.get("presence_penalty", 0.0), case.get("frequency_penalty", 0.0)))
    return hf_generate(path, prompt, n, procs, repetition_penalty=case.get("repetition_penalty", 1.0))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_with_penalties_equals_hf_generate(arch, async_scheduling):
    """Every case on three prompts, all in one batch with plain greedy rows; each case must change some
    completion (else it would test nothing)."""
    path = tiny_dir(arch)
    prompts = _prompts(11, 3)
    cases = PENALTY_CASES + [{}]
    rows = [(p, c) for c in cases for p in prompts]
    sps = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, **c) for _, c in rows]
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, max_num_seqs=len(rows),
              async_scheduling=async_scheduling)
    outs = llm.generate([p for p, _ in rows], sps, use_tqdm=False)
    llm.exit()
    plain = {tuple(p): _hf_for(path, p, 14, {}) for p in prompts}
    for (prompt, case), out in zip(rows, outs):
        assert out.outputs[0].token_ids == _hf_for(path, prompt, 14, case), case
    for case in PENALTY_CASES:
        changed = [o.outputs[0].token_ids != plain[tuple(p)] for (p, c), o in zip(rows, outs) if c is case]
        assert any(changed), f"{case} changed no completion: the test would not see it ignored"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_p_one_on_a_sampled_row_is_greedy_with_its_penalties(async_scheduling):
    """min_p = 1 keeps only the most likely token (after the penalties): hot rows become HF's greedy ids."""
    path = tiny_dir("qwen3")
    prompts = _prompts(12, 3)
    cases = [{}, dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.3)]
    sps = [SamplingParams(temperature=1.7, min_p=1.0, max_tokens=12, ignore_eos=True, seed=i, **c)
           for i, c in enumerate(cases)]
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, sps, use_tqdm=False)
    llm.exit()
    for prompt, case, out in zip(prompts, cases, outs):
        assert out.outputs[0].token_ids == _hf_for(path, prompt, 12, case), case


def _graph_llm(**kw):
    llm = LLM(tiny_dir("qwen3"), enforce_eager=True, max_num_seqs=8, kvcache_block_size=16, **kw)
    llm.model_runner.capture_cudagraph(EagerReplayRunner)
    assert llm.model_runner.graph_samples
    return llm


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_path_sends_penalised_rows_to_the_sampler_after_the_graph(async_scheduling):
    path = tiny_dir("qwen3")
    llm = _graph_llm(async_scheduling=async_scheduling)
    outside = CountingSampler(llm.model_runner)
    prompts = _prompts(13, 3)
    sps = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5),
           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=1.0),
           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == _hf_for(path, prompts[0], 10, dict(repetition_penalty=1.5))
    assert outs[1].outputs[0].token_ids == _hf_for(path, prompts[1], 10, dict(presence_penalty=1.0))
    assert outs[2].outputs[0].token_ids == _hf_for(path, prompts[2], 10, {})
    assert outside.calls >= 10, "decode steps with penalised rows must sample after the graph"
    outside.calls = 0
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert outside.calls <= 2, "without processors decode samples inside the graph again"
    llm.exit()


TIGHT = dict(kvcache_block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=16, max_num_seqs=4)


def test_async_equals_sync_with_mixed_processors_under_preemption():
    """One batch mixing every processor with plain, seeded and filtered rows, through chunked prefill,
    preemption by recompute and parallel samples: the async engine gives the sync engine's tokens."""
    path = tiny_dir("qwen3")
    prompts = _prompts(14, 7)
    sps = [SamplingParams(temperature=0.9, seed=1, max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=0.7),
           SamplingParams(temperature=1.1, seed=2, max_tokens=10, ignore_eos=True, min_p=0.2, top_k=20),
           SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, presence_penalty=1.2, top_p=0.9,
                          min_p=0.05),
           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
           SamplingParams(temperature=1.0, seed=4, max_tokens=10, ignore_eos=True, n=2, repetition_penalty=0.9),
           SamplingParams(temperature=0.7, seed=5, max_tokens=10, min_tokens=4, frequency_penalty=0.5)]
    a = LLM(path, async_scheduling=True, **TIGHT)
    s = LLM(path, async_scheduling=False, **TIGHT)
    oa, os_ = a.generate(prompts, sps, use_tqdm=False), s.generate(prompts, sps, use_tqdm=False)
    assert a.scheduler.num_preemptions > 0, "the tight cache must preempt, or the test checks less"
    assert [[o.token_ids for o in r.outputs] for r in oa] == [[o.token_ids for o in r.outputs] for r in os_]
    assert not a.scheduler.block_manager.used_block_ids
    a.exit(), s.exit()


def test_processors_and_logprobs_make_no_host_sync():
    from nanovllm_ref.layers.logprobs import gather_logprobs
    from test_sampler_top_k_top_p import HostSyncSpy
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 64, generator=g)
    rows, ids = torch.tensor([0, 0, 1, 3]), torch.tensor([5, 5, 7, 9])
    t = torch.tensor([0.0, 1.0, 0.7, 1.2])
    with HostSyncSpy() as spy:
        counts = bin_counts(rows, ids, 4, 64)
        z = apply_penalties(logits, counts > 0, counts, torch.full((4,), 0.5), torch.full((4,), 0.3), torch.full((4,), 1.2))
        z = apply_min_p(z, t, torch.tensor([0.1, 0.2, 0.0, 0.5]))
        gather_logprobs(logits, 3, z.argmax(-1))
    assert spy.seen == []
