"""Logits processors: what a request's settings do to its logits before the sampler draws (chapter 08).

Three penalties, in vLLM's order (vllm/v1/sample/sampler.py, `apply_penalties`), on fp32 logits z of one row:
1. repetition_penalty r (HF's RepetitionPenaltyLogitsProcessor, CTRL, Keskar et al. 2019), over every token
   that occurs in the prompt or in the output so far: z / r where z >= 0, z * r where z < 0 (so r > 1 always
   makes a seen token less likely, whatever the sign of its logit); r = 1 is off.
2. frequency_penalty f: z - f * c, c the token's count in the output so far (OpenAI's definition);
3. presence_penalty p: z - p * [c > 0]. f = p = 0 is off; negative values encourage repetition.
Penalties change logits before the greedy argmax too (as in HF and vLLM), so a greedy row with a penalty is
not the plain argmax. Prompt tokens count for the repetition penalty only (vLLM: prompt mask | output
mask; HF's processor sees prompt + output ids); presence and frequency count output tokens only.

min_p (HF's MinPLogitsWarper; vLLM applies it after the temperature and before top-k / top-p): keep the
tokens whose probability under softmax(z / T) is at least min_p times the row's largest probability. It
never drops the most likely token and needs no sort: one softmax, one max, one compare. The processor here
writes -inf into the logits of the dropped tokens, *before* the sampler divides by T again: masking before
or after dividing by T is the same, and the sampler's softmax then renormalises over the kept tokens, so
any sampler part (the reference or a student's `Parts.sampler`) draws from vLLM's distribution. Greedy rows
are left alone (the most likely token always stays, so their argmax cannot change).

The counts come from the token ids of each row, counted on the device (`bin_counts`), built before the
step's forward (engine/sampling_inputs.py), so under async scheduling the newest output token, still on its
way to the host, is read from the previous step's ids on the device.

Shapes: logits [B, V]; prompt_mask [B, V] bool; output_counts [B, V] int; per-row settings [B] fp32.
All functions return a new tensor and leave their inputs unchanged; none of them syncs with the host.
"""
from dataclasses import dataclass

import torch

from nanovllm_ref.layers.sampler import finite_rows


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor | None, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] float; prompt_mask: [B, V] bool (the token occurs in the row's prompt) or None (no
    prompt tokens count: every repetition penalty is 1, or only output tokens matter); output_counts:
    [B, V] int (occurrences in the output so far); presence, frequency, repetition: [B] fp32 (0, 0, 1 =
    off). Returns a new [B, V] fp32 tensor: the repetition penalty (divide z >= 0, multiply z < 0, where the
    token was seen in the prompt or the output), then z - frequency * count, then z - presence * [count > 0].
    Exactly HF's RepetitionPenaltyLogitsProcessor for the first step (the same fp32 division and product)."""
    z = logits.to(torch.float32, copy=True)
    seen = output_counts > 0
    if prompt_mask is not None:
        seen = seen | prompt_mask
    r = repetition.to(torch.float32).unsqueeze(-1)
    penalised = torch.where(z < 0, z * r, z / r)
    z = torch.where(seen, penalised, z)
    z = z - frequency.to(torch.float32).unsqueeze(-1) * output_counts.to(torch.float32)
    return z - presence.to(torch.float32).unsqueeze(-1) * (output_counts > 0).to(torch.float32)


def min_p_keep(logits: torch.Tensor, temperatures: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] float; temperatures: [B] fp32 (> 0 for the rows min_p applies to); min_p: [B] fp32 in
    [0, 1] (0 = off). Returns [B, V] bool, True for the tokens min_p keeps: p >= min_p * max(p) with
    p = softmax(z / T) in fp32 (HF's MinPLogitsWarper after TemperatureLogitsWarper; rows with T = 0 are
    divided by 1). Non-finite logits as the sampler treats them (layers/sampler.finite_rows)."""
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures)).unsqueeze(-1)
    probs = torch.softmax(finite_rows(logits.float() / t), dim=-1)
    threshold = min_p.to(torch.float32).unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    return probs >= threshold


def apply_min_p(logits: torch.Tensor, temperatures: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`logits` with -inf where `min_p_keep` drops a token, in the rows where min_p > 0 and T > 0 (a new
    tensor, same dtype). The sampler's softmax(z / T) of the result is HF's min-p distribution."""
    drop = ~min_p_keep(logits, temperatures, min_p) & ((min_p > 0) & (temperatures > 0)).unsqueeze(-1)
    return logits.masked_fill(drop, float("-inf"))


def bin_counts(rows: torch.Tensor, token_ids: torch.Tensor, num_rows: int, vocab: int) -> torch.Tensor:
    """rows, token_ids: [N] int64 on one device (token token_ids[i] occurs once in row rows[i]). Returns
    [num_rows, vocab] int32 occurrence counts, counted on the device (scatter_add; no host sync)."""
    counts = torch.zeros(num_rows * vocab, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(0, rows * vocab + token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts.view(num_rows, vocab)


@dataclass(frozen=True)
class LogitsProcessing:
    """What the processors need for one batch (built by engine/sampling_inputs.logits_processing; None there
    when no row uses a penalty or min_p). All tensors on the logits' device.
    presence, frequency, repetition: [B] fp32 (0, 0, 1 for rows without penalties); output_counts: [B, V]
    int32, or None when no row has a penalty; prompt_mask: [B, V] bool, or None when no row has a repetition
    penalty; min_p: [B] fp32 (0 = off, also for greedy rows), or None when no sampled row uses it;
    temperatures: [B] fp32 (min_p's softmax is taken after the temperature)."""
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    temperatures: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> processed [B, V] (fp32 when a penalty runs): penalties, then min_p."""
        if self.output_counts is not None:
            logits = apply_penalties(logits, self.prompt_mask, self.output_counts, self.presence,
                                     self.frequency, self.repetition)
        if self.min_p is not None:
            logits = apply_min_p(logits, self.temperatures, self.min_p)
        return logits
