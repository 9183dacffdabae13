"""A scheduled batch -> what the sampling side of one step reads (chapter 08).

The model runner (engine/model_runner.py) calls these on rank 0, once per step, for the B sequences of the
step in batch order (row i of the logits is seqs[i]):
- `sampling_metadata`: the sampler part's input (layers/sampler.SamplingMetadata: temperatures, top-k / top-p
  when a sampled row uses them, seeds and counters of the counter-based noise);
- `logits_processing`: the penalties' token counts and min_p (layers/logits_processors.LogitsProcessing), or
  None when no row uses them;
- `mask_stop_tokens`: min_tokens' ban (engine/stop.min_tokens_bans) written into the logits;
- `prompt_rows`: which of a prefill's packed tokens give prompt logprobs (SamplingParams.prompt_logprobs);
- `needs_sampler_after_graph`: whether a row can be sampled inside the decode CUDA graph.
Why a module of its own: these are the host's half of sampling. Every choice of a path (None or a tensor,
in the graph or after it) is made here from the requests' settings, never from a tensor's value, so the
step never waits for the device to decide; what the device computes (layers/sampler.py,
layers/logits_processors.py, layers/logprobs.py) stays free of Sequence objects. One batch mixing any
settings is one set of [B] tensors (a row's "off" value: top_k 0, top_p 1, penalties 0 / 0 / 1, min_p 0),
so it runs as one step. vLLM keeps the same per-row tensors in its InputBatch (vllm/v1/worker/).
"""
from typing import NamedTuple

import torch

from nanovllm_ref.engine.inputs import to_device
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.engine.stop import min_tokens_bans
from nanovllm_ref.layers.logits_processors import LogitsProcessing, bin_counts
from nanovllm_ref.layers.sampler import SamplingMetadata


def uses_filters(seq: Sequence) -> bool:
    """A sampled row with top-k or top-p on: it needs the sampler's filtered (uncompiled) path."""
    return seq.temperature > 0 and (seq.top_k > 0 or seq.top_p < 1)


def uses_min_p(seq: Sequence) -> bool:
    """A sampled row with min_p on (on a greedy row min_p cannot change the argmax: it is left out)."""
    return seq.temperature > 0 and seq.min_p > 0


def needs_sampler_after_graph(seq: Sequence) -> bool:
    """A row the in-graph sampler cannot serve: top-k / top-p (the filtered, uncompiled path), still short
    of its min_tokens (its stop ids are masked out of the logits first, engine/stop.py), or with logits
    processors (a penalty, or min_p on a sampled row: layers/logits_processors.py)."""
    return uses_filters(seq) or seq.num_completion_tokens < seq.min_tokens or seq.penalized or uses_min_p(seq)


def sampling_metadata(seqs: list[Sequence], device: torch.device) -> SamplingMetadata:
    """The sampler's view of the batch, its tensors on `device`: temperatures [B] fp32 (0 = greedy); top_k
    [B] int64 and top_p [B] fp64 (0 and 1.0 mean off for a row), or both None unless some sampled
    (temperature > 0) row uses either, one path for any mix; seeds [B] int64 and counters [B] int64 (the
    index of the token each row samples: the counter-based noise of layers/sampler.py), None when every
    row is greedy."""
    temperatures = [seq.temperature for seq in seqs]
    all_greedy = not any(t > 0 for t in temperatures)
    top_k = top_p = seeds = counters = None
    if any(map(uses_filters, seqs)):
        top_k = to_device([seq.top_k for seq in seqs], torch.int64, device)
        top_p = to_device([seq.top_p for seq in seqs], torch.float64, device)
    if not all_greedy:
        seeds = to_device([seq.seed for seq in seqs], torch.int64, device)
        counters = to_device([len(seq) for seq in seqs], torch.int64, device)
    return SamplingMetadata(to_device(temperatures, torch.float32, device), all_greedy=all_greedy,
                            top_k=top_k, top_p=top_p, seeds=seeds, counters=counters)


def logits_processing(seqs: list[Sequence], device: torch.device, vocab_size: int,
                      last_ids: torch.Tensor) -> LogitsProcessing | None:
    """The logits processors' view of the batch (layers/logits_processors.py), its tensors on `device`, or
    None when no row has a penalty and no sampled row has min_p.

    Fields: presence, frequency, repetition [B] fp32 and output_counts [B, vocab_size] int32 when a row has
    a penalty; prompt_mask [B, vocab_size] bool when a row has repetition_penalty != 1 (only that penalty
    counts prompt tokens); min_p and temperatures [B] fp32 when a sampled row has min_p.
    last_ids: [>= B] int64 on `device`, the previous step's sampled ids. A row whose newest output token is
    still pending on the host (async scheduling) has it counted from last_ids[seq.pending_row], on the
    device: so call this before the step's forward, whose graph writes its own ids there. Each penalised
    row's known tokens go to the device as one list per step (O(its tokens) host work, as vLLM's input batch
    does); the counts are made there (bin_counts). Raises RuntimeError for a sequence with more than one
    pending token (the engine never schedules one)."""
    penalized = [i for i, seq in enumerate(seqs) if seq.penalized]
    min_p = [seq.min_p if uses_min_p(seq) else 0.0 for seq in seqs]
    use_min_p = any(p > 0 for p in min_p)
    if not penalized and not use_min_p:
        return None
    fields = {}
    if use_min_p:
        fields["min_p"] = to_device(min_p, torch.float32, device)
        fields["temperatures"] = to_device([seq.temperature for seq in seqs], torch.float32, device)
    if penalized:
        n = len(seqs)
        sps = [seq.sampling_params for seq in seqs]
        for name, attr in (("presence", "presence_penalty"), ("frequency", "frequency_penalty"),
                           ("repetition", "repetition_penalty")):
            fields[name] = to_device([getattr(sp, attr) for sp in sps], torch.float32, device)
        # (row, token) pairs, one per occurrence: bin_counts turns them into counts on the device.
        out_rows, out_ids, pending_rows, pending_src, prompt_rows_of, prompt_ids = [], [], [], [], [], []
        for i in penalized:
            seq = seqs[i]
            known = seq.completion_token_ids
            out_rows += [i] * len(known)
            out_ids += known
            if seq.num_pending:
                if seq.num_pending > 1:
                    raise RuntimeError("a sequence reached a step with more than one pending token")
                pending_rows.append(i)
                pending_src.append(seq.pending_row)
            if sps[i].repetition_penalty != 1:
                prompt_rows_of += [i] * seq.num_prompt_tokens
                prompt_ids += seq.prompt_token_ids
        token_ids = to_device(out_ids, torch.int64, device)
        if pending_src:          # the pending ids never come to the host: gathered from last_ids on the device
            token_ids = torch.cat([token_ids, last_ids[to_device(pending_src, torch.int64, device)]])
        fields["output_counts"] = bin_counts(to_device(out_rows + pending_rows, torch.int64, device), token_ids,
                                             n, vocab_size)
        if prompt_rows_of:
            fields["prompt_mask"] = bin_counts(to_device(prompt_rows_of, torch.int64, device),
                                               to_device(prompt_ids, torch.int64, device), n, vocab_size) > 0
    return LogitsProcessing(**fields)


def mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], eos: frozenset) -> torch.Tensor:
    """logits [B, vocab] (any float dtype) with the eos and stop ids at -inf in the rows still short of
    their min_tokens (engine/stop.min_tokens_bans; HF's MinNewTokensLengthLogitsProcessor), as a new tensor
    of the same dtype; `logits` itself when no row is (decided on the host)."""
    bans = min_tokens_bans(seqs, eos, logits.shape[-1])
    if bans is None:
        return logits
    rows, cols = (to_device(x, torch.int64, logits.device) for x in bans)
    return logits.index_put((rows, cols), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


class PromptRows(NamedTuple):
    """Rank 0's plan for the prompt logprobs of one prefill step: rows (indices into the packed tokens, what
    ModelStep.logit_rows carries), targets (the prompt token each row's logits predict), owners ((sequence,
    first prompt position, count) per sequence, in row order) and num_top (the most top tokens a row asks for)."""
    rows: list[int]
    targets: list[int]
    owners: list[tuple[Sequence, int, int]]
    num_top: int


def prompt_rows(seqs: list[Sequence]) -> PromptRows | None:
    """For a prefill step over `seqs` (tokens [num_cached_tokens, + num_scheduled_tokens) of each, packed in
    order, as Parts.prepare_prefill lays them out): which packed tokens' logits give prompt logprobs, the
    prompt positions of each chunk not computed yet (position p's logits predict prompt token p + 1). None
    when no sequence needs them. Raises RuntimeError if a sequence that needs them skipped positions (a
    prefix-cache hit: the reference BlockManager never gives one to such a sequence)."""
    if not any(seq.needs_prompt_logprobs for seq in seqs):
        return None
    rows, targets, owners, num_top, offset = [], [], [], 0, 0
    for seq in seqs:
        start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
        if seq.needs_prompt_logprobs:
            done = seq.num_prompt_logprobs_launched
            if start > done:
                raise RuntimeError(f"a sequence with prompt_logprobs starts its prefill at position {start} but its "
                                   f"logits are computed up to {done} only: a block manager gave it a prefix-cache "
                                   "hit (the reference one does not, for such a sequence)")
            lo, hi = max(start, done), min(end, seq.num_prompt_tokens - 1)
            if hi > lo:
                rows.extend(range(offset + lo - start, offset + hi - start))
                targets.extend(seq.token_ids[lo + 1:hi + 1])
                owners.append((seq, lo, hi - lo))
                num_top = max(num_top, seq.num_prompt_logprobs)
        offset += end - start
    return PromptRows(rows, targets, owners, num_top) if rows else None
