"""The offline engine loop: add requests, step until all finish (chapter 07).

`generate` validates every prompt and sampling setting first, so a bad request raises ValueError/TypeError
before any request is queued, and the engine stays usable. Then each `step` asks the scheduler for a batch,
runs it on the model runner(s) and feeds the sampled tokens back. Upstream nano-vllm `engine/llm_engine.py`.

Async scheduling (`async_scheduling`, on by default with CUDA): `step` schedules and launches step n+1 while
the device still runs step n, then finishes step n. Step n+1's sequences carry a placeholder for the token
step n samples (engine/sequence.py PENDING); the device reads its value from step n's output, and the host
learns it one step late (`Scheduler.on_tokens`), where the finish and stop checks run, once per token. A
sequence that stops at step n was also given a row in step n+1; that token is dropped. Routes:

| route | when | a step |
|---|---|---|
| async | async_scheduling True, or None on CUDA; one process, the reference scheduler | schedule n+1, launch it, `on_launch`; wait for step n's ids, `on_tokens` |
| sync  | otherwise (CPU by default, TP > 1, a replaced scheduler) | schedule, run (launch + wait), `postprocess` |

Tensor parallelism: rank 0 runs in this process; ranks 1..tp-1 are spawned processes that run
`nanovllm_ref.engine.worker.run_worker` (an importable function, as `spawn` requires). Each engine picks
its own free TCP port for the process-group rendezvous and talks to its workers over private pipes, so two
engines never clash and nothing named is left in /dev/shm after a crash.
"""
import atexit
import multiprocessing as mp
import numbers
import random
import socket
import time
import warnings
from collections.abc import Sequence as SequenceABC

from tqdm.auto import tqdm

from nanovllm_ref.config import Config
from nanovllm_ref.engine.model_runner import ModelRunner
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.parts import Parts
from nanovllm_ref.sampling_params import SamplingParams


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LLMEngine:
    """model: a local model folder; parts: a nanovllm_ref.Parts of swappable parts (default: the reference
    ones); engine_args: the fields of nanovllm_ref.config.Config. Raises TypeError for an unknown argument or
    a `parts` that is not a Parts, ValueError for a bad value."""

    def __init__(self, model: str, parts: Parts | None = None, **engine_args):
        if parts is None:
            parts = Parts()
        if not isinstance(parts, Parts):
            raise TypeError(f"parts must be a nanovllm_ref.Parts, got {type(parts).__name__}")
        unknown = set(engine_args) - set(Config.argument_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s) {sorted(unknown)}; known: {sorted(Config.argument_names())}")
        config = Config(model, **engine_args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers import AutoTokenizer
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(config.model)
            except Exception as exc:
                raise ValueError(f"could not load a tokenizer from {config.model!r}: {exc}") from exc
        if len(self.tokenizer) < 2:
            raise ValueError(f"model folder {config.model!r} has no usable tokenizer "
                             "(tokenizer.json / tokenizer_config.json); the engine needs one")
        if self.tokenizer.eos_token_id is not None:
            config = config.derived(extra_eos=[self.tokenizer.eos_token_id])
        # Each request without its own SamplingParams.seed gets one from here, in arrival order.
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
        self.async_scheduling = self._async_route(config, parts, self.model_runner.device_type)
        self._in_flight = None            # async: (seqs, PendingStep, samples) of the step launched, not finished
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
    def _check_request(self, index: int, prompt, sp: SamplingParams) -> list[int]:
        """Token ids of one validated request; raises ValueError/TypeError naming what is wrong."""
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params[{index}] must be a SamplingParams, got {type(sp).__name__}")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, SequenceABC) and not isinstance(prompt, (bytes, bytearray)):
            for j, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise TypeError(f"prompts[{index}][{j}] must be an int token id, got {type(t).__name__}")
            token_ids = [int(t) for t in prompt]
            vocab = self.config.hf_config.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{index}] has token ids outside [0, {vocab}): {bad[:5]}")
        else:
            raise TypeError(f"prompts[{index}] must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError(f"prompts[{index}] is empty; a prompt needs at least one token")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"prompts[{index}] has {len(token_ids)} tokens, more than max_model_len={max_len}")
        # The most tokens this request ever holds K/V for: the prompt, then every sampled token but the
        # last (generation stops at max_tokens or max_model_len, and the last token is never fed back).
        longest = max(len(token_ids), min(len(token_ids) + sp.max_tokens, max_len) - 1)
        bs = self.config.kvcache_block_size
        need, have = (longest + bs - 1) // bs, self.config.num_kvcache_blocks
        if need > have:
            raise ValueError(f"prompts[{index}] can never fit in the KV cache: up to {longest} tokens need {need} "
                             f"blocks of {bs}, the cache has {have}; lower max_tokens or give the cache more memory")
        return token_ids

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this engine was shut down (exit() was called); create a new LLM")
        if self.model_runner.out_of_step:
            raise RuntimeError("a tensor-parallel step was interrupted on rank 0 while the workers were inside it, "
                               "so they are out of step with rank 0 and this engine cannot run another step; "
                               "call exit() and create a new LLM")

    def add_request(self, prompt, sampling_params: SamplingParams) -> int:
        """Queue one request; returns its sequence id. Raises before queuing if the request is invalid."""
        self._check_open()
        token_ids = self._check_request(0, prompt, sampling_params)
        seq = Sequence(token_ids, self.config.kvcache_block_size, sampling_params, seed=self._seeds.getrandbits(64))
        self.scheduler.add(seq)
        return seq.seq_id

    @staticmethod
    def _async_route(config: Config, parts: Parts, device_type: str) -> bool:
        """Whether `step` runs asynchronously (module docstring). Raises ValueError for async_scheduling=True
        where it cannot run."""
        from nanovllm_ref.engine.scheduler import Scheduler
        possible = config.tensor_parallel_size == 1 and parts.scheduler is Scheduler
        if config.async_scheduling is None:
            return possible and device_type == "cuda"
        if config.async_scheduling and not possible:
            raise ValueError("async_scheduling=True needs the reference scheduler (Parts.scheduler) and "
                             "tensor_parallel_size=1; leave it None or False")
        return config.async_scheduling

    def step(self):
        """One engine step. Returns (finished [(seq_id, completion token ids)], num_tokens) where
        num_tokens > 0 counts the prefill tokens and < 0 the decode tokens of the step launched (for
        throughput). Async scheduling: the step finished is the one launched by the previous call."""
        self._check_open()
        if self.async_scheduling:
            return self._step_async()
        if self.is_finished():
            return [], 0
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(s.num_scheduled_tokens for s in seqs) if is_prefill else -len(seqs)
        token_ids = self.model_runner.run(seqs, is_prefill)        # also sends the step to TP workers
        finished = self.scheduler.postprocess(seqs, token_ids)
        return [(s.seq_id, s.completion_token_ids) for s in finished], num_tokens

    def _step_async(self):
        launched, num_tokens = None, 0
        if not self.scheduler.is_finished():
            seqs, is_prefill = self.scheduler.schedule()
            if seqs:
                num_tokens = sum(s.num_scheduled_tokens for s in seqs) if is_prefill else -len(seqs)
                pending = self.model_runner.launch(seqs, is_prefill)
                launched = (seqs, pending, self.scheduler.on_launch(seqs, pending=True))
        finished = []
        if self._in_flight is not None:
            seqs, pending, samples = self._in_flight
            self._in_flight = None
            finished = self.scheduler.on_tokens(seqs, pending.token_ids(), samples)
        self._in_flight = launched
        if launched is None and not finished and not self.scheduler.is_finished():
            raise RuntimeError("the scheduler scheduled nothing while requests are waiting and no step is in "
                               "flight: no progress is possible")
        return [(s.seq_id, s.completion_token_ids) for s in finished], num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def abort_all(self) -> None:
        """Drop every queued or running request and free its KV blocks (cached prefixes stay cached)."""
        self._in_flight = None
        self.scheduler.abort_all()

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[dict]:
        """Generate completions for `prompts` (a list of str or of token-id lists; one str is also accepted).

        sampling_params: one SamplingParams for all prompts, or a list with one per prompt (default:
        SamplingParams()). Returns, in input order, one dict per prompt: {"text": str, "token_ids": list[int]
        (the completion only), "prompt_token_ids": list[int], "finish_reason": "stop" (an eos / stop id was
        sampled) or "length" (max_tokens reached, or prompt + completion reached max_model_len)}.
        Raises TypeError/ValueError before any work if a request is invalid.
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
        requests = [self._check_request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sampling_params))]
        if not self.is_finished():
            raise RuntimeError("generate() called while requests from add_request() are still pending; "
                               "step() until is_finished(), or call abort_all()")
        seqs = []
        for token_ids, sp in zip(requests, sampling_params):
            seq = Sequence(token_ids, self.config.kvcache_block_size, sp, seed=self._seeds.getrandbits(64))
            self.scheduler.add(seq)
            seqs.append(seq)
        outputs = {}
        pbar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        # Throughput so far (tokens / seconds of that kind of step), not of the last step alone.
        totals = {"prefill": [0, 0.0], "decode": [0, 0.0]}
        try:
            while not self.is_finished():
                t = time.perf_counter()
                finished, num_tokens = self.step()
                kind = totals["prefill" if num_tokens > 0 else "decode"]
                kind[0] += abs(num_tokens)
                kind[1] += time.perf_counter() - t
                if use_tqdm:
                    pbar.set_postfix({k: f"{n / max(s, 1e-9):.0f}tok/s" for k, (n, s) in totals.items()},
                                     refresh=False)
                for seq_id, token_ids in finished:
                    outputs[seq_id] = token_ids
                    pbar.update(1)
        except BaseException:
            # Interrupted (Ctrl-C, a kernel interrupt) or failed: drop this call's requests so the engine
            # stays usable, then let the exception through.
            self.abort_all()
            raise
        finally:
            pbar.close()
        results = []
        for seq in seqs:
            token_ids = outputs[seq.seq_id]
            if seq.finish_reason is None:     # a scheduler part that does not set it: say why from the tokens
                stopped = bool(token_ids) and not seq.ignore_eos and token_ids[-1] in self.config.eos
                seq.finish_reason = "stop" if stopped else "length"
            # Like vLLM, the text leaves out special tokens such as the EOS; token_ids keep them.
            results.append({"text": self.tokenizer.decode(token_ids, skip_special_tokens=True),
                            "token_ids": token_ids, "prompt_token_ids": seq.prompt_token_ids,
                            "finish_reason": seq.finish_reason})
        return results
