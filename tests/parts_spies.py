"""Parts that record that they ran, then do what the reference does (for tests/test_parts.py).

They live in an importable module, like a student's exported parts, so they also pickle into
tensor-parallel workers. CALLS counts calls per Parts field in this process.
"""
from collections import Counter

from nanovllm_ref.attn import torch_backend
from nanovllm_ref.engine import inputs
from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.engine.cuda_graph import graph_batch_sizes
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.layers import activation, layernorm, linear, rotary_embedding, sampler

CALLS: Counter = Counter()


def rms_norm(*a):
    CALLS["rms_norm"] += 1
    return layernorm.rms_norm(*a)


def add_rms_norm(*a):
    CALLS["add_rms_norm"] += 1
    return layernorm.add_rms_norm(*a)


def rope_cos_sin(*a):
    CALLS["rope_cos_sin"] += 1
    return rotary_embedding.rope_cos_sin(*a)


def rotary(*a):
    CALLS["rotary"] += 1
    return rotary_embedding.apply_rope(*a)


def silu_and_mul(*a):
    CALLS["silu_and_mul"] += 1
    return activation.silu_and_mul(*a)


def qkv_weight_loader(*a):
    CALLS["qkv_weight_loader"] += 1
    return linear.load_qkv_shard(*a)


def gate_up_weight_loader(*a):
    CALLS["gate_up_weight_loader"] += 1
    return linear.load_gate_up_shard(*a)


def prepare_prefill(*a):
    CALLS["prepare_prefill"] += 1
    return inputs.prepare_prefill(*a)


def prepare_decode(*a):
    CALLS["prepare_decode"] += 1
    return inputs.prepare_decode(*a)


def _engine_backend(t):
    """What the engine itself uses: the Triton back-end on CUDA (capture-safe), the torch one on CPU."""
    if t.is_cuda:
        from nanovllm_ref.attn import triton_backend
        return triton_backend
    return torch_backend


def paged_decode(q, *a):
    CALLS["attention_backend"] += 1
    return _engine_backend(q).paged_decode(q, *a)


def store_kvcache(key, *a):
    CALLS["store_kvcache"] += 1
    if key.is_cuda:
        from nanovllm_ref.kernels.store_kvcache import store_kvcache as triton_store
        return triton_store(key, *a)
    return torch_backend.store_kvcache(key, *a)


class SpyBlockManager(BlockManager):
    def allocate(self, seq):
        CALLS["block_manager"] += 1
        return super().allocate(seq)


class SpyScheduler(Scheduler):
    def schedule(self):
        CALLS["scheduler"] += 1
        return super().schedule()


def sample(*a):
    CALLS["sampler"] += 1
    return sampler.sample(*a)


def graph_sizes(max_num_seqs):
    CALLS["graph_batch_sizes"] += 1
    return graph_batch_sizes(max_num_seqs)


def rms_norm_breaks_on_7_tokens(x, weight, eps):
    """Raises inside the forward (inside the attention-metadata block) on a 7-token prefill only, so the
    engine's start-up (warm-up prefill, CUDA-graph capture at batch sizes 1, 2, 4, 8, 16) runs through."""
    if x.shape[0] == 7:
        raise RuntimeError("rms_norm broke")
    return layernorm.rms_norm(x, weight, eps)
