"""The engine loop: add requests, step until all finish (chapter 07). Upstream nano-vllm `engine/llm_engine.py`.

One engine serves offline and online use. `add_request(prompt, params, request_id=None) -> request_id`
queues a request, `step()` runs one engine step and returns a RequestOutput for each request that made
progress, `abort_request(request_id)` drops one and frees its KV blocks. A server turns HTTP requests into
those calls and streams the growing text; `generate` is the same loop run to the end (it builds each output
once, when its request is done). Every request is checked first (engine/request.py), so a bad one raises
ValueError/TypeError before anything is queued and the engine stays usable; `generate` checks its whole
batch before queuing any of it.

The engine is split in two, as vLLM v1 is (issue 28):

    LLMEngine (front end)                                   EngineCore (engine/core.py)
    tokenizer, check_request, seeds                         scheduler, block manager, model runner
    OutputProcessor: text, stop strings, RequestOutputs  ◀── token-id deltas (engine/core_messages.py)
                     ──── EngineCoreRequest / EngineCoreAbort ──▶

The core does the steps (schedule, execute, take the sampled ids in; async scheduling lives there) in token
ids only. The front end (engine/output_processor.py) detokenizes, matches stop strings (and aborts a sample in
the core when one hits; tokens made past it are dropped) and builds the RequestOutputs. `engine_core` picks
where the core runs (engine/core_client.py): "inproc" (default) in this process, called directly, so a
notebook can step through it and `scheduler`, `model_runner`, `step_builder`, `workers` are the core's;
"process" in a spawned process of its own, over ZMQ, as the server runs it on CUDA. Either way `step`,
`generate` and the server run the same core loop and the same output code.
"""
import atexit
import logging
import random
import time
from collections.abc import Sequence as SequenceABC
from itertools import count

from tqdm.auto import tqdm

from nanovllm_ref.config import Config
from nanovllm_ref.engine.core import _free_port  # noqa: F401  (bench/tp_comm.py picks its port the same way)
from nanovllm_ref.engine.core_client import (EngineCoreDead, InprocClient, ProcessClient,  # noqa: F401 (re-exported)
                                             check_engine_core)
from nanovllm_ref.engine.core_messages import EngineCoreRequest, sampling_fields
from nanovllm_ref.engine.output_processor import OutputProcessor, RequestState
from nanovllm_ref.engine.request import check_request, load_tokenizer
from nanovllm_ref.engine.token_bytes import token_bytes_for
from nanovllm_ref.errors import RequestError
from nanovllm_ref.outputs import RequestOutput, StepStats
from nanovllm_ref.parts import Parts
from nanovllm_ref.sampling_defaults import describe as describe_sampling_defaults
from nanovllm_ref.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm_ref")


class LLMEngine:
    """model: a local model folder; parts: a nanovllm_ref.Parts of swappable parts (default: the reference
    ones); engine_core: "inproc" (default: the core runs in this process) or "process" (in a spawned process;
    `parts` must then pickle); engine_args: the fields of nanovllm_ref.config.Config. Raises TypeError for an
    unknown argument or a `parts` that is not a Parts, ValueError for a bad value (also an engine_core not in
    ("inproc", "process"), and a tokenizer with more tokens than the model's embedding table, before the
    weights load).

    State a caller may read: `requests` (the unfinished requests by id: with an inproc core, the core's
    engine/request.py Requests with their sequences; with a process core, the front end's RequestStates),
    `last_step` (the StepStats of the last step, None after an idle one), `generate_stats` (the last generate
    call's prefill and decode tokens and seconds), `tokenizer`, `config`, `core_client`, `output_processor`,
    and, with an inproc core, its `scheduler`, `model_runner`, `step_builder`, `workers` (engine/core.py).
    The engine is not thread-safe: one thread (a server's engine loop) makes all calls."""

    def __init__(self, model: str, parts: Parts | None = None, engine_core: str = "inproc", **engine_args):
        if parts is None:
            parts = Parts()
        if not isinstance(parts, Parts):
            raise TypeError(f"parts must be a nanovllm_ref.Parts, got {type(parts).__name__}")
        check_engine_core(engine_core)
        unknown = set(engine_args) - set(Config.argument_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s) {sorted(unknown)}; known: {sorted(Config.argument_names())}")
        config = Config(model, **engine_args)
        # Before the weights load: a tokenizer that knows more tokens than the embedding table has rows
        # would let a str prompt index past it mid-run.
        self.tokenizer = load_tokenizer(config.model, config.hf_config.vocab_size)
        if self.tokenizer.eos_token_id is not None:
            config = config.derived(extra_eos=[self.tokenizer.eos_token_id])
        # The text of one token alone, for logprobs' decoded_token, from its own bytes (engine/token_bytes.py: a
        # piece of a character is named by its bytes, not "�"); cached, since the same ids come back each step.
        self._decode_token = token_bytes_for(self.tokenizer).text
        # Each sample without its own SamplingParams.seed gets one from here, in arrival order.
        self._seeds = random.Random(config.seed)
        self.parts = parts
        self.engine_core = engine_core
        self.core_client = (InprocClient if engine_core == "inproc" else ProcessClient)(config, parts)
        self.config = self.core_client.config            # derived: the KV cache's real size
        if self.config.sampling_defaults:      # a warning, shown without any logging set up: vLLM warns so too
            logger.warning("%s", describe_sampling_defaults(self.config.sampling_defaults, self.config.model,
                                                            self.config.generation_config,
                                                            self.config.override_generation_config))
        self.async_scheduling = self.core_client.async_scheduling
        self.output_processor = OutputProcessor(self.tokenizer, self._decode_token)
        self._request_ids = count()
        self._core_ids = count()           # the core's ids: never reused, so a late output is never mistaken
        self.last_step: StepStats | None = None       # what the last step() computed (throughput)
        self.last_steps: list[StepStats] = []         # every core step the last step() took in (process core)
        self.core_stats: dict = {}                    # the core's scheduler_stats after the last step taken in
        self.core_step_s = 0.0                        # the core's seconds in the steps taken in so far
        self.core_steps = 0                           # the core steps taken in so far (messages that launched one)
        # The core's step time by what it launched after what: {"decode>prefill": [steps, seconds, tokens], ...}.
        # With async scheduling a core step launches step n+1 and waits for step n, so a prefill's host cost
        # shows in "decode>prefill" and its device time in the "prefill>decode" step after it.
        self.core_step_kinds: dict[str, list] = {}
        self._last_core_kind = "idle"
        self.generate_stats: dict = {}
        self._closed = False
        atexit.register(self.exit)

    # -- the inproc core's parts, where a notebook reaches them -------------------------------------------
    def _inproc(self, name: str):
        client = self.__dict__.get("core_client")
        if not isinstance(client, InprocClient):
            raise AttributeError(f"LLMEngine.{name} lives in the engine core, which runs in its own process "
                                 "(engine_core='process'); use engine_core='inproc' to reach it")
        return client.core

    scheduler = property(lambda self: self._inproc("scheduler").scheduler)
    model_runner = property(lambda self: self._inproc("model_runner").model_runner)
    step_builder = property(lambda self: self._inproc("step_builder").step_builder)
    _in_flight = property(lambda self: self._inproc("_in_flight")._in_flight)

    @property
    def workers(self) -> list:
        """The tensor-parallel worker processes (inproc core; [] with a process core, whose workers are its own)."""
        client = self.__dict__.get("core_client")
        return client.core.workers if isinstance(client, InprocClient) else []

    @property
    def requests(self) -> dict:
        """The unfinished requests by id (see the class docstring)."""
        states = self.output_processor.requests
        client = self.core_client
        if isinstance(client, InprocClient):
            core = client.core.requests
            return {rid: core[state.core_id] for rid, state in states.items() if state.core_id in core}
        return dict(states)

    # -- lifecycle --------------------------------------------------------------------------------------
    def exit(self):
        """Stop the engine core (and its worker processes) and free the process group. Safe to call twice."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self.core_client.shutdown()
        finally:
            atexit.unregister(self.exit)

    shutdown = exit

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()

    # -- requests ---------------------------------------------------------------------------------------
    def _check_request(self, prompt, sp, where: str = "prompt", sp_where: str = "sampling_params",
                       defaulted: bool = False) -> list[int]:
        """Token ids of one validated request (engine/request.py, check_request); changes nothing. defaulted: sp
        is get_default_sampling_params() (the caller passed none), so a refusal of one of the model's defaults
        says where the value came from: the caller set no max_tokens, and "lower max_tokens" alone would puzzle."""
        try:
            return check_request(prompt, sp, tokenizer=self.tokenizer, config=self.config,
                                 scheduler_cls=self.core_client.scheduler_cls, where=where, sp_where=sp_where,
                                 block_manager_cls=self.core_client.block_manager_cls)
        except RequestError as exc:
            if not defaulted or exc.field not in self.config.sampling_defaults:
                raise
            value = self.config.sampling_defaults[exc.field]
            raise type(exc)(exc.field, f"{exc.message} ({exc.field}={value!r} is the model's default, from its "
                                       "generation config: pass SamplingParams, or override_generation_config to "
                                       "the engine)") from None

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this engine was shut down (exit() was called); create a new LLM")
        client = self.core_client
        if isinstance(client, InprocClient) and client.core.model_runner.out_of_step:
            raise RuntimeError("a tensor-parallel step was interrupted on rank 0 while the workers were inside it, "
                               "so they are out of step with rank 0 and this engine cannot run another step; "
                               "call exit() and create a new LLM")
        client.check_health()

    def _new_request_id(self, request_id) -> str:
        requests = self.output_processor.requests
        if request_id is None:
            request_id = str(next(self._request_ids))
            while request_id in requests:
                request_id = str(next(self._request_ids))
            return request_id
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str or None, got {type(request_id).__name__}")
        if not request_id:
            raise ValueError("request_id must not be empty")
        if request_id in requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        return request_id

    def _queue(self, request_id: str, prompt, token_ids: list[int], sp: SamplingParams) -> RequestState:
        core_id = str(next(self._core_ids))
        state = self.output_processor.add_request(request_id, core_id, prompt, token_ids, sp)
        self.core_client.add_request(EngineCoreRequest(core_id, token_ids, sampling_fields(sp),
                                                       [self._seeds.getrandbits(64) for _ in range(sp.n)]))
        return state

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a request without its own gets (vLLM's `LLM.get_default_sampling_params`):
        SamplingParams() with the model's generation-config defaults (`config.sampling_defaults`: what
        generation_config.json sets of temperature, top_k, top_p, min_p, repetition_penalty and max_new_tokens,
        or override_generation_config; none with generation_config="vllm"). nanovllm_ref/sampling_defaults.py."""
        return SamplingParams(**self.config.sampling_defaults)

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one request; `step()` then runs it. Returns its request id (str).

        prompt: a str or a list of int token ids. sampling_params: default get_default_sampling_params(). request_id:
        your own id (a non-empty str not used by an unfinished request), or None for the engine's next
        number as a str. Raises TypeError/ValueError, before anything is queued, for a bad request (see
        engine/request.py, check_request) or a request_id in use.
        """
        self._check_open()
        defaulted = sampling_params is None
        if defaulted:
            sampling_params = self.get_default_sampling_params()
        token_ids = self._check_request(prompt, sampling_params, defaulted=defaulted)
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
        core_ids = []
        for rid in ids:
            state = self.output_processor.abort_request(rid)
            if state is not None:
                core_ids.append(state.core_id)
        if core_ids:
            self.core_client.abort(core_ids)
        return bool(core_ids)

    def _step(self) -> list[RequestState]:
        """One engine step; returns the requests that got new tokens in it (finished ones included, and
        dropped from `requests`). Sets `last_step` (the step launched)."""
        self._check_open()
        batches = None
        if not isinstance(self.core_client, InprocClient) and not self.output_processor.has_unfinished_requests():
            # Nothing to wait for: the core is idle or draining. Take in what already arrived (the steps after an
            # abort, the stats message an idle core sends after one), so core_stats say what the core holds now.
            batches = self.core_client.get_outputs(timeout_ms=0)
        progressed, steps = {}, []
        for outs in self.core_client.get_outputs() if batches is None else batches:
            if outs.step is not None:
                steps.append(StepStats(outs.step.kind, outs.step.num_tokens, outs.step.num_seqs))
                self.core_steps += 1
                key = f"{self._last_core_kind}>{outs.step.kind}"
                kind = self.core_step_kinds.setdefault(key, [0, 0.0, 0])
                kind[0] += 1
                kind[1] += outs.step_s
                kind[2] += outs.step.num_tokens
                self._last_core_kind = outs.step.kind
            elif not outs.outputs:
                self._last_core_kind = "idle"
            self.core_stats = outs.scheduler_stats
            self.core_step_s += outs.step_s
            states, aborts = self.output_processor.process_outputs(outs.outputs)
            if aborts:                                   # stop strings ended these samples here
                self.core_client.abort(aborts)
            for state in states:
                progressed[state.request_id] = state
        self.last_steps = steps
        self.last_step = steps[-1] if steps else None
        return list(progressed.values())

    def step(self) -> list[RequestOutput]:
        """Run one engine step (one forward pass over the batch the scheduler picks; with a process core,
        every step it finished since the last call) and return a RequestOutput (nanovllm_ref.outputs) for each
        request that got a new token in it: its text and token ids so far, `finished` once all its samples
        are done. An idle engine returns []. The text of successive outputs of a request only grows (a server
        streams the differences). `last_step` then holds the step's StepStats (kind, tokens computed, batch
        size), or None after an idle call."""
        return [state.output() for state in self._step()]

    def wake(self) -> None:
        """From any thread: a `step()` waiting on a process core's next outputs returns now (with what arrived,
        maybe nothing), so its caller can hand the core a request that came in meanwhile (the server's engine
        loop calls it on every new request and abort). Does nothing with an inproc core, whose step() never
        waits for another process."""
        wake = getattr(self.core_client, "wake", None)
        if wake is not None:
            wake()

    def advance(self) -> int:
        """One engine step, as `step` runs it, without building outputs (what `generate` runs: it makes each
        output once, at the end; benchmarks time this). Returns how many requests finished in it; their
        outputs are gone, so mix it with `step` only to drop requests you do not need."""
        return sum(1 for state in self._step() if state.finished)

    def is_finished(self) -> bool:
        """No request is unfinished (inproc: none waits or runs in the scheduler)."""
        client = self.core_client
        if isinstance(client, InprocClient):
            return client.core.is_finished()
        return not self.output_processor.has_unfinished_requests()

    def has_unfinished_requests(self) -> bool:
        return not self.is_finished()

    def abort_all(self) -> None:
        """Drop every queued or running request and free its KV blocks (cached prefixes stay cached)."""
        self.core_client.abort_all(self.output_processor.abort_all())

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for `prompts` (a list of str or of token-id lists; one str is also accepted).

        sampling_params: one SamplingParams for all prompts, or a list with one per prompt (default:
        get_default_sampling_params(), the model's generation-config defaults). Returns, in input order, one finished RequestOutput per prompt
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
        defaulted = sampling_params is None
        if defaulted:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, SequenceABC) or len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or a list with one per prompt "
                             f"({len(prompts)})")
        token_ids = [self._check_request(p, sp, f"prompts[{i}]", f"sampling_params[{i}]", defaulted)
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
                steps = self.last_steps
                seconds = (time.perf_counter() - t) / max(len(steps), 1)
                for step in steps:
                    kind = totals[step.kind]
                    kind[0] += step.num_tokens
                    kind[1] += seconds
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
        return [state.output() for state in requests]
