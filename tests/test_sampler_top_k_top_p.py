"""Top-k / top-p (nucleus) in the reference sampler: SamplingParams checks, the filter against HF's logits
warpers (kept sets, ties at the boundary, renormalised probabilities), greedy rows exact in mixed batches,
no host sync inside the sampler, and a chi-squared test of the engine's first-token frequencies."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from nanovllm_ref import SamplingParams
from nanovllm_ref.layers.sampler import SamplingMetadata, sample, top_k_top_p_filter

from engine_helpers import LLM, hf_model, sampling_batch, tiny_dir


# -- SamplingParams -------------------------------------------------------------------------------------------
def test_top_k_top_p_defaults_and_vllm_convention():
    sp = SamplingParams()
    assert (sp.top_k, sp.top_p) == (0, 1.0)
    assert SamplingParams(top_k=-1).top_k == 0                  # vLLM accepts -1 as "off" too
    assert SamplingParams(top_k=50, top_p=0.9).top_k == 50
    import numpy as np
    sp = SamplingParams(top_k=np.int64(3), top_p=np.float32(0.5))
    assert type(sp.top_k) is int and type(sp.top_p) is float and sp.top_p == 0.5
    with pytest.raises(Exception):
        sp.top_k = 5                                             # frozen


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_k=1.5), TypeError, "top_k"),
    (dict(top_k=True), TypeError, "top_k"),
    (dict(top_k="5"), TypeError, "top_k"),
    (dict(top_p=0), ValueError, "top_p"),
    (dict(top_p=-0.1), ValueError, "top_p"),
    (dict(top_p=1.01), ValueError, "top_p"),
    (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(top_p=float("inf")), ValueError, "top_p"),
    (dict(top_p=True), TypeError, "top_p"),
    (dict(top_p="0.9"), TypeError, "top_p"),
])
def test_bad_top_k_top_p_name_themselves(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("flags, message", [(["--top-k", "-3"], "top_k"), (["--top-p", "0"], "top_p"),
                                            (["--top-p", "1.5"], "top_p")])
def test_cli_refuses_bad_top_k_top_p_before_loading_weights(tmp_path, capsys, flags, message):
    import os
    from nanovllm_ref.__main__ import main
    from nanovllm_models.tiny import make_tiny_model
    path = make_tiny_model(str(tmp_path / "m"), "qwen3")
    os.remove(os.path.join(path, "model.safetensors"))
    assert main(["generate", "--model", path, "--device", "cpu", "--prompt", "Hello", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "safetensors" not in err


def test_cli_samples_with_top_k_top_p(capsys):
    from nanovllm_ref.__main__ import main
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--top-k" in capsys.readouterr().out
    assert main(["generate", "--model", tiny_dir("qwen3"), "--prompt", "Hello", "--max-tokens", "3", "--device",
                 "cpu", "--temperature", "1", "--top-k", "5", "--top-p", "0.9"]) == 0
    assert "3 output tokens" in capsys.readouterr().out


def test_bad_top_p_in_generate_changes_nothing():
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([[5, 6, 7]], [SamplingParams(top_p=2.0)], use_tqdm=False)
    assert llm.is_finished()
    llm.exit()


# -- the filter against HF's warpers --------------------------------------------------------------------------
def hf_processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row through HF's warpers in generate()'s order: temperature, top-k, top-p (off ones skipped)."""
    scores = logits.float().unsqueeze(0).clone()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores[0]


def ours(logits, temperatures, top_ks, top_ps):
    t = torch.tensor(temperatures, dtype=torch.float32)
    k = torch.tensor(top_ks, dtype=torch.int64)
    p = torch.tensor(top_ps, dtype=torch.float64)
    return top_k_top_p_filter(logits.float() / t.unsqueeze(-1), k, p)


def assert_same_as_hf(logits, temperatures, top_ks, top_ps):
    """Kept sets equal to HF's, and the renormalised probabilities equal to 1e-6. One freedom: where top-p's
    boundary falls inside a run of EQUAL logits, HF's unstable torch.sort decides which of the tied tokens go
    (implementation-defined order); we sort stably (the lower index goes first). There the kept sets may
    differ only by tokens with that same boundary logit, and the number kept and the sorted kept
    probabilities must still be equal."""
    got = ours(logits, temperatures, top_ks, top_ps)
    for row, (t, k, p) in enumerate(zip(temperatures, top_ks, top_ps)):
        want = hf_processed(logits[row], t, k, p)
        what = f"row {row}: T={t} top_k={k} top_p={p}"
        kept, kept_hf = torch.isfinite(got[row]), torch.isfinite(want)
        assert kept.sum() == kept_hf.sum(), f"number kept differs, {what}"
        differ = kept ^ kept_hf
        if differ.any():
            boundary = want[kept_hf].min()
            assert (want.where(kept_hf, got[row])[differ] == boundary).all(), f"kept sets differ, {what}"
        probs, probs_hf = got[row].softmax(-1), want.softmax(-1)
        torch.testing.assert_close(probs.sort().values, probs_hf.sort().values, rtol=0, atol=1e-6, msg=what)
        torch.testing.assert_close(probs[~differ], probs_hf[~differ], rtol=0, atol=1e-6, msg=what)


@pytest.mark.parametrize("vocab", [1, 2, 7, 512, 1000])
def test_filter_matches_hf_warpers_on_random_rows(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g).mul(6)
    temperatures = [float(x) for x in torch.rand(rows, generator=g) * 2 + 0.05]
    choices_k = [0, 1, 2, 3, 5, 17, vocab, vocab + 3]
    top_ks = [choices_k[i % len(choices_k)] for i in range(rows)]
    top_ps = [1.0 if i % 3 == 0 else float(torch.rand((), generator=g)) * 0.99 + 0.01 for i in range(rows)]
    assert_same_as_hf(logits, temperatures, top_ks, top_ps)


def test_filter_matches_hf_in_bf16_logits():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(16, 300, generator=g) * 3).bfloat16()          # bf16 logits: many exact ties
    assert_same_as_hf(logits, [1.0] * 16, [0, 5, 40, 7] * 4, [0.9, 1.0, 0.5, 0.3] * 4)


def test_ties_at_the_top_k_boundary_are_kept_as_hf_does():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    got = ours(logits, [1.0], [2], [1.0])
    assert torch.isfinite(got[0]).tolist() == [True, True, True, True, False, False]   # k=2 keeps 4 tokens
    assert_same_as_hf(logits, [1.0], [2], [1.0])


def test_top_p_boundary_and_ties_as_hf_defines_them():
    # probabilities 1/4, 1/2, 1/4 exactly: top_p = 0.75 drops ONE of the 0.25 tokens (ascending running sums
    # 0.25, 0.5, 1.0; only 0.25 <= 1 - 0.75), the lower index as a stable sort puts it first; top_p = 0.5
    # keeps only the 0.5 token (0.5 <= 0.5 drops the second 0.25 too).
    logits = torch.log(torch.tensor([[0.25, 0.5, 0.25]]))
    for p, kept in [(0.75, [False, True, True]), (0.5, [False, True, False]), (0.76, [True, True, True]),
                    (1e-9, [False, True, False])]:
        assert torch.isfinite(ours(logits, [1.0], [0], [p])[0]).tolist() == kept, p
        assert_same_as_hf(logits, [1.0], [0], [p])
    # ties among the most likely tokens: at least one survives even for a tiny top_p
    flat = torch.zeros(1, 8)
    assert torch.isfinite(ours(flat, [1.0], [0], [1e-6])[0]).sum() == 1
    assert_same_as_hf(flat, [1.0], [0], [1e-6])
    assert_same_as_hf(flat, [1.0], [3], [0.5])


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # p = [0.4, 0.3, 0.2, 0.1]; top_k=2 renormalises to [4/7, 3/7]; top_p=0.5 then keeps only the first.
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.isfinite(ours(logits, [1.0], [2], [0.5])[0]).tolist() == [True, False, False, False]
    assert_same_as_hf(logits, [1.0], [2], [0.5])


def test_filter_leaves_its_input_alone_and_off_rows_unchanged():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    before = logits.clone()
    got = top_k_top_p_filter(logits, torch.tensor([0, 3, 0, 0]), torch.tensor([1.0, 1.0, 0.5, 1.0], dtype=torch.float64))
    assert torch.equal(logits, before)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[3], logits[3])
    assert top_k_top_p_filter(logits, None, None) is logits


# -- the sampler ----------------------------------------------------------------------------------------------
def meta(temperatures, top_ks=None, top_ps=None):
    t = torch.tensor(temperatures, dtype=torch.float32)
    k = None if top_ks is None else torch.tensor(top_ks, dtype=torch.int64)
    p = None if top_ps is None else torch.tensor(top_ps, dtype=torch.float64)
    return SamplingMetadata(t, all_greedy=all(x == 0 for x in temperatures), top_k=k, top_p=p)


def test_greedy_rows_stay_exact_in_a_batch_with_top_k_top_p():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 97, generator=g).bfloat16()
    m = meta([0, 1.0, 0, 0.7, 0, 2.0], [1, 5, 0, 0, 3, 2], [0.1, 1.0, 0.3, 0.9, 1.0, 0.5])
    for _ in range(20):
        ids = sample(logits, m)
        assert ids.dtype == torch.int64 and ids.shape == (6,)
        assert ids[[0, 2, 4]].tolist() == logits.float().argmax(-1)[[0, 2, 4]].tolist()


def test_top_k_1_is_argmax_and_sampled_ids_stay_in_the_kept_set():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 200, generator=g)
    m = meta([1.5, 1.0, 1.0], [1, 4, 0], [1.0, 1.0, 0.2])
    kept = torch.isfinite(ours(logits, [1.5, 1.0, 1.0], [1, 4, 0], [1.0, 1.0, 0.2]))
    for _ in range(50):
        ids = sample(logits, m)
        assert ids[0] == logits[0].argmax()
        assert kept[torch.arange(3), ids].all()


class HostSyncSpy(TorchDispatchMode):
    """Records aten ops that copy a device value to the host or have data-dependent output shapes."""
    SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten.item")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if any(name.startswith(s) for s in self.SYNCS):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_sampler_has_no_host_sync_and_the_spy_sees_one():
    logits = torch.randn(5, 64)
    m = meta([0, 1.0, 0.5, 2.0, 1.0], [0, 3, 0, 10, 1], [1.0, 0.8, 0.3, 1.0, 0.5])
    with HostSyncSpy() as spy:
        sample(logits, m)
        sample(logits, meta([1.0] * 5))
        sample(logits, meta([0.0] * 5))
    assert spy.seen == []
    with HostSyncSpy() as spy:                    # the spy itself works
        m.temperatures[1].item()
        (logits > 0).nonzero()
    assert spy.seen == ["aten._local_scalar_dense", "aten.nonzero"]


def test_sampling_metadata_leaves_top_k_top_p_out_unless_a_sampled_row_uses_them():
    from nanovllm_ref.engine.sampling_inputs import sampling_metadata
    from nanovllm_ref.engine.sequence import Sequence
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)

    def prep(seqs):
        return sampling_metadata(sampling_batch(llm, seqs).sampling, llm.model_runner.device)
    seq = lambda **kw: Sequence([1, 2], 4, SamplingParams(**kw))
    m = prep([seq(temperature=1.0), seq(temperature=0, top_k=5, top_p=0.5)])
    assert m.top_k is None and m.top_p is None and not m.all_greedy
    m = prep([seq(temperature=1.0, top_k=5), seq(temperature=0.5, top_p=0.25)])
    assert m.top_k.tolist() == [5, 0] and m.top_p.tolist() == [1.0, 0.25] and m.top_p.dtype == torch.float64
    llm.exit()


# -- chi-squared: the sampler (40k draws) and the engine end to end ----------------------------------------------
def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """P-value of Pearson's chi-squared test of `counts` against `probs` (bins with a small expected count
    are pooled into one). Fails outright if a zero-probability token was drawn."""
    counts, probs = counts.double(), probs.double()
    assert counts[probs == 0].sum() == 0, "drew a token the filter removed"
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    df = obs.numel() - 1
    if df < 1:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("t, k, p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 10, 1.0), (1.0, 0, 0.7),
                                     (0.8, 20, 0.9)])
def test_sampler_chi_square_40k_draws(t, k, p):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(6)
    row = torch.randn(64, generator=g) * 2
    n = 40_000
    m = meta([t] * n, [k] * n if k else None, [p] * n if p < 1 else None)
    ids = sample(row.expand(n, -1), m)
    want = hf_processed(row, t, k, p).softmax(-1)
    assert chi_square_p(torch.bincount(ids, minlength=64), want) > 1e-6


def test_engine_first_token_frequencies_match_hf_with_mixed_top_k_top_p():
    """Requests with top_k, with top_p and with both in ONE batch, plus greedy rows: each group's first tokens
    follow HF's processed distribution (chi-squared, p > 1e-6), greedy rows give HF's argmax."""
    path = tiny_dir("qwen3")
    prompt = [5, 9, 11, 3, 7, 2, 8]
    n = 500
    groups = {"top_k": SamplingParams(temperature=1.0, top_k=6, max_tokens=1, ignore_eos=True),
              "top_p": SamplingParams(temperature=1.0, top_p=0.3, max_tokens=1, ignore_eos=True),
              "both": SamplingParams(temperature=1.3, top_k=10, top_p=0.6, max_tokens=1, ignore_eos=True)}
    greedy = SamplingParams(temperature=0, top_k=3, top_p=0.2, max_tokens=1, ignore_eos=True)
    sps = [sp for sp in groups.values() for _ in range(n)] + [greedy] * 5
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, max_num_seqs=4096, seed=1)
    out = llm.generate([prompt] * len(sps), sps, use_tqdm=False)
    llm.exit()
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1].float()
    firsts = [o["token_ids"][0] for o in out]
    assert firsts[-5:] == [int(logits.argmax())] * 5
    for i, (name, sp) in enumerate(groups.items()):
        want = hf_processed(logits, sp.temperature, sp.top_k, sp.top_p).softmax(-1)
        counts = torch.bincount(torch.tensor(firsts[i * n:(i + 1) * n]), minlength=logits.numel())
        assert int((want > 0).sum()) > 2, name                       # a real choice, not a near-greedy one
        assert chi_square_p(counts, want) > 1e-6, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_sampler_on_cuda_filters_like_hf_and_keeps_greedy_rows():
    """What a GPU engine runs: the torch.compile'd sampler (fullgraph: no graph break, so no host sync)."""
    from nanovllm_ref.layers.sampler import sample_rows, sampler_with
    sample_compiled = sampler_with(sample_rows.compiled())
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    row = torch.randn(64, generator=g) * 2
    n = 40_000
    for t, k, p in [(1.0, 10, 1.0), (0.8, 20, 0.9), (1.5, 0, 0.6)]:
        temps = [t] * n
        temps[::1000] = [0.0] * len(temps[::1000])
        m = meta(temps, [k] * n, [p] * n)
        m = SamplingMetadata(m.temperatures.cuda(), False, m.top_k.cuda(), m.top_p.cuda())
        ids = sample_compiled(row.expand(n, -1).cuda().bfloat16(), m).cpu()
        greedy = torch.zeros(n, dtype=torch.bool)
        greedy[::1000] = True
        assert (ids[greedy] == row.bfloat16().float().argmax()).all()
        want = hf_processed(row.bfloat16(), t, k, p).softmax(-1)
        assert chi_square_p(torch.bincount(ids[~greedy], minlength=64), want) > 1e-6, (t, k, p)
