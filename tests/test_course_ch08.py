"""Mutation tests of the chapter 08 check helpers (nanovllm_course/ch08.py): each check passes on the
reference (printing exactly its `E8.n ok` line), fails on a stub with 'not implemented yet', and fails on
the plausible mistakes the chapter names with a message chosen from what differs. Also: the host-sync spy
sees `.item()` / `nonzero`, and the engine's own sampler passes the chapter's checks."""
import re

import pytest
import torch

from course_checks import fails, passes, stub
from nanovllm_course import ch08
from nanovllm_ref.layers.sampler import sample as engine_sample

TINY = torch.finfo(torch.float32).tiny



# -- E8.1 -----------------------------------------------------------------------------------------------------
def _greedy_fix(logits, temperatures, probs):
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.float().argmax(-1, keepdim=True), 1.0)
    return torch.where((temperatures == 0).unsqueeze(-1), one_hot, probs)


def _t(temperatures):
    return torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures)).unsqueeze(-1)


def temperature_ignored(logits, temperatures):
    return _greedy_fix(logits, temperatures, torch.softmax(logits.float(), -1))


def probs_divided_by_t(logits, temperatures):
    return _greedy_fix(logits, temperatures, torch.softmax(logits.float(), -1) / _t(temperatures))


def bf16_softmax(logits, temperatures):
    probs = torch.softmax((logits / _t(temperatures).to(logits.dtype)).bfloat16(), -1).float()
    return _greedy_fix(logits, temperatures, probs)


def greedy_by_division(logits, temperatures):
    return torch.softmax(logits.float() / temperatures.unsqueeze(-1), -1)


def returns_logits_dtype(logits, temperatures):
    return ch08.reference_temperature_probs(logits, temperatures).to(logits.dtype)


def test_e8_1(capsys):
    passes(ch08.check_temperature_probs, ch08.reference_temperature_probs, tag="E8.1", capsys=capsys)
    fails(ch08.check_temperature_probs, stub, match="E8.1: not implemented yet")
    fails(ch08.check_temperature_probs, temperature_ignored, match="temperature is ignored")
    fails(ch08.check_temperature_probs, probs_divided_by_t, match="divided the probabilities by T")
    fails(ch08.check_temperature_probs, bf16_softmax, match="softmax computed in bf16")
    fails(ch08.check_temperature_probs, greedy_by_division, match="temperature 0 contain NaN")
    fails(ch08.check_temperature_probs, returns_logits_dtype, match="expected torch.float32")


# -- E8.2 -----------------------------------------------------------------------------------------------------
def noise_times(probs, noise):
    return (probs * noise).argmax(-1)


def noise_negated(probs, noise):
    return (probs / -noise.clamp_min(TINY)).argmax(-1)


def no_floor(probs, noise):
    return (probs / noise).argmax(-1)


def race_with_item(probs, noise):
    return torch.tensor([int((probs[b] / noise[b].clamp_min(TINY)).argmax().item()) for b in range(probs.shape[0])])


def test_e8_2(capsys):
    passes(ch08.check_exponential_race, ch08.reference_exponential_race, tag="E8.2", capsys=capsys)
    fails(ch08.check_exponential_race, stub, match="E8.2: not implemented yet")
    fails(ch08.check_exponential_race, noise_times, match="multiplied by the noise")
    fails(ch08.check_exponential_race, noise_negated, match="wrong sign")
    fails(ch08.check_exponential_race, no_floor, match="noise draw exactly 0")
    fails(ch08.check_exponential_race, race_with_item, match="host sync")


# -- E8.3 -----------------------------------------------------------------------------------------------------
def top_p_one_too_few(probs, top_k, top_p):
    """Keeps the most likely tokens while their running sum stays <= top_p: drops the token that reaches it."""
    probs = ch08.reference_top_k_top_p(probs, top_k, None) if top_k is not None else probs
    if top_p is None:
        return probs
    desc, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = desc.cumsum(-1) <= top_p.float().unsqueeze(-1)
    keep[:, 0] = True
    keep |= (top_p >= 1).unsqueeze(-1)
    kept = torch.zeros_like(probs).scatter(-1, order, desc * keep)
    return kept / kept.sum(-1, keepdim=True)


def top_k_drops_ties(probs, top_k, top_p):
    if top_k is not None:
        vocab = probs.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        rank = probs.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        probs = torch.where(rank < k.unsqueeze(-1), probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return ch08.reference_top_k_top_p(probs, None, top_p)


def not_renormalised(probs, top_k, top_p):
    out = ch08.reference_top_k_top_p(probs, top_k, top_p)
    return torch.where(out > 0, probs, 0.0)


def top_k_with_item(probs, top_k, top_p):
    if top_k is not None:
        rows = []
        for b in range(probs.shape[0]):
            k = int(top_k[b].item())
            rows.append(ch08.reference_top_k_top_p(probs[b:b + 1], torch.tensor([k]), None)[0])
        probs = torch.stack(rows)
    return ch08.reference_top_k_top_p(probs, None, top_p)


def test_e8_3(capsys):
    passes(ch08.check_top_k_top_p, ch08.reference_top_k_top_p, tag="E8.3", capsys=capsys)
    fails(ch08.check_top_k_top_p, stub, match="E8.3: not implemented yet")
    fails(ch08.check_top_k_top_p, top_p_one_too_few, match="top-p kept one token too few")
    fails(ch08.check_top_k_top_p, top_k_drops_ties, match="top-k kept exactly k tokens where several tie")
    fails(ch08.check_top_k_top_p, not_renormalised, match="not renormalised")
    fails(ch08.check_top_k_top_p, top_k_with_item, match="host sync")


def filter_written(**mistake):
    """E8.3 as a student writes it (the course's variant function), with one mistake."""
    return lambda probs, top_k, top_p: ch08.top_k_top_p_variant(probs, top_k, top_p, **mistake)


def top_p_descending_p1_filters(probs, top_k, top_p):
    """The descending formulation (keep while the mass before a token is < top_p), without top_p = 1 as off."""
    probs = ch08.reference_top_k_top_p(probs, top_k, None) if top_k is not None else probs
    if top_p is None:
        return probs
    desc, order = probs.sort(dim=-1, descending=True, stable=True)
    before = desc.cumsum(-1) - desc
    drop = before >= top_p.float().unsqueeze(-1)
    drop[:, 0] = False
    kept = torch.zeros_like(probs).scatter(-1, order, desc.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def top_k_by_torch_topk(probs, top_k, top_p):
    """torch.topk per row: exactly k tokens, a tie at the k-th value cut at random."""
    if top_k is not None:
        vocab = probs.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        _, idx = probs.topk(vocab, dim=-1)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, idx, torch.arange(vocab) < k.unsqueeze(-1))
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return ch08.reference_top_k_top_p(probs, None, top_p)


# (wrong E8.3, what its message must say): each mistake gets its own hint, in every run
FILTER_MUTANTS = [
    (filter_written(ties=False), "top-k kept exactly k tokens where several tie"),
    (top_k_by_torch_topk, "top-k kept exactly k tokens where several tie"),
    (filter_written(kth_offset=1), "top-k kept k + 1 tokens"),
    (filter_written(k0_off=False), "top_k = 0 means off"),
    (filter_written(threshold="p"), "compared the running sum with top_p"),
    (filter_written(p_rule="<"), "(<=, not <)"),
    (filter_written(renormalise_before_p=False), "top-p ran on what top-k left without renormalising it"),
    (filter_written(order="p then k"), "top-k first, then top-p"),
    (filter_written(keep_top=False), "always keep the most likely token"),
    (filter_written(fill=1e-10), "set dropped tokens to exactly 0"),
    (filter_written(renormalise=False), "not renormalised"),
    (top_p_descending_p1_filters, "top_p = 1 means off"),
    (top_p_one_too_few, "top-p kept one token too few"),
]


def test_e8_3_the_written_form_passes(capsys):
    passes(ch08.check_top_k_top_p, filter_written(), tag="E8.3", capsys=capsys)


@pytest.mark.parametrize("fn,says", FILTER_MUTANTS, ids=[
    "ties_dropped", "torch_topk", "k_plus_one", "k0_filters", "threshold_p", "strict_lt", "top_p_unrenormalised",
    "p_then_k", "top_dropped", "fill_tiny", "not_renormalised", "descending_p1_not_off", "one_too_few"])
def test_e8_3_each_mistake_gets_its_own_hint_in_every_run(fn, says):
    for _ in range(3):
        fails(ch08.check_top_k_top_p, fn, match=re.escape(says))


# -- E8.2: precision and floor on full-vocabulary rows ------------------------------------------------------------
RACE_MUTANTS = [   # (wrong race, what its message must say)
    (lambda p, e: (p.bfloat16() / e.clamp_min(TINY).bfloat16()).argmax(-1), "compute probs / noise in fp32"),
    (lambda p, e: (p / e.clamp_min(TINY)).bfloat16().argmax(-1), "compute probs / noise in fp32"),
    (lambda p, e: (p.half() / e.clamp_min(TINY).half()).argmax(-1), "compute probs / noise in fp32"),
    (lambda p, e: (p / e.clamp_min(1e-10)).argmax(-1), "not at 1e-10"),
    (lambda p, e: (p / e.clamp_min(1e-20)).argmax(-1), "not at 1e-10"),
    (lambda p, e: (p / e.clamp_min(torch.finfo(torch.float32).eps)).argmax(-1), "not at 1e-10"),
    (lambda p, e: (p / (e + 1e-10)).argmax(-1), "add nothing to it"),
]


def test_e8_2_right_races_in_other_forms_pass(capsys):
    passes(ch08.check_exponential_race, lambda p, e: (p.double() / e.double().clamp_min(TINY)).argmax(-1), tag="E8.2", capsys=capsys)
    passes(ch08.check_exponential_race, lambda p, e: (p.log() - e.clamp_min(TINY).log()).argmax(-1), tag="E8.2", capsys=capsys)


@pytest.mark.parametrize("fn,says", RACE_MUTANTS, ids=["bf16_inputs", "bf16_quotient", "fp16", "floor_1e-10",
                                                       "floor_1e-20", "floor_eps", "plus_1e-10"])
def test_e8_2_reduced_precision_and_a_high_floor_are_rejected_every_time(fn, says):
    for _ in range(3):
        fails(ch08.check_exponential_race, fn, match=re.escape(says))


def test_e8_2_planted_rows_tell_fp32_from_bf16():
    """The planted near ties: the fp32 race picks the later token, a bf16 one (a tie: argmax takes the first)
    the earlier; the ladder: a floor of 1e-10 moves the winner."""
    g = torch.Generator().manual_seed(3)
    probs, noise, planted = ch08._vocab_case(g)
    fp32 = ch08.reference_exponential_race(probs, noise)
    bf16 = (probs.bfloat16() / noise.bfloat16()).argmax(-1)
    quotient = (probs / noise.clamp_min(TINY)).bfloat16().argmax(-1)
    floored = (probs / noise.clamp_min(1e-10)).argmax(-1)
    for row, (what, want) in planted.items():
        assert int(fp32[row]) == want
        if what == "near":
            assert int(bf16[row]) < want and int(quotient[row]) < want
        else:
            assert int(floored[row]) != want


# -- E8.4 -----------------------------------------------------------------------------------------------------
def sample_with_row_item(logits, metadata):
    """Correct draws, but one `.item()` per row to decide greedy or not."""
    out = []
    for b in range(logits.shape[0]):
        if metadata.temperatures[b].item() == 0:
            out.append(logits[b].float().argmax())
        else:
            sub = type(metadata)(metadata.temperatures[b:b + 1], False,
                                 None if metadata.top_k is None else metadata.top_k[b:b + 1],
                                 None if metadata.top_p is None else metadata.top_p[b:b + 1])
            out.append(ch08.reference_sample(logits[b:b + 1], sub)[0])
    return torch.stack(out)


def sample_ignoring_temperature(logits, metadata):
    m = type(metadata)(torch.where(metadata.temperatures > 0, 1.0, 0.0), metadata.all_greedy, metadata.top_k,
                       metadata.top_p)
    return ch08.reference_sample(logits, m)


def sample_ignoring_filters(logits, metadata):
    return ch08.reference_sample(logits, type(metadata)(metadata.temperatures, metadata.all_greedy))


def sample_greedy_as_t1(logits, metadata):
    m = type(metadata)(torch.where(metadata.temperatures > 0, metadata.temperatures, 1.0), False,
                       metadata.top_k, metadata.top_p)
    return ch08.reference_sample(logits, m)


def test_e8_4(capsys):
    passes(ch08.check_sample, ch08.reference_sample, tag="E8.4", capsys=capsys)
    passes(ch08.check_sample, engine_sample, tag="E8.4", capsys=capsys)            # the engine's sampler passes too
    fails(ch08.check_sample, stub, match="E8.4: not implemented yet")
    fails(ch08.check_sample, sample_with_row_item, match=r"host sync.*aten._local_scalar_dense")
    fails(ch08.check_sample, sample_ignoring_temperature, match="temperature is not applied")
    fails(ch08.check_sample, sample_ignoring_filters, match="the frequencies ignore top-k / top-p")
    # Fresh random logits each run: in the mixed batch the T=1 draws of the greedy rows may all land on the
    # argmax by chance (peaked rows); then the all-greedy batch catches it. Either message names T=0.
    fails(ch08.check_sample, sample_greedy_as_t1, match="temperature 0 did not get argmax|an all-greedy batch did not give argmax")


# -- the machinery ----------------------------------------------------------------------------------------------
def test_host_sync_spy_sees_item_and_nonzero_and_not_the_reference():
    x = torch.randn(3, 5)
    with ch08.HostSyncSpy() as spy:
        ch08.reference_sample(x, ch08.metadata([1.0, 0.0, 0.5], [2, 0, 0], [1.0, 1.0, 0.5]))
        engine_sample(x, ch08.metadata([1.0, 0.0, 0.5], [2, 0, 0], [1.0, 1.0, 0.5]))
    assert spy.seen == []
    with ch08.HostSyncSpy() as spy:
        x[0, 0].item()
        bool(x[0, 0] > 0)
        (x > 0).nonzero()
        x[x > 0]
        x[x > 0] = 0.0
    assert spy.seen == ["aten._local_scalar_dense"] * 2 + ["aten.nonzero", "aten.index (boolean mask)",
                                                           "aten.index_put_ (boolean mask)"]


def test_chi_square_p_is_calibrated_enough():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(30), -1)
    ps = [ch08.chi_square_p(torch.bincount(torch.multinomial(probs, 40_000, replacement=True), minlength=30), probs)
          for _ in range(200)]
    assert sum(p < 0.05 for p in ps) < 25                      # about 10 expected under the null
    assert ch08.chi_square_p(torch.full((30,), 1000.0), probs) < 1e-6


# -- the kinds of issue 22: ties, inputs changed in place, state across calls -----------------------------------
def greedy_all_ties(logits, temperatures):
    """Greedy rows as `logits == max`: every tied maximum gets 1."""
    lf = logits.float()
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures)).unsqueeze(-1)
    hot = (lf == lf.max(-1, keepdim=True).values).float()
    return torch.where((temperatures == 0).unsqueeze(-1), hot, torch.softmax(lf / t, -1))


def greedy_as_tiny_temperature(logits, temperatures):
    """T = 0 replaced by T = 1e-5: one-hot unless the maximum is tied."""
    return torch.softmax(logits.float() / temperatures.clamp_min(1e-5).unsqueeze(-1), -1)


def greedy_last_of_ties(logits, temperatures):
    """One-hot at the LAST tied maximum (argmax of the flipped row)."""
    lf = logits.float()
    last = lf.shape[-1] - 1 - lf.flip(-1).argmax(-1, keepdim=True)
    probs = ch08.reference_temperature_probs(logits, temperatures)
    hot = torch.zeros_like(probs).scatter_(-1, last, 1.0)
    return torch.where((temperatures == 0).unsqueeze(-1), hot, probs)


def temperatures_fixed_in_place(logits, temperatures):
    """Right probabilities, but greedy temperatures overwritten with 1 in the caller's tensor."""
    greedy = temperatures == 0
    temperatures[greedy] = 1.0
    probs = torch.softmax(logits.float() / temperatures.unsqueeze(-1), -1)
    return _greedy_fix(logits, torch.where(greedy, 0.0, temperatures), probs)


def noise_floored_in_place(probs, noise):
    return (probs / noise.clamp_min_(TINY)).argmax(-1)


def top_k_off_rewritten_in_place(probs, top_k, top_p):
    if top_k is not None:
        top_k[top_k == 0] = probs.shape[-1]                  # "0 = off" turned into "keep all" in the caller's k
    return ch08.reference_top_k_top_p(probs, top_k, top_p)


def top_p_before_top_k(probs, top_k, top_p):
    return ch08.reference_top_p_then_k(probs, top_k, top_p)


def sample_reseeded(logits, metadata):
    """A fixed seed on every call: every step draws the same noise."""
    torch.manual_seed(1234)
    return ch08.reference_sample(logits, metadata)


def sample_own_generator(logits, metadata):
    """A new generator with a fixed seed per call (the same mistake without touching the global RNG)."""
    gen = torch.Generator(device=logits.device).manual_seed(7)
    probs = ch08.reference_temperature_probs(logits, metadata.temperatures)
    if metadata.top_k is not None or metadata.top_p is not None:
        probs = ch08.reference_top_k_top_p(probs, metadata.top_k, metadata.top_p)
    return ch08.reference_exponential_race(probs, torch.empty_like(probs).exponential_(1.0, generator=gen))


def sample_tiny_temperature(logits, metadata):
    """Greedy rows sampled at T = 1e-5: right unless the maximum is tied."""
    m = type(metadata)(metadata.temperatures.clamp_min(1e-5), False, metadata.top_k, metadata.top_p)
    return ch08.reference_sample(logits, m)


def sample_scales_logits_in_place(logits, metadata):
    """Divides the caller's logits by the temperature in place."""
    t = torch.where(metadata.temperatures > 0, metadata.temperatures, 1.0).unsqueeze(-1)
    out = ch08.reference_sample(logits, metadata)
    logits.div_(t.to(logits.dtype))
    return out


MUTANTS = [   # (check, wrong answer, what its message must say)
    (ch08.check_temperature_probs, greedy_all_ties, "every tied token got 1.0"),
    (ch08.check_temperature_probs, greedy_as_tiny_temperature, "temperature 0 is not a small temperature"),
    (ch08.check_temperature_probs, greedy_last_of_ties, "the 1.0 goes to the FIRST of them"),
    (ch08.check_temperature_probs, temperatures_fixed_in_place, "changed its input `temperatures`"),
    (ch08.check_exponential_race, noise_floored_in_place, "changed its input `noise`"),
    (ch08.check_top_k_top_p, top_k_off_rewritten_in_place, "changed its input `top_k`"),
    (ch08.check_top_k_top_p, top_p_before_top_k, "top-k first, then top-p"),
    (ch08.check_sample, sample_reseeded, "does not change from call to call"),
    (ch08.check_sample, sample_own_generator, "does not change from call to call"),
    (ch08.check_sample, sample_tiny_temperature, "whose maximum is tied"),
    (ch08.check_sample, sample_scales_logits_in_place, "changed its input `logits`"),
]


@pytest.mark.parametrize("check,fn,says", MUTANTS, ids=[m[1].__name__ for m in MUTANTS])
def test_mutants_of_issue_22_are_rejected_every_time_with_their_hint(check, fn, says):
    for _ in range(3):
        fails(check, fn, match=says)


# -- every hint of the chapter's checks has a mutant that reaches it --------------------------------------------
def probs_transposed(logits, temperatures):
    return ch08.reference_temperature_probs(logits, temperatures).T


def temperature_plus_eps(logits, temperatures):
    """'Avoid dividing by zero' with T + 1e-3: close, but not softmax(logits / T)."""
    probs = torch.softmax(logits.float() / (temperatures + 1e-3).unsqueeze(-1), -1)
    return _greedy_fix(logits, temperatures, probs)


def race_plus_one(probs, noise):
    """'Avoid dividing by zero' with E + 1: no longer a sample from p."""
    return (probs / (noise + 1)).argmax(-1)


def race_as_list(probs, noise):
    return ch08.reference_exponential_race(probs, noise).tolist()


def race_keepdim(probs, noise):
    return (probs / noise.clamp_min(TINY)).argmax(-1, keepdim=True)


def race_int32(probs, noise):
    return ch08.reference_exponential_race(probs, noise).to(torch.int32)


def _top_p_rule(probs, top_p, *, strict=False, keep_top=True):
    """HF's top-p on probabilities, with two planted mistakes: `strict` drops running sums < 1 - p (not <=),
    `keep_top=False` forgets to keep the most likely token."""
    asc, order = probs.sort(dim=-1, stable=True)
    running = asc.cumsum(-1)
    threshold = torch.where(top_p < 1, 1 - top_p.double(), -1.0).to(torch.float32).unsqueeze(-1)
    drop = running < threshold if strict else running <= threshold
    if keep_top:
        drop[:, -1] = False
    kept = torch.zeros_like(probs).scatter(-1, order, asc.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def top_p_strict(probs, top_k, top_p):
    probs = ch08.reference_top_k_top_p(probs, top_k, None) if top_k is not None else probs
    return probs if top_p is None else _top_p_rule(probs, top_p, strict=True)


def top_p_drops_everything(probs, top_k, top_p):
    probs = ch08.reference_top_k_top_p(probs, top_k, None) if top_k is not None else probs
    return probs if top_p is None else _top_p_rule(probs, top_p, keep_top=False)


def top_p_mask_not_scattered(probs, top_k, top_p):
    """Builds top-p's keep mask on the sorted row, then applies it to the unsorted row (no scatter back)."""
    probs = ch08.reference_top_k_top_p(probs, top_k, None) if top_k is not None else probs
    if top_p is None:
        return probs
    desc = probs.sort(dim=-1, descending=True, stable=True).values
    keep = (desc.cumsum(-1) - desc) < top_p.float().unsqueeze(-1)
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def sample_greedy_shortcut_by_sort(logits, metadata):
    """The all-greedy shortcut takes the first index of a descending sort: on ties, not argmax's."""
    if metadata.all_greedy:
        return logits.float().sort(dim=-1, descending=True).indices[:, 0]
    return ch08.reference_sample(logits, metadata)


def sampler_written(race=None, noise="exponential", filters="or", softmax="fp32", order="temperature first"):
    """E8.4 as a student writes it from the course's E8.1-E8.3, with one mistake at a time."""
    def sample(logits, meta):
        filtered = (meta.top_k is not None or meta.top_p is not None) if filters == "or" else \
            (meta.top_k is not None and meta.top_p is not None)
        if order == "filters first":
            probs = torch.softmax(logits.float(), -1)
            if filtered:
                probs = ch08.reference_top_k_top_p(probs, meta.top_k, meta.top_p)
            t = torch.where(meta.temperatures > 0, meta.temperatures, 1.0).unsqueeze(-1)
            sharp = probs.pow(1 / t)
            one_hot = torch.zeros_like(probs).scatter_(-1, logits.float().argmax(-1, keepdim=True), 1.0)
            probs = torch.where((meta.temperatures == 0).unsqueeze(-1), one_hot, sharp / sharp.sum(-1, keepdim=True))
        else:
            if softmax == "logits dtype":
                t = torch.where(meta.temperatures > 0, meta.temperatures, 1.0).unsqueeze(-1)
                probs = torch.softmax(logits / t.to(logits.dtype), -1).float()
                one_hot = torch.zeros_like(probs).scatter_(-1, logits.float().argmax(-1, keepdim=True), 1.0)
                probs = torch.where((meta.temperatures == 0).unsqueeze(-1), one_hot, probs)
            else:
                probs = ch08.reference_temperature_probs(logits, meta.temperatures)
            if filtered:
                probs = ch08.reference_top_k_top_p(probs, meta.top_k, meta.top_p)
        e = {"exponential": lambda: torch.empty_like(probs).exponential_(1.0),
             "uniform": lambda: torch.rand_like(probs),
             "shared": lambda: torch.empty_like(probs[:1]).exponential_(1.0).expand_as(probs)}[noise]()
        return (race or ch08.reference_exponential_race)(probs, e)
    return sample


SAMPLER_MUTANTS = [   # (wrong E8.4, what its message must say): each its own hint, in every run
    (sampler_written(race=lambda p, e: (p.bfloat16() / e.clamp_min(TINY).bfloat16()).argmax(-1)),
     "the race must run in fp32"),
    (sampler_written(race=lambda p, e: (p / e.clamp_min(TINY)).bfloat16().argmax(-1)), "the race must run in fp32"),
    (sampler_written(race=lambda p, e: (p / e.clamp_min(1e-10)).argmax(-1)), "not at 1e-10"),
    (sampler_written(race=lambda p, e: (p * e).argmax(-1)), "you multiplied by the noise"),
    (sampler_written(softmax="logits dtype"), "compute the softmax in fp32"),
    (sampler_written(noise="uniform"), "the race needs Exp(1) noise"),
    (sampler_written(noise="shared"), "the rows share one noise draw"),
    (sampler_written(filters="and"), "apply top_k_top_p when metadata.top_k or top_p is set"),
    (sampler_written(order="filters first"), "the temperature first, then top-k / top-p"),
]


def test_e8_4_the_written_form_passes(capsys):
    passes(ch08.check_sample, sampler_written(), tag="E8.4", capsys=capsys)


@pytest.mark.parametrize("fn,says", SAMPLER_MUTANTS, ids=["bf16_race", "bf16_quotient", "floor_1e-10",
                                                          "noise_multiplied", "bf16_softmax", "uniform_noise",
                                                          "shared_noise", "filters_only_with_both", "filters_first"])
def test_e8_4_each_mistake_gets_its_own_hint_in_every_run(fn, says):
    for _ in range(3):
        fails(ch08.check_sample, fn, match=re.escape(says))


def test_e8_4_planted_noise_reaches_a_sampler_that_draws_with_exponential_():
    logits, noise, planted = ch08._planted_sampler_case(torch.Generator().manual_seed(5))
    with ch08.PlantedNoise(noise) as spy:
        ids = ch08.reference_sample(logits, ch08.metadata([1.0] * logits.shape[0]))
    assert spy.used == 1
    assert all(int(ids[r]) == want for r, (_, want, _) in planted.items())


_CALLS = [0]


def sample_two_seeds(logits, metadata):
    """Alternates between two fixed seeds: consecutive calls differ, but the draws repeat every other call."""
    _CALLS[0] += 1
    torch.manual_seed(_CALLS[0] % 2)
    return ch08.reference_sample(logits, metadata)


def sample_temperature_squared(logits, metadata):
    t = metadata.temperatures
    m = type(metadata)(torch.where(t > 0, t * t, 0.0), metadata.all_greedy, metadata.top_k, metadata.top_p)
    return ch08.reference_sample(logits, m)


COVERAGE = [   # (check, wrong answer, what its message must say)
    (ch08.check_temperature_probs, probs_transposed, "has shape"),
    (ch08.check_temperature_probs, temperature_plus_eps, "differs from the reference"),
    (ch08.check_exponential_race, race_plus_one, "you added 1 to the noise"),
    (ch08.check_exponential_race, race_as_list, "should return a torch.Tensor of token ids"),
    (ch08.check_exponential_race, race_keepdim, "one token id per row"),
    (ch08.check_exponential_race, race_int32, "expected torch.int64"),
    (ch08.check_top_k_top_p, top_p_strict, "(<=, not <)"),
    (ch08.check_top_k_top_p, top_p_drops_everything, "always keep the most likely token"),
    (ch08.check_top_k_top_p, top_p_mask_not_scattered, "keeps a different set of tokens"),
    (ch08.check_top_k_top_p, lambda p, k, q: ch08.reference_top_k_top_p(p, k, q).double(), "has dtype torch.float64"),
    (ch08.check_sample, sample_greedy_shortcut_by_sort, "an all-greedy batch did not give argmax(logits)"),
    (ch08.check_sample, sample_two_seeds, "do not follow softmax(logits) together"),
    (ch08.check_sample, sample_temperature_squared, "do not follow the filtered distribution"),
]


@pytest.mark.parametrize("check,fn,says", COVERAGE, ids=[f"{m[0].__name__}-{i}" for i, m in enumerate(COVERAGE)])
def test_every_hint_is_reached(check, fn, says):
    for _ in range(3):
        fails(check, fn, match=re.escape(says))


# -- E8.5 -----------------------------------------------------------------------------------------------------
def penalties(logits, prompt_mask, output_counts, presence, frequency, repetition, *, rule="sign", rep_on="seen",
              presence_on="output", frequency_counts="output", presence_by_count=False, repetition_first=True,
              sign=-1.0, row_axis=-1, cast=True, nan_mask=False, in_place=False, renormalise=False, clamp_inf=False):
    """The penalties with one planted mistake at a time (the defaults are right)."""
    z = logits.float() if cast else logits
    counts = output_counts.to(z.dtype)
    out = output_counts > 0
    seen = {"seen": prompt_mask | out, "output": out, "all": torch.ones_like(out)}[rep_on]
    p, f, r = (x.unsqueeze(row_axis).to(z.dtype) for x in (presence, frequency, repetition))

    def repetition_penalty(z):
        if rule == "sign":
            hit = torch.where(z < 0, z * r, z / r)
        elif rule == "divide":
            hit = z / r
        elif rule == "positive_only":
            hit = torch.where(z < 0, z, z / r)
        else:
            hit = torch.where(z < 0, z / r, z * r)
        if nan_mask:
            return z * (~seen).to(z.dtype) + hit * seen.to(z.dtype)
        return torch.where(seen, hit, z)

    def subtract(z):
        c = counts + prompt_mask.to(z.dtype) if frequency_counts == "prompt_too" else (
            out.to(z.dtype) if frequency_counts == "mask" else counts)
        m = (prompt_mask | out) if presence_on == "prompt_too" else out
        pres = p * counts if presence_by_count else p * m.to(z.dtype)
        return z + sign * f * c + sign * pres

    if in_place:                   # z = logits.float() is the caller's own tensor when the logits are fp32
        z.copy_(repetition_penalty(z))
        z = subtract(z)
    else:
        z = subtract(repetition_penalty(z)) if repetition_first else repetition_penalty(subtract(z))
    if renormalise:
        z = torch.log_softmax(z, -1)
    if clamp_inf:
        z = torch.nan_to_num(z)
    return z


def penalties_with_item(logits, prompt_mask, output_counts, presence, frequency, repetition):
    rows = [ch08.reference_apply_penalties(logits[b:b + 1], prompt_mask[b:b + 1], output_counts[b:b + 1],
                                           presence[b:b + 1] * float(presence[b].item() != 0), frequency[b:b + 1],
                                           repetition[b:b + 1]) for b in range(logits.shape[0])]
    return torch.cat(rows)


def test_e8_5(capsys):
    passes(ch08.check_penalties, ch08.reference_apply_penalties, tag="E8.5", capsys=capsys)
    passes(ch08.check_penalties, penalties, tag="E8.5", capsys=capsys)          # the mutants' builder, unmutated
    fails(ch08.check_penalties, stub, match="E8.5: not implemented yet")


E8_5_MUTANTS = [   # (planted mistake, what the message must say)
    (dict(rule="divide"), "you divided every seen logit by the repetition penalty"),
    (dict(rule="positive_only"), "divided the positive logits by the repetition penalty and left the negative"),
    (dict(rule="swapped"), "sign rule is swapped"),
    (dict(rep_on="output"), "tokens seen only in the prompt got no repetition penalty"),
    (dict(presence_on="prompt_too"), "tokens seen only in the prompt got the presence penalty"),
    (dict(frequency_counts="prompt_too"), "prompt tokens were counted by the frequency penalty"),
    (dict(presence_by_count=True), "the presence penalty was multiplied by the count"),
    (dict(frequency_counts="mask"), "applied once per token, not once per occurrence"),
    (dict(repetition_first=False), "the penalties ran in the wrong order"),
    (dict(sign=1.0), "added, not subtracted"),
    (dict(rep_on="all"), "changed tokens that were never seen"),
    (dict(row_axis=0), "applied along the vocabulary (token j got row j's penalty)"),
    (dict(cast=False), "expected torch.float32"),
    (dict(nan_mask=True), "contain NaN"),
    (dict(in_place=True), "changed its input `logits`"),
    (dict(renormalise=True), "a row with every penalty off (0, 0, 1) changed"),
    (dict(clamp_inf=True), "did not stay -inf"),
]


@pytest.mark.parametrize("mistake,says", E8_5_MUTANTS, ids=[next(iter(m)) + str(i) for i, (m, _) in
                                                             enumerate(E8_5_MUTANTS)])
def test_e8_5_rejects_each_mistake_with_its_hint(mistake, says):
    for _ in range(3):                                  # fresh inputs each call: the hint must not be luck
        fails(ch08.check_penalties, lambda *a: penalties(*a, **mistake), match=re.escape(says))


def test_e8_5_rejects_a_host_sync_and_an_unknown_mistake():
    fails(ch08.check_penalties, penalties_with_item, match=r"host sync.*aten._local_scalar_dense")
    # the repetition penalty squared: no named mistake, so the generic message with the formula
    fails(ch08.check_penalties, lambda z, m, c, p, f, r: penalties(z, m, c, p, f, r * r), match="differs from the reference")


def test_e8_5_an_answer_wrong_only_in_a_non_square_batch_gets_a_message_not_a_crash():
    """Penalties computed in bf16 and cast at the end differ only in the bf16 case (7 x 151); the check's own
    'settings along the vocabulary' variant was built there too and raised a shape RuntimeError from ch08.py
    (a student's run of 2026-12-01). Now it is built only for a square batch."""
    def bf16_maths(logits, prompt_mask, output_counts, presence, frequency, repetition):
        z = logits.clone()
        seen = prompt_mask | (output_counts > 0)
        r = repetition.unsqueeze(-1).to(z.dtype)
        z = torch.where(seen, torch.where(z < 0, z * r, z / r), z)
        z = z - frequency.unsqueeze(-1).to(z.dtype) * output_counts.to(z.dtype) \
            - presence.unsqueeze(-1).to(z.dtype) * (output_counts > 0).to(z.dtype)
        return z.float()

    for _ in range(3):
        fails(ch08.check_penalties, bf16_maths, match=r"^E8\.5: .*7 rows x 151 tokens")
