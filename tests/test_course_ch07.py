"""Mutation tests of the chapter 07 check helpers (nanovllm_course/ch07.py).

Each check passes on the reference (printing exactly its one `E7.n ok` line), fails on a stub with 'not
implemented yet', and fails on each planted plausible mistake with a message and hint that point at it.
"""
import functools
import random
from collections import deque

import pytest

import course_checks
from nanovllm_course import ch07
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.engine.sequence import SequenceStatus

Ref = ch07.ReferenceScheduler
CHECKS = {tag: e.check for tag, e in ch07.EXERCISES.items() if tag != "E7.4"}     # the Scheduler's three

passes = functools.partial(course_checks.passes_by_tag, CHECKS)
fails = functools.partial(course_checks.fails_by_tag, CHECKS)


def _prefill(self, charge_cached=False, schedule_cached=False, zero_admissions=False):
    scheduled, budget = [], self.max_num_batched_tokens
    for seq in self.running:
        if seq.is_prefilling and budget > 0:
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
    while self.waiting and (budget > 0 or zero_admissions and budget == 0) and len(self.running) < self.max_num_seqs:
        seq = self.waiting[0]
        if not self.block_manager.can_allocate(seq):
            break
        self.block_manager.allocate(seq)
        seq.num_scheduled_tokens = min(len(seq) - (0 if schedule_cached else seq.num_cached_tokens), budget)
        budget -= seq.num_scheduled_tokens + (seq.num_cached_tokens if charge_cached else 0)
        seq.status = SequenceStatus.RUNNING
        self.waiting.popleft()
        self.running.append(seq)
        scheduled.append(seq)
    return scheduled


# -- the mutants named in the chapter's issue ----------------------------------------------------------------
class FirstInVictim(Ref):
    """Preempts the oldest remaining running sequence instead of the most recently admitted one."""
    def _schedule_decode(self):
        kept = deque()
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.popleft())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                kept.append(seq)
        self.running = kept
        return list(kept)


class RequeueAtBack(Ref):
    def preempt(self, seq):
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.append(seq)


class CachedTokensCostBudget(Ref):
    def schedule(self):
        scheduled = _prefill(self, charge_cached=True)
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False


class CachedTokensScheduledAgain(Ref):
    """Schedules the whole prompt even after a prefix hit (recomputes the cached tokens)."""
    def schedule(self):
        scheduled = _prefill(self, schedule_cached=True)
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False


class AppendAfterPartialChunk(Ref):
    def postprocess(self, seqs, token_ids):
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq)
            seq.append_token(token_id)
            if ((not seq.ignore_eos and token_id in self.eos) or seq.num_completion_tokens >= seq.max_tokens
                    or len(seq) >= self.max_model_len):
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished


class DecodeBeforePrefill(Ref):
    def schedule(self):
        if self.running:
            seqs = self._schedule_decode()
            if seqs:
                return seqs, False
        return _prefill(self), True


def _postprocess(self, seqs, token_ids, finish):
    finished = []
    for seq, token_id in zip(seqs, token_ids):
        seq.num_cached_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        self.block_manager.hash_blocks(seq)
        if seq.num_cached_tokens < len(seq):
            continue
        seq.append_token(token_id)
        if finish(self, seq, token_id):
            seq.status = SequenceStatus.FINISHED
            self.block_manager.deallocate(seq)
            self.running.remove(seq)
            finished.append(seq)
    return finished


class MaxLenOneLate(Ref):
    def postprocess(self, seqs, token_ids):
        return _postprocess(self, seqs, token_ids, lambda s, q, t: (not q.ignore_eos and t in s.eos)
                            or q.num_completion_tokens >= q.max_tokens or len(q) > s.max_model_len)


class MaxLenOneEarly(Ref):
    def postprocess(self, seqs, token_ids):
        return _postprocess(self, seqs, token_ids, lambda s, q, t: (not q.ignore_eos and t in s.eos)
                            or q.num_completion_tokens >= q.max_tokens or len(q) + 1 >= s.max_model_len)


# -- more plausible mistakes -----------------------------------------------------------------------------------
class EosAlwaysFinishes(Ref):
    def postprocess(self, seqs, token_ids):
        return _postprocess(self, seqs, token_ids, lambda s, q, t: t in s.eos
                            or q.num_completion_tokens >= q.max_tokens or len(q) >= s.max_model_len)


class NoHashBlocks(Ref):
    def postprocess(self, seqs, token_ids):
        hb = self.block_manager.hash_blocks
        self.block_manager.hash_blocks = lambda seq: None
        try:
            return super().postprocess(seqs, token_ids)
        finally:
            self.block_manager.hash_blocks = hb


class NoSeqCap(Ref):
    def schedule(self):
        saved, self.max_num_seqs = self.max_num_seqs, 10**9
        try:
            scheduled = _prefill(self)
        finally:
            self.max_num_seqs = saved
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False


class SkipsBlockedHead(Ref):
    """Admits a later waiting request when the first one does not fit (not first-come, first-served)."""
    def schedule(self):
        scheduled = [s for s in self.running if s.is_prefilling]
        budget = self.max_num_batched_tokens
        for seq in scheduled:
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not self.block_manager.can_allocate(seq):
                continue
            self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.remove(seq)
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False


class PreemptKeepsBlocks(Ref):
    def preempt(self, seq):
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)


class SelfPreemptNoBreak(Ref):
    """Forgets the `break` after preempting itself: the freed blocks let it append, and it runs anyway."""
    def _schedule_decode(self):
        kept = deque()
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
            self.block_manager.may_append(seq)
            seq.num_scheduled_tokens = 1
            kept.append(seq)
        self.running = kept
        return list(kept)


class NoSelfPreemption(Ref):
    """Waits for a victim that never comes when nobody is left behind: an endless loop."""
    def _schedule_decode(self):
        kept = deque()
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
            self.block_manager.may_append(seq)
            seq.num_scheduled_tokens = 1
            kept.append(seq)
        self.running = kept
        return list(kept)


class FinishedStaysRunning(Ref):
    def postprocess(self, seqs, token_ids):
        saved, self.running = self.running, deque(self.running)
        finished = super().postprocess(seqs, token_ids)
        self.running = saved
        return finished


class FinishedKeepsBlocks(Ref):
    def postprocess(self, seqs, token_ids):
        dealloc = self.block_manager.deallocate
        self.block_manager.deallocate = lambda seq: None
        try:
            return super().postprocess(seqs, token_ids)
        finally:
            self.block_manager.deallocate = dealloc


class AdmitsAtZeroBudget(Ref):
    """Admits while budget >= 0: a sequence joins the step with 0 tokens to compute."""
    def schedule(self):
        scheduled = _prefill(self, zero_admissions=True)
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False


class Stub(Ref):
    def schedule(self):
        raise NotImplementedError("Exercise 7.1: fill in this code")

    def _schedule_decode(self):
        raise NotImplementedError("Exercise 7.2: fill in this code")

    def preempt(self, seq):
        raise NotImplementedError("Exercise 7.2: fill in this code")

    def postprocess(self, seqs, token_ids):
        raise NotImplementedError("Exercise 7.3: fill in this code")


class SelfPreemptSpy(Ref):
    """The reference decode phase, counting the sequences that preempt themselves."""
    count = 0

    def _schedule_decode(self):
        kept = deque()
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    type(self).count += 1
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                kept.append(seq)
        self.running = kept
        return list(kept)


# -- tests ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", sorted(CHECKS))
def test_reference_passes(tag, capsys):
    passes(tag, Ref, capsys)
    passes(tag, Scheduler, capsys)          # the engine's class (other layout: checked whole)


@pytest.mark.parametrize("tag", sorted(CHECKS))
def test_stub_is_not_implemented_yet(tag):
    fails(tag, Stub, "not implemented yet", f"Exercise {tag[1:]}")


def test_each_check_uses_only_its_own_exercise(capsys):
    """A broken E7.2 or E7.3 does not fail the E7.1 check, and so on (isolation)."""
    passes("E7.1", type("S", (Stub,), {"schedule": Ref.schedule}), capsys)
    passes("E7.2", type("S", (Stub,), {"_schedule_decode": Ref._schedule_decode, "preempt": Scheduler.preempt}),
           capsys)
    passes("E7.3", type("S", (Stub,), {"postprocess": Scheduler.postprocess}), capsys)


def test_e7_1_mutants():
    fails("E7.1", CachedTokensCostBudget, "scenario 'a prefix hit'", "cost no budget")
    fails("E7.1", CachedTokensScheduledAgain, "scenario 'a prefix hit'", "cost no budget")
    fails("E7.1", DecodeBeforePrefill, "ran decode", "expected prefill", "prefill comes first")
    fails("E7.1", NoSeqCap, "scenario 'the max_num_seqs cap'", "max_num_seqs (2)")
    fails("E7.1", AdmitsAtZeroBudget, "0 tokens to compute")
    fails("E7.1", SkipsBlockedHead, "scenario 'first come, first served'", "hint: first come, first served")


def test_e7_2_mutants(monkeypatch):
    fails("E7.2", FirstInVictim, "scenario 'a preemption cascade'", "preempted", "most recently admitted")
    fails("E7.2", RequeueAtBack, "scenario 'a preemption cascade'", "waiting", "FRONT of `waiting`")
    fails("E7.2", PreemptKeepsBlocks, "scenario 'a preemption cascade'", "deallocate")
    monkeypatch.setattr(ch07, "_TIME_LIMIT_S", 1)
    fails("E7.2", SelfPreemptNoBreak, "scenario 'self-preemption'", "preempted itself is not scheduled")
    fails("E7.2", NoSelfPreemption, "scenario 'self-preemption'", "did not return", "preempts itself")


def test_e7_3_mutants():
    fails("E7.3", AppendAfterPartialChunk, "scenario 'a 3-chunk prompt'", "meaningless")
    fails("E7.3", MaxLenOneLate, "scenario 'max_model_len'", "len(seq) >= max_model_len")
    fails("E7.3", MaxLenOneEarly, "scenario 'max_model_len'", "len(seq) >= max_model_len")
    fails("E7.3", EosAlwaysFinishes, "scenario 'eos vs ignore_eos'", "ignore_eos")
    fails("E7.3", NoHashBlocks, "hash_blocks")
    fails("E7.3", FinishedStaysRunning, "leaves `running`")
    fails("E7.3", FinishedKeepsBlocks, "gives its blocks back")


def test_scenarios_exercise_what_they_name():
    rng = random.Random(0)
    three = ch07._scenario_three_chunks("E7.x", Scheduler, rng)
    assert [e for e in three.log if e.startswith("prefill")][:3] == ["prefill ['A']", "prefill ['A']", "prefill ['A', 'B']"]
    assert ch07._scenario_budget_used_up("E7.x", Scheduler, rng).log[3] == "prefill ['A', 'B']"
    cascade = ch07._scenario_cascade("E7.x", Scheduler, rng)
    assert "decode ['A', 'B', 'C'], preempted ['D', 'E']" in cascade.log     # two victims in one step
    SelfPreemptSpy.count = 0
    ch07._scenario_self_preemption("E7.x", SelfPreemptSpy, rng)
    assert SelfPreemptSpy.count >= 1
    assert ch07._scenario_prefix_hit("E7.x", Scheduler, rng).hits >= 1
    assert ch07._scenario_hash_then_hit("E7.x", Scheduler, rng).hits >= 1
    eos = ch07._scenario_eos("E7.x", Scheduler, rng)
    assert [len(r.completion_token_ids) for r, _ in eos.pairs] == [2, 5]
    mml = ch07._scenario_max_model_len("E7.x", Scheduler, rng)
    assert [len(r) for r, _ in mml.pairs] == [12, 12, 7]


@pytest.mark.parametrize("seed", range(30))
def test_random_streams_cover_preemption_and_hits(seed):
    t = ch07._random_stream("E7.x", Scheduler, random.Random(seed))
    assert all(s.is_finished for _, s in t.pairs)


def test_random_streams_preempt_and_hit_often_enough():
    runs = [ch07._random_stream("E7.x", Scheduler, random.Random(seed)) for seed in range(ch07.NUM_RANDOM_STREAMS * 5)]
    assert sum(t.ref.num_preemptions > 0 for t in runs) >= len(runs) // 3
    assert sum(t.hits > 0 for t in runs) >= len(runs) // 4


def test_mixed_policy_under_a_tight_cache_finishes():
    reqs = [(0, 9, 12), (0, 9, 12), (1, 20, 6), (2, 5, 10), (2, 30, 3)]
    trace = ch07.simulate(reqs, ch07.MixedScheduler, max_num_batched_tokens=12, kvcache_block_size=4,
                          num_kvcache_blocks=12)
    assert sorted(i for row in trace for i in row["finished"]) == list(range(len(reqs)))
    assert ch07.summary(trace, reqs)["preemptions"] > 0


def test_simulator_and_mixed_policy():
    reqs = [(0, 12, 3), (0, 3, 6), (1, 30, 2), (2, 4, 4)]
    trace = ch07.simulate(reqs, max_num_batched_tokens=8, kvcache_block_size=4, num_kvcache_blocks=32)
    assert all(set(row["phase"].values()) <= {"prefill"} or set(row["phase"].values()) == {"decode"} for row in trace)
    mixed = ch07.simulate(reqs, ch07.MixedScheduler, max_num_batched_tokens=8, kvcache_block_size=4,
                          num_kvcache_blocks=32)
    assert any(set(row["phase"].values()) == {"prefill", "decode"} for row in mixed)
    assert all(sum(row["tokens"].values()) <= 8 for row in mixed)
    assert ch07.summary(mixed, reqs)["max_decode_gap"] < ch07.summary(trace, reqs)["max_decode_gap"]
    static = ch07.simulate_static(reqs, 2)
    assert len(static) > 0 and ch07.gantt_text(static).count("\n") == 4


def test_at_most_one_sequence_is_mid_prefill_when_a_step_starts():
    """The fact behind going-further question 2 (and why no mutant of the `budget > 0` test of the
    chunk loop can be caught): only the last sequence admitted can be left with its prompt cut."""
    most = 0

    class Spy(Scheduler):
        def schedule(self):
            nonlocal most
            most = max(most, sum(s.is_prefilling for s in self.running))
            return super().schedule()
    for seed in range(60):
        ch07._random_stream("E7.x", Spy, random.Random(seed))
    assert most == 1


# -- every hint of the chapter's checks has a mutant that reaches it --------------------------------------------
class DecodeForgetsReturn(Ref):
    def _schedule_decode(self):
        super()._schedule_decode()                  # the list is built, but not returned


class PreemptRemovesAgain(Ref):
    """Removes the victim from `running` although the decode loop already popped it."""
    def preempt(self, seq):
        super().preempt(seq)
        self.running.remove(seq)


class ScheduleReturnsList(Ref):
    def schedule(self):
        return super().schedule()[0]


class PromptNotCut(Ref):
    """Schedules a whole prompt even past the budget (no chunking)."""
    def _admit_waiting(self, budget):
        admitted = super()._admit_waiting(budget)
        for seq in admitted:
            seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
        return admitted


class PreemptNotCounted(Ref):
    def preempt(self, seq):
        super().preempt(seq)
        self.num_preemptions -= 1


class PreemptFreesByHand(Ref):
    """Puts the victim's blocks back in the free pool by hand, without dropping their references."""
    def preempt(self, seq):
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        bm = self.block_manager
        for block_id in reversed(seq.block_table):
            bm.used_block_ids.discard(block_id)
            bm.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)


class PreemptKeepsStatus(Ref):
    def preempt(self, seq):
        super().preempt(seq)
        seq.status = SequenceStatus.RUNNING


class AdmitsBeforeChunks(Ref):
    """Admits waiting sequences before continuing the unfinished prefill chunks."""
    def _schedule_prefill(self):
        budget = self.max_num_batched_tokens
        admitted = self._admit_waiting(budget)
        budget -= sum(s.num_scheduled_tokens for s in admitted)
        chunks = []
        for seq in list(self.running):
            if seq.is_prefilling and seq not in admitted and budget > 0:
                seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
                budget -= seq.num_scheduled_tokens
                chunks.append(seq)
        return admitted + chunks


class NeverAppends(Ref):
    """Advances the cache but never appends the sampled token."""
    def postprocess(self, seqs, token_ids):
        for seq in seqs:
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq)
        return []


class TokensShifted(Ref):
    """Appends the token sampled for the next sequence of the step (an off-by-one in the zip)."""
    def postprocess(self, seqs, token_ids):
        return super().postprocess(seqs, list(token_ids[1:]) + list(token_ids[:1]))


class KeepsScheduledTokens(Ref):
    def postprocess(self, seqs, token_ids):
        counts = [s.num_scheduled_tokens for s in seqs]
        finished = super().postprocess(seqs, token_ids)
        for s, n in zip(seqs, counts):
            if s not in finished:
                s.num_scheduled_tokens = n
        return finished


class ReturnsNoFinished(Ref):
    def postprocess(self, seqs, token_ids):
        super().postprocess(seqs, token_ids)
        return []


class IgnoresEos(Ref):
    def postprocess(self, seqs, token_ids):
        return _postprocess(self, seqs, token_ids, lambda s, q, t: q.num_completion_tokens >= q.max_tokens
                            or len(q) >= s.max_model_len)


class MaxTokensOneLate(Ref):
    def postprocess(self, seqs, token_ids):
        return _postprocess(self, seqs, token_ids, lambda s, q, t: (not q.ignore_eos and t in s.eos)
                            or q.num_completion_tokens > q.max_tokens or len(q) >= s.max_model_len)


def _from_the_check():
    import sys
    return sys._getframe(2).f_code.co_filename.endswith("ch07.py")


class RenamedQueues(Ref):
    """Keeps its queues under other names (`queue`, `active`): the check finds no `waiting` / `running`."""
    def __init__(self, *args):
        super().__init__(*args)
        self.queue, self.active = self.__dict__.pop("waiting"), self.__dict__.pop("running")

    def _get(name):
        def get(self):
            if _from_the_check():
                raise AttributeError(name)
            return getattr(self, {"waiting": "queue", "running": "active"}[name])

        def put(self, value):
            if "queue" in self.__dict__:
                setattr(self, {"waiting": "queue", "running": "active"}[name], value)
            else:
                self.__dict__[name] = value
        return property(get, put)
    waiting, running = _get("waiting"), _get("running")


class FinishedFreedByHand(Ref):
    """Puts a finished sequence's blocks back in the free pool by hand, without dropping their references."""
    def postprocess(self, seqs, token_ids):
        bm = self.block_manager
        real = bm.deallocate

        def by_hand(seq):
            for block_id in reversed(seq.block_table):
                bm.used_block_ids.discard(block_id)
                bm.free_block_ids[block_id] = None
            seq.block_table = []
            seq.num_cached_tokens = 0
        bm.deallocate = by_hand
        try:
            return super().postprocess(seqs, token_ids)
        finally:
            bm.deallocate = real


class RecomputesCachedTokens(Ref):
    """Schedules the cached tokens again (but charges the budget right): the batch is right, the token count not."""
    def _admit_waiting(self, budget):
        admitted = super()._admit_waiting(budget)
        for seq in admitted:
            seq.num_scheduled_tokens += seq.num_cached_tokens
        return admitted


class PreemptedKeepsItsTable(Ref):
    """Frees the victim's blocks in the manager, but the sequence still lists them."""
    def preempt(self, seq):
        table = list(seq.block_table)
        super().preempt(seq)
        seq.block_table = table


class AdmittedStaysWaiting(Ref):
    def _admit_waiting(self, budget):
        admitted = super()._admit_waiting(budget)
        for seq in admitted:
            seq.status = SequenceStatus.WAITING
        return admitted


class DecodesAsOneTokenPrefills(Ref):
    """Takes "fewer tokens cached than the sequence holds" for an unfinished prompt: after every sampled token
    that is true, so each decode step is run as a 1-token prefill."""
    def _schedule_prefill(self):
        scheduled, budget = [], self.max_num_batched_tokens
        for seq in self.running:
            if seq.num_cached_tokens < len(seq) and budget > 0:
                seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
                budget -= seq.num_scheduled_tokens
                scheduled.append(seq)
        return scheduled + self._admit_waiting(budget)


class NeverFinished(Ref):
    def is_finished(self):
        return False


@pytest.mark.parametrize("tag,cls,says", [
    ("E7.2", DecodeForgetsReturn, "expected a list of Sequences, got NoneType"),
    ("E7.2", PreemptRemovesAgain, "raised ValueError"),
    ("E7.1", ScheduleReturnsList, "expected a tuple (list of sequences, is_prefill)"),
    ("E7.1", PromptNotCut, "a prompt longer than what is left of the budget is cut"),
    ("E7.2", PreemptNotCounted, "num_preemptions is"),
    ("E7.2", PreemptFreesByHand, "block manager invariant broken after schedule()"),
    ("E7.2", PreemptKeepsStatus, "preempt() sets seq.status = SequenceStatus.WAITING"),
    ("E7.1", AdmitsBeforeChunks, "unfinished prefill chunks continue first"),
    ("E7.3", NeverAppends, "append the sampled token"),
    ("E7.3", TokensShifted, "append exactly token_ids[i]"),
    ("E7.3", KeepsScheduledTokens, "still has num_scheduled_tokens"),
    ("E7.3", ReturnsNoFinished, "return the list of sequences that finished in this step"),
    ("E7.3", IgnoresEos, "finish when the sampled token is an eos id"),
    ("E7.3", MaxTokensOneLate, "finish when num_completion_tokens reaches max_tokens"),
    ("E7.3", NeverFinished, "every request finished on the reference, but"),
    ("E7.1", DecodesAsOneTokenPrefills, "it decodes, it does not join a prefill step"),
    ("E7.1", RenamedQueues, "the scheduler has no `waiting` / `running` queues"),
    ("E7.3", FinishedFreedByHand, "an unfinished one keeps them"),
    ("E7.1", RecomputesCachedTokens, "prefix-cache hits cost no budget"),
    ("E7.2", PreemptedKeepsItsTable, "preempt() must give back all the victim's blocks"),
    ("E7.1", AdmittedStaysWaiting, "is WAITING, expected RUNNING"),
], ids=lambda x: x.__name__ if isinstance(x, type) else None)
def test_every_hint_is_reached(tag, cls, says):
    for _ in range(2):
        fails(tag, cls, says)


# -- E7.4: the overlap timeline ------------------------------------------------------------------------------
def _timeline(host_ms, device_ms, overlap, start_host=None, device_start=None, launch=None):
    """A timeline written the way a student might, with one rule swapped for a plausible wrong one."""
    out, launch_prev, end_prev, end_prev2 = [], 0.0, 0.0, 0.0
    for h, d in zip(host_ms, device_ms):
        s = (start_host or (lambda lp, e1, e2, ov: max(lp, e2) if ov else e1))(launch_prev, end_prev, end_prev2, overlap)
        lau = (launch or (lambda s, h: s + h))(s, h)
        start = (device_start or (lambda lau, e1: max(lau, e1)))(lau, end_prev)
        out.append((lau, start, start + d))
        launch_prev, end_prev2, end_prev = lau, end_prev, start + d
    return out


def _stub_timeline(host_ms, device_ms, overlap):
    raise NotImplementedError("Exercise 7.4: fill in this code")


TIMELINE_MUTANTS = {
    # (the wrong version, what the message must say)
    "ignores overlap": (lambda h, d, o: _timeline(h, d, False), "the host does not wait for step i-1"),
    "always overlaps": (lambda h, d, o: _timeline(h, d, True), "that is the async timeline"),
    "async waits for step i-1's ids": (
        lambda h, d, o: _timeline(h, d, o, start_host=lambda lp, e1, e2, ov: max(lp, e1)),
        "the host does not wait for step i-1"),
    "host runs ahead without limit": (
        lambda h, d, o: _timeline(h, d, o, start_host=lambda lp, e1, e2, ov: lp if ov else e1),
        "at most ONE step ahead"),
    "two steps at once on the device": (
        lambda h, d, o: _timeline(h, d, o, device_start=lambda lau, e1: lau), "the device runs one step at a time"),
    "host starts before its last launch": (
        lambda h, d, o: _timeline(h, d, o, start_host=lambda lp, e1, e2, ov: e2 if ov else e1),
        "the host does one thing at a time"),
    "device start forgets the launch": (
        lambda h, d, o: _timeline(h, d, o, device_start=lambda lau, e1: e1), "once it is launched AND"),
    "launch before the host work": (
        lambda h, d, o: _timeline(h, d, o, launch=lambda s, h: s), "L_i = S_i + h_i"),
    "only the wall times": (lambda h, d, o: [(r[2],) for r in _timeline(h, d, o)], "tuples of 3"),
    "not a list of tuples": (lambda h, d, o: None, "one (launch, device_start, device_end) tuple"),
}


def test_e7_4_reference_passes(capsys):
    course_checks.passes(ch07.check_overlap_timeline, ch07.reference_overlap_timeline, tag="E7.4", capsys=capsys)
    course_checks.passes(ch07.check_overlap_timeline, lambda h, d, o: _timeline(h, d, o), tag="E7.4", capsys=capsys)


def test_e7_4_stub_is_not_implemented_yet():
    course_checks.fails(ch07.check_overlap_timeline, _stub_timeline, match="E7.4: not implemented yet")


@pytest.mark.parametrize("name", sorted(TIMELINE_MUTANTS))
def test_e7_4_mutants(name):
    fn, says = TIMELINE_MUTANTS[name]
    for _ in range(3):                                     # fresh random inputs each time
        text = course_checks.fails(ch07.check_overlap_timeline, fn, match="E7.4: ")
        assert says in text, text


def test_e7_4_worked_example_and_regimes():
    """The notebook's worked example, and the two regimes: async hides the host up to the device's time."""
    sync = ch07.reference_overlap_timeline([1, 1, 1], [2, 2, 2], False)
    asyn = ch07.reference_overlap_timeline([1, 1, 1], [2, 2, 2], True)
    assert sync == [(1, 1, 3), (4, 4, 6), (7, 7, 9)] and asyn == [(1, 1, 3), (2, 3, 5), (4, 5, 7)]
    n, h, d = 50, 0.37, 1.21
    assert ch07.wall_ms(ch07.reference_overlap_timeline([h] * n, [d] * n, False)) == pytest.approx(n * (h + d))
    assert ch07.wall_ms(ch07.reference_overlap_timeline([h] * n, [d] * n, True)) == pytest.approx(h + n * d)
    # host-bound: overlap hides the device instead, the host's time remains
    assert ch07.wall_ms(ch07.reference_overlap_timeline([d] * n, [h] * n, True)) == pytest.approx(n * d + h)
    assert ch07.wall_ms([]) == 0.0


# -- issue 30: each plausible E7.2 mistake gets its own hint (the planted mistake whose run fails the same way) --
def decode_written(mistake=None):
    """E7.2 as a student writes it, in forms other than the check's planted classes, with one mistake."""
    class Written(Scheduler):
        def _schedule_decode(self):
            kept = deque()
            while self.running:
                seq = self.running.popleft()
                while not self.block_manager.can_append(seq):
                    if self.running and mistake != "evicts itself":
                        victim = self.running[0] if mistake == "victim from the front" else self.running[-1]
                        self.running.remove(victim)
                        self.preempt(victim)
                    else:
                        self.preempt(seq)
                        break
                else:
                    if mistake != "no may_append":
                        self.block_manager.may_append(seq)
                    seq.num_scheduled_tokens = 1
                    if mistake == "reversed":
                        kept.insert(0, seq)
                    else:
                        kept.append(seq)
            if mistake != "running not rebuilt":
                self.running = kept
            return list(kept)

        def preempt(self, seq):
            self.num_preemptions += 1
            seq.status = SequenceStatus.WAITING
            self.block_manager.deallocate(seq)
            if mistake == "queued at the back":
                self.waiting.insert(len(self.waiting), seq)
            else:
                self.waiting.insert(0, seq)
    return Written


def test_e7_2_written_form_passes(capsys):
    passes("E7.2", decode_written(), capsys)


@pytest.mark.parametrize("mistake,says", [
    ("victim from the front", "the BACK of `running` (running.pop()), not the front"),
    ("evicts itself", "not itself: it waits itself only when nobody is left behind it"),
    ("queued at the back", "FRONT of `waiting`"),
    ("no may_append", "call block_manager.may_append(seq)"),
    ("reversed", "keep the running order"),
    ("running not rebuilt", "self.running = kept"),
])
def test_e7_2_each_mistake_gets_its_own_hint_in_every_run(mistake, says):
    for _ in range(3):
        fails("E7.2", decode_written(mistake), says)
