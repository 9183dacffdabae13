"""FlashAttention back-end: our three attention functions on whichever FlashAttention is installed.

`find_implementation()` looks for one, in this order, and the first that imports wins; `implementation()`
keeps the answer for the process (`resolve_backend("auto")` looks among flash-attn and flash-attn-4 only,
and what it finds is kept the same way). All three read the paged KV layout we keep, [num_blocks, block_size,
num_kv_heads, head_dim] per layer, through a block table, and take fp16 / bf16 only.

| implementation | import | paged prefill / decode keys | block size |
|---|---|---|---|
| flash-attn (FA2 API) | `flash_attn.flash_attn_varlen_func`, `flash_attn_with_kvcache` | `block_table` + `cu_seqlens_k`; decode `cache_seqlens` | multiple of 256 |
| vLLM's FA3 | `vllm.vllm_flash_attn.flash_attn_varlen_func(..., fa_version=3)` | `block_table` + `seqused_k`, no `cu_seqlens_k` | multiple of 16 |
| flash-attn-4 | `flash_attn.cute.flash_attn_varlen_func` | `page_table` + `seqused_k` | multiple of 16 |

How our contract (nanovllm_ref/attn/__init__.py) maps onto them:
- varlen_prefill: the varlen call with cu_seqlens_q / cu_seqlens_k, causal (bottom-right aligned in all three,
  as our contract needs).
- paged_prefill: the same queries against the caches; FA3 and FA4 take per-sequence key counts `seqused_k =
  cu_seqlens_k[1:] - cu_seqlens_k[:-1]` with the block table, FA2 takes cu_seqlens_k itself.
- paged_decode: FA2's `flash_attn_with_kvcache(q[:, None], ...)`; FA3 gets q as [batch, heads, head_dim] with
  `cu_seqlens_q = arange(batch + 1)`, max_seqlen_q 1, `seqused_k = context_lens`; FA4 gets q as
  [batch, 1, heads, head_dim] with `seqused_k`. Their max_seqlen_k is a host int read from shapes only
  (block table width * block size), so the call does no device sync and is captured in a CUDA graph.
Upstream nano-vllm `layers/attention.py` makes the FA2 calls; vLLM's FlashAttention back-end the FA3 ones.
"""
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from nanovllm_ref.attn.torch_backend import store_kvcache  # noqa: F401  (the engine uses the Triton store on GPU)

ORDER = ("flash-attn", "vllm-fa3", "flash-attn-4")
DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Implementation:
    """One installed FlashAttention behind our three functions. block_multiple: its paged-KV block sizes
    are multiples of this."""
    name: str
    version: str
    block_multiple: int
    varlen_prefill: Callable
    paged_prefill: Callable
    paged_decode: Callable

    def describe(self) -> str:
        return f"{self.name} {self.version} (paged KV blocks: multiples of {self.block_multiple})"


def _first(out):
    """flash-attn-4 returns (out, lse) in some versions; keep the output."""
    return out[0] if isinstance(out, tuple) else out


def _seqused(cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)


def _max_keys(block_tables: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Most keys any row can have: from shapes only (no device sync; fixed inside a captured graph)."""
    return block_tables.shape[1] * k_cache.shape[1]


def _fa2(module) -> Implementation:
    varlen, kvcache = module.flash_attn_varlen_func, module.flash_attn_with_kvcache

    def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
        return varlen(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=True)

    def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      scale):
        return varlen(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=True,
                      block_table=block_tables)

    def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        return kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens, block_table=block_tables,
                       softmax_scale=scale, causal=True).squeeze(1)

    return Implementation("flash-attn", getattr(module, "__version__", "?"), 256, varlen_prefill, paged_prefill,
                          paged_decode)


def _fa3(module, version: str, fa_version: int = 3) -> Implementation:
    fa = module.flash_attn_varlen_func

    def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
        return fa(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=cu_seqlens_k, softmax_scale=scale,
                  causal=True, fa_version=fa_version)

    def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      scale):
        # With a block table it takes the key count of each sequence (seqused_k), not cumulative offsets.
        return fa(q, k_cache, v_cache, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=_seqused(cu_seqlens_k),
                  softmax_scale=scale, causal=True, block_table=block_tables, fa_version=fa_version)

    def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)   # one query per sequence
        return fa(q, k_cache, v_cache, 1, cu_q, _max_keys(block_tables, k_cache), seqused_k=context_lens,
                  softmax_scale=scale, causal=True, block_table=block_tables, fa_version=fa_version)

    return Implementation(f"vllm-fa{fa_version}", version, 16, varlen_prefill, paged_prefill, paged_decode)


def _fa4(module, version: str) -> Implementation:
    fa = module.flash_attn_varlen_func

    def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
        return _first(fa(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=True))

    def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      scale):
        return _first(fa(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, seqused_k=_seqused(cu_seqlens_k), page_table=block_tables,
                         softmax_scale=scale, causal=True))

    def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        out = fa(q.unsqueeze(1), k_cache, v_cache, max_seqlen_k=_max_keys(block_tables, k_cache),
                 seqused_k=context_lens, page_table=block_tables, softmax_scale=scale, causal=True)
        return _first(out).squeeze(1)

    return Implementation("flash-attn-4", version, 16, varlen_prefill, paged_prefill, paged_decode)


def _load(name: str) -> Implementation:
    """Import one implementation by name; raises ImportError (or what its import raises) when it is absent."""
    if name == "flash-attn":
        module = importlib.import_module("flash_attn")
        if not hasattr(module, "flash_attn_with_kvcache"):     # e.g. only flash-attn-4's namespace package
            raise ImportError("flash_attn has no flash_attn_with_kvcache (not the flash-attn package)")
        return _fa2(module)
    if name == "vllm-fa3":
        module = importlib.import_module("vllm.vllm_flash_attn")
        version = getattr(importlib.import_module("vllm"), "__version__", "?")
        for fa_version in (3, 2):                # FA3 on Hopper; vLLM's FA2 build elsewhere, where it ships
            supported = getattr(module, "is_fa_version_supported", None)
            if supported is None or supported(fa_version):
                return _fa3(module, f"vllm {version}", fa_version)
        raise ImportError("vllm.vllm_flash_attn supports neither FA3 nor FA2 on this GPU")
    if name == "flash-attn-4":
        module = importlib.import_module("flash_attn.cute")
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version
        try:
            version = dist_version("flash-attn-4")
        except PackageNotFoundError:
            version = getattr(module, "__version__", "?")
        return _fa4(module, version)
    raise ValueError(f"FlashAttention implementation must be one of {ORDER}, got {name!r}")


def find_implementation(order=ORDER, skip=()) -> Implementation | None:
    """The first implementation of `order` (names of ORDER) that imports, leaving out those in `skip`; None
    when none does. A stand-in `flash_attn` package (the benchmark's shim for upstream nano-vllm) skips
    "flash-attn", which would be itself."""
    for name in order:
        if name in skip:
            continue
        try:
            return _load(name)
        except Exception:                        # absent, or present but unusable here: try the next one
            continue
    return None


_found: list = []                                # [Implementation | None] once looked up in this process


def implementation(found: Implementation | None = None) -> Implementation | None:
    """The FlashAttention this process uses: the first one looked up is kept. Without an earlier answer it is
    `found` if given (resolve_backend's `auto`, which looks among fewer), else find_implementation()."""
    if not _found:
        _found.append(found if found is not None else find_implementation())
    return _found[0]


def looked_up() -> bool:
    """Whether this process has settled its FlashAttention (implementation() ran)."""
    return bool(_found)


def _impl(q: torch.Tensor) -> Implementation:
    impl = implementation()
    if impl is None:
        raise ValueError("attention_backend='flash_attn' needs a FlashAttention: the flash-attn package, vLLM "
                         "(its bundled FA3) or flash-attn-4; none imports here")
    if q.dtype not in DTYPES:
        raise ValueError(f"attention_backend='flash_attn' runs float16 or bfloat16 only, got {q.dtype}; "
                         "use dtype='bfloat16' or another back-end")
    return impl


def varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    """Causal attention over this step's tokens only. q [num_tokens, H, D], k/v [num_tokens, Hkv, D]."""
    return _impl(q).varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  scale):
    """Causal attention whose keys (cached prefix + this step's tokens) come from the paged cache."""
    return _impl(q).paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, scale)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One new query per sequence against its paged context. q [B, H, D] -> [B, H, D]; no host sync."""
    return _impl(q).paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
