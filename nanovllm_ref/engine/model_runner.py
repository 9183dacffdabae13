"""Runs the model for one scheduled batch: inputs in, next tokens out (chapters 04, 08, 09, 10).

One ModelRunner lives in each tensor-parallel process. Rank 0 runs in the engine's process and forwards
every call (method name + arguments) to the other ranks through a pipe; they execute the same call, so the
collectives inside the layers line up (upstream nano-vllm `engine/model_runner.py`).

Per step it
1. flattens the batch into the tensors the model and the attention layers need: input ids, positions,
   slot mapping, cu_seqlens, context lengths, block tables (`prepare_prefill` / `prepare_decode`);
2. runs the model, eagerly or by replaying a captured CUDA graph (decode only);
3. computes logits for each sequence's last token and samples.

At start-up it loads the weights, runs one warm-up prefill at the largest batch to measure peak activation
memory, sizes the KV cache from what is left, and captures the decode CUDA graphs.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm_ref.attn import get_backend, resolve_backend
from nanovllm_ref.config import Config
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.layers.sampler import Sampler
from nanovllm_ref.models import get_model_class
from nanovllm_ref.utils.context import get_context, reset_context, set_context
from nanovllm_ref.utils.loader import load_model
from nanovllm_ref.utils import fusion, onednn
from nanovllm_ref.utils.parallel import set_tp

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


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 16, and max_num_seqs itself, so any batch size up
    to max_num_seqs pads to a captured graph with at most 15 idle rows."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, conns=None, port: int | None = None):
        self.config = config
        self.rank, self.world_size = rank, config.tensor_parallel_size
        self.conns = conns or []              # rank 0: one pipe per worker; worker: [its pipe]
        self.block_size = config.kvcache_block_size
        hf = config.hf_config
        self.device_type = resolve_device(config.device)
        self.device = torch.device(f"cuda:{rank}" if self.device_type == "cuda" else "cpu")
        self.dtype = resolve_dtype(config.dtype, hf, self.device_type)
        self.backend_name = resolve_backend(config.attention_backend, self.device_type, self.block_size)
        self.enforce_eager = config.enforce_eager or self.device_type != "cuda"
        if self.device_type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            backend = "nccl" if self.device_type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=120))
        set_tp(rank, self.world_size)
        # Fuse RMSNorm / RoPE / SiLU-and-mul into one kernel each on GPU (see utils/fusion.py).
        fusion.enable(self.device_type == "cuda")
        torch.manual_seed(config.seed)

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        with torch.device(self.device):
            self.model = get_model_class(hf)(hf)
        torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            self._init_dummy_weights()
        else:
            load_model(self.model, config.model)
        self.model.eval()
        if self.device_type == "cpu":
            onednn.pack(self.model)           # oneDNN copies of the linear weights (utils/onednn.py)
        self.sampler = Sampler(compile=self.device_type == "cuda")
        self._setup_attention()
        self.warmup_model()
        self.allocate_kv_cache()
        self.graphs = {}
        if not self.enforce_eager:
            self.capture_cudagraph()
        if self.world_size > 1 and rank > 0:
            self.loop()

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

    def _setup_attention(self):
        backend = get_backend(self.backend_name)
        store = None
        if self.device_type == "cuda" or self.backend_name == "triton":
            from nanovllm_ref.kernels.store_kvcache import store_kvcache
            store = store_kvcache
        elif self.backend_name == "cpu":
            store = backend.store_kvcache
        for layer in self._attention_layers():
            layer.backend = backend
            if store is not None:
                layer.store = store

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
        layers = self._attention_layers()
        a = layers[0]
        return 2 * len(layers) * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self):
        """Size and allocate the cache [2, num_layers, num_blocks, block_size, Hkv, D]; point each layer at
        its slice. Raises ValueError if not even one block fits."""
        cfg, block_bytes = self.config, self.kv_block_bytes()
        if self.device_type == "cuda":
            free, total = torch.cuda.mem_get_info()
            stats = torch.cuda.memory_stats()
            used = total - free
            peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
            budget = int(total * cfg.gpu_memory_utilization) - used - peak + current
        else:
            budget = int(cfg.cpu_kvcache_space_gib * 2**30)
        fit = max(budget, 0) // block_bytes
        if cfg.num_kvcache_blocks > 0:
            if cfg.num_kvcache_blocks > fit:
                raise ValueError(f"num_kvcache_blocks={cfg.num_kvcache_blocks} needs "
                                 f"{cfg.num_kvcache_blocks * block_bytes / 2**20:.1f} MiB but only "
                                 f"{max(budget, 0) / 2**20:.1f} MiB is available for the KV cache")
            num_blocks = cfg.num_kvcache_blocks
        else:
            # More blocks than max_num_seqs full-length sequences can use is wasted memory.
            blocks_per_seq = (cfg.max_model_len + self.block_size - 1) // self.block_size
            num_blocks = min(fit, cfg.max_num_seqs * blocks_per_seq)
        if self.world_size > 1:              # every rank must agree, or block ids would differ
            t = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            num_blocks = int(t.item())
        if num_blocks < 1:
            raise ValueError(f"too little memory for one KV-cache block ({block_bytes / 2**20:.2f} MiB per "
                             f"block of {self.block_size} tokens, {max(budget, 0) / 2**20:.2f} MiB available); "
                             "raise gpu_memory_utilization / cpu_kvcache_space_gib or lower kvcache_block_size")
        cfg.num_kvcache_blocks = num_blocks
        layers = self._attention_layers()
        a = layers[0]
        self.kv_cache = torch.zeros(2, len(layers), num_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                                    dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

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
        """Leave the process group and give the GPU memory (graphs, KV cache, weights) back."""
        self.graphs, self.graph_vars, self.kv_cache = {}, None, None
        for layer in self._attention_layers():
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.model = None
        if self.device_type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # -- input preparation ------------------------------------------------------------------------------
    def _to_device(self, data, dtype):
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device_type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _block_tables(self, seqs):
        width = max(len(seq.block_table) for seq in seqs)
        return self._to_device([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs],
                               torch.int32)

    def prepare_prefill(self, seqs: list[Sequence]):
        """Tokens [num_cached_tokens, num_cached_tokens + num_scheduled_tokens) of each sequence."""
        input_ids, positions, slot_mapping = [], [], []
        cu_q, cu_k, max_q, max_k, has_prefix = [0], [0], 0, 0, False
        bs = self.block_size
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq[start:end])
            positions.extend(range(start, end))
            cu_q.append(cu_q[-1] + end - start)
            cu_k.append(cu_k[-1] + end)
            max_q, max_k = max(max_q, end - start), max(max_k, end)
            has_prefix |= start > 0
            if not seq.block_table:          # warm-up: no cache yet
                continue
            for i in range(start // bs, (end + bs - 1) // bs):
                lo, hi = max(start, i * bs), min(end, (i + 1) * bs)
                base = seq.block_table[i] * bs - i * bs
                slot_mapping.extend(range(base + lo, base + hi))
        set_context(True, self._to_device(cu_q, torch.int32), self._to_device(cu_k, torch.int32), max_q, max_k,
                    self._to_device(slot_mapping, torch.int32),
                    block_tables=self._block_tables(seqs) if has_prefix else None)
        return self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64)

    def prepare_decode(self, seqs: list[Sequence]):
        """The last token of each sequence, at position len - 1."""
        bs = self.block_size
        input_ids = [seq.last_token for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        context_lens = [len(seq) for seq in seqs]
        slot_mapping = [seq.block_table[(len(seq) - 1) // bs] * bs + (len(seq) - 1) % bs for seq in seqs]
        set_context(False, slot_mapping=self._to_device(slot_mapping, torch.int32),
                    context_lens=self._to_device(context_lens, torch.int32),
                    block_tables=self._block_tables(seqs))
        return self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64)

    def prepare_sample(self, seqs: list[Sequence]) -> torch.Tensor:
        return self._to_device([seq.temperature for seq in seqs], torch.float32)

    # -- running ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool) -> torch.Tensor:
        """Hidden states of the last token of each sequence: [num_seqs, hidden]."""
        ctx = get_context()
        if is_prefill:
            hidden = self.model(input_ids, positions)
            return hidden[ctx.cu_seqlens_q[1:] - 1]
        batch = input_ids.shape[0]
        graph_bs = next((b for b in self.graph_sizes if b >= batch), None) if self.graphs else None
        if graph_bs is None:
            return self.model(input_ids, positions)
        # Replay: copy this step's inputs into the captured buffers; idle rows write to no slot.
        g = self.graph_vars
        g["input_ids"][:batch] = input_ids
        g["positions"][:batch] = positions
        g["slot_mapping"].fill_(-1)
        g["slot_mapping"][:batch] = ctx.slot_mapping
        g["context_lens"].zero_()
        g["context_lens"][:batch] = ctx.context_lens
        g["block_tables"].fill_(-1)
        g["block_tables"][:batch, :ctx.block_tables.shape[1]] = ctx.block_tables
        self.graphs[graph_bs].replay()
        return g["outputs"][:batch]

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int] | None:
        """One step for `seqs`. Returns one sampled token id per sequence on rank 0, None elsewhere."""
        input_ids, positions = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        temperatures = self.prepare_sample(seqs) if self.rank == 0 else None
        hidden = self.run_model(input_ids, positions, is_prefill)
        logits = self.model.compute_logits(hidden)
        token_ids = None
        if self.rank == 0:
            if all(seq.temperature == 0 for seq in seqs):     # all greedy: skip drawing noise
                token_ids = logits.argmax(dim=-1).tolist()
            else:
                token_ids = self.sampler(logits, temperatures).tolist()
        reset_context()
        return token_ids

    @torch.inference_mode()
    def capture_cudagraph(self):
        """Capture one decode graph per batch size in graph_batch_sizes(max_num_seqs), sharing one pool."""
        cfg = self.config
        max_bs = cfg.max_num_seqs
        max_blocks = (cfg.max_model_len + self.block_size - 1) // self.block_size
        hidden = cfg.hf_config.hidden_size
        dev = self.device
        g = dict(input_ids=torch.zeros(max_bs, dtype=torch.int64, device=dev),
                 positions=torch.zeros(max_bs, dtype=torch.int64, device=dev),
                 slot_mapping=torch.full((max_bs,), -1, dtype=torch.int32, device=dev),
                 context_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
                 block_tables=torch.full((max_bs, max_blocks), -1, dtype=torch.int32, device=dev),
                 outputs=torch.zeros(max_bs, hidden, dtype=self.dtype, device=dev))
        self.graph_sizes = graph_batch_sizes(max_bs)
        pool = None
        for bs in reversed(self.graph_sizes):
            graph = torch.cuda.CUDAGraph()
            set_context(False, slot_mapping=g["slot_mapping"][:bs], context_lens=g["context_lens"][:bs],
                        block_tables=g["block_tables"][:bs])
            g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs])     # warm-up
            with torch.cuda.graph(graph, pool):
                g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs])
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
            reset_context()
        self.graph_vars = g
