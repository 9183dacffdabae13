"""Attention back-ends (chapters 04 and 06).

Every back-end implements the same three functions on the same paged KV-cache layout:

- `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer.
- `varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)`:
  causal attention over this step's tokens only (no cached prefix). q: [num_tokens, num_heads, head_dim],
  k/v: [num_tokens, num_kv_heads, head_dim]. Returns [num_tokens, num_heads, head_dim].
- `paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, scale)`: causal attention whose keys are read from the paged cache (a cached prefix or
  earlier chunks, plus this step's tokens, already stored). Query i of sequence b sits at absolute
  position `k_len_b - q_len_b + i` and sees keys 0..that position.
- `paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)`: one query per sequence.
  q: [num_seqs, num_heads, head_dim]; returns the same shape.

`get_backend(name)` returns a module with those functions: "torch" (the readable reference), "cpu" (the
same maths arranged for a CPU: gathers only real tokens, SDPA calls; `auto` on a CPU), "triton" (our kernels,
chapter 06) or "flash_attn" (whichever FlashAttention is installed: the flash-attn package, vLLM's
FA3 or flash-attn-4; attn/flash_backend.py). A back-end module may also export `store_kvcache`;
the model runner then uses it to write K/V. `AttentionBackend` is the interface as a typing.Protocol;
`FunctionBackend` bundles three functions into an object that pickles (a module does not), so a back-end of
your own can travel to tensor-parallel workers inside `nanovllm_ref.Parts`:

    from dataclasses import replace
    mine = replace(FunctionBackend.of("torch"), paged_decode=my_paged_decode)
    LLM(path, parts=Parts(attention_backend=mine))
"""
import importlib
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionBackend(Protocol):
    """The three functions every attention back-end provides (shapes in this module's docstring)."""

    def varlen_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                       scale: float) -> torch.Tensor: ...

    def paged_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, scale: float) -> torch.Tensor: ...

    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor: ...


@dataclass(frozen=True)
class FunctionBackend:
    """An AttentionBackend made of three module-level functions; picklable when they are."""
    varlen_prefill: Callable
    paged_prefill: Callable
    paged_decode: Callable

    @classmethod
    def of(cls, name: str) -> "FunctionBackend":
        """The functions of a built-in back-end ("torch", "triton", "flash_attn") as a FunctionBackend."""
        m = get_backend(name)
        return cls(m.varlen_prefill, m.paged_prefill, m.paged_decode)


def flash_attn_impl(auto: bool = False):
    """The installed FlashAttention the "flash_attn" back-end would use (an `attn.flash_backend.Implementation`:
    its name, version and block-size rule), or None. auto=True leaves out vLLM's bundled FA3: importing vLLM
    patches torch's Inductor and sets environment variables in this process, so `auto` never pulls it in;
    asking for attention_backend="flash_attn" by name does. The first one found is kept for the process."""
    import importlib.util
    import sys
    from nanovllm_ref.attn import flash_backend
    if auto and not flash_backend.looked_up():
        # Cheap first: no flash_attn on the path, so nothing to import (the usual case).
        if "flash_attn" not in sys.modules and importlib.util.find_spec("flash_attn") is None:
            return None
        impl = flash_backend.find_implementation(order=("flash-attn", "flash-attn-4"))
        return None if impl is None else flash_backend.implementation(impl)
    return flash_backend.implementation()


def flash_attn_available() -> bool:
    """True when some FlashAttention imports (flash-attn, vLLM's FA3 or flash-attn-4; see flash_attn_impl)."""
    return flash_attn_impl() is not None


def triton_available() -> bool:
    try:
        importlib.import_module("triton")
        return True
    except Exception:
        return False


BACKENDS = ("auto", "flash_attn", "triton", "torch", "cpu")


def resolve_backend(name: str, device_type: str, block_size: int = 256, dtype: torch.dtype | None = None) -> str:
    """Pick the concrete back-end for `name` on `device_type` ("cuda" or "cpu").

    auto: on CUDA, flash_attn if the flash-attn package or flash-attn-4 is installed, the block size suits it
    (flash-attn: a multiple of 256; flash-attn-4: of 16) and `dtype` (when given) is float16 / bfloat16; else
    triton (torch without triton). On CPU, cpu. "flash_attn" asked for by name also takes vLLM's FA3 (see
    flash_attn_impl), with its block rule (a multiple of 16).
    Raises ValueError for an unknown name or one that cannot run here (naming what is missing).
    """
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    half = dtype is None or dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        if device_type == "cuda":
            impl = flash_attn_impl(auto=True) if half else None
            if impl is not None and block_size % impl.block_multiple == 0:
                return "flash_attn"
            return "triton" if triton_available() else "torch"
        return "cpu"
    if name == "flash_attn":
        impl = flash_attn_impl() if device_type == "cuda" else None
        if impl is None:
            raise ValueError("attention_backend='flash_attn' needs CUDA and a FlashAttention: the flash-attn "
                             "package, vLLM (its bundled FA3) or flash-attn-4 (pip install flash-attn-4); "
                             "use 'triton' or 'torch' instead")
        if block_size % impl.block_multiple:
            raise ValueError(f"attention_backend='flash_attn' ({impl.name}) needs kvcache_block_size to be a "
                             f"multiple of {impl.block_multiple}, got {block_size}")
        if not half:
            raise ValueError(f"attention_backend='flash_attn' runs float16 or bfloat16 only, got dtype {dtype}; "
                             "use dtype='bfloat16' or attention_backend='triton'")
    if name == "triton" and not triton_available():
        raise ValueError("attention_backend='triton' needs the triton package; use 'torch' instead")
    if name == "triton" and device_type == "cpu":
        from nanovllm_ref.kernels import interpreted
        if not interpreted():
            raise ValueError("attention_backend='triton' on a CPU runs in the Triton interpreter, which must be "
                             "chosen before the kernels are defined: start Python with TRITON_INTERPRET=1, or set "
                             "os.environ['TRITON_INTERPRET'] = '1' before importing nanovllm_ref.kernels "
                             "(nanovllm_ref sets no environment variable itself)")
    return name


def get_backend(name: str):
    """Return the back-end module for a concrete name ("torch", "cpu", "triton" or "flash_attn")."""
    module = {"torch": "torch_backend", "cpu": "cpu_backend", "triton": "triton_backend",
              "flash_attn": "flash_backend"}[name]
    return importlib.import_module(f"nanovllm_ref.attn.{module}")
