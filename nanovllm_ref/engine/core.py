"""The engine core: schedule, execute, update, in token ids only (issue 28; vLLM v1's `vllm/v1/engine/core.py`).

    core = EngineCore(config, parts)
    core.add_request(EngineCoreRequest("0", prompt_token_ids, sampling_fields(sp), seeds=[seed]))
    outs = core.step()          # EngineCoreOutputs: per sample, the token ids this step added
    core.abort(["0"])           # or [("0", 1)]: one sample

The core owns the scheduler, the block manager, the model runner (and its tensor-parallel workers) and the
StepBuilder. It knows no tokenizer and no text: its sequences have no detokenizer, so the scheduler's stop
check (engine/stop.py) ends them on eos, stop ids, min_tokens, max_tokens and max_model_len only. Stop strings
are the front end's (engine/output_processor.py): it matches them on the text and then aborts the sample here.
The front end talks to a core through a client (engine/core_client.py): in this process (InprocClient, what
`LLM` runs by default and a notebook steps through) or in a process of its own over ZMQ (ProcessClient,
`run_engine_core`, what the server runs on CUDA).

Async scheduling (`async_scheduling`, on by default with CUDA): `step` schedules and launches step n+1 while
the device still runs step n, then finishes step n. Step n+1's sequences carry a placeholder for the token
step n samples (engine/sequence.py PENDING); the device reads its value from step n's output, and the host
learns it one step late (`Scheduler.on_tokens`), where the finish and stop checks run, once per token. A
sequence that stops at step n was also given a row in step n+1; that token is dropped. In both routes a decode
step's rows go to the model runner longest context first (engine/step_batch.longest_first: the decode attention
starts its programs in row order, and that order shortens its tail). Routes:

| route | when | a step |
|---|---|---|
| async | async_scheduling True, or None on CUDA; one process, the reference scheduler | schedule n+1 (a decode step's rows longest first), launch it, `on_launch`; wait for step n's ids, `on_tokens`, record its logprobs |
| sync  | otherwise (CPU by default, TP > 1, a replaced scheduler) | schedule (a decode step's rows longest first), launch + wait, `postprocess`, record its logprobs |

Logprobs arrive with their step's ids and are kept for exactly the tokens the scheduler kept (a token dropped
after a stop, or of an aborted request, has none): `_record_logprobs`. A step's message carries the rows new
in it (EngineCoreOutput.new_logprobs, new_prompt_logprobs).

Tensor parallelism: rank 0 runs in the core's process; ranks 1..tp-1 are spawned processes that run
`nanovllm_ref.engine.worker.run_worker` (an importable function, as `spawn` requires). Each core picks its own
free TCP port for the process-group rendezvous and talks to its workers over private pipes, so two engines
never clash and nothing named is left in /dev/shm after a crash.
"""
import multiprocessing as mp
import socket
import time
from functools import partial

from nanovllm_ref.config import Config
from nanovllm_ref.engine.core_messages import (CoreStepStats, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                               core_sampling_params)
from nanovllm_ref.engine.model_runner import ModelRunner
from nanovllm_ref.engine.request import Request
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.engine.sequence import SequenceStatus
from nanovllm_ref.engine.step_batch import StepBuilder, longest_first
from nanovllm_ref.outputs import StepStats
from nanovllm_ref.parts import Parts


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineCore:
    """config: the engine's Config (the tokenizer's eos already in config.eos: the front end derived it);
    parts: a nanovllm_ref.Parts. Loads the weights and sizes the KV cache; raises what ModelRunner raises.

    State a caller may read: `config` (a derived copy holding the cache's real size), `scheduler`,
    `model_runner`, `step_builder`, `workers` (the tensor-parallel worker processes), `async_scheduling`,
    `requests` (unfinished core requests by core id: engine/request.py Request, sequences without text),
    `last_step` (StepStats of the step last launched, None after an idle one). Not thread-safe: one thread
    makes every call."""

    def __init__(self, config: Config, parts: Parts):
        self.parts = parts
        self.workers, conns = [], []
        if config.tensor_parallel_size > 1:
            parts.check_picklable()
            import torch.distributed as dist
            if dist.is_initialized():
                raise ValueError("another tensor-parallel engine is alive in this process; call exit() on it "
                                 "first (one process group per process)")
            from nanovllm_ref.engine.worker import run_worker
            port, ctx = _free_port(), mp.get_context("spawn")
            for rank in range(1, config.tensor_parallel_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=run_worker, args=(config, rank, child, port, parts), daemon=True)
                proc.start()
                self.workers.append(proc)
                conns.append(parent)
        else:
            port = None
        try:
            self.model_runner = ModelRunner(config, 0, conns, port, parts)
        except BaseException:
            self._kill_workers()
            import torch.distributed as dist
            if config.tensor_parallel_size > 1 and dist.is_initialized():
                dist.destroy_process_group()
            raise
        # The scheduler sees the cache's real size (a derived copy: the Config passed in is never changed).
        self.config = config.derived(num_kvcache_blocks=self.model_runner.num_kvcache_blocks)
        self.scheduler = parts.scheduler(self.config, parts.block_manager)
        # Each step's batch record for the model runner, built from the scheduled sequences (engine/step_batch.py)
        self.step_builder = StepBuilder(parts.prepare_prefill, parts.prepare_decode, self.config)
        self.async_scheduling = self.model_runner.plan.async_scheduling       # decided by Parts.resolve
        self._in_flight = None            # async: (seqs, PendingStep, samples) of the step launched, not finished
        self.requests: dict[str, Request] = {}
        self.last_step: StepStats | None = None
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------------------
    def _kill_workers(self):
        for proc in self.workers:
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=10)
        self.workers = []

    def shutdown(self):
        """Stop the worker processes and free the process group. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.model_runner.out_of_step:
            # The workers are stuck inside an interrupted step's collectives: they would never reach the
            # exit barrier. Stop them, then leave the process group without one.
            self._kill_workers()
            self.model_runner._release()
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
            return
        try:
            self.model_runner.shutdown_workers()
        finally:
            for proc in self.workers:
                proc.join(timeout=30)
            self._kill_workers()

    # -- requests ---------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end has checked (engine/request.py check_request); its first sequence
        waits in the scheduler, the other samples fork from it (engine/scheduler.py)."""
        sp = core_sampling_params(request)
        core_request = Request(request.request_id, None, request.prompt_token_ids, sp,
                               self.config.kvcache_block_size, None, seeds=list(request.seeds) or None)
        self.requests[request.request_id] = core_request
        self.scheduler.add(core_request.seqs[0])

    def abort(self, items) -> bool:
        """Stop sequences now: their KV blocks go back (cached prefixes stay cached), the others carry on.
        items: an iterable of core request ids (str: every sample) and (request id, sample index) pairs. An
        id unknown or finished is ignored. Returns True if something was aborted. Aborted samples appear in
        no later output."""
        seqs = []
        for item in items:
            rid, index = (item, -1) if isinstance(item, str) else item
            request = self.requests.get(rid)
            if request is None:
                continue
            chosen = request.seqs if index < 0 else request.seqs[index:index + 1]
            seqs += [seq for seq in chosen if not seq.is_finished]
            if index >= 0:
                # A sibling not forked yet waits in its first sample's forks list: it must not start later.
                first = request.seqs[0]
                first.forks = [s for s in first.forks if s not in chosen]
        abort = getattr(self.scheduler, "abort", None) or partial(Scheduler.abort, self.scheduler)
        abort(seqs)
        for seq in seqs:
            seq.finish_reason, seq.stop_reason = "abort", None
        for rid in {seq.request_id for seq in seqs}:
            request = self.requests.get(rid)
            if request is not None and request.finished:
                del self.requests[rid]
        return bool(seqs)

    def abort_all(self) -> None:
        """Drop every queued or running request and free its KV blocks (cached prefixes stay cached)."""
        self._in_flight = None
        self.scheduler.abort_all()
        for request in self.requests.values():
            for seq in request.seqs:
                if seq.finish_reason is None:
                    seq.finish_reason = "abort"
                seq.status = SequenceStatus.FINISHED
        self.requests.clear()

    def is_finished(self) -> bool:
        """No request is waiting or running (async: a step of finished sequences may still be in flight)."""
        return self.scheduler.is_finished()

    def has_work(self) -> bool:
        """A step would do something: a request is unfinished, or a launched step is still to be taken in."""
        return not self.scheduler.is_finished() or self._in_flight is not None

    def scheduler_stats(self) -> dict[str, int]:
        """Sequences running / waiting and KV blocks free / in all (a replaced scheduler or block manager may
        lack some of them: those are left out)."""
        scheduler = self.scheduler
        out = {name: len(getattr(scheduler, name)) for name in ("running", "waiting") if hasattr(scheduler, name)}
        free = getattr(getattr(scheduler, "block_manager", None), "num_free_blocks", None)
        if isinstance(free, int):
            out["kv_blocks_free"] = free
        out["kv_blocks_total"] = self.config.num_kvcache_blocks
        return out

    # -- the step ---------------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """One engine step: schedule, execute, take the sampled ids in. Returns the step's deltas (one
        EngineCoreOutput per sample that got tokens or prompt logprobs) and sets `last_step` (the step
        launched). Idle: an empty EngineCoreOutputs."""
        start = time.perf_counter()
        if self.async_scheduling:
            arrived = self._step_async()
        elif self.scheduler.is_finished():
            self.last_step = None
            return EngineCoreOutputs(scheduler_stats=self.scheduler_stats())
        else:
            seqs, is_prefill = self.scheduler.schedule()
            seqs = seqs if is_prefill else longest_first(seqs)
            known = [len(seq) for seq in seqs]
            num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else len(seqs)
            pending = self.model_runner.launch(self.step_builder.build(seqs, is_prefill))   # also to TP workers
            rows = self._logprob_counts(seqs)
            self.scheduler.postprocess(seqs, pending.token_ids())
            self._record_logprobs(seqs, known, pending)
            self.last_step = StepStats("prefill" if is_prefill else "decode", num_tokens, len(seqs))
            arrived = list(zip(seqs, known, rows))
        step = self.last_step
        return EngineCoreOutputs(self._outputs(arrived),
                                 CoreStepStats(step.kind, step.num_tokens, step.num_seqs) if step else None,
                                 self.scheduler_stats(), time.perf_counter() - start)

    def _step_async(self) -> list:
        """Schedule and launch the next step, then finish the one in flight (module docstring). Returns
        (sequence, tokens known before, logprob rows before) triples of the step whose ids arrived."""
        launched, self.last_step = None, None
        if not self.scheduler.is_finished():
            seqs, is_prefill = self.scheduler.schedule()
            seqs = seqs if is_prefill else longest_first(seqs)
            if seqs:
                num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else len(seqs)
                pending = self.model_runner.launch(self.step_builder.build(seqs, is_prefill))
                launched = (seqs, pending, self.scheduler.on_launch(seqs, pending=True))
                self.last_step = StepStats("prefill" if is_prefill else "decode", num_tokens, len(seqs))
        arrived = []
        if self._in_flight is not None:
            seqs, pending, samples = self._in_flight
            self._in_flight = None
            known = [len(seq) - seq.num_pending for seq in seqs]
            rows = self._logprob_counts(seqs)
            self.scheduler.on_tokens(seqs, pending.token_ids(), samples)
            self._record_logprobs(seqs, known, pending)
            arrived = list(zip(seqs, known, rows))
        self._in_flight = launched
        if launched is None and not arrived and not self.scheduler.is_finished():
            raise RuntimeError("the scheduler scheduled nothing while requests are waiting and no step is in "
                               "flight: no progress is possible")
        return arrived

    @staticmethod
    def _logprob_counts(seqs) -> list:
        """Per sequence, (completion rows, prompt rows) of logprobs held before this step's are recorded, or
        None for a sequence that asks for neither (the usual case)."""
        return [(len(seq.logprobs), len(seq.prompt_logprobs))
                if seq.num_logprobs is not None or seq.num_prompt_logprobs is not None else None for seq in seqs]

    @staticmethod
    def _record_logprobs(seqs, known_before: list[int], pending) -> None:
        """Keep the logprobs of a step whose ids arrived: a row's entry for each sequence whose known tokens
        grew by its token (one the scheduler kept), and the prompt rows of its prefill. known_before: each
        sequence's tokens known before the ids were taken in."""
        sample, prompt = pending.logprobs()
        if sample is not None:
            ids, lps, ranks = sample
            for row, (seq, n) in enumerate(zip(seqs, known_before)):
                k = seq.num_logprobs
                if k is not None and len(seq) - seq.num_pending > n:
                    seq.logprobs.append((ids[row][:1 + k], lps[row][:1 + k], ranks[row]))
                    seq.cumulative_logprob += lps[row][0]
        if prompt is not None:
            ids, lps, ranks = prompt
            row = 0
            for seq_row, first, count in pending.prompt_owners:
                seq = seqs[seq_row]
                k = seq.num_prompt_logprobs
                if first == len(seq.prompt_logprobs):         # in order, once (a recompute never repeats it)
                    seq.prompt_logprobs.extend((ids[r][:1 + k], lps[r][:1 + k], ranks[r])
                                               for r in range(row, row + count))
                row += count

    def _outputs(self, arrived) -> list[EngineCoreOutput]:
        """The deltas of the sequences whose ids arrived; drops requests all of whose samples finished."""
        outputs, done = [], []
        eos = self.config.eos
        for seq, known, rows in arrived:
            end = len(seq) - seq.num_pending
            new_ids = seq.token_ids[known:end] if end > known else []
            new_lp = new_plp = None
            if rows is not None:
                if seq.num_logprobs is not None and new_ids:
                    new_lp = seq.logprobs[rows[0]:]
                if len(seq.prompt_logprobs) > rows[1]:
                    new_plp = seq.prompt_logprobs[rows[1]:]
            if not new_ids and new_plp is None:
                continue
            out = EngineCoreOutput(seq.request_id, seq.index, new_ids, new_logprobs=new_lp, new_prompt_logprobs=new_plp)
            if seq.is_finished and new_ids:
                if seq.finish_reason is None:          # a Parts.scheduler that does not say why
                    ids = seq.completion_token_ids
                    seq.finish_reason = "stop" if ids and not seq.ignore_eos and ids[-1] in eos else "length"
                out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
                done.append(seq.request_id)
            outputs.append(out)
        for rid in done:
            request = self.requests.get(rid)
            if request is not None and request.finished:
                del self.requests[rid]
        return outputs
