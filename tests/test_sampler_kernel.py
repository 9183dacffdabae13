"""The sampler's row draw as a Triton kernel (nanovllm_ref/kernels/sampler.py, run by the Triton interpreter on
the CPU): the same tokens as the reference `layers.sampler.sample_rows` (the counter-based exponential race),
greedy rows the first argmax, non-finite rows as `finite_rows` has them, over vocabularies split into slices."""
import pytest
import torch

from nanovllm_ref.kernels import sampler as ks
from nanovllm_ref.layers.sampler import sample_rows


def _case(seed, batch, vocab, dtype, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=g) * scale).to(dtype)
    temps = torch.rand(batch, generator=g) * 2
    temps[::3] = 0.0                                       # greedy rows among the sampled ones
    seeds = torch.randint(0, 2**32, (batch,), generator=g, dtype=torch.int64)
    counters = torch.randint(0, 5000, (batch,), generator=g, dtype=torch.int64)
    return logits, temps, seeds, counters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, vocab", [(1, 9000), (5, 4097), (7, 1000)])
def test_kernel_draws_the_reference_tokens(dtype, batch, vocab):
    for seed in range(3):
        logits, temps, seeds, counters = _case(seed, batch, vocab, dtype)
        want = sample_rows(logits, temps, seeds=seeds, counters=counters)
        got = ks.sample_rows(logits, temps, seeds=seeds, counters=counters)
        assert got.dtype == torch.int64 and got.tolist() == want.tolist()


def test_rows_split_into_many_slices_pick_the_winner_across_them(monkeypatch):
    monkeypatch.setattr(ks, "MIN_SLICE", 1024)
    logits, temps, seeds, counters = _case(7, 2, 8192, torch.float32)
    assert ks.num_slices(2, 8192, torch.device("cpu")) == 8       # 8 programs x 4 "SMs" / 2 rows, 8 slices of 1024
    assert ks.sample_rows(logits, temps, seeds=seeds, counters=counters).tolist() == \
        sample_rows(logits, temps, seeds=seeds, counters=counters).tolist()
    # the winner in the last slice, and in the first
    logits = torch.zeros(2, 8192)
    logits[0, 8191], logits[1, 3] = 100.0, 100.0
    temps = torch.tensor([0.0, 0.5])
    assert ks.sample_rows(logits, temps, seeds=seeds, counters=counters).tolist() == [8191, 3]


def test_greedy_takes_the_first_of_equal_maxima_and_nan_never_wins():
    logits = torch.zeros(3, 5000)
    logits[0, [17, 4000]] = 5.0                            # a tie: the first index wins, as argmax does
    logits[1, 2] = float("nan")
    logits[1, 3] = 1.0
    logits[2, :] = float("-inf")                           # nothing finite: token 0, as argmax of it
    temps = torch.zeros(3)
    seeds, counters = torch.arange(3), torch.arange(3)
    assert ks.sample_rows(logits, temps, seeds=seeds, counters=counters).tolist() == [17, 3, 0]


def test_greedy_tie_in_one_lane_of_one_slice_takes_the_first():
    """Equal maxima 1,024 logits apart fall in the same lane of one program's running bests (BLOCK_V = 1,024):
    the lane must keep the earlier index (a strict >), as argmax does."""
    logits = torch.zeros(2, 5000)
    logits[:, [5, 5 + ks.BLOCK_V]] = 5.0
    logits[1, [7, 7 + 2 * ks.BLOCK_V]] = 6.0                 # and two blocks apart, above the first pair
    got = ks.sample_rows(logits, torch.zeros(2), seeds=torch.arange(2), counters=torch.arange(2)).tolist()
    assert got == [5, 7]


def test_a_row_holding_inf_draws_among_its_inf_tokens_uniformly():
    vocab, draws = 1000, 300
    logits = torch.randn(draws, vocab)
    logits[:, [5, 700]] = float("inf")
    logits[:, 9] = float("nan")
    temps = torch.full((draws,), 0.7)
    seeds = torch.full((draws,), 12345)
    counters = torch.arange(draws)
    got = ks.sample_rows(logits, temps, seeds=seeds, counters=counters)
    assert got.tolist() == sample_rows(logits, temps, seeds=seeds, counters=counters).tolist()
    assert set(got.tolist()) == {5, 700} and 110 < (got == 5).sum() < 190       # 1/2 each, 300 draws: +-4.6 sd
    greedy = ks.sample_rows(logits[:1], torch.zeros(1), seeds=seeds[:1], counters=counters[:1])
    assert greedy.tolist() == [5]                          # greedy: the first +inf


def test_successive_counters_of_one_row_draw_what_the_reference_draws():
    """One row sampled at 300 token indices (its counters): token for token the reference's draws, which
    follow softmax(logits / T) (tests/test_sampler_*.py check that of the reference)."""
    vocab, draws, temp = 256, 300, 0.8
    logits = torch.linspace(-2, 2, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(1))]
    rows = logits.expand(draws, vocab).contiguous()
    args = dict(seeds=torch.full((draws,), 99), counters=torch.arange(draws))
    got = ks.sample_rows(rows, torch.full((draws,), temp), **args)
    assert got.tolist() == sample_rows(rows, torch.full((draws,), temp), **args).tolist()
    assert len(set(got.tolist())) > 50                     # the noise changes with the counter


def test_what_the_kernel_does_not_draw_is_refused_by_name():
    logits = torch.zeros(1, 10)
    with pytest.raises(ValueError, match="top_k / top_p"):
        ks.sample_rows(logits, torch.ones(1), top_k=torch.ones(1, dtype=torch.int64), seeds=torch.zeros(1),
                       counters=torch.zeros(1))
    with pytest.raises(ValueError, match="seeds"):
        ks.sample_rows(logits, torch.ones(1))
