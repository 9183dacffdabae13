"""Runs the model for one scheduled batch: inputs in, next tokens out (chapters 04, 08, 09, 10).

A short orchestrator over modules that each teach one thing:
- engine/inputs.py: the batch -> input ids, positions and attention metadata (`Parts.prepare_prefill/decode`);
- utils/context.py: `with attention_metadata(meta):` hands the metadata to the attention layers;
- engine/kv_cache.py: sizing and allocating the paged KV cache;
- engine/cuda_graph.py: decode CUDA graphs (capture, static inputs, replay);
- layers/sampler.py: logits -> token ids (`Parts.sampler`).

One ModelRunner lives in each tensor-parallel process. Rank 0 runs in the engine's process. For each step
it prepares the inputs once and sends them to the other ranks through a pipe as one compact message: the
prepared arrays (a few kB), not the sequences with their whole token lists. Each worker runs `loop()`
(called by engine/worker.py, not from __init__) and executes the same step, so the collectives inside the
layers line up. Other calls (`exit`) are forwarded by name (upstream nano-vllm `engine/model_runner.py`
pickles the sequences instead).

At start-up it:
- builds the model with the engine's parts inside `tensor_parallel(rank, size)` and loads the weights;
- runs one prefill at the largest batch, to measure peak activation memory (GPU);
- sizes the KV cache from what is left;
- captures the decode CUDA graphs;
- warms every other kernel and compiled variant (engine/warmup.py), so no request pays for a compile.
"""
import contextlib
import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm_ref.attn import get_backend, resolve_backend
from nanovllm_ref.config import Config
from nanovllm_ref.engine import kv_cache, warmup
from nanovllm_ref.engine.cuda_graph import CUDAGraphRunner, graph_batch_sizes  # noqa: F401  (tests import it here)
from nanovllm_ref.engine.inputs import StepInputs, prepare_decode, step_from_host, step_to_host, to_device
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.layers.sampler import SamplingMetadata, sample as reference_sample, sample_rows
from nanovllm_ref.models import get_model_class
from nanovllm_ref.parts import Parts
from nanovllm_ref.utils.context import attention_metadata
from nanovllm_ref.utils.fusion import choose
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


def uses_filters(seq: Sequence) -> bool:
    """A sampled row with top-k or top-p on: it needs the sampler's filtered (uncompiled) path."""
    return seq.temperature > 0 and (seq.top_k > 0 or seq.top_p < 1)


def fuse_by_default(device_type: str) -> bool:
    """Whether an engine on this device compiles its small ops (utils/fusion.py): on CUDA only, where
    launches dominate; on a CPU compiling costs more start-up time than it saves."""
    return device_type == "cuda"


class ModelRunner:
    """config: the engine's Config; rank: this process's tensor-parallel rank; conns: rank 0's pipes to the
    workers, or a worker's one pipe; port: the process-group rendezvous port (tp > 1); parts: the engine's
    nanovllm_ref.Parts (None = the reference parts)."""

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
        # Fuse RMSNorm / RoPE / SiLU-and-mul / the sampler into one compiled kernel each on GPU
        # (utils/fusion.py). The choice is this engine's: the model is built with it.
        self.fuse = fuse_by_default(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            backend = "nccl" if self.device_type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=120))
        torch.manual_seed(config.seed)

        self.model = self.kv_cache = self.graph_runner = None
        self.graph_samples = False
        self.out_of_step = False          # rank 0: a tensor-parallel step was interrupted midway (see run)
        try:
            self._build()
        except BaseException:
            self._release()            # a failed start-up must not keep the GPU memory it took
            raise

    def _build(self):
        """Model, weights, warm-ups, KV cache and CUDA graphs (see the module docstring)."""
        config, rank, hf = self.config, self.rank, self.config.hf_config
        model_parts = self._resolve_attention(self.parts)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), tensor_parallel(rank, self.world_size):
                self.model = get_model_class(hf)(hf, parts=model_parts, fuse=self.fuse)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            self._init_dummy_weights()
        else:
            load_model(self.model, config.model)
        self.model.eval()
        if self.device_type == "cpu":
            onednn.pack(self.model)           # oneDNN copies of the linear weights (utils/onednn.py)
        self.sampler = choose(self.parts.sampler, Parts().sampler, self.fuse)
        self.graph_runner, self.graph_samples = None, False
        self.warmup_model()
        self.allocate_kv_cache()
        if not self.enforce_eager:
            self.capture_cudagraph()
        if self.fuse or self.device_type == "cuda":
            warmup.warm_step_variants(self)

    # -- set-up -----------------------------------------------------------------------------------------
    def _resolve_attention(self, parts: Parts) -> Parts:
        """Parts with the attention back-end and KV store filled in: the parts' own, or the engine's choice
        (config.attention_backend; the Triton store on CUDA or with the triton back-end, else the back-end
        module's own store_kvcache if it has one, else the torch one)."""
        if parts.attention_backend is not None:
            if self.config.attention_backend != "auto":
                raise ValueError(f"attention_backend={self.config.attention_backend!r} conflicts with "
                                 "Parts.attention_backend; leave attention_backend='auto' when parts bring one")
            self.backend_name = "parts"
            backend = parts.attention_backend
        else:
            self.backend_name = resolve_backend(self.config.attention_backend, self.device_type, self.block_size,
                                                dtype=self.dtype)
            backend = get_backend(self.backend_name)
        store = parts.store_kvcache
        if store is None and (self.device_type == "cuda" or self.backend_name == "triton"):
            from nanovllm_ref.kernels.store_kvcache import store_kvcache
            store = store_kvcache
        elif store is None and parts.attention_backend is None:
            store = getattr(backend, "store_kvcache", None)      # the "cpu" back-end brings its own
        return dataclasses.replace(parts, attention_backend=backend, store_kvcache=store)

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
    def warmup_model(self):
        """One prefill at the largest batch, to measure peak activation memory before sizing the cache
        (engine/warmup.py warms the other variants once the cache exists)."""
        if self.device_type != "cuda":
            return
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # The biggest step the scheduler can produce: max_num_batched_tokens prompt tokens.
        seq_len = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // seq_len, self.config.max_num_seqs))
        seqs = [Sequence([0] * seq_len, self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        self.run_local(seqs, True)
        torch.cuda.empty_cache()

    def kv_block_bytes(self) -> int:
        return kv_cache.kv_block_bytes(self._attention_layers(), self.block_size, self.dtype)

    def allocate_kv_cache(self):
        """Size the cache (engine/kv_cache.py), record the block count in the config, allocate it.
        Raises ValueError if not even one block fits."""
        budget = kv_cache.kv_budget_bytes(self.config, self.device_type)
        num_blocks = kv_cache.plan_num_blocks(self.config, self.kv_block_bytes(), budget, self.world_size,
                                              self.device)
        self.config.num_kvcache_blocks = num_blocks
        self.kv_cache = kv_cache.allocate_kv_cache(self._attention_layers(), num_blocks, self.block_size,
                                                   self.dtype, self.device)

    # -- tensor parallel plumbing -----------------------------------------------------------------------
    def loop(self):
        """Worker ranks: execute whatever rank 0 sends until told to exit."""
        conn = self.conns[0]
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                # Rank 0 is gone (killed or crashed) without saying "exit". It may have died inside a step,
                # and then an NCCL all-reduce of ours spins on the GPU waiting for it forever. A normal
                # interpreter exit frees CUDA memory, which waits for that kernel: it would hang. Leave at
                # once instead; the driver reclaims the memory of a process that has exited.
                os._exit(1)
            if method == "exit":
                self.exit()
                break
            try:
                getattr(self, method)(*args)
            except Exception:
                # Rank 0 runs the same step and meets the same error, which reaches the caller there. A worker
                # that died here instead would leave rank 0's exit() waiting forever at its barrier.
                import traceback
                traceback.print_exc()

    def call(self, method: str, *args):
        """Rank 0: run `method` here and on every worker."""
        for conn in self.conns:
            conn.send((method, args))
        return getattr(self, method)(*args)

    def exit(self):
        """Leave the process group and give the memory (graphs, KV cache, weights) back."""
        self._release()
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def _release(self):
        """Drop the graphs, the KV cache and the weights, and hand the cached GPU memory back."""
        if self.graph_runner is not None:
            self.graph_runner.release()
        for layer in self._attention_layers() if self.model is not None else []:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.graph_runner, self.kv_cache, self.model = None, None, None
        if self.device_type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()

    # -- one step ---------------------------------------------------------------------------------------
    def prepare_sample(self, seqs: list[Sequence]) -> SamplingMetadata:
        """The sampler's view of the batch. top_k / top_p are None unless some sampled (temperature > 0)
        row uses either; then both are tensors (0 and 1.0 mean off for a row), one path for any mix. The
        choice is made here, on the host."""
        temperatures = [seq.temperature for seq in seqs]
        top_k = top_p = None
        if any(map(uses_filters, seqs)):
            top_k = to_device([seq.top_k for seq in seqs], torch.int64, self.device)
            top_p = to_device([seq.top_p for seq in seqs], torch.float64, self.device)
        return SamplingMetadata(to_device(temperatures, torch.float32, self.device),
                                all_greedy=not any(t > 0 for t in temperatures), top_k=top_k, top_p=top_p)

    def _samples_in_graph(self, seqs: list[Sequence]) -> bool:
        """True when the captured graph's own ids are this batch's answer: the reference sampler, and no
        top-k / top-p on a sampled row (those run after the graph, on its logits)."""
        return self.graph_samples and not any(map(uses_filters, seqs))

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Hidden states of the last token of each sequence: [num_seqs, hidden]. Call inside
        `attention_metadata(meta)`. Decode replays a CUDA graph when one fits the batch."""
        if meta.is_prefill:
            hidden = self.model(input_ids, positions)
            return hidden[meta.cu_seqlens_q[1:] - 1]
        if self.graph_runner is not None:
            hidden = self.graph_runner.run(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions)

    def _message(self, seqs: list[Sequence], is_prefill: bool, remote: bool):
        """This step's inputs as one message: ("graph", packed host buffer, batch) for a decode step that
        replays a graph with the reference input preparation (one copy, no per-step tensors); else
        ("step", StepInputs, is_prefill), the tensors on this device, or as numpy arrays when `remote`
        (the message then travels to tensor-parallel workers, a few kB instead of whole sequences)."""
        padded = (self.graph_runner.padded_size(len(seqs))
                  if not is_prefill and self.graph_runner is not None and self.parts.prepare_decode is prepare_decode
                  else None)
        if padded is not None:
            return ("graph", self.graph_runner.inputs.pack(seqs, self.block_size, padded), len(seqs))
        prepare = self.parts.prepare_prefill if is_prefill else self.parts.prepare_decode
        if not remote:
            return ("step", prepare(seqs, self.block_size, self.device), is_prefill)
        return ("step", step_to_host(prepare(seqs, self.block_size, "cpu")), is_prefill)

    @torch.inference_mode()
    def run_local(self, seqs: list[Sequence], is_prefill: bool) -> list[int] | None:
        """One step on this rank alone (start-up warm-ups, which every rank runs in step on its own)."""
        return self.execute(self._message(seqs, is_prefill, remote=False), seqs)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int] | None:
        """Rank 0: one step for `seqs`. Sends the step's inputs to the workers (tensor parallel), runs it
        here, and returns one sampled token id per sequence."""
        message = self._message(seqs, is_prefill, remote=bool(self.conns) and self.rank == 0)
        if not self.conns:
            return self.execute(message, seqs)
        # From the first send until this rank's part of the step is over, an interrupt here (Ctrl-C, a
        # notebook's interrupt: they reach this process only) leaves the workers inside the step's
        # collectives, out of step with rank 0. `out_of_step` stays True then, and the engine closes.
        # An Exception is met by every rank running the same step, so it leaves them in step.
        self.out_of_step = True
        try:
            for conn in self.conns:
                conn.send(("execute", (message,)))
            token_ids = self.execute(message, seqs)
        except Exception:
            self.out_of_step = False
            raise
        self.out_of_step = False
        return token_ids

    @torch.inference_mode()
    def execute(self, message, seqs: list[Sequence] | None = None) -> list[int] | None:
        """Every rank: run one step from its message (see `_message`). Rank 0 (which has `seqs`) samples
        and returns the token ids; other ranks return None."""
        kind, payload, arg = message
        if kind == "graph":
            runner, batch = self.graph_runner, arg
            runner.inputs.upload(payload)
            runner.replay(batch)
            if self.rank == 0 and self._samples_in_graph(seqs):
                return runner.buffers["token_ids"][:batch].tolist()
            logits = (runner.buffers["logits"][:batch] if self.graph_samples
                      else self.model.compute_logits(runner.buffers["outputs"][:batch]))
        else:
            step = payload if isinstance(payload, StepInputs) else step_from_host(payload, self.device)
            with attention_metadata(step.metadata):
                hidden = self.run_model(step.input_ids, step.positions, step.metadata)
            logits = self.model.compute_logits(hidden)
        if self.rank != 0:
            return None
        return self.sampler(logits, self.prepare_sample(seqs)).tolist()

    @contextlib.contextmanager
    def eager_steps(self):
        """Inside the block, this rank runs decode steps eagerly: no CUDA-graph replay, the model's kernels
        launched one by one (what a profiler needs to see them). The graphs stay captured and replay again
        after the block. Benchmarks and tests use it; an engine never needs it."""
        saved, self.graph_runner = self.graph_runner, None
        saved_samples, self.graph_samples = self.graph_samples, False
        try:
            yield self
        finally:
            self.graph_runner, self.graph_samples = saved, saved_samples

    def capture_cudagraph(self, runner_cls=CUDAGraphRunner):
        """Capture one decode graph per size in Parts.graph_batch_sizes(max_num_seqs) (engine/cuda_graph.py).
        With one process and the reference sampler the graphs end in sampled ids (`graph_samples`).
        runner_cls: CUDAGraphRunner, or (tests on a CPU) a subclass whose `_record` replays eagerly."""
        cfg = self.config
        max_blocks = (cfg.max_model_len + self.block_size - 1) // self.block_size
        self.graph_samples = self.world_size == 1 and self.parts.sampler is reference_sample
        rows = choose(sample_rows, sample_rows, self.fuse) if self.graph_samples else None
        try:
            self.graph_runner = runner_cls(self.model, self.parts.graph_batch_sizes(cfg.max_num_seqs), max_blocks,
                                                cfg.hf_config.hidden_size, self.dtype, self.device,
                                                sample_rows=rows, vocab_size=cfg.hf_config.vocab_size)
        except Exception as exc:
            mine = self.parts.replaced()
            raise RuntimeError(f"CUDA graph capture of the decode step failed ({type(exc).__name__}: {exc})"
                               + (f"; a part may not be capture-safe (no host syncs, no boolean-mask indexing): "
                                  f"Parts fields replaced: {mine}" if mine else "")
                               + "; enforce_eager=True runs without CUDA graphs") from exc
