"""Kernel fusion of the small element-wise steps with torch.compile (chapter 10).

A decode step of a 0.6B model is ~60 tiny kernels per layer when RMSNorm, RoPE and SiLU-and-mul run as
separate PyTorch ops: each kernel costs a few microseconds even inside a CUDA graph, so at batch 1 the step
is launch-bound (~4 ms measured on an H200 for 28 layers) while the weights need ~0.3 ms to read. Compiling
each of those pure functions with torch.compile (Inductor) turns each into one generated Triton kernel.

Only the small functions are compiled, not the whole model: compile time stays a few seconds, the model
code stays plain PyTorch, and the attention back-ends are untouched.

The switch belongs to the engine, not to the process: `@fused` leaves the function as it is and only gives
it a `.compiled()` method; an engine on CUDA builds its model with the compiled versions of the reference
functions (nanovllm_ref.Parts.model_ops, the one place that tells a reference part from yours), an engine on a
CPU with the functions themselves. So a CPU engine and a GPU engine in one process do not change each other.

Hand-written Triton kernels for the decode step (issue 21; `nanovllm_ref/kernels/`)
Compiling each small function still leaves ~17 kernels a layer in a batch-1 decode step (round 2's
profile): Inductor fuses inside one function, not across a GEMM. Three kernels written by hand cut a
layer to 9 (8 when attention runs one KV split): residual add + RMSNorm that also sums the previous GEMM's
split-K partials (kernels/rms_norm.py), q/k-norm + RoPE + KV store (kernels/qk_norm_rope_store.py), and a
small-M GEMM in three forms: full K, split-K partials, and with SiLU-and-mul in its epilogue
(kernels/small_gemm.py). `FusedKernels` names which of them a model uses; the engine decides it once
(nanovllm_ref.Parts.resolve, by this table) and each layer picks its kernel when it is built (models/qwen3.py):

| FusedKernels field   | replaces (GEMMs: steps of <= max_m rows; q/k: any step) | allowed when (Parts)                  |
| rms_norm             | the plain RMSNorm of layer 0's input (every step)       | rms_norm is the reference             |
| add_rms_norm         | every residual add + RMSNorm (every step)               | add_rms_norm is the reference         |
| qk_norm_rope_store   | q/k RMSNorm, RoPE and the KV store                      | rotary and store_kvcache (and rms_norm |
|                      |                                                         | with q/k norm) are the reference      |
| gemm                 | F.linear of qkv, o, gate_up and down projections        | always                                |
| gemm_silu            | gate_up GEMM + SiLU-and-mul (one kernel); above max_m   | gemm, silu_and_mul is the reference   |
|                      | rows and in prefill, kernels/silu_mul.py after cuBLAS   |                                       |
| split_k              | o_proj / down write fp32 partials that add_rms_norm sums| gemm and add_rms_norm                 |

On CUDA the engine turns on every kernel the parts allow (decode_kernels="auto"); a model built on a CPU
uses none unless it is handed a `FusedKernels` (tests do, under the Triton interpreter). The GEMM kernels
serve 1..max_m rows (larger batches and most prefills run cuBLAS, and then no split-K partials flow); the
norm kernels serve every step; the q/k kernel serves decode steps once the KV cache exists (it writes into it)
and prefill steps without its store (kernels/qk_norm_rope_store.qk_norm_rope: q and k back, the layer stores).
"""
import dataclasses
import functools
from dataclasses import dataclass

import torch


def fused(fn):
    """Decorator: give `fn` a `.compiled()` method that returns `fn` compiled by torch.compile (made once,
    with dynamic shapes and fullgraph=True), and `.eager` (= fn). Calling `fn` itself stays eager."""
    @functools.lru_cache(maxsize=None)
    def compiled():
        return torch.compile(fn, dynamic=True, fullgraph=True)

    fn.compiled = compiled
    fn.eager = fn
    return fn


MAX_M = 512      # kernels/small_gemm.MAX_M (not imported here: importing a kernel module fixes interpreter or compiler)


@dataclass(frozen=True)
class FusedKernels:
    """Which of the decode-step Triton kernels a model uses (table in this module's docstring); all off by
    default. max_m: the largest decode batch they serve (1..512, default 64: above that cuBLAS's GEMMs
    made whole layers faster on the H200, kernels/small_gemm.py; larger batches use cuBLAS). pdl: launch
    them with programmatic dependent launch (Hopper; kernels/numerics.py). persistent: a decode step of one
    sequence runs as one persistent kernel (kernels/persistent_decode.py) in place of every layer's kernels;
    it needs every kernel field on, and the engine's plan leaves it off (slower on the H200). Raises TypeError or ValueError
    for a field of the wrong type or a combination that cannot run (split_k without add_rms_norm: nothing
    would sum the partials)."""
    rms_norm: bool = False
    add_rms_norm: bool = False
    qk_norm_rope_store: bool = False
    gemm: bool = False
    gemm_silu: bool = False
    split_k: bool = False
    max_m: int = 64
    pdl: bool = False
    persistent: bool = False

    KERNEL_FIELDS = ("rms_norm", "add_rms_norm", "qk_norm_rope_store", "gemm", "gemm_silu", "split_k")

    def __post_init__(self):
        for name in self.KERNEL_FIELDS + ("pdl", "persistent"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FusedKernels.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.max_m, bool) or not isinstance(self.max_m, int) or not 1 <= self.max_m <= MAX_M:
            raise ValueError(f"FusedKernels.max_m must be an int in [1, {MAX_M}], got {self.max_m!r}")
        if self.gemm_silu and not self.gemm:
            raise ValueError("FusedKernels.gemm_silu needs gemm=True (it is the gate_up GEMM's epilogue)")
        if self.split_k and not (self.gemm and self.add_rms_norm):
            raise ValueError("FusedKernels.split_k needs gemm=True and add_rms_norm=True (the add + RMSNorm "
                             "kernel is what sums the split-K partials)")
        if self.persistent and not all(getattr(self, name) for name in self.KERNEL_FIELDS):
            raise ValueError("FusedKernels.persistent needs every kernel field on (the persistent step does the "
                             "work of all of them, so no part they stand in for may be replaced); got "
                             f"{', '.join(self.enabled()) or 'none'}")

    @classmethod
    def all(cls, **overrides) -> "FusedKernels":
        """Every kernel on (then `overrides`, e.g. pdl=True or max_m=16)."""
        return cls(**{**{name: True for name in cls.KERNEL_FIELDS}, **overrides})

    def any(self) -> bool:
        """True when at least one kernel is on (pdl and max_m alone change nothing)."""
        return any(getattr(self, name) for name in self.KERNEL_FIELDS)

    def enabled(self) -> list[str]:
        """Names of the kernels that are on, in field order."""
        return [name for name in self.KERNEL_FIELDS if getattr(self, name)]

    def large_batch(self) -> "FusedKernels":
        """The kernels of a decode step of more than max_m tokens: the element-wise ones only (add+RMSNorm,
        q/k-norm+RoPE+KV store), the GEMMs cuBLAS's (so no split-K partials, no SiLU epilogue)."""
        return dataclasses.replace(self, gemm=False, gemm_silu=False, split_k=False, persistent=False)

    def restricted_to(self, allowed: "FusedKernels") -> "FusedKernels":
        """The kernels on in both self and `allowed` (split_k and gemm_silu dropped with what they need)."""
        on = {name: getattr(self, name) and getattr(allowed, name) for name in self.KERNEL_FIELDS}
        on["gemm_silu"] = on["gemm_silu"] and on["gemm"]
        on["split_k"] = on["split_k"] and on["gemm"] and on["add_rms_norm"]
        return dataclasses.replace(self, **on, persistent=self.persistent and all(on.values()))
