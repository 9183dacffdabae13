"""Turn logits into next tokens, greedy and sampled rows in one batch (chapter 08).

Sampling uses the Gumbel-max / exponential-race trick: argmax(p_i / E_i) with E_i ~ Exp(1) is a sample
from p, with no cumulative sum and no host sync, so it compiles into one fused kernel (torch.compile) and
fits in the decode step. Rows with temperature 0 take argmax(logits). Logits are divided by the
temperature in fp32: bf16 keeps 7 stored mantissa bits (8 significant bits), too few for the small
probabilities of a sharpened softmax. The noise is floored at fp32's smallest normal number: an Exp(1)
draw of exactly 0 would make p / noise = 0 / 0 = NaN for a zero-probability token, and argmax would pick it.

The sampler is one of the engine's swappable parts (`nanovllm_ref.Parts.sampler`): a function
`(logits, metadata) -> token ids`. The all-greedy shortcut lives here, not in the model runner, so a
replacement sampler is exercised by greedy runs too.
"""
from dataclasses import dataclass

import torch

from nanovllm_ref.utils.fusion import fused


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs: [num_seqs, vocab] fp32; noise: same shape, Exp(1) draws (>= 0). Returns [num_seqs] int64
    argmax(probs / max(noise, tiny)): a token with probability 0 never wins, whatever the draw."""
    return (probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


@dataclass(frozen=True)
class SamplingMetadata:
    """What the sampler knows about the batch. temperatures: [num_seqs] fp32 on the logits' device, >= 0
    (0 = greedy). all_greedy: True when every temperature is 0 (known on the host, so checking it costs no
    device sync)."""
    temperatures: torch.Tensor
    all_greedy: bool


@fused
def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits: [num_seqs, vocab] any float dtype; temperatures: [num_seqs] fp32, >= 0.
    Returns [num_seqs] int64: argmax where the temperature is 0, a draw from softmax(logits / T) elsewhere."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits / t.unsqueeze(-1), dim=-1)
    sampled = exponential_race(probs, torch.empty_like(probs).exponential_(1.0))
    return torch.where(temperatures > 0, sampled, greedy)


def _sample(rows, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.all_greedy:                 # no noise to draw: one argmax
        return logits.argmax(dim=-1)
    return rows(logits, metadata.temperatures)


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The reference sampler: [num_seqs, vocab] logits -> [num_seqs] int64 token ids (see module docstring)."""
    return _sample(sample_rows, logits, metadata)


def sample_compiled(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """`sample` with the row draw compiled by torch.compile (what an engine with fusion on calls)."""
    return _sample(sample_rows.compiled(), logits, metadata)


sample.compiled = lambda: sample_compiled
