"""Turn logits into next tokens, greedy and sampled rows in one batch (chapter 08).

Sampling uses the Gumbel-max / exponential-race trick: argmax(p_i / E_i) with E_i ~ Exp(1) is a sample
from p, with no cumulative sum and no host sync, so it compiles into one fused kernel (torch.compile) and
fits in the decode step. Rows with temperature 0 take argmax(logits). Logits are divided by the
temperature in fp32: bf16 has 8 bits of mantissa, too few for the small probabilities of a sharpened
softmax.
"""
import functools

import torch
from torch import nn


def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits: [num_seqs, vocab] any float dtype; temperatures: [num_seqs] fp32, >= 0.
    Returns [num_seqs] int64 token ids."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits / t.unsqueeze(-1), dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0)
    sampled = (probs / noise).argmax(dim=-1)
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
