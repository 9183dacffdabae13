"""+inf and NaN logits (an fp16 overflow, a broken model), in fp16 on the CPU, greedy and sampled
(layers/sampler.py, finite_rows): the +inf tokens of a row share its probability mass equally, NaN never
wins, a row of finite logits is sampled as before. Before this, softmax of a row holding +inf was NaN
everywhere and every sampled row of the batch returned token 0."""
import pytest
import torch

from nanovllm_ref import SamplingParams
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.layers.logits_processors import apply_min_p, apply_penalties
from nanovllm_ref.layers.logprobs import gather_logprobs
from nanovllm_ref.layers.sampler import SamplingMetadata, finite_rows, sample, sample_rows

from engine_helpers import LLM, sampling_batch, tiny_dir

INF, NAN = float("inf"), float("nan")
VOCAB = 40


def _logits():
    """fp16 rows: 0 overflowed at tokens 7 and 23; 1 with NaN at 0, 1 and 5 (the NaN would win argmax);
    2 finite; 3 overflowed at token 0 only, with a NaN at token 2; 4 all NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, VOCAB, generator=g).half()
    x[0, 7] = x[0, 23] = torch.tensor(70000.0).half()       # fp16 overflow: +inf
    x[1, [0, 1, 5]] = NAN
    x[3, 0], x[3, 2] = INF, NAN
    x[4] = NAN
    assert torch.isinf(x[0, 7]) and x.dtype == torch.float16
    return x


def _meta(temps, seeds=None):
    t = torch.tensor(temps, dtype=torch.float32)
    s = None if seeds is None else torch.tensor(seeds, dtype=torch.int64)
    c = None if seeds is None else torch.zeros(len(temps), dtype=torch.int64)
    return SamplingMetadata(t, all_greedy=all(v == 0 for v in temps), seeds=s, counters=c)


def test_finite_rows_defines_the_distribution():
    x = finite_rows(_logits().float())
    assert torch.equal(torch.isfinite(x[0]).nonzero().flatten(), torch.tensor([7, 23])) and (x[0, [7, 23]] == 0).all()
    assert torch.isneginf(x[1, [0, 1, 5]]).all() and torch.isfinite(x[1]).sum() == VOCAB - 3
    assert torch.equal(x[2], _logits()[2].float()), "finite rows are unchanged"
    assert torch.isfinite(x[3]).sum() == 1 and x[3, 0] == 0
    assert torch.isneginf(x[4]).all()
    assert finite_rows(_logits()).dtype == torch.float16


def test_greedy_rows_take_the_first_inf_and_never_a_nan():
    x = _logits()
    want_finite = int(x[1].float().nan_to_num(-INF).argmax())
    for meta in (_meta([0.0] * 5), _meta([0.0, 0.0, 0.0, 0.0, 0.0], seeds=[1] * 5)):
        ids = sample(x, meta).tolist()                      # the all-greedy shortcut
        assert ids[:4] == [7, want_finite, int(x[2].argmax()), 0] and ids[4] == 0
    mixed = sample(x, _meta([0.0, 0.0, 0.0, 0.0, 1.0])).tolist()     # greedy rows inside sample_rows
    assert mixed[:4] == [7, want_finite, int(x[2].argmax()), 0]


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_sampled_rows_share_the_mass_of_inf_tokens_and_never_draw_nan(seeded, temperature):
    x = _logits()
    n = 2000
    rows = x[[0, 1, 3]].repeat(n, 1)
    temps = [temperature] * (3 * n)
    meta = _meta(temps, seeds=list(range(3 * n))) if seeded else _meta(temps)
    ids = sample(rows, meta).view(n, 3)
    inf_draws = ids[:, 0]
    assert set(inf_draws.tolist()) <= {7, 23}
    share = float((inf_draws == 7).float().mean())
    assert abs(share - 0.5) < 0.05, f"the two +inf tokens share the mass equally, got {share:.3f}"
    assert not set(ids[:, 1].tolist()) & {0, 1, 5}, "a NaN logit was drawn"
    assert len(set(ids[:, 1].tolist())) > 10, "the NaN row still samples from its finite logits"
    assert (ids[:, 2] == 0).all()


def test_filtered_path_and_processors_handle_inf_too():
    x = _logits()[:4]
    t = torch.tensor([1.0, 1.0, 1.0, 1.0])
    meta = SamplingMetadata(t, all_greedy=False, top_k=torch.tensor([5, 5, 5, 0]),
                            top_p=torch.tensor([0.9, 0.9, 1.0, 0.5], dtype=torch.float64))
    for _ in range(20):
        ids = sample(x, meta).tolist()
        assert ids[0] in (7, 23) and ids[1] not in (0, 1, 5) and ids[3] == 0
    # penalties keep +inf at +inf (divide, subtract a finite number); min_p keeps only the +inf tokens
    counts = torch.zeros(4, VOCAB, dtype=torch.int32)
    counts[0, 7] = 3
    pen = apply_penalties(x, None, counts, torch.full((4,), 0.5), torch.full((4,), 1.0), torch.full((4,), 1.3))
    assert torch.isposinf(pen[0, [7, 23]]).all()
    kept = torch.isfinite(finite_rows(apply_min_p(pen, t, torch.full((4,), 0.1))))
    assert kept[0].nonzero().flatten().tolist() == [7, 23]


def test_logprobs_of_a_row_with_inf_are_the_shared_mass():
    x = _logits()[:3]
    out = gather_logprobs(x, 2, torch.tensor([23, 2, 3]))
    assert abs(float(out.logprobs[0, 0]) - torch.log(torch.tensor(0.5)).item()) < 1e-6
    assert set(out.token_ids[0, 1:].tolist()) == {7, 23} and int(out.ranks[0]) == 2
    assert torch.isfinite(out.logprobs[1]).all(), "NaN logits give no NaN logprobs"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_sampler_step_with_fp16_overflow_returns_the_inf_tokens(async_scheduling):
    """The model runner's sampling step (min_tokens mask, processors, sampler) on fp16 logits that overflowed,
    in a batch mixing greedy, sampled, seeded, filtered and penalised rows."""
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64, async_scheduling=async_scheduling)
    runner = llm.model_runner
    vocab = llm.config.hf_config.vocab_size

    def rows(seed: int) -> list[Sequence]:
        # Explicit seeds, one set per round: the counter-based noise of a sequence is a function of its seed
        # and token index, so repeating one batch would repeat its draws (and seq_id-derived seeds would make
        # the outcome depend on which tests ran before).
        sps = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=seed),
               SamplingParams(temperature=0.7, top_k=10, top_p=0.9, seed=seed + 1000),
               SamplingParams(temperature=1.2, repetition_penalty=1.5, min_p=0.2, presence_penalty=0.5,
                              seed=seed + 2000),
               SamplingParams(temperature=0, frequency_penalty=1.0)]
        seqs = [Sequence([11, 12, 13], 4, sp) for sp in sps]
        for seq in seqs:
            seq.append_token(100)
        return seqs

    logits = torch.randn(5, vocab).half()
    logits[:, 100] = INF                      # every row overflowed at 100 and 300
    logits[:, 300] = INF
    logits[:, 5] = NAN
    logits = logits.to(runner.device)
    drawn = set()
    for seed in range(30):
        batch = sampling_batch(llm, rows(seed))
        ids = runner.sample(batch, logits, None, runner.processing(batch)).token_ids()
        assert ids[0] == ids[4] == 100 and set(ids) <= {100, 300}
        drawn.update(ids[1:4])
    assert drawn == {100, 300}, "sampled rows must draw both +inf tokens"
    llm.exit()
