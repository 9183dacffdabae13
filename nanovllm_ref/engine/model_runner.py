"""Runs the model for one scheduled batch: inputs in, next tokens out (chapters 04, 08, 09, 10).

A short orchestrator over modules that each teach one thing:
- engine/inputs.py: the batch -> input ids, positions and attention metadata (`Parts.prepare_prefill/decode`);
- utils/context.py: `with attention_metadata(meta):` hands the metadata to the attention layers;
- engine/kv_cache.py: sizing and allocating the paged KV cache;
- engine/cuda_graph.py: decode CUDA graphs (capture, static inputs, replay);
- layers/sampler.py: logits -> token ids (`Parts.sampler`).

One ModelRunner lives in each tensor-parallel process. Rank 0 runs in the engine's process and forwards
every call (method name + arguments) to the other ranks through a pipe; each worker runs `loop()` (called by
engine/worker.py, not from __init__) and executes the same call, so the collectives inside the layers line
up (upstream nano-vllm `engine/model_runner.py`).

At start-up it builds the model with the engine's parts inside `tensor_parallel(rank, size)`, loads the
weights, runs one warm-up prefill at the largest batch to measure peak activation memory (GPU), sizes the KV
cache from what is left, and captures the decode CUDA graphs.
"""
import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm_ref.attn import get_backend, resolve_backend
from nanovllm_ref.config import Config
from nanovllm_ref.engine import kv_cache
from nanovllm_ref.engine.cuda_graph import CUDAGraphRunner, graph_batch_sizes  # noqa: F401  (tests import it here)
from nanovllm_ref.engine.inputs import to_device
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.layers.sampler import SamplingMetadata
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
        self.fuse = self.device_type == "cuda"
        if self.device_type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            backend = "nccl" if self.device_type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=120))
        torch.manual_seed(config.seed)

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
        self.graph_runner = None
        self.warmup_model()
        self.allocate_kv_cache()
        if not self.enforce_eager:
            self.capture_cudagraph()

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
            self.backend_name = resolve_backend(self.config.attention_backend, self.device_type, self.block_size)
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
        """One prefill at the largest batch, to measure peak activation memory before sizing the cache."""
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
        self.run(seqs, True)
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
            method, args = conn.recv()
            getattr(self, method)(*args)
            if method == "exit":
                break

    def call(self, method: str, *args):
        """Rank 0: run `method` here and on every worker."""
        for conn in self.conns:
            conn.send((method, args))
        return getattr(self, method)(*args)

    def exit(self):
        """Leave the process group and give the memory (graphs, KV cache, weights) back."""
        if self.graph_runner is not None:
            self.graph_runner.release()
        self.graph_runner, self.kv_cache = None, None
        for layer in self._attention_layers() if self.model is not None else []:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.model = None
        if self.device_type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # -- one step ---------------------------------------------------------------------------------------
    def prepare_sample(self, seqs: list[Sequence]) -> SamplingMetadata:
        """The sampler's view of the batch. top_k / top_p are None unless some sampled (temperature > 0)
        row uses them, so the common case skips the sort; the choice is made here, on the host."""
        temperatures = [seq.temperature for seq in seqs]
        sampled = [seq for seq in seqs if seq.temperature > 0]
        top_k = top_p = None
        if any(seq.top_k > 0 for seq in sampled):
            top_k = to_device([seq.top_k for seq in seqs], torch.int64, self.device)
        if any(seq.top_p < 1 for seq in sampled):
            top_p = to_device([seq.top_p for seq in seqs], torch.float64, self.device)
        return SamplingMetadata(to_device(temperatures, torch.float32, self.device),
                                all_greedy=not sampled, top_k=top_k, top_p=top_p)

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

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int] | None:
        """One step for `seqs`. Returns one sampled token id per sequence on rank 0, None elsewhere."""
        prepare = self.parts.prepare_prefill if is_prefill else self.parts.prepare_decode
        step = prepare(seqs, self.block_size, self.device)
        sampling = self.prepare_sample(seqs) if self.rank == 0 else None
        with attention_metadata(step.metadata):
            hidden = self.run_model(step.input_ids, step.positions, step.metadata)
        logits = self.model.compute_logits(hidden)
        if self.rank != 0:
            return None
        return self.sampler(logits, sampling).tolist()

    def capture_cudagraph(self):
        """Capture one decode graph per size in Parts.graph_batch_sizes(max_num_seqs) (engine/cuda_graph.py)."""
        cfg = self.config
        max_blocks = (cfg.max_model_len + self.block_size - 1) // self.block_size
        try:
            self.graph_runner = CUDAGraphRunner(self.model, self.parts.graph_batch_sizes(cfg.max_num_seqs), max_blocks,
                                                cfg.hf_config.hidden_size, self.dtype, self.device)
        except Exception as exc:
            mine = self.parts.replaced()
            raise RuntimeError(f"CUDA graph capture of the decode step failed ({type(exc).__name__}: {exc})"
                               + (f"; a part may not be capture-safe (no host syncs, no boolean-mask indexing): "
                                  f"Parts fields replaced: {mine}" if mine else "")
                               + "; enforce_eager=True runs without CUDA graphs") from exc
