"""Shared pytest configuration.

Notebook tests (course machinery): when CUDA is unavailable, nbval cells whose notebook cell is tagged
`gpu` are skipped, like cells tagged `nbval-skip`. `pytest --nbval` on a chapter notebook grades it against
its solution (nanovllm_course/nbval_grading.py): one item per exercise, named by its id, failing with the
check's verdict line.
"""
import os

import torch

# The grading hook and the gpu-cell skip live in the course's pytest plugin (also registered as an entry point, so
# a student's folder outside this repository is graded too); importing them here registers them for this conftest.
from nanovllm_course.nbval_grading import GPU_TAG, pytest_collect_file, pytest_collection_modifyitems  # noqa: F401,E402

# The Triton kernels run on a CPU only under the Triton interpreter, chosen before any kernel is defined.
# nanovllm_ref sets no environment variable itself, so the test session chooses it here (notebook kernels
# and tensor-parallel workers started by the tests inherit it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
