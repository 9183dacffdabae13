"""Continuous batching with chunked prefill and preemption (chapter 07).

Every engine step the scheduler picks the batch for one forward pass (upstream nano-vllm
`engine/scheduler.py`). The policy is *prefill-first*, and a step is either all prefill or all decode: that
is vLLM V0's default scheduler (chunked prefill off), plus chunking of long prompts. It is not what vLLM
does once chunked prefill is on: V0's chunked-prefill scheduler is *decode-first* and mixes decodes and
prefill chunks in one batch, and V1's scheduler mixes them too, under one token budget per step, with no
separate prefill and decode phases. Chapter 07 teaches this policy and those alternatives.

1. Prefill first. Sequences still in the middle of a chunked prefill continue, then waiting sequences are
   admitted in arrival order, while the step's token budget (`max_num_batched_tokens`), the sequence limit
   (`max_num_seqs`) and free KV blocks allow. A prompt longer than what is left of the budget is cut: its
   first chunk runs now and the rest in later steps (chunked prefill). Prefix-cache hits cost no budget.
2. If nothing was prefilled, every running sequence decodes one token. A sequence that needs a new block
   when none is free preempts the most recently admitted running sequence: that one gives up all its blocks
   and goes back to the front of the queue, to be recomputed later (preemption by recompute).

Because a step is all-prefill or all-decode, the model runner has one code path per kind; the price is that
running sequences wait (no decode) while a long prompt is being prefilled chunk by chunk.

After a step, `postprocess(seqs, token_ids)` does two things, which async scheduling (engine/llm_engine.py)
runs one step apart:
- `record_launch(seqs, pending)` (`Scheduler.on_launch`): the bookkeeping the step's token ids are not
  needed for (its tokens now have K/V; with `pending`, a placeholder for each token the step samples, so
  the next step can be scheduled while this one still runs on the GPU);
- `record_tokens(...)` (`Scheduler.on_tokens`): append (or fill in) the sampled tokens, register full blocks
  for prefix caching, ask `engine/stop.py` whether each sequence stops, finish those, free their blocks.
A sequence whose pending token already reaches max_tokens or max_model_len is not scheduled again: it only
waits for that token's value.

Parallel samples (SamplingParams.n > 1) fork in `record_tokens`: when the first sample's prompt is
prefilled, its siblings join `running` sharing its full prompt blocks (BlockManager.fork, ref counts), and
each recomputes only the prompt's partial last block into a block of its own (at most block_size - 1
tokens; a full last block is recomputed, so there is a token whose logits give the sibling its first
token). A copy of the partial block would save that compute but needs a KV-copy step in the model runner on
every rank; recomputing runs in the ordinary prefill path. A sibling that finds no free block or no seat
(max_num_seqs) waits at the front of `waiting` instead, as a request of its own (a prefix-cache hit then
still shares the prompt's blocks).
"""
from collections import deque

from nanovllm_ref.config import Config
from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.engine.sequence import Sequence, SequenceStatus
from nanovllm_ref.engine.stop import check_stop


class Scheduler:
    """config: the engine's Config (budgets, max_model_len, eos ids, cache size); block_manager_cls: the class
    of the block manager to build, called as block_manager_cls(num_blocks, block_size, enable_prefix_caching)
    (nanovllm_ref.Parts.block_manager)."""

    def __init__(self, config: Config, block_manager_cls=BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos = config.eos
        self.block_manager = block_manager_cls(config.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return (sequences to run this step, is_prefill). Sets seq.num_scheduled_tokens."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        """Phase 1: continue chunked prefills, then admit waiting sequences first-come under the token budget,
        max_num_seqs and can_allocate. Returns the scheduled sequences (empty: nothing to prefill)."""
        scheduled, budget = [], self.max_num_batched_tokens
        # 1a. Continue chunked prefills (they already hold their blocks).
        for seq in self.running:
            if seq.is_prefilling and budget > 0:
                seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
        # 1b. Admit waiting sequences.
        return scheduled + self._admit_waiting(budget)

    def _admit_waiting(self, budget: int) -> list[Sequence]:
        """Admit waiting sequences first-come, while `budget` tokens, max_num_seqs and free blocks allow;
        a prompt longer than what is left of the budget gets its first chunk. Returns the admitted ones."""
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)          # sets num_cached_tokens on a prefix hit
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _schedule_decode(self) -> list[Sequence]:
        """Phase 2: one token for every running sequence, preempting from the back when blocks run out."""
        kept, scheduled = deque(), []
        while self.running:
            seq = self.running.popleft()
            if seq.num_pending and reached_length(seq, self.max_model_len):
                kept.append(seq)                      # its last token is in flight; nothing more to compute
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:                                 # nobody left to evict: this one waits itself
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                kept.append(seq)
                scheduled.append(seq)
        self.running = kept
        return scheduled

    def abort_all(self) -> None:
        """Forget every waiting and running sequence; their blocks go back to the pool (hashes kept)."""
        for seq in list(self.running) + list(self.waiting):
            seq.drop_pending()
            if seq.block_table:
                self.block_manager.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
            seq.num_scheduled_tokens = 0
            seq.forks = []
        self.running.clear()
        self.waiting.clear()

    def abort(self, seqs: list[Sequence]) -> None:
        """Remove `seqs` (waiting, running, or not queued yet: unforked siblings) and free their blocks;
        the other sequences carry on. Sets status FINISHED; finish_reason is the caller's."""
        for seq in seqs:
            seq.drop_pending()                        # async: a token in flight is not part of the output
            if seq in self.running:                   # identity: a Sequence has no __eq__
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            if seq.block_table:
                self.block_manager.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
            seq.num_scheduled_tokens = 0
            seq.forks = []

    def preempt(self, seq: Sequence) -> None:
        """Free all of `seq`'s blocks and queue it first, to be recomputed (prompt + completion so far)."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Account for one finished step: seqs[i] produced token_ids[i] (ignored for a partial prefill).

        Appends each kept token, forks the siblings of a sequence whose prompt is now prefilled (n > 1),
        and finishes the sequences that stop (engine/stop.py: eos, stop ids, stop strings, min_tokens,
        max_tokens, max_model_len). Returns the sequences that finished this step (blocks already freed).
        The same as `on_launch` then `on_tokens` (what async scheduling runs one step apart).
        """
        return record_tokens(self, seqs, token_ids, record_launch(seqs))

    def on_launch(self, seqs: list[Sequence], pending: bool = False) -> list[bool]:
        """Async scheduling, right after the step over `seqs` was launched: see `record_launch`."""
        return record_launch(seqs, pending)

    def on_tokens(self, seqs: list[Sequence], token_ids: list[int], samples: list[bool]) -> list[Sequence]:
        """Async scheduling, when that step's ids arrive: see `record_tokens`."""
        return record_tokens(self, seqs, token_ids, samples)


# The two halves of postprocess, as functions of the scheduler's state (`running`, `waiting`, `eos`,
# `max_model_len`, `block_manager`), so the course can lend them to a scheduler class of a student's.
def reached_length(seq: Sequence, max_model_len: int, counting_pending: bool = True) -> bool:
    """max_tokens or max_model_len reached, by the tokens known (and, by default, those still in flight)."""
    extra = 0 if counting_pending else seq.num_pending
    return seq.num_completion_tokens - extra >= seq.max_tokens or len(seq) - extra >= max_model_len


def record_launch(seqs: list[Sequence], pending: bool = False) -> list[bool]:
    """The step over `seqs` has been launched: the tokens it computes now have K/V in the cache. Returns,
    per row, whether it samples a token (a decode, or a prompt's last chunk). With `pending`, each such
    sequence gets a placeholder for that token, tied to its output row."""
    samples = []
    for row, seq in enumerate(seqs):
        seq.num_cached_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        samples.append(seq.num_cached_tokens >= len(seq))
        if pending and samples[-1]:
            seq.append_pending(row)
    return samples


def record_tokens(sched, seqs: list[Sequence], token_ids: list[int], samples: list[bool]) -> list[Sequence]:
    """The token ids of a step over `seqs` arrived; `samples` is what `record_launch` returned for it. Fill
    in (async) or append each sampled token, register full blocks, finish the sequences that stop. A sequence
    that finished or was aborted meanwhile is skipped. Returns the newly finished sequences."""
    finished = []
    for seq, token_id, sampled in zip(seqs, token_ids, samples):
        if seq.is_finished:
            continue
        if sampled and seq.num_pending:
            seq.fill_pending(token_id)
        elif sampled:
            seq.append_token(token_id)
        # Full blocks, by the tokens known now (a pending token's value is filled in above first). A sequence
        # preempted meanwhile holds no blocks.
        if seq.block_table:
            sched.block_manager.hash_blocks(seq)
        if not sampled:                               # mid chunked prefill: the sampled token is meaningless
            continue
        if seq.forks:                                 # before it may finish: the siblings share its blocks
            _fork(sched, seq)
        if check_stop(seq, token_id, sched.eos, sched.max_model_len):
            _finish(sched, seq)
            finished.append(seq)
    return finished


def _finish(sched, seq: Sequence) -> None:
    seq.drop_pending()                                # a token sampled after the stop is not part of the output
    if seq.status == SequenceStatus.RUNNING:
        sched.running.remove(seq)
    else:                                             # preempted while its last token was in flight
        sched.waiting.remove(seq)
    seq.status = SequenceStatus.FINISHED
    if seq.block_table:
        sched.block_manager.deallocate(seq)


def _fork(sched, parent: Sequence) -> None:
    """Start parent's siblings (n > 1) on its prefilled prompt (see the module docstring)."""
    fork = getattr(sched.block_manager, "fork", None)     # a course BlockManager may not have it
    queued = []
    for child in parent.forks:
        if fork is not None and len(sched.running) < sched.max_num_seqs and fork(parent, child):
            child.status = SequenceStatus.RUNNING
            sched.running.append(child)
        else:
            queued.append(child)
    sched.waiting.extendleft(reversed(queued))
    parent.forks = []
