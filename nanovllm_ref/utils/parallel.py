"""Which tensor-parallel rank this process is, and the two collectives the layers use (chapter 09).

The model runner sets the rank and size once, before it builds the model; layers read them here rather than
from torch.distributed, so a single-process engine never needs a process group.
"""
import torch
import torch.distributed as dist

_TP_RANK, _TP_SIZE = 0, 1


def set_tp(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over ranks in place (a no-op for one rank)."""
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x
