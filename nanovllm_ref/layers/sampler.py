"""Turn logits into next tokens, greedy and sampled rows in one batch (chapter 08).

Sampling uses the Gumbel-max / exponential-race trick: argmax(p_i / E_i) with E_i ~ Exp(1) is a sample
from p, with no cumulative sum and no host sync, so it compiles into one fused kernel (torch.compile) and
fits in the decode step. Rows with temperature 0 take argmax(logits). Logits are divided by the
temperature in fp32: bf16 has 8 bits of mantissa, too few for the small probabilities of a sharpened
softmax. The noise is floored at fp32's smallest normal number: an Exp(1) draw of exactly 0 would make
p / noise = 0 / 0 = NaN for a zero-probability token, and argmax would pick it.
"""
import functools

import torch
from torch import nn


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs: [num_seqs, vocab] fp32; noise: same shape, Exp(1) draws (>= 0). Returns [num_seqs] int64
    argmax(probs / max(noise, tiny)): a token with probability 0 never wins, whatever the draw."""
    return (probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits: [num_seqs, vocab] any float dtype; temperatures: [num_seqs] fp32, >= 0.
    Returns [num_seqs] int64 token ids."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits / t.unsqueeze(-1), dim=-1)
    sampled = exponential_race(probs, torch.empty_like(probs).exponential_(1.0))
    return torch.where(temperatures > 0, sampled, greedy)


@functools.lru_cache(maxsize=None)
def compiled_sample():
    """`sample` compiled once per process (every engine shares it), with a dynamic batch dimension."""
    return torch.compile(sample, dynamic=True)


class Sampler(nn.Module):
    def __init__(self, compile: bool = False):
        super().__init__()
        self.fn = compiled_sample() if compile else sample

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        return self.fn(logits, temperatures)
