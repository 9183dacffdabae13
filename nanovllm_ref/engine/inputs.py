"""Input preparation: a scheduled batch of sequences -> the tensors of one forward (chapter 04).

Pure functions of `(seqs, block_size, device)`: they read the sequences and allocate nothing but the
returned tensors, so the model runner, the course checks and a student's replacement (through
`nanovllm_ref.Parts`) all call them the same way. Upstream nano-vllm keeps this code in
`ModelRunner.prepare_prefill/prepare_decode`.

Layouts (tokens of all sequences packed one after another, no padding):
- prefill: for each sequence, tokens [num_cached_tokens, num_cached_tokens + num_scheduled_tokens): a whole
  prompt, the part after a cached prefix, or one chunk of a long prompt.
- decode: the last token of each sequence, at position len(seq) - 1.
"""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.utils.context import AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    """What one forward needs. input_ids, positions: [num_tokens] int64 on the model's device (num_tokens
    is the number of sequences in a decode step); metadata: what the attention layers read (see
    nanovllm_ref.utils.context)."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list or numpy array -> a tensor on `device`; through pinned memory and a non-blocking copy
    on CUDA. (torch.tensor(..., pin_memory=True) refuses numpy input, hence the two ways in.)"""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and isinstance(data, np.ndarray):
        # pin_memory() copies the array once into pinned memory
        return torch.from_numpy(np.ascontiguousarray(data)).to(dtype).pin_memory().to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slots of positions [start, end) of a sequence whose blocks are `block_table`:
    position p goes to block_table[p // block_size] * block_size + p % block_size.
    Raises ValueError if [start, end) reaches past the table."""
    if end > len(block_table) * block_size:
        raise ValueError(f"positions up to {end} need {(end + block_size - 1) // block_size} blocks, "
                         f"the block table has {len(block_table)}")
    slots = []
    for i in range(start // block_size, (end + block_size - 1) // block_size):
        lo, hi = max(start, i * block_size), min(end, (i + 1) * block_size)
        base = block_table[i] * block_size - i * block_size
        slots.extend(range(base + lo, base + hi))
    return slots


def block_tables_tensor(seqs: list[Sequence], device) -> torch.Tensor:
    """[num_seqs, longest table] int32, each row a sequence's block table padded with -1."""
    width = max(len(seq.block_table) for seq in seqs)
    return to_device([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs],
                     torch.int32, device)


def prepare_prefill(seqs: list[Sequence], block_size: int, device, slot_fn=slot_mapping) -> StepInputs:
    """Inputs of a prefill step over tokens [num_cached_tokens, num_cached_tokens + num_scheduled_tokens)
    of each sequence. Block tables are passed only when some sequence has a cached prefix (or an earlier
    chunk): then attention reads keys from the cache. A sequence with no block table (the model runner's
    warm-up, before the cache exists) gets no slots. `slot_fn` computes one sequence's slots (signature of
    `slot_mapping`; chapter 04's exercise plugs in here)."""
    input_ids, positions, slots = [], [], []
    cu_q, cu_k, max_q, max_k, has_prefix = [0], [0], 0, 0, False
    for seq in seqs:
        start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
        input_ids.extend(seq[start:end])
        positions.extend(range(start, end))
        cu_q.append(cu_q[-1] + end - start)
        cu_k.append(cu_k[-1] + end)
        max_q, max_k = max(max_q, end - start), max(max_k, end)
        has_prefix |= start > 0
        if seq.block_table:
            slots.extend(slot_fn(seq.block_table, start, end, block_size))
    meta = AttentionMetadata(
        is_prefill=True,
        cu_seqlens_q=to_device(cu_q, torch.int32, device), cu_seqlens_k=to_device(cu_k, torch.int32, device),
        max_seqlen_q=max_q, max_seqlen_k=max_k, slot_mapping=to_device(slots, torch.int32, device),
        block_tables=block_tables_tensor(seqs, device) if has_prefix else None)
    return StepInputs(to_device(input_ids, torch.int64, device), to_device(positions, torch.int64, device), meta)


def prepare_decode(seqs: list[Sequence], block_size: int, device, slot_fn=slot_mapping) -> StepInputs:
    """Inputs of a decode step: the last token of each sequence, at position len - 1, written to the slot
    of that position; attention reads len(seq) keys through the block table. `slot_fn` as in prepare_prefill."""
    input_ids = [seq.last_token for seq in seqs]
    positions = [len(seq) - 1 for seq in seqs]
    context_lens = [len(seq) for seq in seqs]
    if slot_fn is slot_mapping:       # the common case, without a list per sequence
        slots = [seq.block_table[(len(seq) - 1) // block_size] * block_size + (len(seq) - 1) % block_size
                 for seq in seqs]
    else:
        slots = [slot_fn(seq.block_table, len(seq) - 1, len(seq), block_size)[0] for seq in seqs]
    meta = AttentionMetadata(is_prefill=False, slot_mapping=to_device(slots, torch.int32, device),
                             context_lens=to_device(context_lens, torch.int32, device),
                             block_tables=block_tables_tensor(seqs, device))
    return StepInputs(to_device(input_ids, torch.int64, device), to_device(positions, torch.int64, device), meta)


def step_to_host(step: StepInputs) -> dict:
    """A StepInputs as plain numpy arrays and ints (picklable in a few kB; what rank 0 sends to
    tensor-parallel workers instead of the sequences and their whole token lists)."""
    meta = {f: getattr(step.metadata, f) for f in AttentionMetadata.__dataclass_fields__}
    host = {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in meta.items()}
    return dict(input_ids=step.input_ids.cpu().numpy(), positions=step.positions.cpu().numpy(), metadata=host)


def step_from_host(host: dict, device) -> StepInputs:
    """The inverse of step_to_host: tensors on `device` (pinned, non-blocking copies on CUDA)."""
    def up(a):
        return to_device(a, torch.from_numpy(a).dtype, device) if a is not None else None
    meta = {k: up(v) if hasattr(v, "dtype") else v for k, v in host["metadata"].items()}
    return StepInputs(up(host["input_ids"]), up(host["positions"]), AttentionMetadata(**meta))
