"""The per-step attention context (chapter 04).

The model's forward signature stays `model(input_ids, positions)` like a plain HF model. Everything the
attention layers need about *this step's batch* (which tokens belong to which sequence, where their K/V
go in the paged cache) is set here by the model runner before the forward and cleared after it.
Follows upstream nano-vllm `utils/context.py`.

Fields (all tensors live on the model's device):
- is_prefill: True for a prefill (or prefill-chunk) step, False for a decode step.
- cu_seqlens_q: [num_seqs + 1] int32, prefix sums of the query lengths (prefill only).
- cu_seqlens_k: [num_seqs + 1] int32, prefix sums of the key lengths = cached prefix + new tokens.
- max_seqlen_q, max_seqlen_k: python ints, the largest of each.
- slot_mapping: [num_tokens] int32; slot = block_id * block_size + offset where the token's K/V is
  written; -1 means "do not write" (padding rows of a captured CUDA graph).
- context_lens: [num_seqs] int32, tokens of context per sequence (decode only).
- block_tables: [num_seqs, max_num_blocks] int32, physical block ids per sequence, padded with -1;
  None in a prefill step with no cached prefix.
"""
from dataclasses import dataclass

import torch


@dataclass
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(is_prefill, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                slot_mapping=None, context_lens=None, block_tables=None) -> None:
    global _CONTEXT
    _CONTEXT = Context(is_prefill, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       slot_mapping, context_lens, block_tables)


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()
