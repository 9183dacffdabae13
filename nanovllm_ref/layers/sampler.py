"""Turn logits into next tokens, greedy and sampled rows in one batch (chapter 08).

Sampling uses the Gumbel-max / exponential-race trick: argmax(p_i / E_i) with E_i ~ Exp(1) is a sample
from p, with no cumulative sum and no host sync, so it compiles into one fused kernel (torch.compile) and
fits in the decode step. Rows with temperature 0 take argmax(logits). Logits are divided by the
temperature in fp32: bf16 keeps 7 stored mantissa bits (8 significant bits), too few for the small
probabilities of a sharpened softmax. The noise is floored at fp32's smallest normal number: an Exp(1)
draw of exactly 0 would make p / noise = 0 / 0 = NaN for a zero-probability token, and argmax would pick it.

Top-k and top-p (nucleus) filtering, per row, after the temperature and in this order (as HF's
TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper and vLLM do):
- top-k keeps every logit >= the k-th largest (ties with the k-th are kept); k = 0 means off;
- top-p sorts the remaining probabilities ascending and drops those whose running sum is <= 1 - top_p,
  always keeping the most likely token; top_p = 1 means off.
Both are masks on one ascending sort of the row, with per-row k and p read from tensors (gather, compare,
scatter): no `.item()`, no `nonzero`, no Python branch on a tensor value, so a batch mixing settings runs as
one graph. When no sampled row uses them, the metadata carries None and the sort is skipped (decided on
the host from the requests' settings, not from tensors).

Random numbers, counter-based: the engine passes each row's `seeds` (one per request, from
`SamplingParams.seed` or drawn by the engine from its own seed) and `counters` (the index of the token being
sampled), and the Exp(1) noise of row b, token v is a pure function of (seed_b, counter_b, v), computed by an
integer hash (`exponential_noise`). So a request's samples do not depend on what else is in the batch or on
any other random draw in the process (torch's global generator is never touched), a CUDA graph replays them
with no generator state to register, and a preempted request that is recomputed samples the same tokens.
This is the idea of counter-based generators (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011; JAX's PRNG). Without seeds (the course's checks, a sampler of your own) the noise comes from
torch's generator, as before.

Non-finite logits (an fp16 overflow gives +inf; a broken model NaN). softmax of a row holding +inf is NaN
everywhere (inf - inf), and argmax of a row holding NaN picks the NaN: left alone, every sampled row of such a
batch would return the first NaN's index, silently. So every row goes through `finite_rows` first:
- NaN logits become -inf: a NaN never wins, greedy or sampled;
- a row holding +inf keeps only its +inf tokens, which share the probability mass equally (the limit of
  softmax as those logits grow together): their logits become 0, all others -inf. Greedy takes the first
  of them, as argmax does; a sampled row draws one of them uniformly, whatever the temperature.
A row with nothing left (all NaN or -inf) has no distribution; it gives token 0, as argmax of it does.

The sampler is one of the engine's swappable parts (`nanovllm_ref.Parts.sampler`): a function
`(logits, metadata) -> token ids`. The all-greedy shortcut lives here, not in the model runner, so a
replacement sampler is exercised by greedy runs too.
"""
import functools
from dataclasses import dataclass

import torch

from nanovllm_ref.utils.fusion import fused


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits: [num_seqs, vocab] float. Returns the same shape and dtype with NaN -> -inf, and in each row that
    holds +inf: +inf -> 0, everything else -> -inf (module docstring). Rows of finite logits are unchanged.
    No host sync."""
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    posinf = logits == float("inf")
    has_posinf = posinf.any(dim=-1, keepdim=True)
    return torch.where(has_posinf, torch.where(posinf, 0.0, float("-inf")).to(logits.dtype), logits)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """[num_seqs, vocab] -> [num_seqs] int64: argmax with NaN never winning (the first +inf wins a row that
    has one, as plain argmax does)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")).argmax(dim=-1)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs: [num_seqs, vocab] fp32; noise: same shape, Exp(1) draws (>= 0). Returns [num_seqs] int64
    argmax(probs / max(noise, tiny)): a token with probability 0 never wins, whatever the draw."""
    return (probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2**32): every input bit flips
    each output bit with probability ~1/2. Products overflow int64 and wrap; the low 32 bits are still exact."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds, counters: [num_seqs] int (a seed in [0, 2**32) and the index of the token being sampled).
    Returns [num_seqs, vocab] fp32 Exp(1) draws, a pure function of (seed, counter, token id): hash the three
    to 32 uniform bits u, then -log(1 - u) with u in [2**-33, 1 - 2**-24] (finite, never 0)."""
    row = _mix32((seeds.long() & _M32) ^ ((counters.long() * 0x9E3779B1) & _M32))
    col = (torch.arange(vocab, device=seeds.device, dtype=torch.int64) * 0x27D4EB2F) & _M32
    bits = _mix32(_mix32(row.unsqueeze(-1) ^ col) ^ row.unsqueeze(-1))
    u = ((bits.float() + 0.5) * 2.0**-32).clamp(max=1 - 2.0**-24)
    return -torch.log1p(-u)


@dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler knows about the batch, all tensors on the logits' device.
    temperatures: [num_seqs] fp32, >= 0 (0 = greedy).
    all_greedy: True when every temperature is 0 (known on the host, so checking it costs no device sync).
    top_k: [num_seqs] int64, 0 = off for that row; None when no sampled row uses top-k.
    top_p: [num_seqs] float64 (the request's Python float, exactly, so 1 - top_p rounds as HF's does),
        1.0 = off for that row; None when no sampled row uses top-p.
    seeds, counters: [num_seqs] int64, each row's request seed in [0, 2**32) and the index of the token it
        samples (the sequence's length before it): the noise is `exponential_noise(seeds, counters)`.
        None: the noise comes from torch's global generator."""
    temperatures: torch.Tensor
    all_greedy: bool
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    counters: torch.Tensor | None = None


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """logits: [num_seqs, vocab] fp32 (already divided by the temperature); top_k: [num_seqs] int (0 = off)
    or None; top_p: [num_seqs] float (1 = off) or None. Returns a new fp32 tensor, the removed logits set to
    -inf (at least one token per row survives). No host sync."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1, stable=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).long()
        kth_largest = ascending.gather(-1, (vocab - k).unsqueeze(-1))
        ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    if top_p is not None:
        running = ascending.softmax(dim=-1).cumsum(dim=-1)
        # 1 - top_p rounded once from float64 to fp32, as HF's comparison with a Python float does. Rows with
        # top_p = 1 drop nothing (not even tokens whose probability underflows to 0).
        threshold = torch.where(top_p < 1, 1 - top_p.double(), -1.0).to(torch.float32).unsqueeze(-1)
        drop = running <= threshold
        drop[:, -1] = False                   # the most likely token always stays
        ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ascending)


@fused
def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None = None,
                top_p: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
                counters: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [num_seqs, vocab] any float dtype; temperatures: [num_seqs] fp32, >= 0; top_k, top_p, seeds,
    counters as in SamplingMetadata (None: off for every row / noise from torch's generator). Returns
    [num_seqs] int64: argmax where the temperature is 0, a draw from the filtered softmax(logits / T)
    elsewhere, non-finite logits handled by `finite_rows` first. The engine compiles it for the unfiltered
    case only (top_k = top_p = None)."""
    logits = finite_rows(logits.float())
    greedy = logits.argmax(dim=-1)
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    scaled = top_k_top_p_filter(logits / t.unsqueeze(-1), top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    if seeds is None:
        noise = torch.empty_like(probs).exponential_(1.0)
    else:
        noise = exponential_noise(seeds, counters, probs.shape[-1])
    sampled = exponential_race(probs, noise)
    return torch.where(temperatures > 0, sampled, greedy)


def _sample(rows, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.all_greedy:                 # no noise to draw: one argmax (NaN never wins)
        return greedy_ids(logits)
    if metadata.top_k is not None or metadata.top_p is not None:
        # Filters run uncompiled: the sort dominates their cost, and Inductor (torch 2.11) fails to generate
        # the dynamic-shape cumsum over a 150k vocabulary (measured on the H200).
        return sample_rows(logits, metadata.temperatures, metadata.top_k, metadata.top_p, metadata.seeds,
                           metadata.counters)
    return rows(logits, metadata.temperatures, seeds=metadata.seeds, counters=metadata.counters)


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The reference sampler: [num_seqs, vocab] logits -> [num_seqs] int64 token ids (see module docstring)."""
    return _sample(sample_rows, logits, metadata)


def sampler_with(rows):
    """The reference sampler with `rows` as the draw of its unfiltered rows: `sample_rows` itself, compiled by
    torch.compile, or the Triton kernel of kernels/sampler.py (the engine's choice when Parts.sampler is the
    reference: nanovllm_ref/parts.py). Returns a function (logits, SamplingMetadata) -> [B] int64."""
    return functools.partial(_sample, rows)
