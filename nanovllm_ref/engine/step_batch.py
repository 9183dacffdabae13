"""One step's batch, built once from plain data on the scheduler's side (issue 29; vLLM's SchedulerOutput,
mini-sglang's ForwardInput).

    builder = StepBuilder(parts.prepare_prefill, parts.prepare_decode, config)   # once, in the engine
    seqs, is_prefill = scheduler.schedule()
    seqs = seqs if is_prefill else longest_first(seqs)                           # decode: launch order
    pending = model_runner.launch(builder.build(seqs, is_prefill))                # every step

`StepBuilder.build` reads the scheduled sequences once and returns a `StepBatch` of host tensors, numpy arrays
and ints: the token ids, positions and attention metadata (Parts.prepare_prefill / prepare_decode, called with
device "cpu"), the rows whose input token the step in flight samples (async scheduling), the sampling rows
(engine/sampling_inputs.SamplingRows) and the prompt-logprob rows of a prefill. The model runner takes nothing
else: it never sees a Sequence, so the same record goes, pickled, to tensor-parallel workers.
"""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm_ref.engine.inputs import StepInputs, block_tables_array
from nanovllm_ref.engine.sampling_inputs import SamplingRows, prompt_rows, sampling_rows
from nanovllm_ref.engine.sequence import Sequence


def longest_first(seqs: list[Sequence]) -> list[Sequence]:
    """A decode step's rows in launch order: longest context first, ties in the scheduler's order (a new list).

    Why: the decode attention launches its programs in row order (kernels/attention.py, grid (Hkv, B, splits)), and
    a row's programs take time in proportion to its context. In the scheduler's order (arrival) a long sequence
    whose programs start in the last wave runs on alone while the other SMs idle; longest first (Graham's LPT
    rule for list scheduling) lets the short rows fill in behind it. Nothing else depends on the order: every
    row carries its own sampling seed and counter, and the engine matches the sampled ids to `seqs` by row
    (async scheduling through `Sequence.pending_row`), so the tokens are the same in any order."""
    return sorted(seqs, key=len, reverse=True)


@dataclass(frozen=True)
class StepBatch:
    """One step as plain data (module docstring).

    is_prefill: a prefill (or prefill-chunk) step, else a decode step of one token per row. inputs: what
    Parts.prepare_prefill / prepare_decode returned, on the host (engine/inputs.StepInputs of CPU tensors).
    prev_rows: None, or [B] int32: for each row the row of the previous step's sampled ids that holds its input
    token (async scheduling), -1 where inputs.input_ids has it. sampling: the rows' sampling settings
    (engine/sampling_inputs.SamplingRows; None in the copy sent to tensor-parallel workers, which do not
    sample). logit_rows / prompt_targets: None, or [P] int64: indices into a prefill's packed tokens whose
    logits give prompt logprobs, and the prompt token each predicts; prompt_num_top: the most top tokens a row
    asks for; prompt_owners: ((batch row, first prompt position, count), ...) per sequence, in row order (the
    engine matches the logprobs to its sequences with them). block_tables: None, or in a prefill step once the KV
    cache exists, every sequence's block table [num_seqs, longest] int32 padded with -1, cached prefix or not
    (what a prefill CUDA graph reads, engine/prefill_graph.py; the attention metadata holds them only when some
    sequence has a cached prefix)."""
    is_prefill: bool
    inputs: StepInputs
    prev_rows: np.ndarray | None = None
    sampling: SamplingRows | None = None
    logit_rows: np.ndarray | None = None
    prompt_targets: np.ndarray | None = None
    prompt_num_top: int = 0
    prompt_owners: tuple = ()
    block_tables: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        """Rows of the batch (sequences; a decode step computes one token per row)."""
        lens = self.inputs.metadata.context_lens
        if lens is not None:
            return int(lens.shape[0])
        return int(self.inputs.metadata.cu_seqlens_q.shape[0]) - 1

    def for_workers(self) -> "StepBatch":
        """The copy tensor-parallel workers receive: no sampling rows, no prompt bookkeeping (rank 0 samples)."""
        return StepBatch(self.is_prefill, self.inputs, self.prev_rows, None, self.logit_rows)


class StepBuilder:
    """Builds each step's StepBatch (module docstring). prepare_prefill / prepare_decode: the parts'
    (nanovllm_ref.Parts), called as prepare(seqs, block_size, "cpu"); config: the engine's Config (block size,
    eos ids, vocabulary size)."""

    def __init__(self, prepare_prefill, prepare_decode, config):
        self.prepare_prefill, self.prepare_decode = prepare_prefill, prepare_decode
        self.block_size = config.kvcache_block_size
        self.eos = config.eos
        self.vocab_size = config.hf_config.vocab_size

    @torch.inference_mode()
    def build(self, seqs: list[Sequence], is_prefill: bool) -> StepBatch:
        """The StepBatch of one step over `seqs` (in batch order). A prefill with prompt_logprobs marks the
        prompt positions whose logits it computes as launched on each such sequence (they are, once the
        record goes to the runner). Raises RuntimeError for a pending token in a prefill step (async
        scheduling decodes it first) and for what sampling_rows / prompt_rows raise. The tensors are made in
        inference mode, as everything the model runner makes (torch.compile's guards tell the two apart)."""
        prepare = self.prepare_prefill if is_prefill else self.prepare_decode
        inputs = prepare(seqs, self.block_size, "cpu")
        prev_rows = None
        if any(seq.num_pending for seq in seqs):
            if is_prefill:
                raise RuntimeError("a pending token reached a prefill step; async scheduling runs decode steps only")
            prev_rows = np.fromiter((seq.pending_row if seq.num_pending else -1 for seq in seqs), dtype=np.int32,
                                    count=len(seqs))
        rows = sampling_rows(seqs, self.eos, self.vocab_size)
        prompt = prompt_rows(seqs) if is_prefill else None
        tables = block_tables_array(seqs) if is_prefill and all(seq.block_table for seq in seqs) else None
        if prompt is None:
            return StepBatch(is_prefill, inputs, prev_rows, rows, block_tables=tables)
        for row, first, count in prompt.owners:
            seqs[row].num_prompt_logprobs_launched = first + count
        return StepBatch(is_prefill, inputs, prev_rows, rows, np.asarray(prompt.rows, dtype=np.int64),
                         np.asarray(prompt.targets, dtype=np.int64), prompt.num_top, tuple(prompt.owners), tables)


@torch.inference_mode()
def prefill_batch(num_seqs: int, seq_len: int) -> StepBatch:
    """A prefill of `num_seqs` prompts of `seq_len` zero tokens with no KV cache (no slots, no block tables):
    the model runner's peak-memory probe at start-up, made without sequences."""
    n = num_seqs * seq_len
    cu = torch.arange(0, n + 1, seq_len, dtype=torch.int32)
    from nanovllm_ref.utils.context import AttentionMetadata
    meta = AttentionMetadata(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq_len,
                             max_seqlen_k=seq_len, slot_mapping=torch.empty(0, dtype=torch.int32))
    inputs = StepInputs(torch.zeros(n, dtype=torch.int64), torch.arange(seq_len).repeat(num_seqs), meta)
    greedy = SamplingRows(np.zeros(num_seqs, np.float32), np.zeros(num_seqs, np.int64),
                          np.full(num_seqs, seq_len, np.int64), all_greedy=True)
    return StepBatch(True, inputs, None, greedy)
