"""Shared pytest configuration.

Notebook tests (course machinery): when CUDA is unavailable, nbval cells whose notebook cell is tagged
`gpu` are skipped, like cells tagged `nbval-skip`. `pytest --nbval` on a chapter notebook grades it against
its solution (nanovllm_course/nbval_grading.py): one item per exercise, named by its id, failing with the
check's verdict line.
"""
import os

import pytest
import torch

from nanovllm_course.nbval_grading import pytest_collect_file  # noqa: F401  (the grading hook)

# The Triton kernels run on a CPU only under the Triton interpreter, chosen before any kernel is defined.
# nanovllm_ref sets no environment variable itself, so the test session chooses it here (notebook kernels
# and tensor-parallel workers started by the tests inherit it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
