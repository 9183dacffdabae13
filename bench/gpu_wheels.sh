#!/usr/bin/env bash
# Wheels of the engine's dependencies that the lent GPU machine lacks (it has no PyPI): msgspec and pyzmq for
# CPython 3.12 on x86-64 Linux, into .carry/wheels (git-ignored). Carry that folder on a device call;
# bench/gpu_run.sh unpacks the wheels into /tmp/site there.
#   SERVE=1 bash bench/gpu_wheels.sh   also the server's (FastAPI, uvicorn with httptools, pydantic and what
#                                      they need that the device lacks), for `gpu_run.sh serve-profile`,
#                                      which runs our server without the peers payload (about 4 MiB more)
set -euo pipefail
PY=${PY:-.venv/bin/python}
mkdir -p .carry/wheels
PLAT=(--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
quiet() { grep -v 'is ignored: it is neither' || true; }
$PY -m pip download -q --no-deps "${PLAT[@]}" -d .carry/wheels msgspec pyzmq 2>&1 | quiet
if [ -n "${SERVE:-}" ]; then
  $PY -m pip download -q "${PLAT[@]}" -d .carry/wheels fastapi uvicorn httptools 2>&1 | quiet
  # Leave out what the device image has already (KINDS.md's package list): its own versions stay in charge.
  $PY - <<'PY'
import os
from packaging.utils import canonicalize_name, parse_wheel_filename
from nanovllm_bench.payload import KINDS_MD, present_packages
present = present_packages(open(KINDS_MD).read())
for name in sorted(os.listdir(".carry/wheels")):
    if name.endswith(".whl") and canonicalize_name(parse_wheel_filename(name)[0]) in present:
        os.remove(os.path.join(".carry/wheels", name))
        print("device has it:", name)
PY
fi
ls -la .carry/wheels
