"""The repository's pytest set-up, for every run here: tests/ and the notebooks (pytest --nbval solutions/ or
chapters/). tests/suite_plugin.py gives every test its area marker, records each notebook's run so that one
execution feeds `grade` and nbval, and writes the chapter timings report; it also chooses the Triton
interpreter where there is no CUDA. The grading of a chapter notebook against its solution (one item per
exercise) and the skipping of `gpu` cells without CUDA come from the course's pytest plugin,
nanovllm_course/nbval_grading.py, which the package registers as an entry point (active in every pytest run
of this environment)."""
pytest_plugins = ["tests.suite_plugin"]
