"""Load the tests/ conftest for notebook runs too (pytest --nbval solutions/ or chapters/): cells tagged `gpu` are
skipped on machines without CUDA, and a chapter notebook is graded against its solution, one item per exercise
(nanovllm_course/nbval_grading.py)."""
pytest_plugins = ["tests.conftest"]
