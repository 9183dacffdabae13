#!/usr/bin/env bash
# Wheels of the engine's dependencies that the lent GPU machine lacks (it has no PyPI): msgspec and pyzmq for
# CPython 3.12 on x86-64 Linux, into .carry/wheels (git-ignored). Carry that folder on a device call;
# bench/gpu_run.sh unpacks the wheels into /tmp/site there.
set -euo pipefail
mkdir -p .carry/wheels
${PY:-.venv/bin/python} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .carry/wheels msgspec pyzmq 2>&1 | grep -v 'is ignored: it is neither' || true
ls -la .carry/wheels
