# nano-vLLM course. Two commands: `make demo` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU build on CPU machines. A GPU user installs their own torch first (in this venv, or in the Python
# that creates it: then the venv sees it through --system-site-packages) and this line is skipped.
TORCH_SPEC ?= torch==2.13.0
PIP := $(PY) -m pip install -q --disable-pip-version-check
QUIET_PIP := { grep -v 'is ignored: it is neither a file nor a directory' || true; }
# JupyterLab serves the repository root (the chapters link their pictures as ../figures/*.png) and opens
# chapters/; as root (containers) it needs --allow-root. tests/browser_lab.py starts Lab with the same flags.
IS_ROOT := $(filter 0,$(shell id -u))
LAB_ARGS := --ServerApp.root_dir=$(CURDIR) --LabApp.default_url=/lab/tree/chapters $(if $(IS_ROOT),--allow-root)
# The venv's bin/ first on the PATH of Lab and so of its kernels: a `!python ...` or `!pip ...` in a notebook runs
# the venv's Python (with torch), not whatever `python` the shell that ran make found first.
LAB_PATH := $(abspath $(VENV))/bin
SUDO := $(if $(IS_ROOT),,sudo)

.PHONY: demo test test-engine test-kernels test-serve test-course test-bench test-fast test-browser suite-timing \
	chromium install model lab release bench-cpu clean

# The stamp names the checkout installed into the venv. A .venv copied or moved from another checkout still
# imports that checkout's code (pip's editable install records its path), so then the stamp is out of date.
ifneq ($(shell cat $(STAMP) 2>/dev/null),$(CURDIR))
.PHONY: $(STAMP)
endif
$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c 'import torch' 2>/dev/null; then \
	    echo "creating $(VENV) (keeping the torch already installed for $(PYTHON))"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); fi; fi
	@if ! $(PY) -c 'import torch' 2>/dev/null; then \
	  echo "installing $(TORCH_SPEC)"; $(PIP) "$(TORCH_SPEC)" 2>&1 | $(QUIET_PIP); fi
	@echo "installing nanovllm_ref and the course tools into $(VENV)"
	@$(PIP) -e '.[course,test]' 2>&1 | $(QUIET_PIP)
	@echo '$(CURDIR)' > $(STAMP)

install: $(STAMP)

model: $(STAMP)
	@$(PY) -m nanovllm_ref download smollm2 >/dev/null

demo: model
	@$(PY) -m nanovllm_ref demo

# The whole suite, tests/. Each chapter notebook runs twice in it, filled and unfilled, each run under nbval as a
# grader runs it and graded by `grade` from that same run; the filled run also compares every cell with the
# solution's stored output (the gate `pytest --nbval solutions/` was; tests/test_course_machinery.py). TEST_WORKERS
# xdist workers share the cores, longest work first (--dist loadgroup, tests/suite_plugin.py). One thread each: the
# workers, the notebook kernels and the TP ranks they start would otherwise each take every core. The chapter
# timings report lands in artifacts/chapter_timings.{csv,json}.
# A developer's loop: `make test-engine` (kernels, serve, course, bench) runs one area, `make test-fast` all
# but the slow tests; PYTEST_ARGS adds options (e.g. PYTEST_ARGS='-k stops -x').
TEST_WORKERS ?= 2
TEST_PATHS := tests/
PYTEST_ARGS ?=
PYTEST := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -p no:cacheprovider -p tests.suite_plugin \
	--timeout=900 -n $(TEST_WORKERS) --dist loadgroup

test: model
	$(PYTEST) $(TEST_PATHS) $(PYTEST_ARGS)

test-engine test-kernels test-serve test-course test-bench: model
	$(PYTEST) -m $(@:test-%=%) $(TEST_PATHS) $(PYTEST_ARGS)

test-fast: model
	$(PYTEST) -m "not slow" $(TEST_PATHS) $(PYTEST_ARGS)

# `make test` quiet, then with both cores kept busy, each timed; the record goes to bench/results/ (see the script).
suite-timing: model
	bench/suite_timing.sh

lab: model
	PATH="$(LAB_PATH):$$PATH" $(VENV)/bin/jupyter lab $(LAB_ARGS)

# Debian's chromium for the browser test (playwright drives it; it comes with the test extra).
chromium:
	@command -v chromium >/dev/null || { echo "installing chromium (apt)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; }

# The student's JupyterLab in headless Chromium: figures load, maths renders, a check says ok.
# Screenshots land in artifacts/browser/ (git-ignored).
test-browser: $(STAMP) chromium
	LAB_ARGS="$(LAB_ARGS)" LAB_PATH="$(LAB_PATH)" CHROMIUM="$$(command -v chromium)" \
	  $(PY) -m pytest -q -p no:cacheprovider --timeout=300 tests/browser_lab.py

release: $(STAMP)
	$(PY) -m nanovllm_course release

bench-cpu: $(STAMP)
	$(PY) -m nanovllm_ref bench --cpu

clean:
	rm -rf $(VENV)
