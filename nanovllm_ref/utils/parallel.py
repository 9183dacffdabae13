"""Which tensor-parallel rank this process is, and the collective the layers use (chapter 09).

The model runner sets the rank and size before it builds the model; each layer copies them at construction
(so a later engine with another size in the same process does not change it), and a single-process engine
never needs a process group.
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


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum `x` over the `tp_size` ranks of the layer's engine, in place (a no-op for one rank)."""
    if tp_size > 1:
        dist.all_reduce(x)
    return x
