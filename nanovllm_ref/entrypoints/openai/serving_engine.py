"""What the server needs from an engine, and the adapter that gives it `LLMEngine` (serving chapter).

The server owns no scheduling: it turns HTTP requests into `add_request` calls, runs the engine's `step()` in
one loop (engine_loop.py) and turns each step's outputs into response chunks. `ServingEngine` is all it
uses, so the loop can be read, taught and tested against a small fake engine, and the real engine plugs in
through a thin adapter (`LLMEngineAdapter`).

Contract (vLLM's `LLMEngine` request API has the same shape):
- `add_request(prompt_token_ids, sampling_params, request_id) -> str` queues one request under the given id
  (a str the engine has not seen among unfinished requests) and returns it. It raises ValueError /
  TypeError (LLMEngine: a RequestError naming the field), before queuing anything, for a request the engine
  can never run.
- `abort_request(request_id)` ends an unfinished request at once and frees its KV blocks; the other requests
  carry on. An id that is unknown or already finished is ignored (a client may leave just as its request
  ends). An aborted request appears in no later `step()` output.
- `step() -> list[RequestOutput]` runs one engine step and returns one output for each request that made
  progress in it. An output has `.request_id`, `.prompt_token_ids` (list[int]), `.finished` (bool) and
  `.outputs`, one per sample (SamplingParams.n) in index order, each with `.index`, `.text`,
  `.token_ids` (list[int], the completion so far), `.finish_reason` (None while running, then "stop",
  "length" or "abort"), `.stop_reason` and, when SamplingParams.logprobs is set, `.logprobs` (one
  {token_id: Logprob} per token id, nanovllm_ref/outputs.py). Text and token ids are cumulative and only ever grow by
  appending (text a stop string may still complete is held back), so the server streams their differences.
  A finished request is returned once with `finished=True`, then never again.
- `has_unfinished_requests() -> bool`; `exit()` frees the engine (idempotent).
- Optional: `check_request(prompt_token_ids, sampling_params, where="prompt")` raises, changing nothing, for
  a request `add_request` would refuse (token ids outside the vocabulary, a prompt that can never fit the KV
  cache, a stop id outside the vocabulary, n above its batch size): a RequestError (nanovllm_ref/errors.py)
  whose `field` names the argument ("prompt" or the SamplingParams field), its message calling the prompt
  `where`. The HTTP side calls it before queuing, so such a request is a 400 at once, naming the request's
  field. It must be safe to call from the HTTP thread while the engine steps (it reads only what does not
  change after start-up).
- Optional: `stats() -> dict[str, int]`, numbers about the engine now (sequences running and waiting, free KV
  blocks); the loop reads them after each tick and GET /health shows them.
- Optional: `check_health()` raises when the engine can no longer run (LLMEngine's core process died:
  EngineCoreDead); the loop calls it a few times a second while idle, so /health turns 503 without a request.
- Facts the server checks requests against, before they reach the engine: `tokenizer` (a transformers
  tokenizer: `encode`, `decode`, `apply_chat_template`), `max_model_len`, `vocab_size` (prompt ids must
  lie in [0, vocab_size)), `kv_cache_tokens` (tokens whose K/V the whole cache holds; None if unknown).
- Optional fact: `sampling_defaults`, a dict of SamplingParams fields (temperature, top_k, top_p, min_p,
  repetition_penalty, max_tokens) that a request leaving the field out gets: the model's generation config
  (nanovllm_ref/sampling_defaults.py, vLLM's `--generation-config auto`). None or missing: no defaults.

The loop calls every method from one thread and never two at once, so an engine needs no locks. Only the
tokenizer and `check_request` are also used from the HTTP side, on the server's one tokenizing thread
(encoding prompts and chat templates, off the event loop).

Test hook: `python -m nanovllm_ref serve --engine-factory module:callable [--engine-factory-kwargs JSON]`
builds the engine with `callable(model, **engine_args, **kwargs)` instead of `default_engine_factory`
(the tests load a fake engine this way). The flag is hidden from --help.
"""
import importlib
import inspect
import json
from typing import Any, Callable, Protocol

from nanovllm_ref.sampling_params import SamplingParams

ENGINE_METHODS = ("add_request", "abort_request", "step", "has_unfinished_requests", "exit")
ENGINE_FACTS = ("tokenizer", "max_model_len", "vocab_size", "kv_cache_tokens")


class ServingEngine(Protocol):
    """See the module docstring for the semantics of each member."""
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    kv_cache_tokens: int | None

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str) -> str: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list: ...

    def has_unfinished_requests(self) -> bool: ...

    def exit(self) -> None: ...


def check_serving_engine(engine) -> None:
    """Raise TypeError naming every member of ServingEngine that `engine` lacks."""
    missing = [m for m in ENGINE_METHODS if not callable(getattr(engine, m, None))]
    missing += [f for f in ENGINE_FACTS if not hasattr(engine, f)]
    if missing:
        raise TypeError(f"{type(engine).__name__} is not a ServingEngine: it lacks {missing} "
                        "(nanovllm_ref/entrypoints/openai/serving_engine.py)")


def engine_request_api_missing(engine_cls) -> list[str]:
    """What `engine_cls` (LLMEngine) lacks of the request API the adapter calls; [] when it has it all."""
    missing = [m for m in ("abort_request", "step", "is_finished", "exit", "add_request")
               if not callable(getattr(engine_cls, m, None))]
    add = getattr(engine_cls, "add_request", None)
    if add is not None and "request_id" not in inspect.signature(add).parameters:
        missing.append("add_request(..., request_id=)")
    return missing


class LLMEngineAdapter:
    """A ServingEngine over nanovllm_ref's LLMEngine (the engine `LLM.generate` runs: one engine, not a
    second copy). Each member forwards to the engine's request API; the facts come from its config (the
    derived copy, which holds the KV cache's real size)."""

    def __init__(self, engine):
        missing = engine_request_api_missing(type(engine))
        if missing:
            raise TypeError(f"{type(engine).__name__} lacks the request API the server needs: {missing}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        config = engine.config
        self.max_model_len = config.max_model_len
        self.vocab_size = config.hf_config.vocab_size
        self.kv_cache_tokens = config.num_kvcache_blocks * config.kvcache_block_size
        self.sampling_defaults = dict(getattr(config, "sampling_defaults", None) or {})

    def add_request(self, prompt_token_ids, sampling_params, request_id):
        return self.engine.add_request(prompt_token_ids, sampling_params, request_id=request_id)

    def check_request(self, prompt_token_ids, sampling_params, where: str = "prompt"):
        """engine/request.py's check_request, the one add_request runs: it reads the config, the tokenizer and
        the scheduler's class, none of which change once the engine runs, so the HTTP thread may call it."""
        from nanovllm_ref.engine.request import check_request
        client = getattr(self.engine, "core_client", None)
        scheduler_cls = client.scheduler_cls if client is not None else type(self.engine.scheduler)
        check_request(prompt_token_ids, sampling_params, tokenizer=self.tokenizer, config=self.engine.config,
                      scheduler_cls=scheduler_cls, where=where, sp_where="the request")

    def abort_request(self, request_id):
        self.engine.abort_request(request_id)

    def step(self):
        return self.engine.step()

    def has_unfinished_requests(self):
        return not self.engine.is_finished()

    def exit(self):
        self.engine.exit()

    def check_health(self) -> None:
        """Raise EngineCoreDead (engine/core_client.py) if the engine core failed or its process died; the loop
        calls it while idle, so a core killed between requests turns /health to 503 within a poll."""
        client = getattr(self.engine, "core_client", None)
        if client is not None:
            client.check_health()

    def stats(self) -> dict:
        """Sequences running / waiting and KV blocks free / in all (a replaced scheduler or block manager may
        lack some of them: those are left out), as the core reported them after its last step taken in (while
        idle, the messages that arrived are taken in first, so aborted requests drop out of them); with
        a process core also its pid, the core steps taken in (`core_steps`), the seconds the core spent in them
        (`core_step_s`) and both by what the step launched after what (`core_step_kinds`: {"decode>prefill":
        [steps, seconds, tokens launched], ...}; LLMEngine.core_step_kinds)."""
        from nanovllm_ref.engine.core_client import ProcessClient
        client = getattr(self.engine, "core_client", None)
        if isinstance(client, ProcessClient):
            if self.engine.is_finished():
                self.engine.step()       # idle: never waits; takes in the core's messages since (after aborts)
            return {**self.engine.core_stats, "core_pid": client.pid, "core_steps": self.engine.core_steps,
                    "core_step_s": round(self.engine.core_step_s, 6),
                    "core_step_kinds": {k: [n, round(t, 6), tokens]
                                        for k, (n, t, tokens) in self.engine.core_step_kinds.items()}}
        scheduler = self.engine.scheduler
        out = {name: len(getattr(scheduler, name)) for name in ("running", "waiting") if hasattr(scheduler, name)}
        free = getattr(getattr(scheduler, "block_manager", None), "num_free_blocks", None)
        if isinstance(free, int):
            out["kv_blocks_free"] = free
        out["kv_blocks_total"] = self.engine.config.num_kvcache_blocks
        return out


ENGINE_CORE_FLAGS = ("process", "thread")


def resolve_engine_core(flag: str | None, device: str = "auto") -> str:
    """The `serve --engine-core` flag as LLMEngine's engine_core: "process" (the core in its own process, fed
    over ZMQ: the event loop's JSON and SSE work no longer shares the GIL with scheduling and the model's
    host work) or "thread" ("inproc": the core on the server's engine thread). None: process on CUDA; on a CPU
    thread, since there the model's own compute dominates a step, a second process only adds its start-up
    (a second torch import and weight load, seconds on a 2-core machine) and the two processes share the
    same few cores. Raises ValueError for another value."""
    if flag is None:
        import torch
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        flag = "process" if cuda else "thread"
    if flag not in ENGINE_CORE_FLAGS:
        raise ValueError(f"--engine-core must be one of {list(ENGINE_CORE_FLAGS)}, got {flag!r}")
    return "process" if flag == "process" else "inproc"


def default_engine_factory(model: str, engine_core: str = "inproc", **engine_args) -> LLMEngineAdapter:
    """The real engine: `LLMEngine(model, engine_core=engine_core, **engine_args)` behind the adapter (its
    errors pass through)."""
    from nanovllm_ref.engine.llm_engine import LLMEngine
    return LLMEngineAdapter(LLMEngine(model, engine_core=engine_core, **engine_args))


def load_engine_factory(spec: str | None) -> Callable[..., ServingEngine]:
    """The callable named by `module:attribute` (the --engine-factory test hook); None: the real engine.
    Raises ValueError for a spec that is malformed or names nothing callable."""
    if spec is None:
        return default_engine_factory
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--engine-factory must be 'module:callable', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--engine-factory {spec!r}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--engine-factory {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def build_engine(model_path: str, engine_args: dict, factory_spec: str | None = None,
                 factory_kwargs: str | None = None, engine_core: str | None = None) -> ServingEngine:
    """The engine `serve` and `chat` run: the factory named by factory_spec (default: the real engine) called
    as factory(model_path, **engine_args, **json.loads(factory_kwargs)), plus engine_core= ("inproc" or
    "process", resolve_engine_core) when given and the factory takes a parameter of that name. Raises
    ValueError for a bad spec or kwargs, TypeError if the result is no ServingEngine."""
    factory = load_engine_factory(factory_spec)
    try:
        extra = json.loads(factory_kwargs or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"--engine-factory-kwargs must be a JSON object: {exc}") from exc
    if not isinstance(extra, dict):
        raise ValueError(f"--engine-factory-kwargs must be a JSON object, got {type(extra).__name__}")
    if engine_core is not None and "engine_core" in inspect.signature(factory).parameters:
        extra = {"engine_core": engine_core, **extra}
    engine = factory(model_path, **engine_args, **extra)
    check_serving_engine(engine)
    return engine
