"""Log-probabilities of chosen tokens and of the most likely ones (SamplingParams.logprobs / prompt_logprobs).

Which distribution: the model's own, log_softmax of the raw logits, before the temperature, the penalties,
min_p, top-k / top-p and min_tokens' masks. That is vLLM's default (`logprobs_mode="raw_logprobs"`), and the
one a user comparing models or scoring text wants: a token's logprob does not change with the settings it was
sampled under, and prompt and completion logprobs are the same quantity. Non-finite logits are treated as
the sampler treats them (layers/sampler.finite_rows: NaN never counts, +inf tokens share the mass).

Shape, as vLLM's sampler returns it (`LogprobsTensors`): for N rows and k top tokens,
- token_ids [N, 1 + k] int64: column 0 the chosen token (the sampled one, or the prompt's next token), then
  the k most likely tokens, most likely first;
- logprobs [N, 1 + k] fp32, the same columns;
- ranks [N] int64: the chosen token's rank, the number of tokens whose logprob is >= its own (1 = the most
  likely; ties count every tied token, as vLLM's `batch_get_rank`).
The engine turns each row into vLLM's dict {token_id: Logprob(logprob, rank, decoded_token)}
(nanovllm_ref/outputs.py). No host sync: the tensors travel to the host with the step's token ids.
"""
from typing import NamedTuple

import torch

from nanovllm_ref.layers.sampler import finite_rows

ROWS_PER_PASS = 1024        # prompt logprobs: rows converted to fp32 at a time (bounds the [rows, vocab] temporary)


class LogprobsTensors(NamedTuple):
    token_ids: torch.Tensor      # [N, 1 + k] int64
    logprobs: torch.Tensor       # [N, 1 + k] fp32
    ranks: torch.Tensor          # [N] int64


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits (any float dtype) -> [N, V] fp32 log_softmax of the model's distribution."""
    return torch.log_softmax(finite_rows(logits.float()), dim=-1)


def gather_logprobs(logits: torch.Tensor, num_top: int, chosen: torch.Tensor) -> LogprobsTensors:
    """logits: [N, V] raw logits; num_top: k >= 0, the top tokens to return per row; chosen: [N] int64 token
    ids. Returns LogprobsTensors (module docstring), computed ROWS_PER_PASS rows at a time."""
    parts = []
    for start in range(0, max(logits.shape[0], 1), ROWS_PER_PASS):
        lp = compute_logprobs(logits[start:start + ROWS_PER_PASS])
        # a copy: `chosen` may be a buffer the next step overwrites before these reach the host
        ids = chosen[start:start + ROWS_PER_PASS].to(torch.int64, copy=True).unsqueeze(-1)
        own = lp.gather(-1, ids)
        ranks = (lp >= own).sum(dim=-1)
        if num_top > 0:
            top_lp, top_ids = lp.topk(min(num_top, lp.shape[-1]), dim=-1)
            ids, own = torch.cat([ids, top_ids], dim=-1), torch.cat([own, top_lp], dim=-1)
        parts.append(LogprobsTensors(ids, own, ranks))
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(*(torch.cat(column) for column in zip(*parts)))
