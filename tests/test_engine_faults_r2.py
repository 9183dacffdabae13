"""Issue 12: config and checkpoint faults from public bug reports, each with HF transformers as the oracle
where a model is involved. Every test here failed on the engine before the fix it names."""
import pytest
import torch

from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.layers.sampler import exponential_race


# -- 2. the exponential race's noise has a floor ---------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.01])
def test_zero_noise_never_picks_a_zero_probability_token(temperature):
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
    probs = torch.softmax(logits / temperature, dim=-1)
    if temperature == 1.0:                   # make the zero probability exact, as it is at T=0.01
        probs = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert probs[0, 1] == 0 and probs[1, 0] == 0
    noise = torch.tensor([[1.0, 0.0], [0.0, 1.0]])   # a draw of exactly 0 for the zero-probability token
    assert exponential_race(probs, noise).tolist() == [0, 1]
    # both draws 0: still the token with all the probability
    assert exponential_race(probs, torch.zeros(2, 2)).tolist() == [0, 1]


# -- 7. a prefix-cache hit also checks the block's parent ------------------------------------------------
def weak_hash(token_ids, prefix_hash=-1):
    """A 4-bit hash that ignores the prefix: every block with the same token sum collides."""
    return sum(token_ids) % 16


def _run_prefill(bm, tokens):
    seq = Sequence(tokens, bm.block_size)
    bm.allocate(seq)
    hit = seq.num_cached_tokens
    seq.num_cached_tokens = len(seq)          # as if the step computed the rest
    bm.hash_blocks(seq)
    return seq, hit


def test_prefix_hit_requires_the_cached_blocks_parent():
    bm = BlockManager(16, 4, True, hash_fn=weak_hash)
    x, x2, y = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 34]     # hashes 14, 6, 15
    _run_prefill(bm, x + y + [1])             # caches block y with parent x
    _run_prefill(bm, x2 + [40, 41, 42, 40] + [1])   # caches block x2
    _, hit = _run_prefill(bm, x + y + [1])    # the true prefix hits both blocks
    assert hit == 8
    # x2 hits; y's hash and tokens match, but y's K/V were computed after x, not x2: no hit.
    _, hit = _run_prefill(bm, x2 + y + [1])
    assert hit == 4

