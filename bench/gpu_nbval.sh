#!/usr/bin/env bash
# Every solution notebook, top to bottom, under nbval on the lent H200, with the cells tagged `gpu` included
# (issue 22, part 5): what a student with a GPU runs.
#
#   call 1 (carry .carry/a):                    bash bench/gpu_run.sh stage    # GGUF part 1 -> /tmp/smol
#   call 2 (carry .carry/b and .carry/nbwheels): bash bench/gpu_nbval.sh        # wheels + SmolLM2, then nbval
#   CPU dry run (no GPU, no carry; gpu cells are skipped there):
#       GPU_NBVAL_DRY=1 PYTHON=.venv/bin/python OUT=/tmp/gpu_nbval_dry bash bench/gpu_nbval.sh
#
# .carry/b holds the second half of SmolLM2-135M-Instruct.Q4_1.gguf and the gguf wheel (as for gpu_run.sh);
# .carry/nbwheels holds the notebook packages the device lacks, listed in bench/gpu_nbval_wheels.txt (fetch them
# with the pip download command at its top). The notebook run gets NBVAL_LIMIT_S seconds (default 540) so the
# call stays inside the device's 600 s.
# Results in $OUT: gpu_nbval.xml (JUnit, one testcase per code cell; check cells are named by their exercise id
# and fail with the check's verdict line), gpu_nbval.log (this script's output), gpu_nbval_pytest.log (pytest's
# full output) and gpu_nbval_times.txt (seconds per notebook, from the JUnit file).
set -uo pipefail
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
LIMIT=${NBVAL_LIMIT_S:-540}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ -z "${GPU_NBVAL_DRY:-}" ]; then
  # the wheels go to /tmp/site; jupyter and IPython write their runtime files under /tmp
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" NANOVLLM_REF_HOME=/tmp/nanovllm_home \
         JUPYTER_RUNTIME_DIR=/tmp/jupyter_runtime JUPYTER_DATA_DIR=/tmp/jupyter_data IPYTHONDIR=/tmp/ipython \
         JUPYTER_PLATFORM_DIRS=1 MPLBACKEND=Agg
  unset TRITON_INTERPRET                 # compiled Triton kernels on the GPU
fi

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
{
  step "versions"
  $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"

  if [ -z "${GPU_NBVAL_DRY:-}" ]; then
    step "notebook packages (wheels) and SmolLM2 (reassemble + convert)"
    ls .carry/nbwheels/*.whl > /dev/null || { echo "no .carry/nbwheels/*.whl: carry the wheels of bench/gpu_nbval_wheels.txt"; exit 1; }
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/nbwheels/*.whl .carry/b/gguf-*.whl \
      || { echo "wheel install failed"; exit 1; }
    cat /tmp/smol/part_aa .carry/b/part_ab > /tmp/smol/model.gguf || { echo "stage GGUF part 1 first: bash bench/gpu_run.sh stage"; exit 1; }
    $PY - <<'PY' || exit 1
from nanovllm_models import download
download.verify_sha256("/tmp/smol/model.gguf", download.MODELS["smollm2"]["sha256"])
print(download.convert_gguf("/tmp/smol/model.gguf", download.model_dir("smollm2")))
PY
  fi
  $PY -c "import nbval, nbclient, nbformat, ipykernel, jupyter_client, IPython, zmq; \
print('nbclient', nbclient.__version__, 'nbformat', nbformat.__version__, 'ipykernel', ipykernel.__version__, \
'jupyter_client', jupyter_client.__version__, 'IPython', IPython.__version__, 'pyzmq', zmq.__version__)" || exit 1

  step "every solution notebook under nbval, gpu cells included (limit ${LIMIT} s)"
  start=$(date +%s)
  timeout "$LIMIT" $PY -m pytest -q -p no:cacheprovider -rfEsx --nbval --nbval-current-env \
    --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout 300 ${NOTEBOOKS:-solutions/} \
    --junitxml="$OUT/gpu_nbval.xml" > "$OUT/gpu_nbval_pytest.log" 2>&1
  rc=$?
  grep -v DEBUG "$OUT/gpu_nbval_pytest.log" | tail -60
  echo "pytest exit status $rc after $(( $(date +%s) - start )) s"

  step "seconds per notebook (JUnit)"
  $PY - "$OUT/gpu_nbval.xml" <<'PY' | tee "$OUT/gpu_nbval_times.txt"
import re, sys, xml.etree.ElementTree as ET
from collections import OrderedDict
seconds, counts = OrderedDict(), {}
for tc in ET.parse(sys.argv[1]).iter("testcase"):
    m = re.search(r"(\d\d_[a-z0-9_]+\.ipynb)$", tc.get("classname", ""))
    nb = m.group(1) if m else tc.get("classname", "?")
    seconds[nb] = seconds.get(nb, 0.0) + float(tc.get("time", 0))
    outcome = next((c.tag for c in tc if c.tag in ("failure", "error", "skipped")), "passed")
    counts.setdefault(nb, {}).setdefault(outcome, 0)
    counts[nb][outcome] += 1
for nb, s in seconds.items():
    print(f"{s:7.1f} s  {nb}  " + ", ".join(f"{n} {k}" for k, n in sorted(counts[nb].items())))
print(f"{sum(seconds.values()):7.1f} s  total")
PY
  step "done"
  exit $rc
} 2>&1 | tee "$OUT/gpu_nbval.log"
exit "${PIPESTATUS[0]}"
