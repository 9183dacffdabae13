"""Triton kernels: attention and the KV store (chapter 06); the decode step's fused kernels (chapter 10:
rms_norm.py, qk_norm_rope_store.py, small_gemm.py, numerics.py, and the opt-in persistent batch-1 step
persistent_decode.py; chosen by utils/fusion.FusedKernels) and the sampler's row draw (sampler.py).

On a machine without CUDA, Triton kernels run only under the Triton interpreter, and Triton decides that
when a kernel is *defined* (`@triton.jit` reads the TRITON_INTERPRET setting then). Importing nanovllm_ref
changes no environment variable, so choose it yourself, before anything imports these modules:

    TRITON_INTERPRET=1 python my_script.py          # from the shell, or, as the first lines of a notebook:
    import os; os.environ["TRITON_INTERPRET"] = "1"

`interpreted()` tells which way this process's kernels were defined; the engine refuses
attention_backend="triton" on a CPU when they cannot run (nanovllm_ref.attn.resolve_backend).
"""
import os
import sys


def interpreted() -> bool:
    """True when this process's Triton kernels run in the interpreter: TRITON_INTERPRET=1 now, and the
    kernel modules (if already imported) were defined under it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    for name in ("nanovllm_ref.kernels.attention", "nanovllm_ref.kernels.store_kvcache",
                 "nanovllm_ref.kernels.numerics", "nanovllm_ref.kernels.rms_norm",
                 "nanovllm_ref.kernels.qk_norm_rope_store", "nanovllm_ref.kernels.small_gemm",
                 "nanovllm_ref.kernels.sampler", "nanovllm_ref.kernels.persistent_decode"):
        module = sys.modules.get(name)
        if module is not None and not getattr(module, "DEFINED_INTERPRETED", False):
            return False
    return True
