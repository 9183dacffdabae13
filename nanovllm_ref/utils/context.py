"""The attention metadata of one step, and the one hidden channel that carries it to the layers (chapter 04).

The model's forward signature stays `model(input_ids, positions)`, like a plain HF model. What the attention
layers need to know about *this step's batch* (which tokens belong to which sequence, where their K/V go in
the paged cache) travels beside the call, not through it:

    meta = AttentionMetadata(is_prefill=True, cu_seqlens_q=..., ...)
    with attention_metadata(meta):          # the model runner, around one forward
        hidden = model(input_ids, positions)
    # inside, each Attention layer calls current_metadata()

This is the only hidden channel in the engine's design. vLLM calls the same idea the *forward context*
(`vllm/forward_context.py`); upstream nano-vllm's is `utils/context.py` with a set/reset pair. Here it is a
context manager: the metadata is visible only inside the `with` block and is restored when the block exits,
also when the forward raises, so a failed step never leaves stale metadata for the next one. Blocks nest
(the inner one wins and the outer one comes back).

Fields of AttentionMetadata (tensors live on the model's device):
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
import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


_EMPTY = AttentionMetadata()
_current = _EMPTY


def current_metadata() -> AttentionMetadata:
    """The metadata of the step being run: the innermost `attention_metadata(...)` block, else an empty
    AttentionMetadata (is_prefill False, every tensor None)."""
    return _current


@contextlib.contextmanager
def attention_metadata(meta: AttentionMetadata):
    """Make `meta` what `current_metadata()` returns inside the block; restore the previous one on exit,
    whether the block returns or raises. Raises TypeError if `meta` is not an AttentionMetadata."""
    global _current
    if not isinstance(meta, AttentionMetadata):
        raise TypeError(f"attention_metadata needs an AttentionMetadata, got {type(meta).__name__}")
    previous, _current = _current, meta
    try:
        yield meta
    finally:
        _current = previous


# The name upstream nano-vllm and the chapters' first drafts used for current_metadata().
get_context = current_metadata
