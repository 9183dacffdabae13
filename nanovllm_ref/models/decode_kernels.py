"""Which hand-written Triton kernels a model's decode step runs (chapter 10; issue 21).

A model is built with a `utils.fusion.FusedKernels` record (`Qwen3ForCausalLM(..., kernels=...)`), or
with None, and `resolve` turns that into the record the model keeps:
- None: every kernel the parts allow when `fuse` is on and the model is being built on a CUDA device with
  Triton (the engine builds its GPU models with fuse=True), launched with PDL on Hopper, else none: a CPU
  engine keeps its oneDNN matmuls and its `cpu` attention back-end;
- a record: kept as it is, after checking that each kernel it turns on stands in only for reference parts
  (`kernels_allowed`); otherwise ValueError names the kernel and the part, since a part must run as written.
The rules are the table of utils/fusion.py. The KV stores the engine picks itself (the Triton one, the
torch one, the cpu back-end's) count as reference: they all write what the fused kernel writes.

The kernel modules are imported only when a kernel first runs (`qk_norm_rope_store` below, and
layers/linear.py, layers/layernorm.py): defining a Triton kernel fixes interpreter or compiler for the
process (kernels/__init__.py), so importing the model must not define them.
"""
import torch

from nanovllm_ref.layers.activation import silu_and_mul
from nanovllm_ref.layers.layernorm import add_rms_norm, rms_norm
from nanovllm_ref.layers.rotary_embedding import apply_rope
from nanovllm_ref.utils.fusion import FusedKernels

# Parts fields a kernel stands in for -> their reference functions.
_REFERENCES = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotary": apply_rope,
               "silu_and_mul": silu_and_mul}


def _is_reference(parts, name: str) -> bool:
    """A field `parts` lacks (or parts None) means the reference, as models/qwen3.ModelOps reads it."""
    return getattr(parts, name, _REFERENCES[name]) is _REFERENCES[name]


def _engine_stores():
    """The KV stores the engine itself picks (they all write the same thing as the fused kernel)."""
    from nanovllm_ref.attn import cpu_backend, torch_backend
    stores = [None, torch_backend.store_kvcache, cpu_backend.store_kvcache]
    try:
        from nanovllm_ref.kernels.store_kvcache import store_kvcache
        stores.append(store_kvcache)
    except ImportError:                 # no triton: then no Triton kernels either
        pass
    return stores


def _store_is_the_engines(parts) -> bool:
    return any(getattr(parts, "store_kvcache", None) is s for s in _engine_stores())


def kernels_allowed(parts, qk_norm: bool) -> FusedKernels:
    """Every decode kernel that `parts` (a nanovllm_ref.Parts, or None = the reference parts) leave room for:
    a kernel may stand in only for reference parts. qk_norm: the model normalises q and k (Qwen3), so the
    q/k kernel also stands in for rms_norm."""
    def ref(name):
        return _is_reference(parts, name)
    qk = ref("rotary") and _store_is_the_engines(parts) and (ref("rms_norm") or not qk_norm)
    return FusedKernels(rms_norm=ref("rms_norm"), add_rms_norm=ref("add_rms_norm"), qk_norm_rope_store=qk,
                        gemm=True, gemm_silu=ref("silu_and_mul"), split_k=ref("add_rms_norm"))


def _triton_device() -> bool:
    """The model is being built on a CUDA device (`with torch.device(...)`) where Triton can compile."""
    if torch.empty(0).device.type != "cuda":
        return False
    from nanovllm_ref.attn import triton_available
    return triton_available()


def resolve(parts, fuse: bool, kernels: FusedKernels | None, qk_norm: bool) -> FusedKernels:
    """The FusedKernels a model built with (parts, fuse, kernels) uses (module docstring). Raises TypeError
    for a `kernels` that is not a FusedKernels, ValueError for a kernel the parts do not allow."""
    allowed = kernels_allowed(parts, qk_norm)
    if kernels is None:
        if not (fuse and _triton_device()):
            return FusedKernels()
        # Programmatic dependent launch on Hopper: each kernel's launch overlaps the previous one's tail;
        # measured on the H200 it takes a decode layer at batch 1 from 44.9 to 41.0 us, at 16 from 54 to 46.
        from nanovllm_ref.kernels.numerics import pdl_available
        return FusedKernels.all(pdl=pdl_available(torch.empty(0).device)).restricted_to(allowed)
    if not isinstance(kernels, FusedKernels):
        raise TypeError(f"kernels must be a FusedKernels or None, got {type(kernels).__name__}")
    for name in kernels.enabled():
        if not getattr(allowed, name):
            replaced = [n for n in _REFERENCES if not _is_reference(parts, n)]
            if not _store_is_the_engines(parts):
                replaced.append("store_kvcache")
            raise ValueError(f"FusedKernels.{name} stands in for a reference part that Parts replaced "
                             f"({', '.join(replaced)}); a part runs as written, so turn it off")
    return kernels


def qk_norm_rope_store(*args, **kwargs):
    """kernels/qk_norm_rope_store.qk_norm_rope_store, imported at its first call (module docstring)."""
    from nanovllm_ref.kernels.qk_norm_rope_store import qk_norm_rope_store
    return qk_norm_rope_store(*args, **kwargs)
