"""The engine loop: add requests, step until all finish (chapter 07). Upstream nano-vllm `engine/llm_engine.py`.

One engine serves offline and online use. `add_request(prompt, params, request_id=None) -> request_id`
queues a request, `step()` runs one forward pass (the scheduler picks the batch, the model runner(s) run it,
the scheduler takes the sampled tokens back and decides the stops) and returns a RequestOutput for each
request that made progress, `abort_request(request_id)` drops one and frees its KV blocks. A server turns
HTTP requests into those calls and streams the growing text; `generate` is the same loop run to the end
(it builds each output once, when its request is done). Every request is checked first
(engine/request.py), so a bad one raises ValueError/TypeError before anything is queued and the engine
stays usable; `generate` checks its whole batch before queuing any of it.

Async scheduling (`async_scheduling`, on by default with CUDA): `step` schedules and launches step n+1 while
the device still runs step n, then finishes step n. Step n+1's sequences carry a placeholder for the token
step n samples (engine/sequence.py PENDING); the device reads its value from step n's output, and the host
learns it one step late (`Scheduler.on_tokens`), where the finish and stop checks run, once per token. A
sequence that stops at step n was also given a row in step n+1; that token is dropped. Routes:

| route | when | a step |
|---|---|---|
| async | async_scheduling True, or None on CUDA; one process, the reference scheduler | schedule n+1, launch it, `on_launch`; wait for step n's ids, `on_tokens`, record its logprobs |
| sync  | otherwise (CPU by default, TP > 1, a replaced scheduler) | schedule, launch + wait, `postprocess`, record its logprobs |

Every SamplingParams setting runs on both routes. The ones that read the tokens generated so far need no
sync point: the penalties count the output tokens on the device, and a row's newest token, pending on the
host, is read there from the previous step's ids (ModelRunner.processing, as the decode inputs read
it); stop checks run on the host once the ids arrive, as above. Logprobs arrive with their step's ids and are
kept for exactly the tokens the scheduler kept (a token dropped after a stop, or of an aborted request, has
none): `_record_logprobs`.

Tensor parallelism: rank 0 runs in this process; ranks 1..tp-1 are spawned processes that run
`nanovllm_ref.engine.worker.run_worker` (an importable function, as `spawn` requires). Each engine picks
its own free TCP port for the process-group rendezvous and talks to its workers over private pipes, so two
engines never clash and nothing named is left in /dev/shm after a crash.
"""
import atexit
import functools
import multiprocessing as mp
import random
import socket
import time
from collections.abc import Sequence as SequenceABC
from functools import partial
from itertools import count

from tqdm.auto import tqdm

from nanovllm_ref.config import Config
from nanovllm_ref.engine.detokenizer import IncrementalDetokenizer
from nanovllm_ref.engine.model_runner import ModelRunner
from nanovllm_ref.engine.request import Request, check_request, load_tokenizer
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.engine.sequence import SequenceStatus
from nanovllm_ref.engine.step_batch import StepBuilder
from nanovllm_ref.outputs import RequestOutput, StepStats
from nanovllm_ref.parts import Parts
from nanovllm_ref.sampling_params import SamplingParams


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LLMEngine:
    """model: a local model folder; parts: a nanovllm_ref.Parts of swappable parts (default: the reference
    ones); engine_args: the fields of nanovllm_ref.config.Config. Raises TypeError for an unknown argument or
    a `parts` that is not a Parts, ValueError for a bad value (also a tokenizer with more tokens than the
    model's embedding table, before the weights load).

    State a caller may read: `requests` (the unfinished requests by id, engine/request.py), `last_step`
    (the StepStats of the last step, None after an idle one), `generate_stats` (the last generate call's
    prefill and decode tokens and seconds), `tokenizer`, `config`, `scheduler`. The
    engine is not thread-safe: one thread (a server's engine loop) makes all calls."""

    def __init__(self, model: str, parts: Parts | None = None, **engine_args):
        if parts is None:
            parts = Parts()
        if not isinstance(parts, Parts):
            raise TypeError(f"parts must be a nanovllm_ref.Parts, got {type(parts).__name__}")
        unknown = set(engine_args) - set(Config.argument_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s) {sorted(unknown)}; known: {sorted(Config.argument_names())}")
        config = Config(model, **engine_args)
        # Before the weights load: a tokenizer that knows more tokens than the embedding table has rows
        # would let a str prompt index past it mid-run.
        self.tokenizer = load_tokenizer(config.model, config.hf_config.vocab_size)
        if self.tokenizer.eos_token_id is not None:
            config = config.derived(extra_eos=[self.tokenizer.eos_token_id])
        # The text of one token alone, for logprobs' decoded_token (vLLM: tokenizer.decode([id])); cached,
        # since the same ids come back at every step.
        self._decode_token = functools.lru_cache(maxsize=65536)(lambda i: self.tokenizer.decode([i]))
        # Each sample without its own SamplingParams.seed gets one from here, in arrival order.
        self._seeds = random.Random(config.seed)
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
        self.requests: dict[str, Request] = {}       # unfinished requests by id (engine/request.py)
        self._request_ids = count()
        self.last_step: StepStats | None = None       # what the last step() computed (throughput)
        self.generate_stats: dict = {}
        self._closed = False
        atexit.register(self.exit)

    # -- lifecycle --------------------------------------------------------------------------------------
    def _kill_workers(self):
        for proc in self.workers:
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=10)
        self.workers = []

    def exit(self):
        """Stop the worker processes and free the process group. Safe to call twice."""
        if getattr(self, "_closed", True):
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
            atexit.unregister(self.exit)
            return
        try:
            self.model_runner.shutdown_workers()
        finally:
            for proc in self.workers:
                proc.join(timeout=30)
            self._kill_workers()
        atexit.unregister(self.exit)

    shutdown = exit

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()

    # -- requests ---------------------------------------------------------------------------------------
    def _check_request(self, prompt, sp, where: str = "prompt", sp_where: str = "sampling_params") -> list[int]:
        """Token ids of one validated request (engine/request.py, check_request); changes nothing."""
        return check_request(prompt, sp, tokenizer=self.tokenizer, config=self.config,
                             scheduler_cls=type(self.scheduler), where=where, sp_where=sp_where,
                             block_manager_cls=type(self.scheduler.block_manager))

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this engine was shut down (exit() was called); create a new LLM")
        if self.model_runner.out_of_step:
            raise RuntimeError("a tensor-parallel step was interrupted on rank 0 while the workers were inside it, "
                               "so they are out of step with rank 0 and this engine cannot run another step; "
                               "call exit() and create a new LLM")

    def _new_request_id(self, request_id) -> str:
        if request_id is None:
            request_id = str(next(self._request_ids))
            while request_id in self.requests:
                request_id = str(next(self._request_ids))
            return request_id
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {type(request_id).__name__}")
        if not request_id:
            raise ValueError("request_id must not be empty")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        return request_id

    def _queue(self, request_id: str, prompt, token_ids: list[int], sp: SamplingParams) -> Request:
        request = Request(request_id, prompt, token_ids, sp, self.config.kvcache_block_size,
                          lambda ids: IncrementalDetokenizer(self.tokenizer, ids, sp.skip_special_tokens),
                          seeds=[self._seeds.getrandbits(64) for _ in range(sp.n)])
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])          # the other samples fork from it (engine/scheduler.py)
        return request

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one request; `step()` then runs it. Returns its request id (str).

        prompt: a str or a list of int token ids. sampling_params: default SamplingParams(). request_id:
        your own id (a non-empty str not used by an unfinished request), or None for the engine's next
        number as a str. Raises TypeError/ValueError, before anything is queued, for a bad request (see
        engine/request.py, check_request) or a request_id in use.
        """
        self._check_open()
        if sampling_params is None:
            sampling_params = SamplingParams()
        token_ids = self._check_request(prompt, sampling_params)
        request_id = self._new_request_id(request_id)
        return self._queue(request_id, prompt, token_ids, sampling_params).request_id

    def abort_request(self, request_id) -> bool:
        """Stop an unfinished request now: its sequences leave the queues and give their KV blocks back (cached
        prefixes stay cached); the other requests carry on. request_id: a str, or a list of them. An id that
        is unknown or already finished is ignored (a server may abort a request that just finished). Returns
        True if something was aborted. Its outputs are not returned by later steps."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        if not isinstance(ids, (list, tuple, set)) or not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request_id must be a str or a list of str, got {request_id!r:.80}")
        seqs = []
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                seqs += [seq for seq in request.seqs if not seq.is_finished]
        abort = getattr(self.scheduler, "abort", None) or partial(Scheduler.abort, self.scheduler)
        abort(seqs)
        for seq in seqs:
            seq.finish_reason, seq.stop_reason = "abort", None
        return bool(seqs)

    def _step(self) -> list[Request]:
        """One engine step; returns the requests that got new tokens in it (finished ones included, and
        dropped from `requests`). Sets `last_step` (the step launched)."""
        self._check_open()
        if self.async_scheduling:
            arrived = self._step_async()
        elif self.is_finished():
            self.last_step = None
            return []
        else:
            seqs, is_prefill = self.scheduler.schedule()
            known = [len(seq) for seq in seqs]
            num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else len(seqs)
            pending = self.model_runner.launch(self.step_builder.build(seqs, is_prefill))   # also to TP workers
            self.scheduler.postprocess(seqs, pending.token_ids())
            self._record_logprobs(seqs, known, pending)
            self.last_step = StepStats("prefill" if is_prefill else "decode", num_tokens, len(seqs))
            arrived = list(zip(seqs, known))
        progressed = {}
        for seq, n in arrived:
            request = self.requests.get(seq.request_id)
            if len(seq) - seq.num_pending > n and request is not None:
                progressed[seq.request_id] = request
        for request_id, request in progressed.items():
            if request.finished:
                del self.requests[request_id]
        return list(progressed.values())

    def _step_async(self) -> list:
        """Schedule and launch the next step, then finish the one in flight (module docstring). Returns
        (sequence, tokens known before) pairs of the step whose ids arrived."""
        launched, self.last_step = None, None
        if not self.scheduler.is_finished():
            seqs, is_prefill = self.scheduler.schedule()
            if seqs:
                num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else len(seqs)
                pending = self.model_runner.launch(self.step_builder.build(seqs, is_prefill))
                launched = (seqs, pending, self.scheduler.on_launch(seqs, pending=True))
                self.last_step = StepStats("prefill" if is_prefill else "decode", num_tokens, len(seqs))
        arrived = []
        if self._in_flight is not None:
            seqs, pending, samples = self._in_flight
            self._in_flight = None
            arrived = [(seq, len(seq) - seq.num_pending) for seq in seqs]
            self.scheduler.on_tokens(seqs, pending.token_ids(), samples)
            self._record_logprobs(seqs, [n for _, n in arrived], pending)
        self._in_flight = launched
        if launched is None and not arrived and not self.scheduler.is_finished():
            raise RuntimeError("the scheduler scheduled nothing while requests are waiting and no step is in "
                               "flight: no progress is possible")
        return arrived

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

    def step(self) -> list[RequestOutput]:
        """Run one engine step (one forward pass over the batch the scheduler picks) and return a RequestOutput
        (nanovllm_ref.outputs) for each request that got a new token in it: its text and token ids so far,
        `finished` once all its samples are done. An idle engine returns []. The text of successive outputs
        of a request only grows (a server streams the differences). `last_step` then holds the step's
        StepStats (kind, tokens computed, batch size), or None after an idle call."""
        return [request.output(self.config.eos, self._decode_token) for request in self._step()]

    def advance(self) -> int:
        """One engine step, as `step` runs it, without building outputs (what `generate` runs: it makes each
        output once, at the end; benchmarks time this). Returns how many requests finished in it; their
        outputs are gone, so mix it with `step` only to drop requests you do not need."""
        return sum(1 for request in self._step() if request.finished)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

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

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for `prompts` (a list of str or of token-id lists; one str is also accepted).

        sampling_params: one SamplingParams for all prompts, or a list with one per prompt (default:
        SamplingParams()). Returns, in input order, one finished RequestOutput per prompt
        (nanovllm_ref.outputs): `.outputs[i].text`, `.token_ids` (the completion only), `.finish_reason`
        ("stop": eos, a stop id or a stop string; "length": max_tokens, or prompt + completion reached
        max_model_len) and `.stop_reason`, plus `.prompt_token_ids`. With one sample per prompt,
        `out["text"]`, `out["token_ids"]`, `out["prompt_token_ids"]` and `out["finish_reason"]` work too.
        Raises TypeError/ValueError before any work if a request is invalid, and RuntimeError if requests
        from add_request() are still pending.
        """
        self._check_open()
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC):
            raise TypeError(f"prompts must be a list of str or of token-id lists, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, SequenceABC) or len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or a list with one per prompt "
                             f"({len(prompts)})")
        token_ids = [self._check_request(p, sp, f"prompts[{i}]", f"sampling_params[{i}]")
                     for i, (p, sp) in enumerate(zip(prompts, sampling_params))]
        if not self.is_finished():
            raise RuntimeError("generate() called while requests from add_request() are still pending; "
                               "step() until is_finished(), or call abort_all()")
        requests = [self._queue(self._new_request_id(None), p, ids, sp)
                    for p, ids, sp in zip(prompts, token_ids, sampling_params)]
        pbar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        # Throughput so far (tokens / seconds of that kind of step), not of the last step alone.
        totals = {"prefill": [0, 0.0], "decode": [0, 0.0]}
        try:
            while not self.is_finished():
                t = time.perf_counter()
                progressed = self._step()
                if self.last_step is not None:
                    kind = totals[self.last_step.kind]
                    kind[0] += self.last_step.num_tokens
                    kind[1] += time.perf_counter() - t
                if use_tqdm:
                    pbar.set_postfix({k: f"{n / max(s, 1e-9):.0f}tok/s" for k, (n, s) in totals.items()},
                                     refresh=False)
                pbar.update(sum(1 for r in progressed if r.finished))
        except BaseException:
            # Interrupted (Ctrl-C, a kernel interrupt) or failed: drop this call's requests so the engine
            # stays usable, then let the exception through.
            self.abort_all()
            raise
        finally:
            pbar.close()
            # What this call computed, by kind of step: {"prefill"|"decode": (tokens, seconds)} (benchmarks)
            self.generate_stats = {k: tuple(v) for k, v in totals.items()}
        return [request.output(self.config.eos, self._decode_token) for request in requests]
