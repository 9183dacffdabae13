"""The engine's swappable parts: one place that names every piece a course exercise can replace.

    from nanovllm_ref import LLM, Parts
    llm = LLM(path, parts=Parts(rms_norm=my_rms_norm, sampler=my_sample))

Each field holds the reference part by default. `LLMEngine` hands the parts to the Scheduler (block manager
class) and to every ModelRunner (the model is built with them; tensor-parallel workers receive them
pickled, so a part must be importable: a module-level function or class, not one defined in a notebook
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
- prepare_prefill / prepare_decode(seqs, block_size, device) -> engine.inputs.StepInputs       (ch04)
- attention_backend: an attn.AttentionBackend (e.g. attn.FunctionBackend), or None for the engine's choice
  by its `attention_backend` argument (which must then stay "auto" when this is set)         (ch04, ch06)
- store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None, or None for the engine's choice (ch04, ch06)
- block_manager: a class like engine.block_manager.BlockManager(num_blocks, block_size, enable_prefix_caching) (ch05);
  without a `fork` method the samples of an n > 1 request queue as requests of their own
- scheduler: a class like engine.scheduler.Scheduler(config, block_manager_cls)              (ch07);
  with a postprocess of its own, requests using n, stop, stop_token_ids or min_tokens are refused
- sampler(logits [B, V], layers.sampler.SamplingMetadata) -> [B] int64                        (ch08)
- graph_batch_sizes(max_num_seqs) -> sorted list of batch sizes to capture as CUDA graphs     (ch10)

On a GPU the engine compiles the reference element-wise ops and sampler (utils/fusion.py); a part you pass
runs exactly as written.
"""
import dataclasses
import pickle
from dataclasses import dataclass
from typing import Callable

from nanovllm_ref.engine import inputs
from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.engine.cuda_graph import graph_batch_sizes
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.layers.activation import silu_and_mul
from nanovllm_ref.layers.layernorm import add_rms_norm, rms_norm
from nanovllm_ref.layers.linear import load_gate_up_shard, load_qkv_shard
from nanovllm_ref.layers.rotary_embedding import apply_rope, rope_cos_sin
from nanovllm_ref.layers.sampler import sample


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

    def replaced(self) -> list[str]:
        """Names of the fields that differ from the reference parts, in field order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not getattr(REFERENCE, f.name)]

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


REFERENCE = Parts()
