"""Shared pytest configuration of tests/.

The suite's machinery (areas, the notebook-run recorder, the chapter timings report, TRITON_INTERPRET on a CPU)
is tests/suite_plugin.py, loaded by the repository's conftest.py for every run. The grading of notebooks under
`pytest --nbval` and the skip of `gpu` cells without CUDA are the course's plugin (nanovllm_course/nbval_grading.py,
an entry point of the package).
"""
