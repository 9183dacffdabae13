"""A scheduled batch -> what the sampling side of one step reads, as plain data (chapter 08).

`sampling_rows(seqs, eos, vocab_size)` reads the B sequences of a step once, in batch order (row i of the
logits is seqs[i]), on the engine's side of the step (engine/step_batch.py), and returns a `SamplingRows`:
numpy arrays and ints, no Sequence objects. Each setting is read once and serves every consumer:
temperatures feed the sampler, min_p's softmax and the decode graph's in-step sampler alike. The model runner
turns the record into device tensors:
- `sampling_metadata(rows, device)`: the sampler part's input (layers/sampler.SamplingMetadata: temperatures,
  top-k / top-p when a sampled row uses them, seeds and counters of the counter-based noise);
- `logits_processing(rows, device, vocab_size, last_ids)`: the penalties' token counts and min_p
  (layers/logits_processors.LogitsProcessing), or None when no row uses them;
- `mask_stop_tokens(logits, rows)`: min_tokens' ban (engine/stop.min_tokens_bans) written into the logits.
`prompt_rows(seqs)` says which of a prefill's packed tokens give prompt logprobs (SamplingParams.prompt_logprobs).
Why a module of its own: these are the host's half of sampling. Every choice of a path (None or a tensor,
in the graph or after it: `SamplingRows.after_graph`) is made here from the requests' settings, never from a
tensor's value, so the step never waits for the device to decide; what the device computes
(layers/sampler.py, layers/logits_processors.py, layers/logprobs.py) stays free of Sequence objects. One batch
mixing any settings is one set of [B] arrays (a row's "off" value: top_k 0, top_p 1, penalties 0 / 0 / 1,
min_p 0), so it runs as one step. vLLM keeps the same per-row arrays in its InputBatch (vllm/v1/worker/).
"""
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
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
    """A row the in-graph sampler cannot serve: top-k / top-p (the filtered path), still short of its
    min_tokens (its stop ids are masked out of the logits first, engine/stop.py), or with logits processors
    (a penalty, or min_p on a sampled row: layers/logits_processors.py)."""
    return uses_filters(seq) or seq.num_completion_tokens < seq.min_tokens or seq.penalized or uses_min_p(seq)


class Pairs(NamedTuple):
    """(row, token id) pairs, one per occurrence, as two [N] int64 arrays: what `bin_counts` counts."""
    rows: np.ndarray
    ids: np.ndarray


@dataclass(frozen=True)
class SamplingRows:
    """The sampling side of one step, one entry per row (module docstring).

    temperatures [B] fp32 (0 = greedy); seeds [B] int64 in [0, 2**32); counters [B] int64, the index of the
    token each row samples (its length before it: the counter-based noise of layers/sampler.py); all_greedy:
    every temperature is 0. top_k [B] int64 and top_p [B] fp64 (0 and 1.0 = off), both None unless a sampled
    row uses either. min_p [B] fp32 (0 = off, greedy rows too), None unless a sampled row uses it.
    penalties [3, B] fp32 (presence, frequency, repetition; 0, 0, 1 = off) with `outputs` (the known output
    tokens of the penalised rows, Pairs), `pending` (Pairs of (row, row of the previous step's ids) for a
    penalised row whose newest token is still on its way: async scheduling) and `prompts` (prompt tokens of
    rows with repetition_penalty != 1, Pairs, or None), all None when no row has a penalty. bans: Pairs of the
    logits min_tokens masks this step, or None. num_logprobs: the most top tokens a row asks logprobs for
    (None: no row asks). after_graph: some row needs the sampler after the decode graph
    (needs_sampler_after_graph)."""
    temperatures: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray
    all_greedy: bool
    top_k: np.ndarray | None = None
    top_p: np.ndarray | None = None
    min_p: np.ndarray | None = None
    penalties: np.ndarray | None = None
    outputs: Pairs | None = None
    pending: Pairs | None = None
    prompts: Pairs | None = None
    bans: Pairs | None = None
    num_logprobs: int | None = None
    after_graph: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.temperatures)


def sampling_rows(seqs: list[Sequence], eos: frozenset, vocab_size: int) -> SamplingRows:
    """The SamplingRows of a step over `seqs` (module docstring). The rows with a setting beyond temperature and
    seed (Sequence.special: filters, min_p, penalties, min_tokens, logprobs) are looked at one by one; the
    others cost three array reads each. Raises RuntimeError for a penalised sequence with more than one
    pending token (the engine never schedules one)."""
    n = len(seqs)
    temperatures = np.fromiter((seq.temperature for seq in seqs), dtype=np.float32, count=n)
    seeds = np.fromiter((seq.seed for seq in seqs), dtype=np.int64, count=n)
    counters = np.fromiter((seq.num_tokens for seq in seqs), dtype=np.int64, count=n)
    fields = dict(temperatures=temperatures, seeds=seeds, counters=counters, all_greedy=not temperatures.any())
    special = [i for i, seq in enumerate(seqs) if seq.special]
    if not special:
        return SamplingRows(**fields)
    picked = [seqs[i] for i in special]
    if any(map(uses_filters, picked)):
        fields["top_k"] = np.fromiter((seq.top_k for seq in seqs), dtype=np.int64, count=n)
        fields["top_p"] = np.fromiter((seq.top_p for seq in seqs), dtype=np.float64, count=n)
    if any(map(uses_min_p, picked)):
        fields["min_p"] = np.fromiter((seq.min_p if uses_min_p(seq) else 0.0 for seq in seqs), dtype=np.float32,
                                      count=n)
    penalized = [i for i in special if seqs[i].penalized]
    if penalized:
        fields.update(_penalty_rows(seqs, penalized))
    bans = min_tokens_bans(seqs, eos, vocab_size) if any(s.num_completion_tokens < s.min_tokens for s in picked) \
        else None
    if bans is not None:
        fields["bans"] = Pairs(np.asarray(bans[0], dtype=np.int64), np.asarray(bans[1], dtype=np.int64))
    fields["num_logprobs"] = max((s.num_logprobs for s in picked if s.num_logprobs is not None), default=None)
    fields["after_graph"] = any(map(needs_sampler_after_graph, picked))
    return SamplingRows(**fields)


def _penalty_rows(seqs: list[Sequence], penalized: list[int]) -> dict:
    """The penalties' fields of SamplingRows for the rows `penalized` (indices into seqs)."""
    n = len(seqs)
    penalties = np.zeros((3, n), dtype=np.float32)
    penalties[2] = 1.0
    out_rows, out_ids, pending_rows, pending_src, prompt_rows_of, prompt_ids = [], [], [], [], [], []
    for i in penalized:
        seq = seqs[i]
        sp = seq.sampling_params
        penalties[:, i] = (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
        known = seq.completion_token_ids
        out_rows += [i] * len(known)
        out_ids += known
        if seq.num_pending:
            if seq.num_pending > 1:
                raise RuntimeError("a sequence reached a step with more than one pending token")
            pending_rows.append(i)
            pending_src.append(seq.pending_row)
        if sp.repetition_penalty != 1:
            prompt_rows_of += [i] * seq.num_prompt_tokens
            prompt_ids += seq.prompt_token_ids
    i64 = np.int64
    return dict(penalties=penalties, outputs=Pairs(np.asarray(out_rows, i64), np.asarray(out_ids, i64)),
                pending=Pairs(np.asarray(pending_rows, i64), np.asarray(pending_src, i64)) if pending_rows else None,
                prompts=Pairs(np.asarray(prompt_rows_of, i64), np.asarray(prompt_ids, i64)) if prompt_rows_of else None)


# -- the model runner's side: plain rows -> device tensors ---------------------------------------------------
def sampling_metadata(rows: SamplingRows, device: torch.device) -> SamplingMetadata:
    """The sampler's view of the batch, its tensors on `device`: temperatures [B] fp32; top_k [B] int64 and
    top_p [B] fp64, or both None; seeds [B] int64 and counters [B] int64, None when every row is greedy."""
    top_k = top_p = seeds = counters = None
    if rows.top_k is not None:
        top_k, top_p = to_device(rows.top_k, torch.int64, device), to_device(rows.top_p, torch.float64, device)
    if not rows.all_greedy:
        seeds, counters = to_device(rows.seeds, torch.int64, device), to_device(rows.counters, torch.int64, device)
    return SamplingMetadata(to_device(rows.temperatures, torch.float32, device), all_greedy=rows.all_greedy,
                            top_k=top_k, top_p=top_p, seeds=seeds, counters=counters)


def logits_processing(rows: SamplingRows, device: torch.device, vocab_size: int,
                      last_ids: torch.Tensor) -> LogitsProcessing | None:
    """The logits processors' view of the batch (layers/logits_processors.py), its tensors on `device`, or
    None when no row has a penalty and no sampled row has min_p.

    Fields: presence, frequency, repetition [B] fp32 and output_counts [B, vocab_size] int32 when a row has a
    penalty; prompt_mask [B, vocab_size] bool when a row has repetition_penalty != 1 (only that penalty counts
    prompt tokens); min_p and temperatures [B] fp32 when a sampled row has min_p.
    last_ids: [>= B] int64 on `device`, the previous step's sampled ids: a row whose newest output token is
    still pending on the host (async scheduling) has it counted from last_ids, on the device, so call this
    before the step's forward, whose graph writes its own ids there. The counts are made on the device
    (bin_counts) from the (row, token) pairs: O(the penalised rows' tokens) host work, as vLLM's input batch."""
    if rows.penalties is None and rows.min_p is None:
        return None
    fields = {}
    if rows.min_p is not None:
        fields["min_p"] = to_device(rows.min_p, torch.float32, device)
        fields["temperatures"] = to_device(rows.temperatures, torch.float32, device)
    if rows.penalties is not None:
        penalties = to_device(rows.penalties, torch.float32, device)
        fields.update(presence=penalties[0], frequency=penalties[1], repetition=penalties[2])
        out_rows = to_device(rows.outputs.rows, torch.int64, device)
        token_ids = to_device(rows.outputs.ids, torch.int64, device)
        if rows.pending is not None:     # the pending ids never come to the host: gathered from last_ids here
            out_rows = torch.cat([out_rows, to_device(rows.pending.rows, torch.int64, device)])
            token_ids = torch.cat([token_ids, last_ids[to_device(rows.pending.ids, torch.int64, device)]])
        fields["output_counts"] = bin_counts(out_rows, token_ids, rows.num_rows, vocab_size)
        if rows.prompts is not None:
            fields["prompt_mask"] = bin_counts(to_device(rows.prompts.rows, torch.int64, device),
                                               to_device(rows.prompts.ids, torch.int64, device), rows.num_rows,
                                               vocab_size) > 0
    return LogitsProcessing(**fields)


def mask_stop_tokens(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """logits [B, vocab] (any float dtype) with the eos and stop ids at -inf in the rows still short of
    their min_tokens (rows.bans: engine/stop.min_tokens_bans; HF's MinNewTokensLengthLogitsProcessor), as a
    new tensor of the same dtype; `logits` itself when no row is (decided on the host)."""
    if rows.bans is None:
        return logits
    r, c = (to_device(x, torch.int64, logits.device) for x in rows.bans)
    return logits.index_put((r, c), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


class PromptRows(NamedTuple):
    """The plan for the prompt logprobs of one prefill step: rows (indices into the packed tokens whose logits
    are computed too), targets (the prompt token each row's logits predict), owners ((batch row, first prompt
    position, count) per sequence, in row order) and num_top (the most top tokens a row asks for)."""
    rows: list[int]
    targets: list[int]
    owners: list[tuple[int, int, int]]
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
    for row, seq in enumerate(seqs):
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
                owners.append((row, lo, hi - lo))
                num_top = max(num_top, seq.num_prompt_logprobs)
        offset += end - start
    return PromptRows(rows, targets, owners, num_top) if rows else None
