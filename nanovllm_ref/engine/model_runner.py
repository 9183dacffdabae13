"""Runs the model for one step's batch: a plain record in, next tokens out (chapters 04, 08, 09, 10).

A short orchestrator over modules that each teach one thing:
- engine/step_batch.py: the step's batch record (StepBatch), built on the scheduler's side from the
  sequences; the runner never sees a Sequence;
- engine/inputs.py: `upload` of the record's host tensors (Parts.prepare_prefill/decode made them);
- utils/context.py: `with attention_metadata(meta):` hands the metadata to the attention layers;
- engine/kv_cache.py: sizing and allocating the paged KV cache;
- engine/cuda_graph.py: decode CUDA graphs (capture, the packed static inputs, replay);
- engine/prefill_graph.py: prefill CUDA graphs by token count (small prefill steps, padded);
- engine/sampling_inputs.py: the record's sampling rows -> the sampler's, the processors' and min_tokens'
  device tensors;
- layers/logits_processors.py, layers/sampler.py, layers/logprobs.py: what runs on the logits.
What runs is decided once, when the runner is built, by `Parts.resolve` (nanovllm_ref/parts.py): the runner's
`plan`, an EnginePlan (attention back-end and KV store, the model's ops and kernels, sampler, graphs).

Entry points: rank 0 calls `launch(batch)` once per step; it makes the step's message, sends it to the
other tensor-parallel ranks, every rank runs `execute(message)`, and rank 0 samples (`sample`). `launch`
returns a `PendingStep` at once: the sampled ids stay on the device (in `last_ids`, where the next step can
read them as inputs) and reach the host through a pinned, non-blocking copy when `token_ids()` is called,
so the engine can schedule and launch the next step meanwhile (async scheduling, engine/llm_engine.py).
Worker ranks sit in `loop()` (called by engine/worker.py) until an `Exit` message. Start-up warm-ups call
`execute(message(batch))` on each rank alone.

Messages (one per step, rank 0 -> every rank; a few kB, never the sequences with their token lists):
- `PackedDecodeStep(packed, batch, sample_in_graph)`: the decode graphs' packed input buffer (one pinned
  copy, engine/cuda_graph.py) and the batch size; `sample_in_graph` says whether the graph's own ids are the
  answer;
- `PackedPrefillStep(packed, num_tokens, num_seqs)`: a prefill step that replays a prefill graph (rank 0 only:
  prefill graphs run in one process);
- `ModelStep(batch)`: the StepBatch itself (without its sampling rows: StepBatch.for_workers), for a step
  that runs eagerly; each rank copies its host tensors to its device;
- `Exit()`: leave the process group and free the memory.

Decode step routes. Per step only two facts choose the row: does the batch fit a captured graph, and does a
row need the sampler after the graph (`SamplingRows.after_graph`: top-k / top-p on a sampled row; a row still
short of its min_tokens, whose stop ids are masked out of its logits first; a row with a presence, frequency
or repetition penalty, greedy or not, and a sampled row with min_p, whose logits the processors change first).

| inputs                            | forward            | sampler                 | when                                                     |
|-----------------------------------|--------------------|-------------------------|----------------------------------------------------------|
| packed buffer, one pinned copy    | CUDA graph replay  | inside the graph        | plan.graph_sample_rows (the reference sampler, one process) and no row after_graph |
| packed buffer, one pinned copy    | CUDA graph replay  | after, on the logits    | graphs otherwise (a sampler of yours, TP > 1, such a row)  |
| the record's tensors, copied in   | eager              | after, on the logits    | no graphs (CPU, enforce_eager), or more rows than the largest graph |

"After, on the logits" is, in order: min_tokens' mask, the processors (penalties, then min_p; their inputs
made before the forward, so the newest output token of an async step, still pending on the host, is counted
from `last_ids` on the device before the graph overwrites them), then `plan.sampler`.
Logprobs (SamplingParams.logprobs) change no route: they are computed from the step's raw logits, which every
route keeps, and the ids the step chose, and travel to the host with the ids (`PendingStep`).

Prefill step routes. Both sample after the forward, on the logits of each sequence's last token.

| inputs                            | forward                          | when                                                    |
|-----------------------------------|----------------------------------|---------------------------------------------------------|
| packed buffer, one pinned copy    | prefill graph replay (padded)    | plan.prefill_graph_sizes, and the step fits one: at most the largest size in tokens, at most 16 sequences, no prompt_logprobs |
| the record's tensors, copied in   | eager                            | otherwise                                               |

A prefill with prompt_logprobs also computes the logits of its chunk's prompt positions (`StepBatch.logit_rows`,
on every rank, since the LM head gathers across ranks), from which the prompt's logprobs come.

At start-up the runner:
- resolves the parts into its plan and logs it (logger "nanovllm_ref", INFO);
- builds the model with the plan's ops inside `tensor_parallel(rank, size)` and loads the weights;
- runs one prefill at the largest batch, to measure peak activation memory (GPU);
- sizes the KV cache from what is left (`num_kvcache_blocks`; the engine builds the scheduler with it);
- captures the decode CUDA graphs (plan.graph_batch_sizes);
- warms every other kernel and compiled variant (engine/warmup.py), so no request pays for a compile;
- captures the prefill CUDA graphs (plan.prefill_graph_sizes), after the warm-up, whose prefill steps must
  run eagerly to warm the eager route.
Upstream nano-vllm `engine/model_runner.py` pickles the sequences to the workers and has one decode route.
"""
import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanovllm_ref.config import Config
from nanovllm_ref.engine import kv_cache, sampling_inputs, warmup
from nanovllm_ref.engine.cuda_graph import CUDAGraphRunner, resolve_pending
from nanovllm_ref.engine.prefill_graph import MAX_SEQS as PREFILL_GRAPH_SEQS, PrefillGraphRunner
from nanovllm_ref.engine.inputs import to_device, upload
from nanovllm_ref.engine.step_batch import StepBatch, prefill_batch
from nanovllm_ref.layers.logits_processors import LogitsProcessing
from nanovllm_ref.layers.logprobs import LogprobsTensors, gather_logprobs
from nanovllm_ref.models import get_model_class
from nanovllm_ref.parts import Parts, logger
from nanovllm_ref.utils.context import attention_metadata
from nanovllm_ref.utils.loader import load_model
from nanovllm_ref.utils import onednn
from nanovllm_ref.utils.parallel import tensor_parallel

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False; use device='cpu'")
    return name


def resolve_dtype(name: str, hf_config, device: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device == "cpu":
        return torch.float32            # CPU matmuls in bf16 are slow and fp32 matches HF's CPU default
    dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.bfloat16)
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


# -- the messages of one step (module docstring) ---------------------------------------------------------
@dataclass(frozen=True)
class ModelStep:
    """A step that runs eagerly: its StepBatch (on a tensor-parallel message, StepBatch.for_workers)."""
    batch: StepBatch


@dataclass(frozen=True)
class PackedDecodeStep:
    """A decode step that replays a CUDA graph from the packed input buffer.
    packed: [fields * max_bs + padded * max_blocks] int32, what StaticDecodeInputs.pack returned;
    batch: the real rows (the rest up to the graph's size are padding); sample_in_graph: the graph's own
    sampled ids are this step's answer (else the sampler runs after the graph, on its logits)."""
    packed: np.ndarray
    batch: int
    sample_in_graph: bool


@dataclass(frozen=True)
class PackedPrefillStep:
    """A prefill step that replays a prefill CUDA graph (engine/prefill_graph.py). packed: the graphs' whole
    input buffer, what StaticPrefillInputs.pack returned; num_tokens, num_seqs: the real tokens and sequences
    (the rest up to the graph's sizes are padding)."""
    packed: np.ndarray
    num_tokens: int
    num_seqs: int


@dataclass(frozen=True)
class Exit:
    """Leave the process group and give the memory back."""


def _to_host(tensors: LogprobsTensors | None, pinned: bool) -> LogprobsTensors | None:
    """The tensors on their way to the host: pinned copies filled by non-blocking copies (CUDA), else as
    they are."""
    if tensors is None or not pinned:
        return tensors
    return LogprobsTensors(*(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                             for t in tensors))


def _lists(tensors: LogprobsTensors | None):
    return None if tensors is None else tuple(t.tolist() for t in tensors)


class PendingStep:
    """The sampled ids of a launched step. `token_ids()` waits for them and returns one int per sequence.
    On CUDA they come through a pinned host buffer filled by a non-blocking copy (an event marks its end);
    two buffers take turns, so the next step's copy never overwrites ids not yet read.
    `logprobs()` (after the same wait) returns (sample, prompt): the step's LogprobsTensors as Python lists
    (token ids [B][1 + k], logprobs [B][1 + k], ranks [B]; None when no row asked for logprobs), and the same
    for its prompt rows (None without prompt_logprobs); `prompt_owners` says which batch row each run of
    prompt rows belongs to (StepBatch.prompt_owners: (row, first prompt position, count))."""

    def __init__(self, ids: torch.Tensor, host: torch.Tensor | None, logprobs: LogprobsTensors | None = None,
                 prompt_logprobs: LogprobsTensors | None = None, prompt_owners=()):
        self._n = ids.shape[0]
        self.prompt_owners = prompt_owners
        if host is None:                              # CPU: the step has already run
            # Read everything now: `ids` (and a logprobs column taken from it) views the runner's last_ids,
            # which the next step, launched before this one is read (async scheduling), overwrites.
            self._ids, self._event = ids.tolist(), None
            self._logprobs = (_lists(logprobs), _lists(prompt_logprobs))
        else:
            host[:self._n].copy_(ids, non_blocking=True)
            self._logprobs = (_to_host(logprobs, True), _to_host(prompt_logprobs, True))
            self._host, self._event = host, torch.cuda.Event()
            self._event.record()

    def token_ids(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
            self._ids, self._event = self._host[:self._n].tolist(), None
            self._logprobs = tuple(map(_lists, self._logprobs))
        return self._ids

    def logprobs(self) -> tuple:
        self.token_ids()
        return self._logprobs


class ModelRunner:
    """config: the engine's Config; rank: this process's tensor-parallel rank; conns: rank 0's pipes to the
    workers, or a worker's one pipe; port: the process-group rendezvous port (tp > 1); parts: the engine's
    nanovllm_ref.Parts (None = the reference parts), resolved into `plan` (an EnginePlan). After construction
    `num_kvcache_blocks` holds the size of the KV cache (the Config is never changed)."""

    def __init__(self, config: Config, rank: int = 0, conns=None, port: int | None = None, parts: Parts | None = None):
        self.config = config
        self.parts = parts if parts is not None else Parts()
        self.rank, self.world_size = rank, config.tensor_parallel_size
        self.conns = conns or []              # rank 0: one pipe per worker; worker: [its pipe]
        self.block_size = config.kvcache_block_size
        hf = config.hf_config
        self.device_type = resolve_device(config.device)
        self.device = torch.device(f"cuda:{rank}" if self.device_type == "cuda" else "cpu")
        self.dtype = resolve_dtype(config.dtype, hf, self.device_type)
        self.enforce_eager = config.enforce_eager or self.device_type != "cuda"
        if self.device_type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            backend = "nccl" if self.device_type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=120))

        self.model = self.kv_cache = self.graph_runner = self.prefill_graphs = self.plan = None
        self.num_kvcache_blocks = 0
        self.out_of_step = False          # rank 0: a tensor-parallel step was interrupted midway (see launch)
        try:
            self._build()
        except BaseException:
            self._release()            # a failed start-up must not keep the GPU memory it took
            raise

    @property
    def backend_name(self) -> str:
        """The attention back-end's name (EnginePlan.attention)."""
        return self.plan.attention

    @property
    def graph_samples(self) -> bool:
        """True when decode graphs are captured and end in sampled ids (EnginePlan.graph_sample_rows)."""
        return self.graph_runner is not None and self.graph_runner.sample_rows is not None

    def _build(self):
        """Plan, model, weights, warm-ups, KV cache and CUDA graphs (see the module docstring)."""
        config, rank, hf = self.config, self.rank, self.config.hf_config
        self.plan = self.parts.resolve(config, self.device_type, self.dtype, self.world_size)
        if rank == 0:
            logger.info("%s", self.plan.describe())
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), tensor_parallel(rank, self.world_size):
                self.model = get_model_class(hf)(hf, ops=self.plan.ops)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            self._init_dummy_weights()
        else:
            load_model(self.model, config.model)
        self.model.eval()
        if self.device_type == "cpu":
            onednn.pack(self.model)           # oneDNN copies of the linear weights (utils/onednn.py)
        self.sampler = self.plan.sampler
        # The last step's sampled ids stay here on the device (a decode step's pending inputs are read from
        # it); on CUDA two pinned host buffers take turns receiving them.
        rows = max(config.max_num_seqs, 2)
        self.last_ids = torch.zeros(rows, dtype=torch.int64, device=self.device)
        pinned = self.device_type == "cuda"
        self._host_ids = [torch.zeros(rows, dtype=torch.int64, pin_memory=pinned) for _ in range(2)] if pinned else None
        self._turn = 0
        self._profile_peak_memory()
        self.allocate_kv_cache()
        if self.plan.use_graphs:
            self.capture_cudagraph()
        if self.plan.fuse or self.device_type == "cuda":
            warmup.warm_step_variants(self)
        if self.plan.prefill_graph_sizes:
            self.capture_prefill_graphs()

    # -- set-up -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_dummy_weights(self):
        """Random weights with the checkpoint's shapes (benchmarks only): N(0, 0.02), norms at 1."""
        gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        for name, param in self.model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)

    def _attention_layers(self):
        from nanovllm_ref.layers.attention import Attention
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    @torch.inference_mode()
    def _profile_peak_memory(self):
        """GPU: one prefill at the largest batch, to measure peak activation memory before sizing the cache
        (engine/warmup.py warms the other variants once the cache exists)."""
        if self.device_type != "cuda":
            return
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # The biggest step the scheduler can produce: max_num_batched_tokens prompt tokens.
        seq_len = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // seq_len, self.config.max_num_seqs))
        self.execute(ModelStep(prefill_batch(num_seqs, seq_len)))
        torch.cuda.empty_cache()

    def kv_block_bytes(self) -> int:
        return kv_cache.kv_block_bytes(self._attention_layers(), self.block_size, self.dtype)

    def allocate_kv_cache(self):
        """Size the cache (engine/kv_cache.py) into `num_kvcache_blocks` and allocate it.
        Raises ValueError if not even one block fits."""
        budget = kv_cache.kv_budget_bytes(self.config, self.device_type)
        self.num_kvcache_blocks = kv_cache.plan_num_blocks(self.config, self.kv_block_bytes(), budget,
                                                           self.world_size, self.device)
        self.kv_cache = kv_cache.allocate_kv_cache(self._attention_layers(), self.num_kvcache_blocks,
                                                   self.block_size, self.dtype, self.device)

    def capture_cudagraph(self, runner_cls=CUDAGraphRunner):
        """Capture one decode graph per size in plan.graph_batch_sizes (Parts.graph_batch_sizes(max_num_seqs);
        engine/cuda_graph.py). runner_cls: CUDAGraphRunner, or (tests on a CPU) a subclass whose `_record`
        replays eagerly; there the sizes come from Parts.graph_batch_sizes and the in-graph sampler is the
        reference row draw the plan would use."""
        cfg = self.config
        max_blocks = (cfg.max_model_len + self.block_size - 1) // self.block_size
        sizes = list(self.plan.graph_batch_sizes or self.parts.graph_batch_sizes(cfg.max_num_seqs))
        rows = self.plan.graph_sample_rows
        if not self.plan.use_graphs and self.world_size == 1 and "sampler" not in self.plan.replaced:
            from nanovllm_ref.layers.sampler import sample_rows
            rows = sample_rows                    # a CPU test of the graph path: the eager row draw
        try:
            self.graph_runner = runner_cls(self.model, sizes, max_blocks, cfg.hf_config.hidden_size, self.dtype,
                                           self.device, sample_rows=rows, vocab_size=cfg.hf_config.vocab_size,
                                           token_ids=self.last_ids)
        except Exception as exc:
            mine = list(self.plan.replaced)
            raise RuntimeError(f"CUDA graph capture of the decode step failed ({type(exc).__name__}: {exc})"
                               + (f"; a part may not be capture-safe (no host syncs, no boolean-mask indexing): "
                                  f"Parts fields replaced: {mine}" if mine else "")
                               + "; enforce_eager=True runs without CUDA graphs") from exc

    def capture_prefill_graphs(self, runner_cls=PrefillGraphRunner, sizes=None):
        """Capture one prefill graph per token count in `sizes` (default plan.prefill_graph_sizes;
        engine/prefill_graph.py). runner_cls: PrefillGraphRunner, or (tests on a CPU) a subclass whose
        `_record` replays eagerly. Raises RuntimeError, naming max_prefill_graph_tokens=0 as the way out, if a
        capture fails."""
        cfg = self.config
        max_blocks = (cfg.max_model_len + self.block_size - 1) // self.block_size
        sizes = list(sizes or self.plan.prefill_graph_sizes)
        try:
            self.prefill_graphs = runner_cls(self.model, sizes, max_blocks, cfg.hf_config.hidden_size, self.dtype,
                                             self.device, max_seqs=min(cfg.max_num_seqs, PREFILL_GRAPH_SEQS),
                                             max_seqlen_k=cfg.max_model_len)
        except Exception as exc:
            raise RuntimeError(f"CUDA graph capture of the prefill step failed ({type(exc).__name__}: {exc}); "
                               "max_prefill_graph_tokens=0 runs prefill steps eagerly") from exc

    @contextlib.contextmanager
    def eager_steps(self):
        """Inside the block, this rank runs decode and prefill steps eagerly: no CUDA-graph replay, the model's kernels
        launched one by one (what a profiler needs to see them). The graphs stay captured and replay again
        after the block. Benchmarks and tests use it; an engine never needs it."""
        saved = self.graph_runner, self.prefill_graphs
        self.graph_runner = self.prefill_graphs = None
        try:
            yield self
        finally:
            self.graph_runner, self.prefill_graphs = saved

    # -- one step ---------------------------------------------------------------------------------------
    def message(self, batch: StepBatch):
        """This step's message (module docstring): a PackedDecodeStep or PackedPrefillStep when graphs are
        captured and one fits the batch, else a ModelStep of the record (without its sampling rows)."""
        prefill = self.prefill_graphs
        if batch.is_prefill and prefill is not None and prefill.inputs.fits(batch):
            return PackedPrefillStep(prefill.inputs.pack(batch), int(batch.inputs.input_ids.shape[0]), batch.num_seqs)
        if not batch.is_prefill and self.graph_runner is not None:
            padded = self.graph_runner.padded_size(batch.num_seqs)
            if padded is not None:
                packed = self.graph_runner.inputs.pack(batch, padded)
                in_graph = self.graph_runner.sample_rows is not None and not batch.sampling.after_graph
                return PackedDecodeStep(packed, batch.num_seqs, in_graph)
        if batch.prev_rows is not None and self.conns:
            raise RuntimeError("a pending token reached a tensor-parallel message; async scheduling runs one "
                               "process only")
        return ModelStep(batch.for_workers())

    @torch.inference_mode()
    def execute(self, message) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Every rank: the forward of one step. Returns (logits [num_seqs, vocab], token ids [num_seqs]
        int64 when the graph sampled them, else None, prompt logits [P, vocab] for the batch's logit_rows,
        else None). With tensor parallelism only rank 0's logits are the whole vocabulary (the LM head
        gathers them there; the other ranks get None)."""
        if isinstance(message, PackedDecodeStep):
            graph = self.graph_runner
            graph.inputs.upload(message.packed)
            graph.replay(message.batch)
            b = message.batch
            if graph.sample_rows is not None:
                ids = graph.buffers["token_ids"][:b] if message.sample_in_graph else None
                return graph.buffers["logits"][:b], ids, None
            return self.model.compute_logits(graph.buffers["outputs"][:b]), None, None
        if isinstance(message, PackedPrefillStep):
            graphs = self.prefill_graphs
            graphs.inputs.upload(message.packed)
            graphs.replay(message.num_tokens)
            return self.model.compute_logits(graphs.buffers["outputs"][:message.num_seqs]), None, None
        batch = message.batch
        step = upload(batch.inputs, self.device)
        meta, input_ids = step.metadata, step.input_ids
        if batch.prev_rows is not None:
            input_ids = resolve_pending(input_ids, to_device(batch.prev_rows, torch.int32, self.device), self.last_ids)
        with attention_metadata(meta):
            every = self.model(input_ids, step.positions)    # eager: prefill, no graphs, or too many rows
        hidden = every[meta.cu_seqlens_q[1:] - 1] if meta.is_prefill else every
        if batch.logit_rows is None or not meta.is_prefill:
            return self.model.compute_logits(hidden), None, None
        # One LM-head call for both (on every rank: it gathers across ranks); the sampled rows come first.
        rows = to_device(batch.logit_rows, torch.int64, self.device)
        logits = self.model.compute_logits(torch.cat([hidden, every[rows]]))
        if logits is None:
            return None, None, None
        n = hidden.shape[0]
        return logits[:n], None, logits[n:]

    def processing(self, batch: StepBatch) -> LogitsProcessing | None:
        """The logits processors' view of the batch, or None (engine/sampling_inputs.logits_processing). Call
        it before the step's forward: a pending token is read from `last_ids`, which the graph overwrites."""
        return sampling_inputs.logits_processing(batch.sampling, self.device, self.config.hf_config.vocab_size,
                                                 self.last_ids)

    def sample(self, batch: StepBatch, logits: torch.Tensor, token_ids: torch.Tensor | None,
               processing: LogitsProcessing | None = None, prompt_logits: torch.Tensor | None = None) -> PendingStep:
        """Rank 0: this step's next token per row, from the graph's own ids (already in `last_ids`) or from the
        sampler (copied there) after min_tokens' mask and the processors, on its way to the host with the
        logprobs the rows ask for (from the raw `logits`; the prompt's from `prompt_logits`, the batch's
        logit_rows)."""
        rows = batch.sampling
        n = rows.num_rows
        if token_ids is None:
            metadata = sampling_inputs.sampling_metadata(rows, self.device)
            chosen = sampling_inputs.mask_stop_tokens(logits, rows)
            if processing is not None:
                chosen = processing.apply(chosen)
            self.last_ids[:n].copy_(self.sampler(chosen, metadata))
        elif processing is not None:
            raise RuntimeError("a step with logits processors sampled inside the graph (SamplingRows.after_graph)")
        elif token_ids.data_ptr() != self.last_ids.data_ptr():     # a graph runner with its own buffer
            self.last_ids[:n].copy_(token_ids)
        logprobs = None if rows.num_logprobs is None else gather_logprobs(logits, rows.num_logprobs, self.last_ids[:n])
        prompt_logprobs = None
        if batch.logit_rows is not None:
            targets = to_device(batch.prompt_targets, torch.int64, self.device)
            prompt_logprobs = gather_logprobs(prompt_logits, batch.prompt_num_top, targets)
        host = None
        if self._host_ids is not None:
            host, self._turn = self._host_ids[self._turn], 1 - self._turn
        return PendingStep(self.last_ids[:n], host, logprobs, prompt_logprobs, batch.prompt_owners)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> list[int]:
        """Rank 0: one step, waited for: one sampled token id per row."""
        return self.launch(batch).token_ids()

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> PendingStep:
        """Rank 0: one step of `batch` (engine/step_batch.StepBatch). Sends the step's message to the workers
        (tensor parallel), runs it here, and returns its sampled ids on their way to the host (PendingStep)."""
        message = self.message(batch)
        processing = self.processing(batch)            # before the forward (see `processing`)

        def run_here() -> PendingStep:
            logits, token_ids, prompt_logits = self.execute(message)
            return self.sample(batch, logits, token_ids, processing, prompt_logits)

        if not self.conns:
            return run_here()
        # From the first send until this rank's part of the step is over, an interrupt here (Ctrl-C, a
        # notebook's interrupt: they reach this process only) leaves the workers inside the step's
        # collectives, out of step with rank 0. `out_of_step` stays True then, and the engine closes.
        # An Exception is met by every rank running the same step, so it leaves them in step.
        self.out_of_step = True
        try:
            for conn in self.conns:
                conn.send(message)
            pending = run_here()
            pending.token_ids()               # the step is over on every rank once its ids are here
        except Exception:
            self.out_of_step = False
            raise
        self.out_of_step = False
        return pending

    # -- tensor parallel plumbing -----------------------------------------------------------------------
    def loop(self):
        """Worker ranks: execute each step rank 0 sends, until an Exit message."""
        conn = self.conns[0]
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                # Rank 0 is gone (killed or crashed) without saying "exit". It may have died inside a step,
                # and then an NCCL all-reduce of ours spins on the GPU waiting for it forever. A normal
                # interpreter exit frees CUDA memory, which waits for that kernel: it would hang. Leave at
                # once instead; the driver reclaims the memory of a process that has exited.
                os._exit(1)
            if isinstance(message, Exit):
                self.exit()
                break
            try:
                self.execute(message)
            except Exception:
                # Rank 0 runs the same step and meets the same error, which reaches the caller there. A worker
                # that died here instead would leave rank 0's exit() waiting forever at its barrier.
                import traceback
                traceback.print_exc()

    def shutdown_workers(self):
        """Rank 0: send Exit to every worker, then leave the process group here too."""
        for conn in self.conns:
            conn.send(Exit())
        self.exit()

    def exit(self):
        """Leave the process group and give the memory (graphs, KV cache, weights) back."""
        self._release()
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def _release(self):
        """Drop the graphs, the KV cache and the weights, and hand the cached GPU memory back."""
        for graphs in (self.graph_runner, self.prefill_graphs):
            if graphs is not None:
                graphs.release()
        for layer in self._attention_layers() if self.model is not None else []:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.graph_runner, self.prefill_graphs, self.kv_cache, self.model = None, None, None, None
        if self.device_type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()
