"""The engine's swappable parts, and what runs: the one place that names every piece a course exercise can
replace and decides, once, what the engine runs in its place.

    from nanovllm_ref import LLM, Parts
    llm = LLM(path, parts=Parts(rms_norm=my_rms_norm, sampler=my_sample))

Each field holds the reference part by default. `LLMEngine` hands the parts to the Scheduler (block manager
class), to its step builder (engine/step_batch.py: the input preparation) and to every ModelRunner, which
resolves them into an `EnginePlan` (tensor-parallel workers receive the parts pickled and resolve them
the same way, so a part must be importable: a module-level function or class, not one defined in a notebook
cell or a lambda). Nothing is monkeypatched and nothing is registered globally: two engines with different
parts live side by side in one process.

Field → signature (shapes as in the chapters; T tokens, H/Hkv heads, d head size):
- rms_norm(x [T, D], weight [D], eps) -> [T, D] in x's dtype                                (ch01, E1.1)
- add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)            (ch01, E1.2)
- rope_cos_sin(head_dim, max_position, base) -> (cos, sin), each [max_position, d/2] fp32     (ch02, E2.1)
- rotary(positions [T] int64, q [T, H, d], k [T, Hkv, d], cos, sin) -> (q, k)                 (ch02, E2.2)
- silu_and_mul(x [T, 2I]) -> [T, I]                                                           (ch03)
- qkv_weight_loader(layer, param, loaded_weight, shard_id "q"|"k"|"v") -> None                (ch03 E3.3, ch09)
- gate_up_weight_loader(layer, param, loaded_weight, shard_id 0|1) -> None                    (ch03 E3.3, ch09)
- prepare_prefill / prepare_decode(seqs, block_size, device) -> engine.inputs.StepInputs       (ch04); the
  engine calls them on the host (device "cpu", on the scheduler's side of the step) and the model runner
  copies what they return to the GPU
- attention_backend: an attn.AttentionBackend (e.g. attn.FunctionBackend), or None for the engine's choice
  by its `attention_backend` argument (which must then stay "auto" when this is set)         (ch04, ch06)
- store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None, or None for the engine's choice (ch04, ch06)
- block_manager: a class like engine.block_manager.BlockManager(num_blocks, block_size, enable_prefix_caching) (ch05);
  without a `fork` method the samples of an n > 1 request queue as requests of their own
- scheduler: a class like engine.scheduler.Scheduler(config, block_manager_cls)              (ch07);
  with a postprocess of its own, requests using n, stop, stop_token_ids or min_tokens are refused
- sampler(logits [B, V], layers.sampler.SamplingMetadata) -> [B] int64                        (ch08)
- graph_batch_sizes(max_num_seqs) -> sorted list of batch sizes to capture as CUDA graphs     (ch10)

What runs (`Parts.resolve`, called once by each ModelRunner when it is built). `is_reference(field)` answers
"is this the reference part?"; nothing else in the engine compares functions (tests/test_parts.py holds that
line). From it and the engine's settings follow, in one frozen `EnginePlan`, which the engine logs at start-up
(logger "nanovllm_ref", level INFO):
| choice                | the reference part                                        | a part of yours      |
|-----------------------|-----------------------------------------------------------|----------------------|
| attention, KV store   | attention_backend by name (attn.resolve_backend); the     | runs as written      |
|                       | Triton store on CUDA, the back-end's own store elsewhere  |                      |
| element-wise ops      | compiled by torch.compile on CUDA (utils/fusion.py)        | runs as written      |
| decode kernels        | the Triton kernels of utils/fusion.FusedKernels stand in  | no kernel stands in  |
|                       | for it on CUDA (decode_kernels="auto")                    | for it               |
| sampler               | its row draw is a Triton kernel on CUDA (kernels/sampler.py)| runs as written,   |
|                       | and runs inside the decode CUDA graph (one process)       | after the graph      |
| scheduler             | async scheduling on CUDA (one process)                    | synchronous steps    |
| graph_batch_sizes     | decode graphs of these sizes (CUDA, enforce_eager False)  | the same             |
"""
import dataclasses
import functools
import logging
import pickle
from dataclasses import dataclass
from typing import Callable

import torch

from nanovllm_ref.engine import inputs
from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.engine.cuda_graph import graph_batch_sizes
from nanovllm_ref.engine.prefill_graph import MAX_SEQS as PREFILL_GRAPH_SEQS, prefill_graph_sizes
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.layers.activation import silu_and_mul
from nanovllm_ref.layers.layernorm import add_rms_norm, rms_norm
from nanovllm_ref.layers.linear import load_gate_up_shard, load_qkv_shard
from nanovllm_ref.layers.rotary_embedding import apply_rope, rope_cos_sin
from nanovllm_ref.layers.sampler import sample
from nanovllm_ref.models.ops import ModelOps
from nanovllm_ref.utils.fusion import FusedKernels

logger = logging.getLogger("nanovllm_ref")

# The fields a model's layers call (ModelOps has the same names).
MODEL_FIELDS = ("rms_norm", "add_rms_norm", "rope_cos_sin", "rotary", "silu_and_mul", "qkv_weight_loader",
                "gate_up_weight_loader")


@dataclass(frozen=True)
class Parts:
    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    rope_cos_sin: Callable = rope_cos_sin
    rotary: Callable = apply_rope
    silu_and_mul: Callable = silu_and_mul
    qkv_weight_loader: Callable = load_qkv_shard
    gate_up_weight_loader: Callable = load_gate_up_shard
    prepare_prefill: Callable = inputs.prepare_prefill
    prepare_decode: Callable = inputs.prepare_decode
    attention_backend: object = None
    store_kvcache: Callable | None = None
    block_manager: type = BlockManager
    scheduler: type = Scheduler
    sampler: Callable = sample
    graph_batch_sizes: Callable = graph_batch_sizes

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("attention_backend", "store_kvcache"):
                continue
            if f.name == "attention_backend":
                from nanovllm_ref.attn import AttentionBackend
                if not isinstance(value, AttentionBackend):
                    raise TypeError("Parts.attention_backend must have varlen_prefill, paged_prefill and "
                                    f"paged_decode (e.g. nanovllm_ref.attn.FunctionBackend), got {type(value).__name__}")
            elif f.name in ("block_manager", "scheduler"):
                if not isinstance(value, type):
                    raise TypeError(f"Parts.{f.name} must be a class, got {type(value).__name__}")
            elif not callable(value):
                raise TypeError(f"Parts.{f.name} must be callable, got {type(value).__name__}")

    # -- the identity question, asked here only ------------------------------------------------------------
    def is_reference(self, field: str) -> bool:
        """Whether Parts.<field> is the reference part. store_kvcache counts as the reference when it is one of
        the stores the engine picks itself (the torch, cpu and Triton ones write what the fused kernels write).
        Raises ValueError for a name that is not a field."""
        if field not in _FIELD_NAMES:
            raise ValueError(f"{field!r} is not a Parts field; the fields are {list(_FIELD_NAMES)}")
        return is_reference_part(field, getattr(self, field))

    def replaced(self) -> list[str]:
        """Names of the fields that differ from the reference parts, in field order."""
        return [name for name in _FIELD_NAMES if not self.is_reference(name)]

    def check_picklable(self) -> None:
        """Raise TypeError naming the first part that cannot be pickled (needed for tensor_parallel_size > 1:
        each worker process receives the parts pickled)."""
        for f in dataclasses.fields(self):
            try:
                pickle.dumps(getattr(self, f.name))
            except Exception as exc:
                raise TypeError(f"Parts.{f.name} cannot be sent to tensor-parallel workers ({exc}); define it "
                                "at the top level of an importable module (not in a notebook cell or a lambda), "
                                "e.g. with the course's export command") from None

    # -- what the model runs ---------------------------------------------------------------------------------
    def kernels_allowed(self, qk_norm: bool) -> FusedKernels:
        """Every decode kernel these parts leave room for: a kernel may stand in only for reference parts
        (utils/fusion.py's table). qk_norm: the model normalises q and k (Qwen3), so the q/k kernel also stands
        in for rms_norm."""
        ref = self.is_reference
        qk = ref("rotary") and ref("store_kvcache") and (ref("rms_norm") or not qk_norm)
        return FusedKernels(rms_norm=ref("rms_norm"), add_rms_norm=ref("add_rms_norm"), qk_norm_rope_store=qk,
                            gemm=True, gemm_silu=ref("silu_and_mul"), split_k=ref("add_rms_norm"))

    def model_ops(self, fuse: bool = False, kernels: FusedKernels | None = None, qk_norm: bool = True,
                  attention_backend=None, store_kvcache=None) -> ModelOps:
        """The ModelOps a model is built with (models/ops.py): each reference op compiled when `fuse` (a part
        of yours as written); `kernels` (a FusedKernels) checked against `kernels_allowed` (ValueError names a
        kernel that would stand in for a part you replaced; TypeError for a kernels that is no FusedKernels),
        None = none; Qwen3's q/k norm + RoPE compiled into one kernel when fuse and both parts are the
        reference and kernels leaves the q/k kernel off (on, prefill runs that kernel); attention_backend /
        store_kvcache: what the layers attend with and store with (None: the torch back-end and store)."""
        if kernels is None:
            kernels = FusedKernels()
        if not isinstance(kernels, FusedKernels):
            raise TypeError(f"kernels must be a FusedKernels or None, got {type(kernels).__name__}")
        allowed = self.kernels_allowed(qk_norm)
        for name in kernels.enabled():
            if not getattr(allowed, name):
                mine = [f for f in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "store_kvcache")
                        if not self.is_reference(f)]
                raise ValueError(f"FusedKernels.{name} stands in for a reference part that Parts replaced "
                                 f"({', '.join(mine)}); a part runs as written, so turn it off")
        ops = {name: self._op(name, fuse) for name in MODEL_FIELDS}
        if self.is_reference("rope_cos_sin"):
            ops["rope_cos_sin"] = None                 # the reference: it also builds scaled RoPE tables
        # With the q/k kernel on, prefill runs it too (without its store): nothing to compile then.
        if fuse and qk_norm and self.is_reference("rms_norm") and self.is_reference("rotary") \
                and not kernels.qk_norm_rope_store:
            from nanovllm_ref.models.qwen3 import qk_norm_rope
            ops["qk_norm_rope"] = qk_norm_rope.compiled()
        return ModelOps(**ops, attention_backend=attention_backend, store_kvcache=store_kvcache, kernels=kernels)

    def _op(self, field: str, fuse: bool):
        """A model op as the engine calls it: the reference compiled when fusing, a part of yours as written."""
        value = getattr(self, field)
        if fuse and self.is_reference(field) and hasattr(value, "compiled"):
            return value.compiled()
        return value

    # -- everything at once ------------------------------------------------------------------------------------
    def resolve(self, config, device_type: str, dtype: torch.dtype, world_size: int = 1) -> "EnginePlan":
        """The EnginePlan of an engine with these parts and `config` (nanovllm_ref.config.Config) on
        `device_type` ("cuda" or "cpu") in `dtype`, with `world_size` tensor-parallel ranks (module
        docstring). Raises ValueError for a setting the parts rule out: attention_backend other than "auto"
        with Parts.attention_backend, async_scheduling=True with a replaced scheduler; and what
        attn.resolve_backend raises."""
        cuda = device_type == "cuda"
        name, backend, store = self._attention(config, device_type, dtype)
        fuse = fuse_by_default(device_type)
        triton = cuda and _triton_importable()
        qk_norm = _qk_norm(config.hf_config)
        kernels = FusedKernels()
        persistent = config.decode_kernels == "persistent"
        if persistent and not (fuse and triton and world_size == 1):
            raise ValueError("decode_kernels='persistent' needs CUDA with Triton and tensor_parallel_size 1 (the "
                             "persistent decode step is one Triton kernel over the whole model)")
        if persistent and name != "triton":
            asked = "Parts.attention_backend" if name == "parts" else f"attention_backend={config.attention_backend!r}"
            raise ValueError(f"decode_kernels='persistent' attends with its own Triton kernel, so it needs the triton "
                             f"back-end (attention_backend 'triton' or 'auto', no Parts.attention_backend), not {asked}")
        hf = config.hf_config
        if persistent and (getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False)):
            raise ValueError("decode_kernels='persistent' needs a model without attention_bias or mlp_bias (the "
                             "persistent step has no linear biases)")
        if config.decode_kernels in ("auto", "persistent") and fuse and triton:
            from nanovllm_ref.kernels.numerics import pdl_available
            pdl = pdl_available(torch.device("cuda", torch.cuda.current_device()))
            # FusedKernels.persistent only when asked ("persistent"): on the H200 it is level with these kernels
            # (batch-1 +4 % in the engine, a step 0-5 % slower alone), and its grid barriers need all of its
            # programs resident at once, which a GPU shared with other work does not promise
            # (kernels/persistent_decode.py).
            kernels = FusedKernels.all(pdl=pdl, persistent=persistent).restricted_to(self.kernels_allowed(qk_norm))
            if persistent and not kernels.persistent:
                mine = [f for f in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "store_kvcache")
                        if not self.is_reference(f)]
                raise ValueError(f"decode_kernels='persistent' needs every decode kernel, and replaced parts "
                                 f"({', '.join(mine)}) rule some out: the persistent step does what those parts do")
        if name == "triton" and kernels.pdl:
            # The decode attention's two kernels launched like the decode kernels around them (PDL, Hopper).
            from nanovllm_ref.attn import FunctionBackend
            backend = FunctionBackend(backend.varlen_prefill, backend.paged_prefill, backend.paged_decode_pdl)
        ops = self.model_ops(fuse, kernels, qk_norm, attention_backend=backend, store_kvcache=store)
        use_graphs = cuda and not config.enforce_eager
        sampler, rows, rows_name = self.sampler, None, "as written"
        if self.is_reference("sampler"):
            from nanovllm_ref.layers import sampler as sampling
            if triton and fuse:
                from nanovllm_ref.kernels.sampler import sample_rows as kernel_rows
                rows, rows_name = kernel_rows, "Triton kernel (kernels/sampler.py)"
            elif fuse:
                rows, rows_name = sampling.sample_rows.compiled(), "compiled (torch.compile)"
            else:
                rows, rows_name = sampling.sample_rows, "eager"
            sampler = sampling.sampler_with(rows)
        in_graph = use_graphs and self.is_reference("sampler") and world_size == 1
        possible = world_size == 1 and self.is_reference("scheduler")
        if config.async_scheduling is None:
            async_ = possible and cuda
        elif config.async_scheduling and not possible:
            raise ValueError("async_scheduling=True needs the reference scheduler (Parts.scheduler) and "
                             "tensor_parallel_size=1; leave it None or False")
        else:
            async_ = bool(config.async_scheduling)
        sizes = tuple(self.graph_batch_sizes(config.max_num_seqs)) if use_graphs else ()
        if persistent and sizes and 1 not in sizes:
            raise ValueError(f"decode_kernels='persistent' runs in the batch-1 decode graph, and "
                             f"Parts.graph_batch_sizes gives {sizes} (no 1: a batch of one is padded, the step never runs)")
        prefill_sizes, prefill_off = self._prefill_graphs(config, use_graphs, name, world_size)
        return EnginePlan(device_type=device_type, dtype=dtype, world_size=world_size, attention=name,
                          backend=backend, store_kvcache=store, fuse=fuse, ops=ops,
                          prepare_prefill=self.prepare_prefill, prepare_decode=self.prepare_decode,
                          sampler=sampler, sample_rows_name=rows_name,
                          graph_sample_rows=rows if in_graph else None, use_graphs=use_graphs,
                          graph_batch_sizes=sizes, prefill_graph_sizes=prefill_sizes, prefill_graphs_off=prefill_off,
                          async_scheduling=async_, replaced=tuple(self.replaced()))

    @staticmethod
    def _prefill_graphs(config, use_graphs: bool, attention: str, world_size: int) -> tuple[tuple, str]:
        """(token counts to capture prefill graphs for, why there are none: "" when there are some). They need
        decode graphs' conditions (CUDA, not enforce_eager), one process (the workers run eager prefill
        messages), and the engine's Triton back-end, whose prefill kernel has no host sync and takes padded
        sequences (engine/prefill_graph.py)."""
        if not use_graphs:
            return (), "no CUDA graphs"
        if config.max_prefill_graph_tokens == 0:
            return (), "max_prefill_graph_tokens=0"
        if world_size > 1:
            return (), "tensor parallel"
        if attention != "triton":
            return (), f"the {attention} attention back-end (they need the engine's triton one)"
        return prefill_graph_sizes(config.max_prefill_graph_tokens, config.max_num_batched_tokens), ""

    def _attention(self, config, device_type: str, dtype: torch.dtype):
        """(back-end name, back-end, KV store): the parts' own, or the engine's choice (config.attention_backend;
        the Triton store on CUDA or with the triton back-end, else the back-end module's own store_kvcache if it
        has one, else the torch one)."""
        from nanovllm_ref.attn import get_backend, resolve_backend
        from nanovllm_ref.attn.torch_backend import store_kvcache as torch_store
        if self.attention_backend is not None:
            if config.attention_backend != "auto":
                raise ValueError(f"attention_backend={config.attention_backend!r} conflicts with "
                                 "Parts.attention_backend; leave attention_backend='auto' when parts bring one")
            name, backend = "parts", self.attention_backend
        else:
            asked = config.attention_backend
            if asked == "auto" and config.decode_kernels == "persistent" and device_type == "cuda":
                asked = "triton"                 # the persistent step attends with the triton back-end's algorithm
            name = resolve_backend(asked, device_type, config.kvcache_block_size, dtype=dtype)
            backend = get_backend(name)
        store = self.store_kvcache
        if store is None and (device_type == "cuda" or name == "triton"):
            from nanovllm_ref.kernels.store_kvcache import store_kvcache
            store = store_kvcache
        elif store is None and self.attention_backend is None:
            store = getattr(backend, "store_kvcache", None)      # the "cpu" back-end brings its own
        return name, backend, store or torch_store


REFERENCE = Parts()
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Parts))


def _engine_stores() -> tuple:
    """The KV stores the engine picks itself: they all write what the fused q/k-norm + RoPE + store kernel writes."""
    from nanovllm_ref.attn import cpu_backend, torch_backend
    stores = [None, torch_backend.store_kvcache, cpu_backend.store_kvcache]
    if _triton_importable():
        from nanovllm_ref.kernels.store_kvcache import store_kvcache
        stores.append(store_kvcache)
    return tuple(stores)


def is_reference_part(field: str, value) -> bool:
    """Whether `value` is the reference part for Parts.<field> (see Parts.is_reference)."""
    if field == "store_kvcache":
        return any(value is store for store in _engine_stores())
    return value is getattr(REFERENCE, field)


def uses_reference_postprocess(scheduler_cls) -> bool:
    """Whether a scheduler class keeps the reference Scheduler.postprocess (stops, forks, min_tokens live there)."""
    return getattr(scheduler_cls, "postprocess", None) is Scheduler.postprocess


def fuse_by_default(device_type: str) -> bool:
    """Whether an engine on this device compiles its small ops (utils/fusion.py): on CUDA only, where
    launches dominate; on a CPU compiling costs more start-up time than it saves."""
    return device_type == "cuda"


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    from nanovllm_ref.attn import triton_available
    return triton_available()


def _qk_norm(hf_config) -> bool:
    from nanovllm_ref.models import get_model_class
    return bool(getattr(get_model_class(hf_config), "QK_NORM", False))


def _name(fn) -> str:
    fn = getattr(fn, "func", fn)
    if getattr(fn, "_torchdynamo_orig_callable", None) is not None:          # a torch.compile wrapper
        return f"{getattr(fn._torchdynamo_orig_callable, '__name__', '?')} (compiled)"
    module, name = getattr(fn, "__module__", None) or "", getattr(fn, "__qualname__", type(fn).__name__)
    return f"{module}.{name}" if module else name


@dataclass(frozen=True)
class EnginePlan:
    """What one engine runs, decided once when it is built (Parts.resolve; the module docstring's table).

    device_type, dtype, world_size: where and in what it runs. attention: the back-end's name ("triton",
    "flash_attn", "cpu", "torch", or "parts" for Parts.attention_backend); backend: that back-end (a module or
    an attn.AttentionBackend; the triton one with its decode kernels launched by PDL when the decode kernels
    are); store_kvcache: the KV store the attention layers call. fuse: the reference
    element-wise ops and sampler are compiled. ops: what the model's layers call (models/ops.ModelOps, with
    its decode kernels `ops.kernels`). prepare_prefill / prepare_decode: the input preparation, run on the
    host by the engine's step builder. sampler: (logits, SamplingMetadata) -> ids, as the runner calls it
    after a forward; sample_rows_name: how the reference's row draw runs ("Triton kernel", "compiled",
    "eager", or "as written" for a sampler of yours). graph_sample_rows: the row draw that runs inside the
    decode CUDA graph (then the graph ends in sampled ids), or None (the graph stops at the hidden states: a
    sampler of yours, tensor parallelism, no graphs). use_graphs, graph_batch_sizes: decode CUDA graphs and
    their sizes. prefill_graph_sizes: the token counts of the prefill CUDA graphs (engine/prefill_graph.py), ()
    for none, and then prefill_graphs_off says why. async_scheduling: the engine schedules step n+1 while step n runs. replaced: the Parts
    fields that are not the reference."""
    device_type: str
    dtype: torch.dtype
    world_size: int
    attention: str
    backend: object
    store_kvcache: Callable
    fuse: bool
    ops: ModelOps
    prepare_prefill: Callable
    prepare_decode: Callable
    sampler: Callable
    sample_rows_name: str
    graph_sample_rows: Callable | None
    use_graphs: bool
    graph_batch_sizes: tuple
    async_scheduling: bool
    replaced: tuple
    prefill_graph_sizes: tuple = ()
    prefill_graphs_off: str = "not planned"

    def describe(self) -> str:
        """The plan as a few lines of text (what the engine logs at start-up)."""
        k = self.ops.kernels
        compiled = [n for n in MODEL_FIELDS[:5] if self.fuse and n not in self.replaced]
        sizes = self.graph_batch_sizes
        lines = [
            f"engine plan: {self.device_type}, {str(self.dtype).removeprefix('torch.')}, tensor parallel {self.world_size}",
            f"  attention: {self.attention}; KV store: {_name(self.store_kvcache)}",
            f"  element-wise ops: {'compiled: ' + ', '.join(compiled) if compiled else 'eager'}"
            + ("; q/k norm + RoPE compiled as one" if self.ops.qk_norm_rope is not None else ""),
            f"  decode kernels: {', '.join(k.enabled()) or 'none'}"
            + (f" (up to {k.max_m} rows for the GEMMs, PDL {'on' if k.pdl else 'off'})" if k.any() else "")
            + ("; q/k norm + RoPE of prefill steps: qk_norm_rope_store without its store" if k.qk_norm_rope_store else "")
            + ("; a batch of one: one persistent kernel (kernels/persistent_decode.py)" if k.persistent else ""),
            f"  sampler: {'reference' if 'sampler' not in self.replaced else 'Parts.sampler'}, row draw "
            f"{self.sample_rows_name}; {'inside the decode CUDA graph' if self.graph_sample_rows else 'after the forward'}",
            f"  CUDA graphs: {'sizes ' + _sizes(sizes) if self.use_graphs else 'off'}; async scheduling "
            f"{'on' if self.async_scheduling else 'off'}",
            "  prefill CUDA graphs: " + (f"token counts {_sizes(self.prefill_graph_sizes)}, up to {PREFILL_GRAPH_SEQS} "
                                         "sequences" if self.prefill_graph_sizes else f"off ({self.prefill_graphs_off})"),
            f"  replaced parts: {', '.join(self.replaced) or 'none'}",
        ]
        return "\n".join(lines)


def _sizes(sizes) -> str:
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]} ({len(sizes)} graphs)"
