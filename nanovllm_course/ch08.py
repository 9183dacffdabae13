"""Checks for chapter 08: the sampler (temperature, the exponential race, top-k / top-p).

- `check_temperature_probs(fn)` (E8.1): fn(logits [B, V] fp32 or bf16, temperatures [B] fp32) -> probs
  [B, V] fp32. Rows with temperature > 0: softmax(logits / T) computed in fp32, to atol 1e-6. Rows with
  temperature 0: exactly one-hot at argmax(logits) (the first index on ties, as torch.argmax); every call has
  greedy rows whose maximum is tied (two or three tokens share it), and logits and temperatures must come
  back unchanged.
- `check_exponential_race(fn)` (E8.2): fn(probs [B, V] fp32, noise [B, V] fp32 >= 0) -> [B] int64, exactly
  argmax(probs / max(noise, tiny)) (tiny = fp32's smallest normal), with draws of exactly 0 (on a token of
  probability 0 and on a possible one) and a subnormal draw in every call; and 6 rows of 151,936 tokens (Qwen3's
  vocabulary, `_vocab_case`) where the precision decides: in four, two tokens of equal probability whose draws
  differ by 1 part in 16,384 (a race in bf16 or fp16 ties them and takes the first), in one a ladder of draws
  from 2 tiny to 1e-4 (a floor above 8 tiny, such as 1e-10 or eps, moves the winner); the inputs unchanged;
  no host sync.
- `check_top_k_top_p(fn)` (E8.3): fn(probs [B, V] fp32, top_k [B] int64 or None, top_p [B] float64 or None)
  -> renormalised probs [B, V] fp32, dropped tokens exactly 0. Same kept tokens as the reference (HF's
  TopKLogitsWarper / TopPLogitsWarper rules; where top-p's boundary falls inside a run of equal
  probabilities, any of the tied tokens may go, but the number kept must match), probabilities to atol 1e-6;
  a case where the order of the two filters changes the result, one where top_p = 1 meets a row whose fp32
  running sum reaches 1.0 early; the inputs unchanged; no host sync. A wrong answer gets the hint of the planted
  mistake (`top_k_top_p_variant`, `_FILTER_MISTAKES`) that gives it in every case.
- `check_sample(fn)` (E8.4): fn(logits, nanovllm_ref.layers.sampler.SamplingMetadata) -> [B] int64: greedy
  rows exactly argmax over 6 + 3 calls, most of them with a tied maximum; no host sync (a dispatch spy watches
  for aten::_local_scalar_dense (`.item()`, `int(t)`, `if t:`), aten::nonzero, masked_select, unique); the
  inputs unchanged; 200 calls of 200 rows at T = 1 that must not repeat each other and together pass a
  chi-squared test (state across calls: a sampler that reseeds its generator draws the same noise every
  step); chi-squared tests on 40,000 draws each for T in {0.5, 1, 2}, for top-k, top-p and both, and for T = 2
  with top-p (top-p before the temperature keeps the wrong nucleus there); and one batch of 7 rows of 151,936
  bf16 logits at T = 1 whose noise the check plants (`PlantedNoise` fills the sampler's `.exponential_()`): the
  winners exactly the reference's in the rows where the race's precision, the softmax's precision or the
  noise's floor decides (E8.2's planted rows; skipped for a sampler that draws its noise another way).

- `check_penalties(fn)` (E8.5): fn(logits [B, V] fp32 or bf16, prompt_mask [B, V] bool, output_counts [B, V]
  int32, presence [B], frequency [B], repetition [B] fp32) -> [B, V] fp32 penalised logits, to rtol 1e-6 /
  atol 1e-6 of the reference (nanovllm_ref.layers.logits_processors.apply_penalties: HF's repetition penalty,
  then OpenAI's frequency and presence penalties, vLLM's order); -inf logits (masked earlier) stay -inf and
  nothing is NaN. Every call draws: a square batch (B == V, where a [B] setting broadcast along the vocabulary
  still runs), bf16 logits, logits exactly 0, -0.0 and -inf, tokens seen only in the prompt, only in the
  output, in both, repeated (counts up to 6) or never, ties between a seen and an unseen token, negative
  presence / frequency, repetition below and above 1, rows with every penalty off (unchanged); inputs
  unchanged; no host sync.

Statistics: each chi-squared test fails when its p-value is below 1e-6, so a correct sampler fails one test
with probability about 1e-6 (the chi-squared approximation, with bins of expected count < 5 pooled); E8.4
runs 8 tests, so it fails a correct answer about 8 times in a million runs.

Every check draws fresh random inputs and prints `E8.n ok` and nothing else on success.
`reference_temperature_probs`, `reference_exponential_race`, `reference_top_k_top_p`, `reference_sample`,
`reference_apply_penalties` are the reference answers.
"""
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanovllm_course.common import CheckFailed, call_student, check_close, check_unchanged, fail, fresh_generator, ok
from nanovllm_ref.layers import sampler as ref_sampler
from nanovllm_ref.layers.logits_processors import apply_penalties as reference_apply_penalties
from nanovllm_ref.layers.sampler import SamplingMetadata

DRAWS = 40_000
P_FAIL = 1e-6
TINY = torch.finfo(torch.float32).tiny


# -- reference answers ---------------------------------------------------------------------------------------
def reference_temperature_probs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    greedy = (temperatures == 0).unsqueeze(-1)
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures)).unsqueeze(-1)
    probs = torch.softmax(logits / t, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


reference_exponential_race = ref_sampler.exponential_race


def reference_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """The engine's filter (nanovllm_ref.layers.sampler.top_k_top_p_filter) applied to log-probabilities."""
    return torch.softmax(ref_sampler.top_k_top_p_filter(probs.float().log(), top_k, top_p), dim=-1)


def reference_sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The chapter's sampler built from the three reference pieces (the engine's `sample` draws the same
    distribution with a shortcut for all-greedy batches)."""
    probs = reference_temperature_probs(logits, metadata.temperatures)
    if metadata.top_k is not None or metadata.top_p is not None:
        probs = reference_top_k_top_p(probs, metadata.top_k, metadata.top_p)
    return reference_exponential_race(probs, torch.empty_like(probs).exponential_(1.0))


def metadata(temperatures, top_k=None, top_p=None, device="cpu") -> SamplingMetadata:
    """SamplingMetadata from Python lists (None = not used by any row), as engine/sampling_inputs.sampling_metadata."""
    t = torch.tensor(temperatures, dtype=torch.float32, device=device)
    k = None if top_k is None else torch.tensor(top_k, dtype=torch.int64, device=device)
    p = None if top_p is None else torch.tensor(top_p, dtype=torch.float64, device=device)
    return SamplingMetadata(t, all_greedy=all(x == 0 for x in temperatures), top_k=k, top_p=p)


# -- the host-sync spy and the chi-squared test ----------------------------------------------------------------
class HostSyncSpy(TorchDispatchMode):
    """Inside `with HostSyncSpy() as spy:`, records the aten ops that copy a tensor value to the host
    (`.item()`, `int(t)`, `bool(t)`, `.tolist()` all become aten::_local_scalar_dense) or whose output shape
    depends on values (nonzero, masked_select, unique, indexing with a boolean mask): on a GPU each one waits
    for the device."""
    SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique",
             "aten._unique", "aten.item")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(getattr(func, "overloadpacket", func))
        if name.startswith(self.SYNCS):
            self.seen.append(name)
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and len(args) > 1 and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            self.seen.append(f"{name} (boolean mask)")      # x[mask]: the output size depends on the mask
        return func(*args, **(kwargs or {}))


def _sync_message(seen: list[str]) -> str:
    ops = sorted(set(seen))
    what = []
    if "aten._local_scalar_dense" in ops:
        what.append("reads a tensor value on the host (`.item()`, `int(t)`, `float(t)`, `if t:` or `.tolist()`)")
    if any(op != "aten._local_scalar_dense" for op in ops):   # nonzero, x[mask], unique, masked_select
        what.append("makes a value-dependent shape (`nonzero`, boolean-mask indexing `x[mask]`, `unique`; "
                    "masked_fill / torch.where keep the shape)")
    return f"your code {' and '.join(what)}: {len(seen)} host sync(s) per call ({', '.join(ops)})"


def chi_square_test(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's chi-squared test of the draw `counts` [V] against `probs` [V]: (p-value, number of bins).
    Bins with an expected count below `min_expected` are pooled into one; zero-probability tokens are left
    out (drawing one is a separate, certain failure: see `impossible_draws`)."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    small = ~big & (probs > 0)
    obs = torch.cat([counts[big], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[small].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    if obs.numel() < 2:
        return 1.0, obs.numel()
    stat = ((obs - exp) ** 2 / exp).sum()
    p = float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64), stat / 2))
    return p, obs.numel()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """The p-value of `chi_square_test`."""
    return chi_square_test(counts, probs, min_expected)[0]


def impossible_draws(counts: torch.Tensor, probs: torch.Tensor) -> int:
    return int(counts[probs.cpu() == 0].sum())


def _draw_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids.reshape(-1).long().cpu(), minlength=vocab)[:vocab]


def _check_ids(tag: str, ids, batch: int, what: str) -> None:
    if not isinstance(ids, torch.Tensor):
        fail(tag, f"{what} should return a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.shape != (batch,):
        fail(tag, f"{what} returned shape {tuple(ids.shape)}, expected ({batch},): one token id per row",
             "reduce over the vocabulary axis (dim=-1)")
    if ids.dtype != torch.int64:
        fail(tag, f"{what} returned dtype {ids.dtype}, expected torch.int64", "argmax returns int64 already")


def _logits(g: torch.Generator, rows: int, vocab: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=g) * scale


# -- E8.1 -----------------------------------------------------------------------------------------------------
def _tie_rows(g: torch.Generator, logits: torch.Tensor, rows) -> None:
    """Make each of `rows` of `logits` tie at its maximum: the largest value appears at two (or three) random
    positions, exactly (also after a cast to bf16: the tied value is copied, not recomputed)."""
    vocab = logits.shape[1]
    for r in rows:
        k = min(vocab, 2 + int(torch.randint(0, 2, (1,), generator=g)))
        where = torch.randperm(vocab, generator=g)[:k]
        logits[r, where] = logits[r].max() + 0.5


def _greedy_hint(got_row: torch.Tensor, logits_row: torch.Tensor) -> str | None:
    """Why a greedy row's probabilities are not the one-hot at the first argmax, when a tie explains it."""
    lf = logits_row.float()
    tied = (lf == lf.max()).nonzero().flatten().tolist()
    if len(tied) < 2 or not torch.isfinite(got_row).all():
        return None
    if sorted((got_row == 1).nonzero().flatten().tolist()) == tied and float(got_row.sum()) == len(tied):
        return ("this row's maximum is tied: every tied token got 1.0 (logits == max); the one-hot has a single 1.0, "
                "at the FIRST of them, which is what argmax (and the engine's greedy) returns")
    if torch.allclose(got_row, torch.zeros_like(got_row).index_fill_(0, torch.tensor(tied), 1 / len(tied)), atol=1e-3):
        return ("this row's maximum is tied and your greedy row splits the probability between the tied tokens, as "
                "softmax(logits / T) does for a tiny T: temperature 0 is not a small temperature, it is argmax "
                "(one 1.0 at its first index)")
    if float(got_row.sum()) == 1.0 and int((got_row == 1).sum()) == 1 and int(got_row.argmax()) in tied:
        return (f"this row's maximum is tied at tokens {tied}: the 1.0 goes to the FIRST of them ({tied[0]}), "
                "as torch.argmax returns")
    return None


def check_temperature_probs(fn) -> None:
    tag = "E8.1"
    g = fresh_generator()
    cases = [(1, 7, torch.float32), (5, 32, torch.float32), (6, 151, torch.bfloat16), (9, 1000, torch.bfloat16)]
    for rows, vocab, dtype in cases:
        logits = _logits(g, rows, vocab, 3.0)
        temps = torch.rand(rows, generator=g) * 1.9 + 0.1
        temps[torch.arange(rows) % 3 == 1] = 0.0                        # greedy rows in the same batch
        temps[torch.arange(rows) % 3 == 2] *= 0.25                      # sharp rows: small probabilities matter
        _tie_rows(g, logits, [r for r in range(rows) if r % 2 == 1 or rows == 1])   # ties, greedy rows included
        logits = logits.to(dtype)
        before = {"logits": logits.clone(), "temperatures": temps.clone()}
        got = call_student(tag, fn, logits, temps)
        check_unchanged(tag, before, {"logits": logits, "temperatures": temps},
                        "divide into a new tensor (logits / t) and pick the greedy rows with torch.where; never write "
                        "into logits or temperatures (the engine still reads them)")
        want = reference_temperature_probs(logits, temps)
        case = f"{rows} rows x {vocab} tokens, {str(dtype).replace('torch.', '')} logits"
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            check_close(tag, got, want, rtol=0, atol=1e-6, what=f"probs ({case})")
        if got.dtype != torch.float32:
            fail(tag, f"probs have dtype {got.dtype} ({case}), expected torch.float32",
                 "call .float() on the logits before dividing and taking the softmax")
        greedy = temps == 0
        if greedy.any() and not torch.equal(got[greedy], want[greedy]):
            bad = [int(r) for r in greedy.nonzero().flatten() if not torch.equal(got[r], want[r])]
            row = bad[0]
            tie_hint = _greedy_hint(got[row], logits[row])
            if not torch.isfinite(got[greedy]).all():
                msg = "rows with temperature 0 contain NaN or inf (dividing by T = 0)"
            elif tie_hint:
                msg = "a row with temperature 0 and a tied maximum is not one-hot at the first argmax"
            else:
                msg = "rows with temperature 0 must be exactly one-hot at argmax(logits) (1.0 there, 0.0 elsewhere)"
            fail(tag, f"{msg}; first wrong row {row} ({case})", tie_hint or
                 "pick those rows with torch.where(temperatures == 0, one_hot, probs), one_hot built with scatter_")
        sampled = ~greedy
        a, e = got[sampled], want[sampled]
        if a.numel() == 0 or (a - e).abs().max() <= 1e-6:
            continue
        t = temps[sampled].unsqueeze(-1)
        lf = logits.float()[sampled]
        candidates = [
            (torch.softmax(lf, dim=-1), "the temperature is ignored: these are softmax(logits), not softmax(logits / T)",
             "divide each row's logits by its own temperature (temperatures.unsqueeze(-1)) before the softmax"),
            (torch.softmax(lf, dim=-1) / t, "you divided the probabilities by T; the temperature divides the LOGITS",
             "softmax(logits / T) is not softmax(logits) / T (which does not even sum to 1)"),
            (torch.softmax(lf * t, dim=-1), "you multiplied the logits by T; divide them by T",
             "T < 1 must sharpen the distribution and T > 1 flatten it"),
            (torch.softmax((logits[sampled] / t.to(logits.dtype)).to(torch.bfloat16), dim=-1).float(),
             "these look like a softmax computed in bf16: small probabilities are off by far more than 1e-6",
             "convert the logits with .float() first; bf16 keeps only 8 significant bits"),
            (torch.softmax(lf.to(torch.bfloat16).float() / t, dim=-1).to(torch.bfloat16).float(),
             "these look like bf16 probabilities (rounded to 8 significant bits)",
             "return the fp32 softmax; do not cast back to the logits' dtype"),
        ]
        for cand, msg, hint in candidates:
            if cand.shape == a.shape and (a - cand).abs().max() <= 1e-6:
                fail(tag, f"{msg} ({case})", hint)
        check_close(tag, got, want, rtol=0, atol=1e-6, what=f"probs ({case})",
                    hint="softmax(logits.float() / T) per row; one-hot at argmax for T = 0")
    ok(tag)


# -- E8.2 -----------------------------------------------------------------------------------------------------
_RACE_MISTAKES = [   # (wrong race on (probs, noise), message, hint); the sign mistakes with the noise floored
    (lambda p, e: (p / e).argmax(-1), "with a noise draw exactly 0 on a token of probability 0 your race picked "
     "that token (0 / 0 = NaN, and argmax returns NaN's position)",
     "floor the noise: noise.clamp_min(torch.finfo(torch.float32).tiny)"),
    (lambda p, e: (p * e.clamp_min(TINY)).argmax(-1), "you multiplied by the noise: argmax(p * E) is the race with "
     "the noise's sign flipped (in Gumbel terms, log p - G instead of log p + G)", "the winner is argmax(p / E)"),
    (lambda p, e: (p / -e.clamp_min(TINY)).argmax(-1), "the noise has the wrong sign: argmax(p / -E) picks the "
     "SLOWEST racer", "divide by E itself, E >= 0"),
    (lambda p, e: (p / e.clamp_min(TINY)).argmin(-1), "argmin instead of argmax", "the winner has the largest p / E"),
    (lambda p, e: (p.log() + e).argmax(-1), "log p + E is not Gumbel-max: Gumbel noise is -log(E), not E",
     "use the race directly: argmax(p / E)"),
    # Named by itself: on a draw where every racer's E is large it agrees with the race, and where one draw is
    # tiny it looks like a floor set too high, so neither of those messages would say what was done.
    (lambda p, e: (p / (e + 1)).argmax(-1), "you added 1 to the noise (to avoid dividing by zero): argmax(p / (E + 1)) "
     "is no longer a draw from p, since a racer's time is E itself", "floor the noise instead, at fp32's smallest "
     "normal: noise.clamp_min(torch.finfo(torch.float32).tiny)"),
]


VOCAB = 151_936            # Qwen3's vocabulary: the full-size rows of E8.2 and E8.4
NEAR = 2.0 ** -14          # two planted racers' noise differs by 1 part in 16,384: fp32 tells them apart, bf16
                           # (8 bits) and fp16 (11 bits) round both to the same value, and argmax takes the first
LADDER_STEP = 16.0         # the floor ladder's draws: 2 tiny, 32 tiny, ... up to ~1e-4; probabilities x4 a rung


def _bf16_value(x: float) -> float:
    """The bf16 value nearest to x (a float that bf16, fp16 and fp32 all hold exactly)."""
    return float(torch.tensor(x, dtype=torch.float32).bfloat16().float())


def _best_ratio(probs_row: torch.Tensor, noise_row: torch.Tensor) -> float:
    return float((probs_row.double() / noise_row.double().clamp_min(TINY)).max())


def plant_near_tie(probs_row: torch.Tensor, noise_row: torch.Tensor, a: int, b: int, exact: str) -> None:
    """Make two tokens a > b of equal probability win the race by 1 part in 16,384 (NEAR): noise[a] =
    noise[b] * (1 - NEAR), both far ahead of every other token. exact="noise": noise[b] is a bf16 value, so a
    race on bf16-rounded noise ties them; exact="quotient": probs[b] / noise[b] is a bf16 value, so a race that
    rounds the quotient ties them. On a tie argmax returns b, the first; the fp32 race picks a. The two tokens'
    probabilities must already be equal (the caller sets them). Writes noise_row in place."""
    assert a > b and probs_row[a] == probs_row[b]
    p = float(probs_row[a])
    others = noise_row.clone()
    others[[a, b]] = float("inf")
    target = 4 * _best_ratio(probs_row, others)            # a quotient 4x the best of the rest
    if exact == "noise":
        e = _bf16_value(p / target)
        noise_row[b] = e
    else:
        noise_row[b] = p / _bf16_value(target)
    noise_row[a] = float(noise_row[b]) * (1 - NEAR)


def ladder_tokens(g: torch.Generator, vocab: int) -> list[int]:
    """The tokens of the floor ladder: as many rungs as draws 2 tiny * 16**k stay below 1e-4 (28)."""
    rungs = 0
    while 2 * TINY * LADDER_STEP ** rungs < 1e-4:
        rungs += 1
    return torch.randperm(vocab, generator=g)[:rungs].tolist()


def plant_floor_ladder(tokens: list[int], noise_row: torch.Tensor) -> None:
    """Noise draws from just above fp32's smallest normal up to ~1e-4 on `tokens` (rung k: 2 tiny * 16**k),
    whose probabilities rise 4x a rung (the caller sets them): the right race picks the lowest rung, whose draw
    is tiny; a race that floors the noise at f > 8 tiny (1e-10, 1e-20, eps) lifts every draw below f to f and
    picks a higher rung. In place."""
    for k, t in enumerate(tokens):
        noise_row[t] = 2 * TINY * LADDER_STEP ** k


def _vocab_case(g: torch.Generator):
    """E8.2's full-vocabulary case: 6 rows of VOCAB tokens; rows 0-1 a near tie with bf16-exact noise, rows 2-3
    one with a bf16-exact quotient, row 4 the floor ladder, row 5 untouched. Returns (probs, noise, planted) with
    planted {row: (what, the right winner)}."""
    rows = 6
    probs = torch.softmax(_logits(g, rows, VOCAB, 2.5), dim=-1)
    noise = torch.empty(rows, VOCAB).exponential_(1.0, generator=g)
    ladder = ladder_tokens(g, VOCAB)
    top = float(probs[4].max())
    for k, t in enumerate(ladder):                             # p rises 4x a rung, the last near the row's top
        probs[4, t] = top * 4.0 ** (k - len(ladder) + 1)
    probs[4] /= probs[4].sum()
    plant_floor_ladder(ladder, noise[4])
    planted = {4: ("floor", ladder[0])}
    for r in range(4):
        # the pair holds half the row's mass and the other draws are >= 1e-3, so the pair's draws are ~1e-2, above
        # any floor a race might use: only the precision decides these rows
        b, a = sorted(torch.randperm(VOCAB, generator=g)[:2].tolist())
        probs[r] *= 0.5 / (1 - probs[r, a] - probs[r, b])
        probs[r, a] = probs[r, b] = 0.25
        noise[r].clamp_min_(1e-3)
        plant_near_tie(probs[r], noise[r], a, b, "noise" if r < 2 else "quotient")
        planted[r] = ("near", a)
    return probs, noise, planted


_FLOORS = (1e-6, torch.finfo(torch.float32).eps, 1e-8, 1e-10, 1e-12, 1e-15, 1e-20, 1e-30, 1e-37)   # usual wrong ones
_FLOOR_HINT = ("floor the noise at fp32's smallest normal, noise.clamp_min(torch.finfo(torch.float32).tiny) "
               "(1.2e-38), not at 1e-10, 1e-20 or eps, and add nothing to it: a draw below your floor is lifted to "
               "it, and a token whose tiny draw should win loses to another")
_NEAR_HINT = ("compute probs / noise in fp32, as given: in bf16 (8 bits) or fp16 (11 bits) two quotients closer "
              "than 1 part in 256 (or 2,048) become equal and argmax takes the first, which changes about 1 winner "
              "in 400 full-vocabulary rows")


def check_exponential_race(fn) -> None:
    tag = "E8.2"
    g = fresh_generator()
    results = []
    for rows, vocab in [(1, 5), (7, 64), (16, 1001)]:
        probs = torch.softmax(_logits(g, rows, vocab, 2.5), dim=-1)
        impossible = torch.randperm(vocab, generator=g)[: max(2, vocab // 3)]
        probs[0, impossible] = 0.0                                            # impossible tokens in row 0
        probs[0] /= probs[0].sum()
        noise = torch.empty(rows, vocab).exponential_(1.0, generator=g)
        # Draws that fp32 can produce: exactly 0 (on an impossible token of row 0, where 0 / 0 must not win, and
        # on a possible token of the last row, which then wins) and a subnormal one.
        noise[0, impossible[1]] = 0.0
        if rows > 1:
            noise[-1, int(torch.randint(vocab, (1,), generator=g))] = 0.0
            noise[1, int(torch.randint(vocab, (1,), generator=g))] = TINY / 8
        results.append((rows, vocab, probs, noise))
    big_probs, big_noise, planted = _vocab_case(g)
    results.append((big_probs.shape[0], VOCAB, big_probs, big_noise))
    done = []
    for rows, vocab, probs, noise in results:
        before = {"probs": probs.clone(), "noise": noise.clone()}
        got = call_student(tag, fn, probs, noise)
        check_unchanged(tag, before, {"probs": probs, "noise": noise},
                        "compute probs / noise.clamp_min(tiny) into a new tensor; an in-place clamp_min_ or div_ "
                        "rewrites the caller's noise")
        _check_ids(tag, got, rows, "exponential_race")
        done.append((rows, vocab, probs, noise, got, reference_exponential_race(probs, noise)))
    wrong = [r for r in done if not torch.equal(r[4], r[5])]
    if wrong:
        # The mistake that explains every case (one case alone may not tell two mistakes apart).
        for race, msg, hint in _RACE_MISTAKES:
            if all(torch.equal(got, race(probs, noise)) for _, _, probs, noise, got, _ in done):
                rows, vocab = wrong[0][:2]
                fail(tag, f"{msg} ({rows} rows x {vocab} tokens)", hint)
        rows, vocab, _, _, got, want = next((r for r in wrong if r[1] == VOCAB), wrong[0])
        if vocab == VOCAB:                   # the full-vocabulary case is wrong: its planted rows say why
            bad = (got != want).nonzero().flatten().tolist()
            kinds = {planted.get(r, ("other",))[0] for r in bad}
            if "near" in kinds:
                near = [r for r in bad if planted.get(r, ("",))[0] == "near"]
                fail(tag, f"in {len(near)} row(s) of {VOCAB} tokens, two tokens of equal probability whose draws "
                          "differ by 1 part in 16,384 (the later token's the smaller, so it wins) gave the earlier "
                          "token", _NEAR_HINT)
            floors = [lambda p, e, f=f: (p / e.clamp_min(f)).argmax(-1) for f in _FLOORS] + \
                [lambda p, e, f=f: (p / (e + f)).argmax(-1) for f in _FLOORS]
            if "floor" in kinds and (kinds == {"floor"} or any(
                    all(torch.equal(got_, race(p_, e_)) for _, _, p_, e_, got_, _ in done) for race in floors)):
                fail(tag, f"in a row of {VOCAB} tokens whose winning draw is 2.4e-38 (fp32 draws go that low), your "
                          "race picked another token", _FLOOR_HINT)
        fail(tag, f"token ids differ from argmax(probs / noise) in {int((got != want).sum())} of {rows} rows "
                  f"({rows} rows x {vocab} tokens)", "one argmax over the vocabulary of probs / noise")
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.25, 0.0, 0.75]])
    with HostSyncSpy() as spy:
        call_student(tag, fn, probs, torch.ones(2, 3))
    if spy.seen:
        fail(tag, _sync_message(spy.seen), "one tensor expression: (probs / noise).argmax(dim=-1)")
    # No statistics here: a race that gives exactly argmax(p / max(E, tiny)) for every given noise draws from p
    # (the notebook shows the frequencies); E8.4 tests the sampler's draws.
    ok(tag)


# -- E8.3 -----------------------------------------------------------------------------------------------------
def reference_top_p_then_k(probs, top_k, top_p):
    """The filters in the wrong order (top-p on the whole distribution, then top-k), for the checks' hints."""
    return reference_top_k_top_p(reference_top_k_top_p(probs, None, top_p), top_k, None)


def _same_kept(got, variant, probs):
    """True when `got` keeps the tokens `variant` keeps (up to ties at the boundary), as many per row."""
    kept, kv = got > 0, variant > 0
    if not torch.equal(kept.sum(-1), kv.sum(-1)):
        return False
    differ = kept ^ kv
    boundary = torch.where(kv, probs, torch.full_like(probs, 2.0)).min(-1, keepdim=True).values
    return bool((probs[differ] == boundary.expand_as(probs)[differ]).all())


def _kept_compare(tag, probs, got, want, case, top_k=None, top_p=None):
    """Compare kept sets (tokens tied at top-p's boundary may swap) and renormalised probabilities."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        check_close(tag, got, want, rtol=0, atol=1e6, what=f"filtered probs ({case})")  # type / shape / dtype
    if not torch.isfinite(got).all():
        fail(tag, f"filtered probs contain NaN or inf ({case})",
             "a row whose kept mass you divide by must keep at least one token")
    kept, kept_ref = got > 0, want > 0
    n, n_ref = kept.sum(-1), kept_ref.sum(-1)
    if top_k is not None and top_p is not None and not _same_kept(got, want, probs) and \
            _same_kept(got, reference_top_p_then_k(probs, top_k, top_p), probs):
        row = int(((n != n_ref) | (kept ^ kept_ref).any(-1)).nonzero()[0])
        fail(tag, f"row {row} keeps {int(n[row])} tokens, the reference {int(n_ref[row])}: the tokens of top-p "
                  f"applied before top-k ({case})",
             "top-k first, then top-p on the renormalised top-k distribution (HF's TopKLogitsWarper, then "
             "TopPLogitsWarper): after top-k the kept mass is renormalised, so top-p may keep fewer tokens")
    if not torch.equal(n, n_ref):
        row = int((n != n_ref).nonzero()[0])
        if top_p is not None and float(top_p[row]) >= 1 and (top_k is None or int(top_k[row]) == 0) \
                and n[row] < n_ref[row]:
            fail(tag, f"row {row} has top_p = 1 (off) and no top-k, yet you dropped {int(n_ref[row] - n[row])} of its "
                      f"tokens ({case})", "top_p = 1 means off: keep every token. A running sum in fp32 can reach 1.0 "
                      "before the end of a row (the tail's tiny probabilities no longer change it), so 'keep while "
                      "the mass before the token is < top_p' drops the tail unless top_p = 1 skips the filter")
        if (n - n_ref).abs().max() == 1 and (n <= n_ref).all():
            msg = (f"top-p kept one token too few (row {row}: {int(n[row])} instead of {int(n_ref[row])}): the "
                   "token whose probability makes the kept mass reach top_p belongs to the nucleus")
            hint = ("drop a token only if the mass of the LESS likely tokens up to and including it is <= 1 - top_p "
                    "(HF's rule); equivalently keep a token while the mass of the MORE likely ones before it is < top_p")
        elif (n - n_ref).abs().max() == 1 and (n >= n_ref).all():
            msg = f"kept one token too many (row {row}: {int(n[row])} instead of {int(n_ref[row])})"
            hint = "a token whose ascending running sum is exactly 1 - top_p is dropped (<=, not <)"
        else:
            msg = f"row {row} keeps {int(n[row])} tokens, the reference {int(n_ref[row])}"
            hint = ("top-k keeps every token >= the k-th largest (ties included), k = 0 means off; then top-p on "
                    "the renormalised top-k distribution; always keep the most likely token")
        fail(tag, f"{msg} ({case})", hint)
    differ = kept ^ kept_ref
    if differ.any():
        # Allowed only among tokens tied with the smallest kept probability (top-p's boundary inside a tie).
        boundary = torch.where(kept_ref, probs, torch.full_like(probs, 2.0)).min(-1, keepdim=True).values
        if not (probs[differ] == boundary.expand_as(probs)[differ]).all():
            row = int(differ.any(-1).nonzero()[0])
            fail(tag, f"row {row} keeps a different set of tokens than the reference ({case})",
                 "keep the largest probabilities: sort each row, mask by rank, scatter the mask back")
    if (got.sum(-1) - 1).abs().max() > 1e-5:
        fail(tag, f"the kept probabilities do not sum to 1 ({case})", "renormalise: divide by the kept mass")
    same = ~differ
    check_close(tag, got[same], want[same], rtol=0, atol=1e-6, what=f"renormalised probs ({case})",
                hint="divide the kept probabilities by their sum")


def _call_filter(tag, fn, probs, top_k, top_p):
    """fn(probs, top_k, top_p) on the caller's own tensors, which must come back unchanged."""
    given = {"probs": probs, "top_k": top_k, "top_p": top_p}
    given = {k: v for k, v in given.items() if v is not None}
    before = {k: v.clone() for k, v in given.items()}
    got = call_student(tag, fn, probs, top_k, top_p)
    check_unchanged(tag, before, given, "build the result with masked_fill / torch.where, and a per-row k or p "
                                        "with torch.where(top_k > 0, top_k, vocab) into a new tensor")
    return got


def top_k_top_p_variant(probs, top_k, top_p, *, kth_offset=0, ties=True, k0_off=True, p_rule="<=",
                        renormalise_before_p=True, renormalise=True, keep_top=True, fill=0.0, threshold="1 - p",
                        order="k then p", p1_off=True):
    """E8.3 written out (sort ascending, mask by rank, running sum, scatter back) with planted mistakes for the
    hints; the defaults are right. kth_offset 1 / -1 (k + 1 or k - 1 kept), ties False (exactly k kept, as
    torch.topk), k0_off False (top_k = 0 keeps 1), p_rule "<" (a running sum equal to 1 - p kept),
    renormalise_before_p False (top-p on top-k's unrenormalised mass), renormalise False, keep_top False (the most
    likely token may go), fill (dropped tokens set to it, not 0), threshold "p" (running sum against p, not
    1 - p), order "p then k", p1_off False (top_p = 1 filters too: fp32 running sums reach 1.0 early)."""
    vocab = probs.shape[-1]
    ascending, index = probs.float().sort(dim=-1, stable=True)

    def by_rank(asc):
        k = torch.where(top_k > 0, top_k, vocab) if k0_off else top_k.clamp(min=1)
        k = (k + kth_offset).clamp(1, vocab)
        if not ties:
            return asc.masked_fill(torch.arange(vocab).expand_as(asc) < (vocab - k).unsqueeze(-1), 0.0)
        return asc.masked_fill(asc < asc.gather(-1, (vocab - k).unsqueeze(-1)), 0.0)

    def by_mass(asc):
        base = asc / asc.sum(-1, keepdim=True) if renormalise_before_p else asc
        running = base.cumsum(dim=-1)
        cut = (1 - top_p.double()) if threshold == "1 - p" else top_p.double()
        cut = (torch.where(top_p < 1, cut, -1.0) if p1_off else cut).float().unsqueeze(-1)
        drop = running <= cut if p_rule == "<=" else running < cut
        if keep_top:
            drop[:, -1] = False
        return asc.masked_fill(drop, 0.0)

    steps = [(top_k, by_rank), (top_p, by_mass)]
    for setting, step in steps if order == "k then p" else steps[::-1]:
        if setting is not None:
            ascending = step(ascending)
    kept = torch.zeros_like(ascending).scatter(-1, index, ascending)
    if fill:
        kept = torch.where(kept > 0, kept, torch.full_like(kept, fill))
    return kept / kept.sum(dim=-1, keepdim=True) if renormalise else kept


_FILTER_MISTAKES = [    # (top_k_top_p_variant flags, message, hint): the first that explains every case wins
    (dict(ties=False), "top-k kept exactly k tokens where several tie with the k-th largest",
     "keep every token whose probability is >= the k-th largest (a tie at the k-th value keeps all of it): "
     "torch.topk keeps exactly k and drops the rest of the tie at random"),
    (dict(kth_offset=1), "top-k kept k + 1 tokens", "in a row sorted ascending the k-th largest is at index V - k"),
    (dict(kth_offset=-1), "top-k kept k - 1 tokens", "in a row sorted ascending the k-th largest is at index V - k"),
    (dict(k0_off=False), "top_k = 0 filtered the row", "top_k = 0 means off: keep every token (k = V)"),
    (dict(p1_off=False), "top_p = 1 dropped tokens", "top_p = 1 means off: keep every token. The fp32 running sum "
     "of a long row reaches 1.0 before its end, so without that rule its tail is dropped"),
    (dict(threshold="p"), "top-p compared the running sum with top_p", "sort ascending and drop a token while the "
     "running sum up to and including it is <= 1 - top_p (the mass of the tail you drop), not <= top_p"),
    (dict(p_rule="<"), "top-p kept a token whose ascending running sum is exactly 1 - top_p",
     "drop a token whose ascending running sum is <= 1 - top_p (<=, not <): the tokens above it already reach top_p"),
    (dict(renormalise_before_p=False), "top-p ran on what top-k left without renormalising it",
     "after top-k, divide the kept probabilities by their sum before top-p's running sum: top-p applies to the "
     "top-k distribution (HF's TopKLogitsWarper, then TopPLogitsWarper)"),
    (dict(order="p then k"), "top-p ran before top-k", "top-k first, then top-p on the renormalised top-k "
     "distribution (HF's TopKLogitsWarper, then TopPLogitsWarper): after top-k the kept mass is renormalised, so "
     "top-p may keep fewer tokens"),
    (dict(keep_top=False), "the most likely token was dropped", "always keep the most likely token: with a tiny "
     "top_p, 1 - top_p rounds to 1.0 in fp32 and every running sum is <= it"),
    (dict(fill=1e-10), "dropped tokens are not exactly 0", "set dropped tokens to exactly 0 (masked_fill(drop, "
     "0.0)): a tiny value can still win the race, and the engine counts a token as kept when it is > 0"),
    (dict(renormalise=False), "the kept probabilities were not renormalised", "divide the kept probabilities by "
     "their sum"),
]


def _explains(got, wrong, probs) -> bool:
    """True when `got` is `wrong`: the same kept tokens (up to ties at the boundary) and probabilities."""
    if not (torch.isfinite(got).all() and torch.isfinite(wrong).all()):
        return torch.allclose(got, wrong, atol=1e-6, rtol=0, equal_nan=True)
    return _same_kept(got, wrong, probs) and torch.allclose(got.sort(-1).values, wrong.sort(-1).values, atol=1e-6,
                                                            rtol=0)


def _filter_mistake(results):
    """(message, hint) of the planted mistake that gives the student's output in every case, else None."""
    for flags, message, hint in _FILTER_MISTAKES:
        if all(_explains(got, top_k_top_p_variant(probs, top_k, top_p, **flags), probs)
               for probs, top_k, top_p, got, _ in results):
            return message, hint
    return None


def check_top_k_top_p(fn) -> None:
    tag = "E8.3"
    g = fresh_generator()
    # Hand-made boundary cases (exact in fp32): ties at the k-th value, a top-p sum landing exactly on top_p.
    fixed = [
        (torch.tensor([[0.1, 0.3, 0.3, 0.3]]), [1], None, "ties at the k-th largest are kept"),
        (torch.tensor([[0.125, 0.5, 0.125, 0.25]]), None, [0.75], "top_p = 0.75, mass 0.5 + 0.25 lands on it"),
        (torch.tensor([[0.5, 0.3, 0.2]]), None, [0.6], "top_p = 0.6 needs 0.5 and 0.3"),
        (torch.tensor([[0.25, 0.5, 0.25]]), [2], [0.99], "top_k = 2 keeps 3 (a tie), then top_p"),
        (torch.tensor([[0.7, 0.1, 0.1, 0.1]]), [0], [0.05], "a tiny top_p keeps the most likely token"),
        (torch.tensor([[0.1, 0.2, 0.4, 0.3]]), None, [1e-8], "top_p = 1e-8: 1 - top_p rounds to 1.0 in fp32, and "
         "the most likely token still stays"),
        (torch.tensor([[0.125, 0.25, 0.5, 0.125]]), [2], [0.6],
         "top_k = 2 keeps 0.5 and 0.25, renormalised 2/3 and 1/3; then top_p = 0.6 keeps only 2/3"),
        (torch.tensor([[0.5] + [1e-10] * 8 + [0.5]]), None, [1.0], "top_p = 1 (off) on a row whose fp32 running "
         "sum reaches 1.0 before its tail of 1e-10s"),
    ]
    cases = []
    for probs, k, p, what in fixed:
        cases.append((probs, None if k is None else torch.tensor(k),
                      None if p is None else torch.tensor(p, dtype=torch.float64), f"the case {what}"))
    for rows, vocab in [(1, 2), (8, 17), (24, 300)]:
        probs = torch.softmax(_logits(g, rows, vocab, 2.5), dim=-1)
        ks = torch.tensor([0, 1, 2, 5, vocab, vocab + 7, 3, 0])[torch.arange(rows) % 8]
        ps = torch.tensor([1.0, 0.9, 0.5, 0.95, 0.3, 1.0, 0.8, 0.01], dtype=torch.float64)[torch.arange(rows) % 8]
        for top_k, top_p, what in [(ks, None, "top_k only"), (None, ps, "top_p only"), (ks, ps, "both")]:
            cases.append((probs, top_k, top_p, f"{rows} rows x {vocab} tokens, {what}"))
    results, first = [], None
    for probs, top_k, top_p, case in cases:
        got = _call_filter(tag, fn, probs, top_k, top_p)
        want = reference_top_k_top_p(probs, top_k, top_p)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            _kept_compare(tag, probs, got, want, case, top_k, top_p)     # fails on the type, shape or dtype
        results.append((probs, top_k, top_p, got, case))
        if first is None:
            try:
                _kept_compare(tag, probs, got, want, case, top_k, top_p)
            except CheckFailed as exc:
                first = (exc, case)
    if first is not None:
        mistake = _filter_mistake(results)
        if mistake:
            fail(tag, f"{mistake[0]} ({first[1]})", mistake[1])
        raise first[0]
    probs = torch.softmax(_logits(g, 4, 50), dim=-1)
    with HostSyncSpy() as spy:
        call_student(tag, fn, probs, torch.tensor([0, 3, 7, 1]), torch.tensor([0.5, 1.0, 0.9, 0.2], dtype=torch.float64))
    if spy.seen:
        fail(tag, _sync_message(spy.seen) + "; a per-row k or p must stay a tensor",
             "sort once, gather the k-th value per row, compare; cumsum and compare with 1 - top_p per row")
    ok(tag)


# -- E8.4 -----------------------------------------------------------------------------------------------------
def _call_sampler(tag, fn, logits, meta, batch):
    """fn(logits, meta) on the caller's tensors, which must come back unchanged; returns the ids."""
    given = {"logits": logits, "metadata.temperatures": meta.temperatures}
    given.update({f"metadata.{k}": getattr(meta, k) for k in ("top_k", "top_p") if getattr(meta, k) is not None})
    before = {k: v.clone() for k, v in given.items()}
    ids = call_student(tag, fn, logits, meta)
    check_unchanged(tag, before, given, "the sampler only reads its inputs: the engine keeps the metadata for the "
                                        "next step, and the logits are the model's output buffer")
    _check_ids(tag, ids, batch, "sample")
    return ids


class PlantedNoise(TorchDispatchMode):
    """Inside `with PlantedNoise(noise):`, a `.exponential_()` on a tensor of noise's shape (how the chapter's
    sampler draws its noise) is filled with `noise` instead (the generator still advances), so a check knows
    the draws a sampler races with; `used` counts the draws replaced."""

    def __init__(self, noise: torch.Tensor):
        super().__init__()
        self.noise, self.used = noise, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.exponential_.default and tuple(args[0].shape) == tuple(self.noise.shape):
            args[0].copy_(self.noise)
            self.used += 1
        return out


def _planted_sampler_case(g: torch.Generator):
    """E8.4's full-vocabulary batch at T = 1: (logits [7, VOCAB], noise, planted {row: (what, right winner,
    partner)}): rows 0-3 two tokens of equal logit whose draws differ by 1 part in 16,384 (NEAR; rows 0-1 with
    bf16-exact draws, 2-3 with a bf16-exact quotient), row 4 the floor ladder on 28 tokens, row 5 two tokens with
    equal draws whose logits differ by NEAR (a softmax in bf16 makes their probabilities equal), row 6 untouched.
    The partner is the token a wrong race picks instead (None for the ladder). bf16 logits, as the engine's on
    a GPU."""
    rows = 7
    logits = _logits(g, rows, VOCAB, 2.0)
    logits[5] -= 30.0                             # row 5: the pair near 0 holds all the mass (see below)
    noise = torch.empty(rows, VOCAB).exponential_(1.0, generator=g)
    ladder = ladder_tokens(g, VOCAB)
    top = float(logits[4].max())
    for k, t in enumerate(ladder):                # p rises 4x a rung; the top rung near the row's largest logit
        logits[4, t] = top + (k - len(ladder) + 1) * math.log(4.0)
    plant_floor_ladder(ladder, noise[4])
    planted = {4: ("floor", ladder[0], None)}
    for r in range(4):                                     # equal probabilities, draws 1 part in 16,384 apart
        b, a = sorted(torch.randperm(VOCAB, generator=g)[:2].tolist())
        logits[r, a] = logits[r, b] = _bf16_value(float(logits[r].max()) + 3.0)     # far above the rest
        noise[r].clamp_min_(1e-3)
        probs = reference_temperature_probs(logits[r:r + 1].bfloat16(), torch.ones(1))[0]
        plant_near_tie(probs, noise[r], a, b, "noise" if r < 2 else "quotient")
        planted[r] = ("near", a, b)
    # Row 5: logits 0 and 2**-14 (both bf16 values) far above the rest, equal draws: in fp32 the second token's
    # probability is 0.50002 against 0.49998, so it wins; a softmax in bf16 rounds both to 0.5 (a tie: argmax
    # takes the first).
    b, a = sorted(torch.randperm(VOCAB, generator=g)[:2].tolist())
    logits[5, b], logits[5, a] = 0.0, NEAR
    noise[5].clamp_min_(1e-3)
    noise[5, a] = noise[5, b] = 1.0
    planted[5] = ("logit", a, b)
    return logits.bfloat16(), noise, planted


def _check_planted_noise(tag, fn, g) -> None:
    """The sampler's race on known noise (PlantedNoise) in full-vocabulary rows: the winner exactly the
    reference's where the precision of the softmax or of the race, or the floor of the noise, decides."""
    logits, noise, planted = _planted_sampler_case(g)
    meta = metadata([1.0] * logits.shape[0])
    with PlantedNoise(noise) as spy:
        ids = _call_sampler(tag, fn, logits, meta, logits.shape[0])
    if spy.used != 1:                  # drawn another way (torch.rand, a per-row loop): nothing to compare exactly
        return
    wrong = [r for r, (_, want, _) in sorted(planted.items()) if int(ids[r]) != want]
    if not wrong:
        return
    probs = reference_temperature_probs(logits, meta.temperatures)
    rows = sorted(planted)
    for race, msg, hint in _RACE_MISTAKES:       # a race mistake shows here too: the noise is known
        if torch.equal(ids[rows], race(probs[rows], noise[rows])):
            fail(tag, f"for the noise it drew, your sampler's race is wrong: {msg} (a batch of {VOCAB} tokens at T=1)",
                 hint + " (E8.2)")
    row = wrong[0]
    what, want, partner = planted[row]
    if what == "near" and int(ids[row]) == partner:
        fail(tag, f"in a row of {VOCAB} tokens at T=1, two tokens of equal logit whose noise draws differ by 1 "
                  "part in 16,384 gave the earlier token; the later one's draw is smaller, so it wins",
             "the race must run in fp32 (E8.2): " + _NEAR_HINT.split(": ", 1)[1])
    if what == "logit" and int(ids[row]) == partner:
        fail(tag, f"in a row of {VOCAB} bf16 logits at T=1, two tokens with logits 0 and 2**-14 (all the row's mass) "
                  "and equal noise draws gave the one with the smaller logit",
             "compute the softmax in fp32 (E8.1: logits.float() / T first): in bf16 both probabilities, 0.49998 and "
             "0.50002, round to 0.5, and the race's argmax takes the first")
    if what == "floor":
        fail(tag, f"in a row of {VOCAB} tokens at T=1 whose winning noise draw is 2.4e-38, your sampler picked "
                  "another token", _FLOOR_HINT)
    fail(tag, f"for the noise it drew, your sampler did not pick argmax(probs / noise) in row {row} of a batch of "
              f"{VOCAB} tokens at T=1 (no top-k or top-p)",
         "temperature_probs -> exponential_race on the noise you drew, probs / noise.clamp_min(tiny) in fp32")


def _filters_then_temperature(row: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """The distribution of a sampler that runs top-k / top-p on softmax(logits) and the temperature after."""
    kept = reference_top_k_top_p(torch.softmax(row.float(), -1)[None], torch.tensor([k]) if k else None,
                                 torch.tensor([p], dtype=torch.float64) if p < 1 else None)[0]
    sharp = kept.pow(1 / t)
    return sharp / sharp.sum()


class RandomOpsSpy(TorchDispatchMode):
    """Inside `with RandomOpsSpy() as spy:`, `spy.seen` collects the random-number and log ops a sampler runs:
    which noise it draws (exponential_, uniform_, normal_, ...) and whether it turns a uniform draw into an
    exponential one (-log U)."""
    OPS = ("aten.exponential", "aten.uniform", "aten.normal", "aten.rand", "aten.randn", "aten.bernoulli",
           "aten.random", "aten.multinomial", "aten.log", "aten.log1p", "aten.log_")

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(getattr(func, "overloadpacket", func))
        if name.startswith(self.OPS):
            self.seen.add(name)
        return func(*args, **(kwargs or {}))


def _noise_hint(seen: set) -> str:
    """The hint for a sampler whose T = 1 draws follow the wrong distribution, from the random ops it ran."""
    bases = {op.split(".")[1] for op in seen}
    kinds = {("exp" if b.startswith("exponential") else "log" if b.startswith("log") else
              "normal" if b.startswith(("normal", "randn")) else "uniform" if b.startswith(("uniform", "rand")) else b)
             for b in bases}
    if not kinds & {"exp", "log"} and kinds & {"uniform", "normal"}:
        return ("the race needs Exp(1) noise: torch.empty_like(probs).exponential_() (or -log(U) of a uniform U); "
                "your sampler races with " + ("uniform" if "uniform" in kinds else "normal") + " draws, and "
                "argmax(p / noise) then does not draw from p")
    return ("temperature_probs -> top_k_top_p -> exponential_race with fresh Exp(1) noise: the winner is "
            "argmax(p / E), E = torch.empty_like(probs).exponential_()")


REPEATS = 200          # calls of the repeated-draw test, each of REPEAT_ROWS rows
REPEAT_ROWS = 200


def check_sample(fn) -> None:
    tag = "E8.4"
    g = fresh_generator()
    # Greedy rows exact, in a mixed batch and in an all-greedy one (bf16 logits, as the engine's). Every greedy
    # row but one has a tied maximum (bf16 logits of a big vocabulary tie often): argmax is its first index.
    logits = _logits(g, 8, 97, 3.0)
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 2.0, 0.0, 0.5]
    _tie_rows(g, logits, [0, 2, 3, 4, 6])
    logits = logits.bfloat16()
    meta = metadata(temps, [3, 5, 0, 0, 1, 2, 0, 0], [0.2, 1.0, 0.5, 0.9, 1.0, 0.5, 1.0, 0.7])
    greedy = torch.tensor([t == 0 for t in temps])
    argmax = logits.float().argmax(-1)
    tie_hint = ("a greedy row whose largest logit is tied (several tokens share it) must give the FIRST of them, "
                "as argmax does, on every call: temperature 0 is not a tiny temperature (softmax(logits / 1e-5) "
                "shares the probability between tied tokens), and the one-hot of E8.1 has one 1.0")
    for _ in range(6):
        ids = _call_sampler(tag, fn, logits, meta, 8)
        if not torch.equal(ids[greedy], argmax[greedy]):
            row = int(((ids != argmax) & greedy).nonzero()[0])
            tied = int((logits[row] == logits[row].max()).sum()) > 1
            fail(tag, f"a row with temperature 0 did not get argmax(logits) in a batch that also samples (row {row}"
                      f"{', whose maximum is tied' if tied else ''})",
                 tie_hint if tied else "greedy rows are one-hot (E8.1), so the race picks their argmax whatever "
                                       "the noise")
    # An all-greedy batch (the engine's fast path), 12 of its 16 rows tied at their maximum.
    all_greedy = _logits(g, 16, 97, 3.0)
    _tie_rows(g, all_greedy, range(12))
    all_greedy = all_greedy.bfloat16()
    all_argmax = all_greedy.float().argmax(-1)
    for _ in range(3):
        ids = _call_sampler(tag, fn, all_greedy, metadata([0.0] * 16), 16)
        if not torch.equal(ids, all_argmax):
            row = int((ids != all_argmax).nonzero()[0])
            tied = int((all_greedy[row] == all_greedy[row].max()).sum()) > 1
            fail(tag, f"an all-greedy batch did not give argmax(logits) (row {row}"
                      f"{', whose maximum is tied' if tied else ''})",
                 tie_hint if tied else "temperature 0 means argmax, exactly")
    with HostSyncSpy() as spy:
        call_student(tag, fn, logits, meta)
        call_student(tag, fn, logits, metadata([1.0] * 8))
    if spy.seen:
        fail(tag, _sync_message(spy.seen) + "; the engine's decode step (a CUDA graph) cannot wait for the host",
             "no .item(), no `if tensor:`, no Python loop over rows: tensor ops on the whole batch")
    _check_planted_noise(tag, fn, g)
    # State across calls: each step must draw fresh noise. REPEATS calls of REPEAT_ROWS rows each.
    vocab = 40
    row = _logits(g, 1, vocab, 1.5)[0]
    probs = torch.softmax(row, -1)
    meta1 = metadata([1.0] * REPEAT_ROWS)
    batch = row.expand(REPEAT_ROWS, vocab).contiguous()
    draws = [_call_sampler(tag, fn, batch, meta1, REPEAT_ROWS) for _ in range(REPEATS)]
    reseed_hint = ("draw fresh noise on every call from the global generator (torch.empty_like(probs).exponential_()"
                   "): seeding a generator inside the sampler (torch.manual_seed, or a new torch.Generator with a "
                   "fixed seed) makes every decode step draw the same noise")
    # Shared noise first: one noise row for the whole batch gives each call a single token, and three such
    # calls draw the same one often enough (a few % here) to look like noise that never changes.
    if all(len(set(d.tolist())) == 1 for d in draws[:5]):
        fail(tag, f"in each of 5 calls all {REPEAT_ROWS} rows (equal logits, T=1) drew the same token: the rows share "
                  "one noise draw", "draw noise of the batch's shape, [B, V] (torch.empty_like(probs).exponential_()), "
                                    "not one [1, V] row broadcast over the batch: each row is its own request")
    if all(torch.equal(draws[0], d) for d in draws[1:3]):
        fail(tag, f"three calls with the same {REPEAT_ROWS} rows at T=1 drew exactly the same tokens: the noise "
                  "does not change from call to call", reseed_hint)
    counts = _draw_counts(torch.stack(draws), vocab)
    pv = chi_square_p(counts, probs)
    if pv < P_FAIL:
        if len({tuple(d.tolist()) for d in draws}) < REPEATS:
            fail(tag, f"{REPEATS} calls of {REPEAT_ROWS} rows at T=1 do not follow softmax(logits) together "
                      f"(chi-squared p = {pv:.1e}), and some calls drew exactly what an earlier one drew: the noise "
                      "repeats", reseed_hint)
        with RandomOpsSpy() as rng:
            call_student(tag, fn, batch, meta1)
        fail(tag, f"{REPEATS} calls of {REPEAT_ROWS} rows at T=1 (no top-k, top-p) do not follow softmax(logits) "
                  f"(chi-squared p = {pv:.1e}), though no call repeats another", _noise_hint(rng.seen))
    # Statistics: 40k draws per setting, in one call each.
    settings = [(0.5, 0, 1.0), (1.0, 0, 1.0), (2.0, 0, 1.0), (1.0, 8, 1.0), (1.0, 0, 0.7), (0.8, 12, 0.8),
                (2.0, 0, 0.7)]        # T = 2 widens the nucleus: top-p before the temperature keeps T = 1's
    for t, k, p in settings:
        meta = metadata([t] * DRAWS, [k] * DRAWS if k else None, [p] * DRAWS if p < 1 else None)
        want = reference_top_k_top_p(reference_temperature_probs(row[None], meta.temperatures[:1]),
                                     meta.top_k[:1] if k else None, meta.top_p[:1] if p < 1 else None)[0]
        ids = _call_sampler(tag, fn, row.expand(DRAWS, vocab), meta, DRAWS)
        counts = _draw_counts(ids, vocab)
        setting = f"T={t}" + (f", top_k={k}" if k else "") + (f", top_p={p}" if p < 1 else "")
        bad = impossible_draws(counts, want)
        pv = chi_square_p(counts, want)
        if pv >= P_FAIL and not bad:
            continue
        plain = reference_temperature_probs(row[None], meta.temperatures[:1])[0]
        candidates = [
            (_filters_then_temperature(row, t, k, p), "the frequencies are those of top-k / top-p applied before the "
             "temperature", "the temperature first, then top-k / top-p on softmax(logits / T) (HF's and vLLM's "
             "order): top-p's nucleus depends on T"),
            (torch.softmax(row, -1) if t != 1 else None, "the frequencies follow softmax(logits): the temperature "
             "is not applied", "pass metadata.temperatures to temperature_probs"),
            (plain, "the frequencies ignore top-k / top-p", "apply top_k_top_p when metadata.top_k or top_p is set"),
        ]
        for cand, msg, hint in candidates:
            if cand is None:
                continue
            if not torch.equal(cand > 0, want > 0) or not torch.allclose(cand, want, atol=1e-4):
                if impossible_draws(counts, cand) == 0 and chi_square_p(counts, cand) >= P_FAIL:
                    fail(tag, f"with {setting}, {msg} (chi-squared p = {pv:.1e} against the right distribution)", hint)
        if bad:
            fail(tag, f"with {setting}, {bad} of {DRAWS} draws were tokens that top-k / top-p removed",
                 "sample from the filtered probabilities (E8.3), not from the unfiltered ones")
        with RandomOpsSpy() as rng:
            call_student(tag, fn, row.expand(8, vocab), metadata([t] * 8))
        fail(tag, f"with {setting}, {DRAWS} draws do not follow the filtered distribution (chi-squared p = {pv:.1e})",
             _noise_hint(rng.seen))
    ok(tag)


# -- E8.5 -----------------------------------------------------------------------------------------------------
def _penalty_case(g: torch.Generator, rows: int, vocab: int, dtype: torch.dtype):
    """One batch for E8.5 with every adversarial class in it (check_penalties' docstring)."""
    logits = _logits(g, rows, vocab, 3.0)
    prompt_len = max(1, vocab // 3)
    prompts = torch.randint(0, vocab, (rows, prompt_len), generator=g)
    # few distinct output ids, so tokens repeat; counts up to 6
    outputs = torch.randint(0, max(1, min(vocab, 6)), (rows, 6), generator=g)
    prompt_mask = torch.zeros(rows, vocab, dtype=torch.bool)
    prompt_mask[torch.arange(rows).unsqueeze(-1), prompts] = True
    counts = torch.zeros(rows, vocab, dtype=torch.int32)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.int32))
    if vocab >= 4:
        counts[:, 0], prompt_mask[:, 0] = 3, False              # token 0: output only, three times
        counts[:, 1], prompt_mask[:, 1] = 0, True               # token 1: prompt only
        counts[:, 2], prompt_mask[:, 2] = 1, True               # token 2: both
        counts[:, 3], prompt_mask[:, 3] = 0, False              # token 3: never seen, tied with token 2
        logits[:, 3] = logits[:, 2]
        logits[0, 0] = 0.0
        logits[-1, 2] = logits[-1, 3] = -0.0
        logits[:, 1] = -logits[:, 1].abs() - 0.5                # a negative seen logit
        logits[rows // 2, 0] = float("-inf")                    # masked earlier (min_tokens): stays -inf
    settings = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.5], [1.2, 0.0, 1.0], [0.0, 0.8, 1.0],
                             [-0.7, -1.1, 0.6], [2.0, 2.0, 2.0], [0.3, -0.4, 1.25]])
    pick = torch.cat([torch.arange(min(rows, 7)), torch.randint(1, 7, (max(0, rows - 7),), generator=g)])
    presence, frequency, repetition = settings[pick].unbind(-1)
    return logits.to(dtype), prompt_mask, counts, presence, frequency, repetition


def _penalty_variants(z, prompt_mask, counts, presence, frequency, repetition):
    """(wrong penalties on the case's fp32 logits z, message, hint): the plausible mistakes, each computed
    from the same inputs."""
    c = counts.float()
    out = c > 0
    seen = prompt_mask | out
    p, f, r = presence.unsqueeze(-1), frequency.unsqueeze(-1), repetition.unsqueeze(-1)

    def rep(zz, where, rr=r, rule="sign"):
        if rule == "sign":
            hit = torch.where(zz < 0, zz * rr, zz / rr)
        elif rule == "divide":
            hit = zz / rr
        elif rule == "positive_only":                           # the negatives left as they were
            hit = torch.where(zz < 0, zz, zz / rr)
        else:                                                   # swapped: divide the negatives
            hit = torch.where(zz < 0, zz / rr, zz * rr)
        return torch.where(where, hit, zz)

    def sub(zz, cc=c, mask=out, pp=p, ff=f):
        return zz - ff * cc - pp * mask.float()

    variants = [
        (sub(rep(z, seen, rule="divide")), "a negative logit of a seen token moved UP: you divided every seen "
         "logit by the repetition penalty", "z / r is smaller only for z > 0; for z < 0 multiply (z * r), so the "
         "token always becomes less likely"),
        (sub(rep(z, seen, rule="positive_only")), "a negative logit of a seen token did not move: you divided the "
         "positive logits by the repetition penalty and left the negative ones", "for z < 0 multiply (z * r): "
         "a seen token with a negative logit must become less likely too"),
        (sub(rep(z, seen, rule="swapped")), "the repetition penalty's sign rule is swapped (negative logits divided, "
         "positive multiplied)", "torch.where(z < 0, z * r, z / r)"),
        (sub(rep(z, out)), "tokens seen only in the prompt got no repetition penalty",
         "the repetition penalty counts prompt and output tokens: prompt_mask | (output_counts > 0)"),
        (sub(rep(z, seen), mask=seen), "tokens seen only in the prompt got the presence penalty",
         "presence and frequency count the OUTPUT tokens only (OpenAI's definition); only the repetition penalty "
         "looks at the prompt"),
        (sub(rep(z, seen), cc=c + prompt_mask.float()), "prompt tokens were counted by the frequency penalty",
         "frequency * output_counts: the prompt does not count"),
        (sub(rep(z, seen), mask=out, pp=p * c), "the presence penalty was multiplied by the count",
         "presence is subtracted once for a token that occurs (count > 0), however often it occurs; frequency is "
         "the one that scales with the count"),
        (sub(rep(z, seen), cc=out.float()), "the frequency penalty was applied once per token, not once per "
         "occurrence", "subtract frequency * output_counts (a token seen 3 times loses 3 * frequency)"),
        (rep(sub(z), seen), "the penalties ran in the wrong order: frequency and presence before the repetition "
         "penalty", "vLLM's order: the repetition penalty first (it scales the logit), then subtract frequency "
         "and presence"),
        (rep(z, seen) + f * c + p * out.float(), "frequency and presence were added, not subtracted",
         "a positive penalty makes a repeated token LESS likely: z - frequency * count - presence"),
        (sub(rep(z, torch.ones_like(seen))), "the repetition penalty changed tokens that were never seen",
         "apply it only where prompt_mask | (output_counts > 0)"),
    ]
    if z.shape[0] == z.shape[1]:          # the settings along the vocabulary broadcast only in a square batch
        variants.append((sub(rep(z, seen, rr=repetition.unsqueeze(0)), pp=presence.unsqueeze(0),
                             ff=frequency.unsqueeze(0)),
                         "each row's settings were applied along the vocabulary (token j got row j's penalty): this "
                         "batch is square (B == V), so the shapes did not complain", "give the [B] settings a "
                         "vocabulary axis: presence.unsqueeze(-1) is [B, 1] and broadcasts over the row"))
    return variants


def check_penalties(fn) -> None:
    tag = "E8.5"
    g = fresh_generator()
    cases = [(1, 2, torch.float32), (6, 6, torch.float32), (4, 17, torch.float32), (7, 151, torch.bfloat16),
             (9, 300, torch.float32)]
    for rows, vocab, dtype in cases:
        logits, prompt_mask, counts, presence, frequency, repetition = _penalty_case(g, rows, vocab, dtype)
        given = {"logits": logits, "prompt_mask": prompt_mask, "output_counts": counts, "presence": presence,
                 "frequency": frequency, "repetition": repetition}
        before = {k: v.clone() for k, v in given.items()}
        with HostSyncSpy() as spy:
            got = call_student(tag, fn, logits, prompt_mask, counts, presence, frequency, repetition)
        check_unchanged(tag, before, given, "compute into new tensors (z = torch.where(...), z = z - ...); `z = "
                                            "logits.float()` is the SAME tensor for fp32 logits, so z -= ... "
                                            "rewrites the caller's logits")
        case = f"{rows} rows x {vocab} tokens, {str(dtype).replace('torch.', '')} logits"
        if spy.seen:
            fail(tag, _sync_message(spy.seen) + f" ({case})", "tensor ops on the whole batch: torch.where for the "
                 "sign rule and for the seen tokens, no Python loop over rows or tokens")
        want = reference_apply_penalties(logits, prompt_mask, counts, presence, frequency, repetition)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            check_close(tag, got, want, rtol=1e-6, atol=1e-6, what=f"penalised logits ({case})")
        if got.dtype != torch.float32:
            fail(tag, f"penalised logits have dtype {got.dtype} ({case}), expected torch.float32",
                 "convert the logits with .float() first (the sampler works in fp32)")
        if torch.isnan(got).any():
            fail(tag, f"your penalised logits contain NaN ({case}); this batch has a logit at -inf (masked by "
                      "min_tokens)", "-inf * 0 is NaN: pick with torch.where(seen, penalised, z) instead of "
                                     "multiplying by a 0/1 mask")
        if not torch.equal(torch.isneginf(got), torch.isneginf(want)):
            fail(tag, f"a logit at -inf (a token masked earlier) did not stay -inf, or a finite one became -inf "
                      f"({case})", "every penalty keeps -inf at -inf; do not clamp or replace infinite values")
        finite = torch.isfinite(want)
        a, e = got.where(finite, 0.0), want.where(finite, 0.0)
        if (a - e).abs().max() <= 1e-6 + 1e-6 * e.abs().max():
            continue
        for cand, msg, hint in _penalty_variants(logits.float(), prompt_mask, counts, presence, frequency, repetition):
            c = cand.where(finite, 0.0)
            if torch.isfinite(c).all() and ((a - c).abs() <= 1e-6 + 1e-6 * c.abs()).all():
                fail(tag, f"{msg} ({case})", hint)
        off = (presence == 0) & (frequency == 0) & (repetition == 1)
        if off.any() and not torch.equal(got[off].where(finite[off], 0.0), logits.float()[off].where(finite[off], 0.0)):
            fail(tag, f"a row with every penalty off (0, 0, 1) changed ({case})",
                 "presence = frequency = 0 and repetition = 1 must leave a row exactly as it was")
        check_close(tag, a, e, rtol=1e-6, atol=1e-6, what=f"penalised logits ({case})",
                    hint="repetition: torch.where(seen, torch.where(z < 0, z * r, z / r), z); then "
                         "z - frequency * count - presence * (count > 0)")
    ok(tag)


# -- the engine with the student's sampler -----------------------------------------------------------------
def your_sampler_in_the_engine(sample) -> None:
    """Ungraded: greedy ids through the engine with Parts(sampler=sample) (vs HF), then one sampled run.
    Prints one line per run, or one line if `sample` is still a stub."""
    import warnings

    from nanovllm_course.common import tiny_model_dir
    from nanovllm_course.engine_check import your_part_in_the_engine
    from nanovllm_course.export import is_stub
    from nanovllm_ref import LLM, Parts, SamplingParams
    if is_stub(sample) or any(is_stub(sample.__globals__.get(h)) for h in HELPERS if h in sample.__globals__):
        print("Your sample (or a piece it calls) is still a stub, so the engine would run the reference. "
              "Fill in E8.1-E8.4, then run this cell again.")
        return
    your_part_in_the_engine(sample=sample)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(tiny_model_dir("qwen3"), parts=Parts(sampler=sample), device="cpu", kvcache_block_size=4,
                      max_model_len=64)
            try:
                sps = [SamplingParams(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True),
                       SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8, ignore_eos=True),
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
                outs = llm.generate([[5, 9, 11, 3], [100, 4], [7, 13, 21]], sps, use_tqdm=False)
            finally:
                llm.exit()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"The sampled run with your sample failed: {type(exc).__name__}: {first[:200]}")
        return
    n = sum(len(o["token_ids"]) for o in outs)
    print(f"Sampled run with your sample (top_k=20 / top_p=0.9 / greedy rows in one batch): {n} tokens, "
          f"all in the vocabulary: {all(0 <= t < 512 for o in outs for t in o['token_ids'])}.")


HELPERS = ("temperature_probs", "top_k_top_p", "exponential_race")


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402

# sample() calls the E8.1-E8.3 helpers; E8.4's check runs it inside the engine
EXERCISES = exercises(
    Exercise("E8.1", check_temperature_probs, ("temperature_probs",), (reference_temperature_probs,)),
    Exercise("E8.2", check_exponential_race, ("exponential_race",), (reference_exponential_race,)),
    Exercise("E8.3", check_top_k_top_p, ("top_k_top_p",), (reference_top_k_top_p,)),
    Exercise("E8.4", check_sample, ("sample",), (reference_sample,), parts=(
        EnginePart("sample", "sampler", "E8.1-E8.4", check=lambda mod: check_sample(mod.sample)),)),
    Exercise("E8.5", check_penalties, ("apply_penalties",), (reference_apply_penalties,)),
)
PARTS = parts_of(EXERCISES)
