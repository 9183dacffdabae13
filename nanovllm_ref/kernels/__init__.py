"""Triton kernels (chapter 06).

On a machine without CUDA, Triton kernels can still run under the Triton interpreter, which must be switched
on before any `@triton.jit` function is defined. We do that here, before the kernel modules are imported, so
`import nanovllm_ref.kernels.store_kvcache` works on a CPU laptop (slowly, for tests and teaching).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
