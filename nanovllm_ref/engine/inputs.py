"""Input preparation: a scheduled batch of sequences -> the tensors of one forward (chapter 04).

Pure functions of `(seqs, block_size, device)`: they read the sequences and allocate nothing but the
returned tensors, so the engine, the course checks and a student's replacement (through `nanovllm_ref.Parts`)
all call them the same way. The engine calls them on the host (device "cpu"), on the scheduler's side of the
step, and puts what they return into the step's batch record (engine/step_batch.py); the model runner copies
it to the GPU (`upload`). Upstream nano-vllm keeps this code in `ModelRunner.prepare_prefill/prepare_decode`.

Layouts (tokens of all sequences packed one after another, no padding):
- prefill: for each sequence, tokens [num_cached_tokens, num_cached_tokens + num_scheduled_tokens): a whole
  prompt, the part after a cached prefix, or one chunk of a long prompt.
- decode: the last token of each sequence, at position len(seq) - 1.
"""
from dataclasses import dataclass, fields
from itertools import chain

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
    """A host list, numpy array or CPU tensor -> a tensor of `dtype` on `device`; through pinned memory and a
    non-blocking copy on CUDA. A numpy array or CPU tensor that is already `dtype` stays as it is on the CPU
    (no copy). (torch.tensor(..., pin_memory=True) refuses numpy input, hence the ways in.)"""
    device = torch.device(device)
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data if data.flags.c_contiguous else np.ascontiguousarray(data))
    if isinstance(data, torch.Tensor):
        if data.dtype != dtype:
            data = data.to(dtype)
        if device.type == "cpu":
            return data
        # pin_memory() copies the tensor once into pinned memory
        return (data if data.is_pinned() else data.pin_memory()).to(device, non_blocking=True)
    cuda = device.type == "cuda"
    return torch.tensor(data, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def upload(step: "StepInputs", device) -> "StepInputs":
    """A StepInputs made on the host (device "cpu") with its tensors on `device` (the same object when that is
    the CPU): pinned, non-blocking copies on CUDA."""
    if torch.device(device).type == "cpu":
        return step
    def up(t):
        return to_device(t, t.dtype, device) if isinstance(t, torch.Tensor) else t
    meta = step.metadata
    return StepInputs(up(step.input_ids), up(step.positions),
                      AttentionMetadata(**{f.name: up(getattr(meta, f.name)) for f in fields(meta)}))


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


def block_tables_array(seqs: list[Sequence]) -> np.ndarray:
    """[num_seqs, longest table] int32, each row a sequence's block table padded with -1 (numpy, one
    vectorised scatter of the concatenated tables)."""
    tables = [seq.block_table for seq in seqs]
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lens.max()) if len(tables) else 0
    if width and int(lens.min()) == width:            # every table as long: no padding to do
        return np.array(tables, dtype=np.int32)
    out = np.full((len(seqs), width), -1, dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    out[np.arange(width)[None, :] < lens[:, None]] = flat
    return out


def block_tables_tensor(seqs: list[Sequence], device) -> torch.Tensor:
    """[num_seqs, longest table] int32, each row a sequence's block table padded with -1."""
    return to_device(block_tables_array(seqs), torch.int32, device)


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


def prepare_decode(seqs: list[Sequence], block_size: int, device, slot_fn=None) -> StepInputs:
    """Inputs of a decode step: the last token of each sequence, at position len - 1, written to the slot
    of that position; attention reads len(seq) keys through the block table. `slot_fn`: None computes every
    slot at once from the block tables (what `slot_mapping` gives, vectorised), or a function with
    `slot_mapping`'s signature called for each sequence (chapter 04's exercise plugs in here).
    An input id is PENDING (-1) for a sequence whose last token a step still in flight samples (async
    scheduling); the step's batch record says where the model runner reads it (engine/step_batch.py)."""
    n = len(seqs)
    lens = np.fromiter((seq.num_tokens for seq in seqs), dtype=np.int64, count=n)
    input_ids = np.fromiter((seq.last_token for seq in seqs), dtype=np.int64, count=n)
    tables = block_tables_array(seqs)
    last = lens - 1
    if slot_fn is None:
        slots = (tables[np.arange(n), last // block_size].astype(np.int64) * block_size + last % block_size
                 ).astype(np.int32)
    else:
        slots = [slot_fn(seq.block_table, len(seq) - 1, len(seq), block_size)[0] for seq in seqs]
    meta = AttentionMetadata(is_prefill=False, slot_mapping=to_device(slots, torch.int32, device),
                             context_lens=to_device(lens.astype(np.int32), torch.int32, device),
                             block_tables=to_device(tables, torch.int32, device))
    return StepInputs(to_device(input_ids, torch.int64, device), to_device(last, torch.int64, device), meta)
