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

After each step `postprocess` appends the sampled tokens and asks `engine/stop.py` whether each sequence
stops. Parallel samples (SamplingParams.n > 1) fork there: when the first sample's prompt is prefilled,
its siblings join `running` sharing its full prompt blocks (BlockManager.fork, ref counts), and each
recomputes only the prompt's partial last block into a block of its own (at most block_size - 1 tokens;
a full last block is recomputed, so there is a token whose logits give the sibling its first token). A
copy of the partial block would save that compute but needs a KV-copy step in the model runner on every
rank; recomputing runs in the ordinary prefill path. A sibling that finds no free block or no seat
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
        kept = deque()
        while self.running:
            seq = self.running.popleft()
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
        self.running = kept
        return list(kept)

    def abort_all(self) -> None:
        """Forget every waiting and running sequence; their blocks go back to the pool (hashes kept)."""
        for seq in list(self.running) + list(self.waiting):
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
        """
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq)
            if seq.num_cached_tokens < len(seq):      # mid chunked prefill: the sampled token is meaningless
                continue
            seq.append_token(token_id)
            if seq.forks:                             # before it may finish: the siblings share its blocks
                self._fork(seq)
            if check_stop(seq, self.eos, self.max_model_len):
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _fork(self, parent: Sequence) -> None:
        """Start parent's siblings (n > 1) on its prefilled prompt (see the module docstring)."""
        fork = getattr(self.block_manager, "fork", None)     # a course BlockManager may not have it
        queued = []
        for child in parent.forks:
            if fork is not None and len(self.running) < self.max_num_seqs and fork(parent, child):
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            else:
                queued.append(child)
        self.waiting.extendleft(reversed(queued))
        parent.forks = []
