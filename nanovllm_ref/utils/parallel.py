"""Which tensor-parallel rank a layer is built for, and the collective the layers use (chapter 09).

Each parallel layer copies the rank and size into itself when it is constructed (`self.tp_rank`,
`self.tp_size`) and never looks them up again. The model runner builds the model inside
`with tensor_parallel(rank, size):`, which sets them only for the duration of the block, so nothing
outlives the engine: a model built later (or by another engine in the same process) is not sharded
unless it is built inside its own block. Outside any block the size is 1 and the rank 0.
"""
import contextlib

import torch
import torch.distributed as dist

_TP_RANK, _TP_SIZE = 0, 1


@contextlib.contextmanager
def tensor_parallel(rank: int, size: int):
    """Build layers for rank `rank` of `size` inside the block; the previous values come back on exit
    (also when construction raises). Raises ValueError unless 0 <= rank < size."""
    global _TP_RANK, _TP_SIZE
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank must be in [0, {size}), got {rank}")
    previous = _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, size
    try:
        yield
    finally:
        _TP_RANK, _TP_SIZE = previous


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum `x` over the `tp_size` ranks of the layer's engine, in place (a no-op for one rank)."""
    if tp_size > 1:
        dist.all_reduce(x)
    return x
