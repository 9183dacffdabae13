"""Checks for chapter 07: the scheduler (continuous batching, chunked prefill, preemption).

The student writes a class with the reference Scheduler's constructor `(config, block_manager_cls)` and its
methods: `schedule()` (E7.1: the prefill phase and the choice of phase), `_schedule_decode()` and `preempt()`
(E7.2: the decode phase with preemption by recompute) and `postprocess()` (E7.3). E7.4 is a function: the
timeline of the engine loop with and without async (overlap) scheduling.

- `check_schedule_prefill(cls)` (E7.1), `check_schedule_decode(cls)` (E7.2), `check_postprocess(cls)`
  (E7.3): run the student's class in **lockstep** with `nanovllm_ref.engine.scheduler.Scheduler` on named
  scenarios and on random request streams under a tight block budget, with a fake model (sampled tokens from
  a seeded RNG, sometimes the eos id). After every `schedule()` they compare, exactly: the requests
  scheduled (in order), the phase, each one's `num_scheduled_tokens` and block table, the waiting and
  running queues and the preemption count; after every `postprocess()`: the finished requests, every
  request's token ids, status and `num_cached_tokens`, and the prefix-cache hash map. The block manager's
  invariants (`nanovllm_ref.engine.invariants.check_block_manager`) must hold after every step, and every
  request must finish. Each check uses the student's code for its own exercise only and the reference for
  the others (when the class has the `_schedule_decode` / `preempt` / `postprocess` methods of the
  notebook's layout; a class of another layout is checked whole). A failure is replayed with the planted
  mistakes of its exercise (`PLANTED`: the same scenario from the same random state); the one that fails with
  the very same message gives its hint (E7.2: the victim from the front, a sequence evicting itself, the victim
  queued at the back, no deallocate, no count, no status, no may_append, no token, the order reversed,
  `running` not rebuilt).

- `check_overlap_timeline(fn)` (E7.4): `fn(host_ms, device_ms, overlap) -> [(launch, device_start,
  device_end)]`, the timeline of the engine loop's host and device clocks, synchronous (`overlap=False`) or
  with async scheduling one step ahead (`overlap=True`, engine/llm_engine.py `_step_async`), compared with
  `reference_overlap_timeline` at an abs/rel tolerance of 1e-9 on fresh random step times (one and two steps,
  host shorter and longer than the device, a long prefill step among decodes, no host time); a wrong answer
  that matches a known mistake (no overlap, the host more than one step ahead, two steps on the device at
  once, the host on two steps at once) gets that mistake's hint.

Every check draws fresh random streams on each call and prints `E7.n ok` and nothing else on success.
`ReferenceScheduler`, `reference_schedule_prefill`, `reference_schedule_decode`, `reference_preempt` and
`reference_postprocess`, `reference_overlap_timeline` are the reference answers (`wall_ms` reads a timeline's
end); `simulate`, `simulate_static` and `gantt_text` are the
model-free simulator of the chapter's demos and figures; `MixedScheduler` is a vLLM-V1-style policy (one
token budget shared by decodes and prefill chunks), for the simulator only.
"""
import contextlib
import io
import math
import random
import signal
import threading
from collections import deque
from contextlib import contextmanager
from types import SimpleNamespace

from nanovllm_course.common import CheckFailed, NotDone, call_student, fail, fresh_generator, ok
from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.engine.invariants import check_block_manager
from nanovllm_ref.engine.scheduler import Scheduler as EngineScheduler
from nanovllm_ref.engine.sequence import Sequence, SequenceStatus
from nanovllm_ref.sampling_params import SamplingParams

EOS = 1                 # the fake model's end-of-sequence id
_VOCAB = 1000
_TIME_LIMIT_S = 20      # per scenario: a student's endless loop becomes a failure, not a hung kernel


# -- the reference answers, split the way the notebook splits the exercises -----------------------------------


def reference_schedule_prefill(sched) -> list[Sequence]:
    """Phase 1 of the reference `schedule()`: continue chunked prefills, then admit waiting sequences
    first-come under the token budget, `max_num_seqs` and `can_allocate`. Returns the scheduled list."""
    return EngineScheduler._schedule_prefill(sched)


def reference_schedule_decode(sched) -> list[Sequence]:
    """Phase 2 of the reference `schedule()`: one token for every running sequence, preempting from the
    back of `running` (via `sched.preempt`) when a block is needed and none is free."""
    return EngineScheduler._schedule_decode(sched)


reference_preempt = EngineScheduler.preempt
reference_postprocess = EngineScheduler.postprocess


def _schedule_with_own_decode(self):
    scheduled = reference_schedule_prefill(self)
    if scheduled:
        return scheduled, True
    return self._schedule_decode(), False


# The engine's Scheduler already has `schedule()` split into the notebook's two phases.
ReferenceScheduler = EngineScheduler


def _hybrid(cls, exercise: str):
    """`cls` with the methods of the other exercises taken from the reference (isolation: a stub or bug in
    E7.2 does not fail the check of E7.1). A class without the notebook's layout is returned whole."""
    if not isinstance(cls, type):
        return cls
    if not all(callable(getattr(cls, m, None)) for m in ("schedule", "_schedule_decode", "preempt", "postprocess")):
        return cls
    body = {}
    if exercise != "E7.1":
        body["schedule"] = _schedule_with_own_decode
        body["_admit_waiting"] = EngineScheduler._admit_waiting      # the reference prefill phase uses it
    if exercise != "E7.2":
        body["_schedule_decode"] = reference_schedule_decode
        body["preempt"] = reference_preempt
    if exercise != "E7.3":
        body["postprocess"] = reference_postprocess
    return type(cls.__name__, (cls,), body)


# -- a model-free simulator ------------------------------------------------------------------------------------


class MixedScheduler(EngineScheduler):
    """A vLLM-V1-style policy, for the simulator only (the engine's model runner runs all-prefill or
    all-decode steps): ONE token budget per step, spent first on the running sequences in admission order
    (a decode costs 1 token, an unfinished prompt its next chunk), then on admitting waiting sequences.
    Decodes and prefill chunks share a step. Preemption as in the reference. Returns (seqs, None)."""

    def schedule(self):
        budget, scheduled, kept = self.max_num_batched_tokens, [], deque()
        while self.running:
            seq = self.running.popleft()
            if budget == 0:
                seq.num_scheduled_tokens = 0
                kept.append(seq)
                continue
            if seq.is_prefilling:
                seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            else:
                while not self.block_manager.can_append(seq):
                    if self.running:
                        self.preempt(self.running.pop())
                    else:
                        self.preempt(seq)
                        break
                else:
                    self.block_manager.may_append(seq)
                    seq.num_scheduled_tokens = 1
                if seq.status == SequenceStatus.WAITING:
                    continue
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            kept.append(seq)
        self.running = kept
        return scheduled + self._admit_waiting(budget), None


def _config(**kw) -> SimpleNamespace:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=10**6, eos=frozenset({EOS}),
               num_kvcache_blocks=64, kvcache_block_size=4, enable_prefix_caching=True)
    cfg.update(kw)
    return SimpleNamespace(**cfg)


def simulate(requests, scheduler_cls=ReferenceScheduler, max_steps: int = 10_000, **config) -> list[dict]:
    """Run a scheduler with no model. `requests`: (arrival step, prompt length, max_tokens) tuples, or
    (arrival, prompt token list, max_tokens). The fake model never samples eos. `config`: fields of the
    engine Config (max_num_seqs, max_num_batched_tokens, num_kvcache_blocks, kvcache_block_size, ...).

    Returns one dict per step: {"phase": {request index: "prefill" | "decode"}, "tokens": {index: tokens
    computed}, "preempted": [indices preempted in this step], "stalled": [running, but not in this step],
    "finished": [indices], "waiting": [indices queued after the step]}."""
    sched = scheduler_cls(_config(**config), BlockManager)
    bs = sched.block_manager.block_size
    pending = sorted(range(len(requests)), key=lambda i: requests[i][0])
    seqs, index, trace, step = {}, {}, [], 0
    while pending or not sched.is_finished():
        while pending and requests[pending[0]][0] <= step:
            i = pending.pop(0)
            _, prompt, max_tokens = requests[i]
            prompt = list(range(100 + i, 100 + i + prompt)) if isinstance(prompt, int) else list(prompt)
            seq = Sequence(prompt, bs, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            seqs[i], index[id(seq)] = seq, i
            sched.add(seq)
        row = {"phase": {}, "tokens": {}, "preempted": [], "stalled": [], "finished": [], "waiting": []}
        if not sched.is_finished():
            before = {i for i, s in seqs.items() if s.status == SequenceStatus.RUNNING}
            decoding = {i for i in before if not seqs[i].is_prefilling}
            batch, is_prefill = sched.schedule()
            row["preempted"] = sorted(i for i in before if seqs[i].status == SequenceStatus.WAITING)
            for seq in batch:
                i = index[id(seq)]
                # a mixed policy returns is_prefill None: a sequence decodes if its prompt was done before
                decode = (not is_prefill) if is_prefill is not None else i in decoding
                row["phase"][i] = "decode" if decode else "prefill"
                row["tokens"][i] = seq.num_scheduled_tokens
            tokens = [2 + (index[id(s)] * 7 + len(s)) % (_VOCAB - 2) for s in batch]
            row["stalled"] = sorted(index[id(s)] for s in sched.running if index[id(s)] not in row["phase"])
            row["finished"] = sorted(index[id(s)] for s in sched.postprocess(batch, tokens))
            row["waiting"] = sorted(index[id(s)] for s in sched.waiting)
        trace.append(row)
        step += 1
        if step > max_steps:
            raise RuntimeError("simulation made no progress")
    return trace


def simulate_static(requests, batch_size: int) -> list[dict]:
    """Static batching: requests are taken `batch_size` at a time in arrival order; a batch prefills all
    its prompts in one step, then decodes until its LONGEST request is done, and only then does the next
    batch start. A request that finished early keeps its slot ("idle"). Same trace format as `simulate`
    plus "idle": [indices holding a slot without computing]."""
    order = sorted(range(len(requests)), key=lambda i: requests[i][0])
    plen = lambda i: requests[i][1] if isinstance(requests[i][1], int) else len(requests[i][1])  # noqa: E731
    trace, step = [], 0

    def queued(started):
        return sorted(i for i in order[started:] if requests[i][0] <= step)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        while step < max(requests[i][0] for i in batch):      # wait for the batch's last arrival
            trace.append({"phase": {}, "tokens": {}, "preempted": [], "stalled": [], "finished": [], "idle": [],
                          "waiting": queued(start)})
            step += 1
        left = {i: requests[i][2] for i in batch}
        first = True
        while any(left.values()):
            row = {"phase": {}, "tokens": {}, "preempted": [], "stalled": [], "finished": [], "idle": [],
                   "waiting": queued(start + batch_size)}
            for i in batch:
                if left[i] == 0:
                    row["idle"].append(i)
                    continue
                row["phase"][i] = "prefill" if first else "decode"
                row["tokens"][i] = plen(i) if first else 1
                left[i] -= 1
                if left[i] == 0:
                    row["finished"].append(i)
            first = False
            trace.append(row)
            step += 1
    return trace


def gantt_text(trace, num_requests: int | None = None) -> str:
    """The trace as text: one row per request, one column per step. P prefill (a whole prompt or a
    chunk), d decode, X preempted in this step, _ running but left out of this step (a stall), - waiting
    in the queue, . an idle slot (static batching: finished, but the batch still runs)."""
    n = num_requests if num_requests is not None else 1 + max(
        [i for row in trace for i in list(row["phase"]) + row["preempted"] + row.get("idle", [])] or [0])
    width = len(trace)
    lines = ["step        " + "".join(str(s % 10) for s in range(width))]
    for i in range(n):
        cells = []
        for row in trace:
            if i in row["preempted"]:
                cells.append("X")
            elif i in row["phase"]:
                cells.append("P" if row["phase"][i] == "prefill" else "d")
            elif i in row.get("idle", []):
                cells.append(".")
            elif i in row.get("stalled", []):
                cells.append("_")
            elif i in row.get("waiting", []):
                cells.append("-")
            else:
                cells.append(" ")
        lines.append(f"request {i:<3} " + "".join(cells).rstrip())
    return "\n".join(lines)


def summary(trace, requests) -> dict:
    """{"steps", "tokens_per_step", "mean_latency" (steps from arrival to the last token), "preemptions",
    "max_decode_gap" (the longest run of steps a started request waited between two of its tokens)}."""
    finish, last, gap = {}, {}, 0
    for s, row in enumerate(trace):
        for i in row["finished"]:
            finish[i] = s
        for i, phase in row["phase"].items():
            if phase == "decode" and i in last:
                gap = max(gap, s - last[i] - 1)
            last[i] = s
        for i in row["preempted"]:
            last.pop(i, None)
    tokens = sum(sum(row["tokens"].values()) for row in trace)
    lat = [finish[i] + 1 - requests[i][0] for i in finish]
    return {"steps": len(trace), "tokens_per_step": tokens / max(1, len(trace)),
            "mean_latency": sum(lat) / max(1, len(lat)), "preemptions": sum(len(r["preempted"]) for r in trace),
            "max_decode_gap": gap}


# -- the lockstep harness ---------------------------------------------------------------------------------------


class _Timeout(BaseException):
    pass


@contextmanager
def _time_limit(seconds):
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def handler(signum, frame):
        raise _Timeout()
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


_HINT_QUEUE_FRONT = ("preempt() puts the victim back at the FRONT of `waiting` (appendleft): it was admitted "
                     "before everything still waiting, so it goes first when blocks free up")
_HINT_VICTIM = ("the victim is the most recently admitted running sequence: the BACK of `running` "
                "(running.pop()), not the front")
_HINT_CACHED_BUDGET = ("prefix-cache hits cost no budget: after allocate(), schedule and charge only "
                       "len(seq) - seq.num_cached_tokens tokens")
_HINT_DEALLOCATE = ("preempt() must give back all the victim's blocks (block_manager.deallocate(seq)); otherwise "
                    "nobody can use them and the next sequence needs another victim")
_HINT_FCFS = ("first come, first served: when the first waiting sequence cannot get its blocks (can_allocate is "
              "False), stop admitting; do not skip ahead to a later one")
_HINT_PREFILL_FIRST = ("prefill comes first: a step decodes only when the prefill phase scheduled nothing "
                       "(no unfinished chunk and no admissible waiting sequence)")
_HINT_PARTIAL = ("after a partial prefill chunk (num_cached_tokens < len(seq)) the sampled token is "
                 "meaningless: skip it (no append, no finish test)")
_HINT_MAX_LEN = ("finish when len(seq) >= max_model_len, counting the token just appended: the sequence "
                 "may hold exactly max_model_len tokens, never more")


class _Lockstep:
    """Drives the reference Scheduler and the student's class with the same request stream and the same fake
    model, comparing everything observable after each call."""

    def __init__(self, tag, cls, scenario, cfg, hint, model=None, rng=None):
        self.tag, self.scenario, self.hint, self.cfg = tag, scenario, hint, cfg
        self.rng = rng or random.Random(0)
        self.model = model or self._random_model(0.0)
        self.ref = EngineScheduler(cfg, BlockManager)
        self.stu = self._call(cls, cfg, BlockManager, op=f"{getattr(cls, '__name__', 'Scheduler')}(config, "
                                                          "BlockManager)")
        self.pairs, self.label, self.log = [], {}, []
        self.step_no = 0
        self.hits = 0

    # -- plumbing -----------------------------------------------------------------------------------------------
    def _random_model(self, eos_rate):
        def model(i, seq):
            return EOS if self.rng.random() < eos_rate else self.rng.randrange(2, _VOCAB)
        return model

    def where(self):
        c = self.cfg
        setup = (f"{c.num_kvcache_blocks} blocks of {c.kvcache_block_size}, budget {c.max_num_batched_tokens} "
                 f"tokens, max_num_seqs {c.max_num_seqs}"
                 + (f", max_model_len {c.max_model_len}" if c.max_model_len < 10**6 else ""))
        recent = "; ".join(self.log[-5:]) or "nothing yet"
        return f"scenario '{self.scenario}' ({setup}), step {self.step_no}; recent: {recent}"

    def fail(self, message, hint=None):
        fail(self.tag, f"{message} [{self.where()}]", hint or self.hint)

    def _call(self, fn, *args, op):
        try:
            return fn(*args)
        except NotImplementedError as exc:
            fail(self.tag, f"not implemented yet ({exc}) [in {op}]",
                 "fill in the Scheduler methods above, run the cell, then this check")
        except (AssertionError, _Timeout):
            raise
        except Exception as exc:
            self.fail(f"{op} raised {type(exc).__name__}: {exc}")

    def name(self, seq):
        return self.label.get(id(seq), "?")

    def names(self, seqs):
        try:
            return [self.name(s) for s in seqs]
        except TypeError:
            self.fail(f"expected a list of Sequences, got {type(seqs).__name__}")

    # -- requests -----------------------------------------------------------------------------------------------
    def add(self, prompt, max_tokens, ignore_eos=True):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        bs = self.cfg.kvcache_block_size
        r, s = Sequence(prompt, bs, sp), Sequence(prompt, bs, sp)
        label = chr(ord("A") + len(self.pairs)) if len(self.pairs) < 26 else f"R{len(self.pairs)}"
        self.label[id(r)] = self.label[id(s)] = label
        self.pairs.append((r, s))
        self.log.append(f"add {label} ({len(prompt)} tokens{', ignore_eos' if ignore_eos else ''}, "
                        f"max_tokens {max_tokens})")
        self.ref.add(r)
        self._call(self.stu.add, s, op=f"add({label})")

    # -- comparisons --------------------------------------------------------------------------------------------
    def _queues(self, sched):
        try:
            return self.names(sched.waiting), self.names(sched.running)
        except AttributeError:
            self.fail("the scheduler has no `waiting` / `running` queues",
                      "keep the attributes of the given __init__: waiting and running are deques of Sequences")

    def _check_invariants(self, after):
        try:
            check_block_manager(self.stu.block_manager, list(self.stu.running) + list(self.stu.waiting))
        except AssertionError as exc:
            hint = None
            if after == "schedule" and self.ref.num_preemptions:
                hint = _HINT_DEALLOCATE
            elif after == "postprocess":
                hint = ("a finished sequence gives its blocks back (block_manager.deallocate) and leaves "
                        "`running`; an unfinished one keeps them")
            self.fail(f"block manager invariant broken after {after}(): {exc}", hint)

    def schedule(self):
        before = {self.name(r): r.status for r, _ in self.pairs}
        ref_batch, ref_pre = self.ref.schedule()
        out = self._call(self.stu.schedule, op="schedule()")
        if not (isinstance(out, tuple) and len(out) == 2):
            self.fail(f"schedule() returned {type(out).__name__}, expected a tuple (list of sequences, is_prefill)")
        stu_batch, stu_pre = out
        ref_ids, stu_ids = self.names(ref_batch), self.names(stu_batch)
        kind = {True: "prefill", False: "decode"}
        preempted_ref = [n for n, st in before.items() if st == SequenceStatus.RUNNING
                         and self.pairs[self._index(n)][0].status == SequenceStatus.WAITING]
        preempted_stu = [n for n, st in before.items() if st == SequenceStatus.RUNNING
                         and self.pairs[self._index(n)][1].status == SequenceStatus.WAITING]
        self.hits += sum(1 for r in ref_batch if ref_pre and r.num_cached_tokens > 0
                         and r.num_cached_tokens % self.cfg.kvcache_block_size == 0
                         and before[self.name(r)] == SequenceStatus.WAITING)
        desc = f"{kind[ref_pre]} {ref_ids}"
        if preempted_ref:
            desc += f", preempted {preempted_ref}"
        if bool(stu_pre) != ref_pre or ref_ids != stu_ids:
            got = f"{kind.get(bool(stu_pre))} {stu_ids}"
            hint = self._schedule_hint(ref_batch, ref_pre, stu_batch, stu_pre, preempted_ref, preempted_stu)
            if preempted_stu:
                got += f" (preempted {preempted_stu})"
            self.fail(f"schedule() ran {got}, expected {desc}", hint)
        if preempted_stu != preempted_ref:
            hint = _HINT_VICTIM if preempted_stu and preempted_ref else None
            queued = set(self.names(self.stu.waiting))
            kept_running = [n for n in preempted_ref if n not in preempted_stu and n in queued]
            if kept_running:
                hint = (f"request {kept_running[0]} was put back in `waiting` but is still marked RUNNING: preempt() "
                        "sets seq.status = SequenceStatus.WAITING")
            self.fail(f"schedule() preempted {preempted_stu}, expected {preempted_ref}", hint)
        for r, s in zip(ref_batch, stu_batch):
            if s.num_scheduled_tokens != r.num_scheduled_tokens:
                hint = None
                n = self.name(r)
                if s.num_scheduled_tokens == r.num_scheduled_tokens + r.num_cached_tokens and r.num_cached_tokens:
                    hint = _HINT_CACHED_BUDGET
                elif ref_pre and r.num_scheduled_tokens < len(r) - r.num_cached_tokens:
                    hint = ("a prompt longer than what is left of the budget is cut: schedule "
                            "min(len(seq) - num_cached_tokens, budget left) tokens now, the rest in later steps")
                self.fail(f"request {n} got num_scheduled_tokens {s.num_scheduled_tokens}, expected "
                          f"{r.num_scheduled_tokens} (it has {len(r)} tokens, {r.num_cached_tokens} cached)", hint)
        self._compare_state("schedule")
        if self.stu.num_preemptions != self.ref.num_preemptions:
            self.fail(f"num_preemptions is {self.stu.num_preemptions}, expected {self.ref.num_preemptions}",
                      "preempt() counts every preemption: self.num_preemptions += 1")
        self._check_invariants("schedule")
        self.log.append(desc)
        return ref_batch, stu_batch

    def _index(self, label):
        for i, (r, _) in enumerate(self.pairs):
            if self.label[id(r)] == label:
                return i
        raise KeyError(label)

    def _schedule_hint(self, ref_batch, ref_pre, stu_batch, stu_pre, pre_ref, pre_stu):
        if ref_pre and not stu_pre:
            return _HINT_PREFILL_FIRST
        decoding = [n for n in self.names(stu_batch) if stu_pre and self._was_running_decode.get(n)]
        if decoding:
            return (f"request {decoding[0]} has its prompt computed (only its newest token lacks K/V): it decodes, it "
                    "does not join a prefill step; a prompt is unfinished while num_cached_tokens < len(seq) - 1 "
                    "(seq.is_prefilling)")
        if not ref_pre and stu_pre:
            jumped = [n for n in self.names(stu_batch) if self._was_waiting.get(id(self.pairs[self._index(n)][0]))]
            if jumped and self.ref.waiting and self.name(self.ref.waiting[0]) not in self.names(stu_batch):
                return _HINT_FCFS
            return ("this step has nothing to prefill (every running sequence has its prompt computed and no "
                    "waiting one can be admitted): decode every running sequence")
        if not ref_pre:
            if any(self.name(s) in pre_stu for s in stu_batch):
                return ("a sequence that preempted itself is not scheduled in this step: after preempt(seq), "
                        "stop looking for blocks for it (break) and go on with the next one")
            if any(self.pairs[self._index(n)][1].block_table for n in pre_stu):
                return _HINT_DEALLOCATE
            return _HINT_VICTIM if pre_stu and pre_ref and pre_stu != pre_ref else None
        ref_ids, stu_ids = self.names(ref_batch), self.names(stu_batch)
        admitted = [r for r in ref_batch if self._was_waiting.get(id(r))]
        continuing = [self.name(r) for r in ref_batch if not self._was_waiting.get(id(r))]
        if len(self.stu.running) > self.cfg.max_num_seqs:
            return f"admit only while len(running) < max_num_seqs ({self.cfg.max_num_seqs})"
        extra = [s for s in stu_batch if self.name(s) not in ref_ids]
        if any(s.num_scheduled_tokens == 0 for s in extra):
            return ("admit only while budget > 0: once the budget is used up nobody else joins the step (a "
                    "sequence with 0 tokens to compute must not run)")
        if extra and self.ref.waiting and self.name(self.ref.waiting[0]) not in stu_ids:
            return _HINT_FCFS
        missing = [n for n in ref_ids if n not in stu_ids]
        if missing and any(r.num_cached_tokens > 0 for r in admitted):
            return _HINT_CACHED_BUDGET
        if continuing and stu_ids[:len(continuing)] != continuing:
            return ("unfinished prefill chunks continue first, in `running` order, before any waiting "
                    "sequence is admitted")
        return None

    def _compare_state(self, after):
        rw, rr = self._queues(self.ref)
        sw, sr = self._queues(self.stu)
        if (sw, sr) != (rw, rr):
            hint = None
            finished = {self.name(r) for r, _ in self.pairs if r.status == SequenceStatus.FINISHED}
            if sorted(sw) == sorted(rw) and sw != rw:
                hint = _HINT_QUEUE_FRONT
            elif after == "postprocess" and finished & set(sr):
                hint = "a finished sequence leaves `running` (self.running.remove(seq))"
            self.fail(f"after {after}(): waiting {sw}, running {sr}; expected waiting {rw}, running {rr}", hint)
        for r, s in self.pairs:
            n = self.name(r)
            if list(s.block_table) != list(r.block_table):
                hint = None
                if not r.block_table and r.status == SequenceStatus.WAITING:
                    hint = _HINT_DEALLOCATE
                self.fail(f"after {after}(): request {n} has block_table {list(s.block_table)}, expected "
                          f"{r.block_table}", hint)
            if s.status != r.status:
                self.fail(f"after {after}(): request {n} is {s.status.name}, expected {r.status.name}")

    def postprocess(self, ref_batch, stu_batch):
        tokens = [self.model(self.name(r), r) for r in ref_batch]
        in_step = {id(r) for r in ref_batch}
        ref_done = reference_postprocess(self.ref, ref_batch, tokens)
        got = self._call(self.stu.postprocess, stu_batch, list(tokens), op="postprocess(seqs, token_ids)")
        for r, s in self.pairs:
            n = self.name(r)
            if s.token_ids != r.token_ids:
                hint = None
                if len(s) > len(r) and id(r) in in_step and r.num_cached_tokens < len(r):
                    hint = _HINT_PARTIAL
                elif len(s) < len(r):
                    hint = "when the whole sequence is computed (num_cached_tokens == len(seq)), append the sampled token"
                if len(s) == len(r):
                    i = next(i for i, (a, b) in enumerate(zip(s.token_ids, r.token_ids)) if a != b)
                    self.fail(f"after postprocess(): request {n} holds token {s.token_ids[i]!r} at position {i}, "
                              f"expected {r.token_ids[i]}", "append exactly token_ids[i], the token sampled for seqs[i]")
                self.fail(f"after postprocess(): request {n} has {len(s)} tokens, expected {len(r)}", hint)
            if s.status != r.status:
                self.fail(f"after postprocess(): request {n} is {s.status.name}, expected {r.status.name}",
                          self._finish_hint(r, s))
            if id(r) in in_step and s.num_scheduled_tokens != r.num_scheduled_tokens:
                self.fail(f"after postprocess(): request {n} still has num_scheduled_tokens {s.num_scheduled_tokens}",
                          "the step is accounted for: set num_scheduled_tokens back to 0")
            if s.num_cached_tokens != r.num_cached_tokens:
                hint = ("every scheduled token now has its K/V in the cache: num_cached_tokens += "
                        "num_scheduled_tokens (then reset num_scheduled_tokens to 0)")
                if r.status == SequenceStatus.FINISHED and s.block_table:
                    hint = "a finished sequence gives its blocks back: block_manager.deallocate(seq)"
                self.fail(f"after postprocess(): request {n} has num_cached_tokens {s.num_cached_tokens}, expected "
                          f"{r.num_cached_tokens}", hint)
        if got is None or self.names(got) != self.names(ref_done):
            self.fail(f"postprocess() returned {None if got is None else self.names(got)} as finished, expected "
                      f"{self.names(ref_done)}", "return the list of sequences that finished in this step")
        ref_hashes = set(self.ref.block_manager.hash_to_block_id.items())
        stu_hashes = set(self.stu.block_manager.hash_to_block_id.items())
        if ref_hashes != stu_hashes:
            self.fail(f"after postprocess(): the prefix cache has {len(stu_hashes)} hashed blocks, expected "
                      f"{len(ref_hashes)}", "after advancing num_cached_tokens, call block_manager.hash_blocks(seq) "
                      "for every sequence of the step, so full written blocks can be hit later")
        self._compare_state("postprocess")
        self._check_invariants("postprocess")
        if ref_done:
            self.log.append(f"finished {self.names(ref_done)}")

    def _finish_hint(self, r, s):
        if r.status == SequenceStatus.FINISHED:
            last = r.token_ids[-1]
            if len(r) >= self.cfg.max_model_len and r.num_completion_tokens < r.max_tokens and \
                    not (last in self.cfg.eos and not r.ignore_eos):
                return _HINT_MAX_LEN
            if last in self.cfg.eos and not r.ignore_eos:
                return "finish when the sampled token is an eos id (token_id in self.eos) unless ignore_eos"
            return "finish when num_completion_tokens reaches max_tokens"
        if s.status == SequenceStatus.FINISHED:
            last = r.token_ids[-1]
            if last in self.cfg.eos and r.ignore_eos:
                return "with ignore_eos the eos token is an ordinary token: do not finish on it"
            if len(r) == self.cfg.max_model_len - 1 or len(s) == self.cfg.max_model_len - 1:
                return _HINT_MAX_LEN
            if r.num_cached_tokens < len(r) or len(s) > len(r):
                return _HINT_PARTIAL
        return None

    # -- driving ------------------------------------------------------------------------------------------------
    def step(self):
        self.step_no += 1
        self._was_waiting = {id(r): r.status == SequenceStatus.WAITING for r, _ in self.pairs}
        self._was_running_decode = {self.name(r): r.status == SequenceStatus.RUNNING and not r.is_prefilling
                                    for r, _ in self.pairs}
        ref_batch, stu_batch = self.schedule()
        self.postprocess(ref_batch, stu_batch)

    def run(self, arrivals: dict, max_steps: int = 3000):
        """arrivals: {step: [(prompt, max_tokens, ignore_eos), ...]}; run until every request finished."""
        last = max(arrivals) if arrivals else 0
        t = 0
        try:
            with _time_limit(_TIME_LIMIT_S):
                while t <= last or not self.ref.is_finished():
                    for prompt, max_tokens, ignore_eos in arrivals.get(t, []):
                        self.add(prompt, max_tokens, ignore_eos)
                    if not self.ref.is_finished():
                        self.step()
                    t += 1
                    if t > max_steps:
                        self.fail("the reference did not finish (a bug in the check)")
        except _Timeout:
            self.fail(f"the scheduler did not return within {_TIME_LIMIT_S} s (an endless loop?)",
                      "in the decode phase, a sequence that needs a block preempts the back of `running`; when "
                      "nobody is left behind it, it preempts itself and stops looking (break)")
        done = self._call(self.stu.is_finished, op="is_finished()")
        unfinished = [self.name(s) for _, s in self.pairs if s.status != SequenceStatus.FINISHED]
        if not done or unfinished:
            self.fail(f"every request finished on the reference, but {unfinished or 'the queues'} did not")
        return self


# -- scenarios ------------------------------------------------------------------------------------------------


def _toks(rng, n):
    return [rng.randrange(2, _VOCAB) for _ in range(n)]


def _scenario_three_chunks(tag, cls, rng):
    t = _Lockstep(tag, cls, "a 3-chunk prompt", _config(max_num_batched_tokens=8, kvcache_block_size=4),
                  "a 20-token prompt under an 8-token budget runs as chunks of 8, 8 and 4; an unfinished "
                  "chunk continues before a waiting request is admitted, which then gets the budget left",
                  rng=rng)
    return t.run({0: [(_toks(rng, 20), 3, True)], 1: [(_toks(rng, 6), 2, True)]})


def _scenario_budget_used_up(tag, cls, rng):
    t = _Lockstep(tag, cls, "a budget exactly used up", _config(max_num_batched_tokens=10),
                  "admit while budget > 0: after 4 + 6 tokens the budget is 0 and the third request waits", rng=rng)
    return t.run({0: [(_toks(rng, 4), 2, True), (_toks(rng, 6), 2, True), (_toks(rng, 3), 2, True)]})


def _scenario_max_num_seqs(tag, cls, rng):
    t = _Lockstep(tag, cls, "the max_num_seqs cap", _config(max_num_seqs=2, max_num_batched_tokens=64),
                  "admit only while len(running) < max_num_seqs; the others wait until one finishes", rng=rng)
    return t.run({0: [(_toks(rng, 3), 2, True), (_toks(rng, 5), 4, True), (_toks(rng, 2), 3, True),
                      (_toks(rng, 4), 1, True)]})


def _scenario_prefix_hit(tag, cls, rng):
    shared = _toks(rng, 8)
    t = _Lockstep(tag, cls, "a prefix hit", _config(max_num_batched_tokens=12, kvcache_block_size=4),
                  _HINT_CACHED_BUDGET, rng=rng)
    return t.run({0: [(shared + _toks(rng, 3), 3, True)],
                  2: [(shared + _toks(rng, 5), 2, True), (_toks(rng, 6), 2, True)]})


def _scenario_fcfs(tag, cls, rng):
    t = _Lockstep(tag, cls, "first come, first served", _config(num_kvcache_blocks=5, kvcache_block_size=2,
                                                                max_num_batched_tokens=32),
                  "first come, first served: when the first waiting sequence cannot get its blocks "
                  "(can_allocate is False), stop admitting; do not skip ahead to a smaller one", rng=rng)
    return t.run({0: [(_toks(rng, 5), 2, True)], 1: [(_toks(rng, 7), 1, True), (_toks(rng, 1), 1, True)]})


def _scenario_decode_all(tag, cls, rng):
    t = _Lockstep(tag, cls, "decode every running sequence", _config(),
                  "with nothing to prefill, every running sequence decodes one token (num_scheduled_tokens 1), "
                  "in `running` order, after block_manager.may_append(seq)", rng=rng)
    return t.run({0: [(_toks(rng, 3), 4, True), (_toks(rng, 6), 6, True), (_toks(rng, 1), 5, True)]})


def _scenario_cascade(tag, cls, rng):
    t = _Lockstep(tag, cls, "a preemption cascade", _config(num_kvcache_blocks=10, kvcache_block_size=2,
                                                            max_num_batched_tokens=64, max_num_seqs=8),
                  "a sequence that needs a block when none is free preempts the back of `running` "
                  "(the most recently admitted), again and again until it can append; each victim frees all "
                  "its blocks and goes to the FRONT of `waiting`", rng=rng)
    return t.run({0: [(_toks(rng, 3), 6, True) for _ in range(5)]})


def _scenario_self_preemption(tag, cls, rng):
    t = _Lockstep(tag, cls, "self-preemption", _config(num_kvcache_blocks=5, kvcache_block_size=2,
                                                       max_num_batched_tokens=64),
                  "when a sequence needs a block and nobody is left behind it in `running`, it preempts "
                  "itself (frees its blocks, goes to the front of `waiting`) and is not scheduled this step",
                  rng=rng)
    return t.run({0: [(_toks(rng, 3), 4, True), (_toks(rng, 3), 4, True)]})


def _scenario_eos(tag, cls, rng):
    def model(label, seq):                      # eos as the second completion token, for everyone
        return EOS if seq.num_completion_tokens == 1 else rng.randrange(2, _VOCAB)
    t = _Lockstep(tag, cls, "eos vs ignore_eos", _config(), None, model=model, rng=rng)
    prompt = _toks(rng, 5)
    return t.run({0: [(prompt, 5, False), (prompt, 5, True)]})


def _scenario_max_model_len(tag, cls, rng):
    t = _Lockstep(tag, cls, "max_model_len", _config(max_model_len=12), _HINT_MAX_LEN, rng=rng)
    return t.run({0: [(_toks(rng, 9), 10, True), (_toks(rng, 11), 10, True), (_toks(rng, 4), 3, True)]})


def _scenario_hash_then_hit(tag, cls, rng):
    shared = _toks(rng, 8)
    t = _Lockstep(tag, cls, "a prefix hit after the blocks were hashed",
                  _config(max_num_batched_tokens=6, kvcache_block_size=4),
                  "postprocess calls block_manager.hash_blocks(seq) after advancing num_cached_tokens, so "
                  "the full blocks a chunk wrote can be hit by the next request", rng=rng)
    return t.run({0: [(shared + _toks(rng, 2), 3, True)], 3: [(shared + _toks(rng, 3), 2, True)]})


def _random_stream(tag, cls, rng, eos_rate=0.1, name="a random request stream"):
    bs = rng.choice([1, 2, 3, 4])
    num_blocks = rng.randint(5, 12)
    budget = rng.choice([2 * bs, 7, 16, 40])
    mml = rng.choice([10**6, 10**6, rng.randint(6, 24)])
    cfg = _config(max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=budget, max_model_len=mml,
                  num_kvcache_blocks=num_blocks, kvcache_block_size=bs,
                  enable_prefix_caching=rng.random() < 0.75)
    t = _Lockstep(tag, cls, name, cfg, None, rng=rng)
    t.model = t._random_model(eos_rate)
    families = [_toks(rng, rng.randint(0, 3 * bs)) for _ in range(3)]
    arrivals, step, prompts = {}, 0, []
    for _ in range(rng.randint(8, 14)):
        if prompts and rng.random() < 0.2:
            prompt = list(rng.choice(prompts))
        else:
            prompt = rng.choice(families) + _toks(rng, rng.randint(1, 2 * bs + 2))
        prompt = prompt[:min(mml, num_blocks * bs)]
        max_tokens = rng.randint(1, 8)
        # the request must fit in the cache on its own (the engine refuses one that never can)
        while max_tokens > 1 and -(-max(len(prompt), min(len(prompt) + max_tokens, mml) - 1) // bs) > num_blocks:
            max_tokens -= 1
        while -(-max(len(prompt), min(len(prompt) + max_tokens, mml) - 1) // bs) > num_blocks:
            prompt = prompt[:-1]
        prompts.append(prompt)
        arrivals.setdefault(step, []).append((prompt, max_tokens, rng.random() < 0.5))
        step += rng.choice([0, 0, 1, 2, 3])
    return t.run(arrivals)


def _rng() -> random.Random:
    return random.Random(int(fresh_generator().initial_seed()))


SCENARIOS = {
    "E7.1": [_scenario_three_chunks, _scenario_budget_used_up, _scenario_max_num_seqs, _scenario_prefix_hit,
             _scenario_fcfs],
    "E7.2": [_scenario_decode_all, _scenario_cascade, _scenario_self_preemption],
    "E7.3": [_scenario_three_chunks, _scenario_eos, _scenario_max_model_len, _scenario_hash_then_hit],
}
NUM_RANDOM_STREAMS = 20


def planted_decode_scheduler(mistake: str) -> type:
    """The reference Scheduler with one planted mistake in E7.2's `_schedule_decode` / `preempt` (for the hints):
    victim_front, preempt_self, queue_back, no_deallocate, no_count, no_status, no_may_append, no_tokens,
    kept_reversed, running_not_reassigned."""
    class Planted(EngineScheduler):
        def _schedule_decode(self):
            kept = deque()
            while self.running:
                seq = self.running.popleft()
                while not self.block_manager.can_append(seq):
                    if mistake == "preempt_self" or not self.running:
                        self.preempt(seq)
                        break
                    self.preempt(self.running.popleft() if mistake == "victim_front" else self.running.pop())
                else:
                    if mistake != "no_may_append":
                        self.block_manager.may_append(seq)
                    if mistake != "no_tokens":
                        seq.num_scheduled_tokens = 1
                    (kept.appendleft if mistake == "kept_reversed" else kept.append)(seq)
            if mistake != "running_not_reassigned":
                self.running = kept
            return list(kept)

        def preempt(self, seq):
            if mistake != "no_count":
                self.num_preemptions += 1
            if mistake != "no_status":
                seq.status = SequenceStatus.WAITING
            if mistake != "no_deallocate":
                self.block_manager.deallocate(seq)
            (self.waiting.append if mistake == "queue_back" else self.waiting.appendleft)(seq)
    Planted.__name__ = Planted.__qualname__ = "Scheduler"
    return Planted


PLANTED = {   # exercise -> [(planted class, hint)]: a failure the same as a planted one's gets that one's hint
    "E7.2": [
        (planted_decode_scheduler("victim_front"), _HINT_VICTIM),
        (planted_decode_scheduler("preempt_self"), "a sequence that needs a block preempts the BACK of `running` "
         "(the most recently admitted, running.pop()), not itself: it waits itself only when nobody is left behind "
         "it"),
        (planted_decode_scheduler("queue_back"), _HINT_QUEUE_FRONT),
        (planted_decode_scheduler("no_deallocate"), _HINT_DEALLOCATE),
        (planted_decode_scheduler("no_count"), "preempt() counts every preemption: self.num_preemptions += 1"),
        (planted_decode_scheduler("no_status"), "preempt() sets seq.status = SequenceStatus.WAITING: the victim is "
         "waiting again (and the prefill phase will admit it like a new request)"),
        (planted_decode_scheduler("no_may_append"), "call block_manager.may_append(seq) for each sequence that "
         "decodes: it gives the sequence a new block when its next token starts one"),
        (planted_decode_scheduler("no_tokens"), "each decoding sequence computes one token: seq.num_scheduled_tokens "
         "= 1"),
        (planted_decode_scheduler("kept_reversed"), "keep the running order: the sequences that decode stay in "
         "admission order (kept.append(seq)), and `running` becomes them in that order"),
        (planted_decode_scheduler("running_not_reassigned"), "popleft() empties `running` while you walk it: after "
         "the loop, self.running = kept (the sequences that were not preempted)"),
    ],
}


def _explained(tag, exc, scenario, rng_state, planted) -> str | None:
    """The hint of the planted mistake that fails `scenario` (run from the same random state) exactly as the
    student's class did, else None."""
    for cls, hint in planted:
        rng = random.Random()
        rng.setstate(rng_state)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                scenario(tag, _hybrid(cls, tag), rng)
        except CheckFailed as mine:
            if mine.message == exc.message:
                return hint
        except Exception:       # noqa: BLE001 - a planted class that breaks differently explains nothing
            continue
    return None


def _check(tag, cls, rng=None):
    rng = rng or _rng()
    impl = _hybrid(cls, tag)
    runs = list(SCENARIOS[tag]) + [_random_stream] * NUM_RANDOM_STREAMS
    for scenario in runs:
        state = rng.getstate()
        try:
            scenario(tag, impl, rng)
        except CheckFailed as exc:
            hint = _explained(tag, exc, scenario, state, PLANTED.get(tag, []))
            if hint is None or isinstance(exc, NotDone):
                raise
            raise CheckFailed(tag, exc.message, hint) from None
    ok(tag)


def check_schedule_prefill(cls) -> None:
    """E7.1: the prefill phase of schedule() (with the reference decode phase and postprocess)."""
    _check("E7.1", cls)


def check_schedule_decode(cls) -> None:
    """E7.2: _schedule_decode() and preempt() (with the reference prefill phase and postprocess)."""
    _check("E7.2", cls)


def check_postprocess(cls) -> None:
    """E7.3: postprocess() (with the reference schedule())."""
    _check("E7.3", cls)


# -- E7.4: the overlap timeline ----------------------------------------------------------------------------------
# A model of the engine loop's two clocks (engine/llm_engine.py, `_step` and `_step_async`). Step i costs the
# host h_i ms (all host work between two launches: the bookkeeping of the ids that arrived, schedule, prepare,
# launch) and the device d_i ms. Times in ms from 0; E_{-1} = E_{-2} = L_{-1} = 0.
#   sync:  the host starts step i when step i-1's ids are back:   S_i = E_{i-1}
#   async: the host starts step i once it has launched step i-1
#          and step i-2's ids are back (one step ahead, no more): S_i = max(L_{i-1}, E_{i-2})
#   both:  launch L_i = S_i + h_i; the device runs one step at a time: start_i = max(L_i, E_{i-1}),
#          E_i = start_i + d_i. Wall time: E of the last step.


def _timeline(host_ms, device_ms, overlap: bool, variant: str = "reference") -> list[tuple[float, float, float]]:
    """The reference timeline, or one of the wrong variants the check recognises (to name the mistake)."""
    out, launch_prev, end_prev, end_prev2 = [], 0.0, 0.0, 0.0
    for h, d in zip(host_ms, device_ms):
        if not overlap:
            start_host = end_prev
        elif variant == "unbounded":
            start_host = launch_prev
        elif variant == "host_parallel":
            start_host = end_prev2
        else:
            start_host = max(launch_prev, end_prev2)
        launch = start_host + h
        start = launch if variant == "device_parallel" else max(launch, end_prev)
        end = start + d
        out.append((launch, start, end))
        launch_prev, end_prev2, end_prev = launch, end_prev, end
    return out


def reference_overlap_timeline(host_ms: list[float], device_ms: list[float], overlap: bool) -> list[tuple]:
    """E7.4's answer: [(launch, device_start, device_end)] per step, in ms, for the synchronous loop
    (overlap=False) or async scheduling one step ahead (overlap=True); the rules are in the notebook."""
    return _timeline(host_ms, device_ms, overlap)


def wall_ms(timeline) -> float:
    """When the last step's ids are on the host: the device end of the last step (0 for no steps)."""
    return timeline[-1][2] if timeline else 0.0


_HINT_ONE_AT_A_TIME = "the device runs one step at a time: step i starts at max(launch_i, end of step i-1)"


def _known_mistakes(host, device, overlap: bool):
    """(a wrong timeline, the hint that names its mistake) for this mode."""
    if not overlap:
        return [(_timeline(host, device, True), "that is the async timeline: with overlap=False the host starts "
                                                "step i only when step i-1's ids are back, S_i = E_{i-1}"),
                (_timeline(host, device, False, "device_parallel"), _HINT_ONE_AT_A_TIME)]
    return [(_timeline(host, device, False), "with overlap=True the host does not wait for step i-1: it starts "
                                             "step i as soon as it has launched step i-1 (and step i-2's ids are "
                                             "back), while the device runs step i-1"),
            (_timeline(host, device, True, "unbounded"), "the host runs at most ONE step ahead: before it schedules "
                                                         "step i it needs step i-2's ids (which sequences finished "
                                                         "there), so S_i = max(L_{i-1}, E_{i-2}), not just L_{i-1}"),
            (_timeline(host, device, True, "device_parallel"), _HINT_ONE_AT_A_TIME),
            (_timeline(host, device, True, "host_parallel"), "the host does one thing at a time: it starts step "
                                                             "i's work only after it launched step i-1, "
                                                             "S_i = max(L_{i-1}, E_{i-2})")]


_FIELDS = ("launch", "device start", "device end")


def _timeline_cases(rng: random.Random):
    """(name, host_ms, device_ms): fresh random runs of steps in the regimes that behave differently."""
    def draw(n, lo, hi):
        return [round(rng.uniform(lo, hi), 3) for _ in range(n)]
    n = rng.randint(6, 30)
    prefill = draw(n, 0.2, 0.6)
    spike = rng.randrange(n)
    device = draw(n, 1.0, 2.0)
    device[spike] *= 20                                       # a prefill step among decodes
    return [
        ("one step", draw(1, 0.1, 1), draw(1, 0.5, 3)),
        ("two steps", draw(2, 0.1, 1), draw(2, 0.5, 3)),
        ("host shorter than device (batch 1 on the H200)", draw(n, 0.2, 0.5), draw(n, 1.0, 1.5)),
        ("host longer than device (host-bound)", draw(n, 1.0, 3.0), draw(n, 0.2, 0.8)),
        ("mixed, with a long prefill step", prefill, device),
        ("host and device times drawn alike", draw(n, 0.0, 2.0), draw(n, 0.0, 2.0)),
        ("no host time", [0.0] * 5, draw(5, 0.5, 1.0)),
    ]


def check_overlap_timeline(fn) -> None:
    """E7.4: `fn(host_ms, device_ms, overlap)` must give the reference's [(launch, device_start, device_end)]
    per step (abs/rel tolerance 1e-9) on fresh random runs, synchronous and asynchronous."""
    tag = "E7.4"
    rng = _rng()
    for name, host, device in _timeline_cases(rng):
        for overlap in (False, True):
            mode = "overlap=True" if overlap else "overlap=False"
            got = call_student(tag, fn, list(host), list(device), overlap)
            want = reference_overlap_timeline(host, device, overlap)
            where = f"{len(host)} step{'s' if len(host) != 1 else ''}, {name}, {mode}"
            try:
                got = [tuple(float(v) for v in row) for row in got]
            except (TypeError, ValueError):
                fail(tag, f"overlap_timeline returned a {type(got).__name__}, not a list of tuples ({where})",
                     "return a list with one (launch, device_start, device_end) tuple of floats per step")
            if len(got) != len(want) or any(len(row) != 3 for row in got):
                fail(tag, f"overlap_timeline returned {len(got)} row(s), expected {len(want)} tuples of 3 ({where})",
                     "one (launch, device_start, device_end) tuple per step, in step order")
            if _same(got, want):
                continue
            for wrong, hint in _known_mistakes(host, device, overlap):
                if _same(got, wrong):
                    i, f = _first_difference(got, want)
                    fail(tag, f"step {i}: {_FIELDS[f]} at {got[i][f]:.3f} ms, expected {want[i][f]:.3f} ms "
                              f"({where})", hint)
            i, f = _first_difference(got, want)
            hint = {0: "the launch is when the host's work for the step ends: L_i = S_i + h_i, with S_i as the "
                       "rules above say for this mode",
                    1: "the device starts a step once it is launched AND the previous step is done: "
                       "max(L_i, E_{i-1})",
                    2: "a step ends device_ms[i] after it starts on the device"}[f]
            fail(tag, f"step {i}: {_FIELDS[f]} at {got[i][f]:.3f} ms, expected {want[i][f]:.3f} ms ({where})", hint)
    ok(tag)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
                                    for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _first_difference(got, want) -> tuple[int, int]:
    for i, (ra, rb) in enumerate(zip(got, want)):
        for f, (x, y) in enumerate(zip(ra, rb)):
            if not math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9):
                return i, f
    return 0, 0


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402

# one class built over three exercises: E7.3's check runs it inside the engine once all three are done
EXERCISES = exercises(
    Exercise("E7.1", check_schedule_prefill, ("Scheduler",), (ReferenceScheduler,)),
    Exercise("E7.2", check_schedule_decode, ("Scheduler",), (ReferenceScheduler,)),
    Exercise("E7.3", check_postprocess, ("Scheduler",), (ReferenceScheduler,), parts=(
        EnginePart("Scheduler", "scheduler", "E7.1-E7.3",
                   check=lambda mod: (check_schedule_prefill(mod.Scheduler), check_schedule_decode(mod.Scheduler),
                                      check_postprocess(mod.Scheduler))),)),
    Exercise("E7.4", check_overlap_timeline, ("overlap_timeline",), (reference_overlap_timeline,)),
)
PARTS = parts_of(EXERCISES)
