"""Shared pytest configuration.

Notebook tests (course machinery): when CUDA is unavailable, nbval cells whose notebook cell is tagged
`gpu` are skipped, like cells tagged `nbval-skip`.
"""
import pytest

GPU_TAG = "gpu"


def _cell_tags(item) -> list:
    cell = getattr(item, "cell", None)           # nbval.plugin.IPyNbCell keeps its notebook cell here
    if cell is None:
        return []
    return list((cell.get("metadata") or {}).get("tags") or [])


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if GPU_TAG in _cell_tags(item)]
    if not gpu_items:
        return
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="notebook cell tagged 'gpu' needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)
