#!/usr/bin/env bash
# Online serving benchmark on the lent H200, in one device call: `vllm serve` and our server, one after the
# other, each driven by the same client (nanovllm_bench/serve.py) at the same Poisson request rates.
#
#   bash bench/gpu_run.sh serve        # unpacks the peers payload, then runs this script
#   bash bench/gpu_serve.sh            # results in $OUT: serve_h200.json (the record), serve_h200.png, logs
#
# Needs vLLM 0.20.2 and its dependencies (FastAPI, uvicorn, pydantic, httpx among them) unpacked in $SITE
# (default /tmp/peers/site, where bench/gpu_run.sh's `assemble` puts the peers payload: peers-stage calls,
# then `serve`, `peers` or `flash-check`); our server and the client take FastAPI, uvicorn, pydantic and
# httpx from there too. Both servers open the same config-only
# Qwen3-0.6B folder with random weights (--load-format dummy, bf16, max_model_len 4096, no prefix caching:
# the rates replay one workload) and a word-level tokenizer that decodes every id, so both detokenize and
# stream real text. Env: RATES (default 8,16,32,inf), VLLM_S / OURS_S (seconds allowed per server, start-up
# included: default 220 each, so the whole call, unpacking included, stays within 540 s), RATE_S (seconds per
# rate before open requests count as failed, default 60), SKIP_VLLM=1 / SKIP_OURS=1, CLIENT_PROCS (client
# processes; default 4: one Python client process streaming 256 requests at once was saturated (2026-12-02:
# 5.3 s of CPU in a 5.7 s run) and set the TTFT it measured; a list such as "4 1" runs the client once per count, the first into the record).
# STACK_SAMPLE=1 (gpu_run.sh serve-profile): our server's processes sample their Python stacks
# (nanovllm_bench/stack_sampler.py), the client runs once per rate with the rate as the samples' phase, each
# rate's record in serve_profile_<rate>.json, and the report in stacks_report.txt / stacks_report.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/peers/site}
RATES=${RATES:-8,16,32,inf}
MODEL=/tmp/serve_qwen3_06b
NAME=qwen3-0.6b-dummy
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
START=$SECONDS
say() { echo "=== $* (t=$((SECONDS - START)) s, $(date -u +%H:%M:%S))"; }

if [ ! -d "$SITE/vllm" ] && [ -z "${SKIP_VLLM:-}" ]; then
  echo "error: $SITE/vllm is missing: stage and unpack the peers payload first (bash bench/gpu_run.sh serve)"; exit 2
fi
CLIENT=(env PYTHONPATH="$PWD:$SITE" python3 -m nanovllm_bench serve)
"${CLIENT[@]}" model "$MODEL" >/dev/null || exit 2
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader

wait_health() {   # url pid seconds
  "${CLIENT[@]}" wait --base-url "$1" --pid "$2" --timeout "$3"
}
stop() {          # pid: SIGTERM, then SIGKILL after 30 s; prints the exit status
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -0 "$1" 2>/dev/null && { echo "still running 30 s after SIGTERM: SIGKILL"; kill -KILL "$1"; }
  wait "$1"; echo "exit status $?"
}
bench() {         # url server-name notes seconds-left
  local t0=$SECONDS rec=serve_h200.json
  for cp in ${CLIENT_PROCS:-4}; do   # the first count's results go to the record, later ones to serve_h200_procsN.json
    local left=$(($4 - (SECONDS - t0)))
    if [ "$left" -le 10 ]; then echo "no time left for the client ($left s)"; return; fi
    timeout "$left" "${CLIENT[@]}" run --base-url "$1" --server "$2" --notes "$3" --rates "$RATES" \
      --record "$OUT/$rec" --time-limit "${RATE_S:-60}" --client-procs "$cp"
    echo "client exit $?"
    rec=serve_h200_procs$cp.json
  done
}

COMMON=(--load-format dummy --dtype bfloat16 --max-model-len 4096 --no-enable-prefix-caching --seed 0
        --served-model-name "$NAME" --host 127.0.0.1)

if [ -z "${SKIP_VLLM:-}" ]; then
  say "vllm serve"
  PYTHONPATH="$SITE" python3 -c 'import sys; from vllm.entrypoints.cli.main import main; sys.argv = ["vllm"] + sys.argv[1:]; main()' \
    serve "$MODEL" "${COMMON[@]}" --port 8100 --disable-uvicorn-access-log > "$OUT/serve_vllm.log" 2>&1 &
  PID=$! T0=$SECONDS LIMIT=${VLLM_S:-220}
  if wait_health http://127.0.0.1:8100 $PID $((LIMIT - 60)); then
    VER=$(PYTHONPATH="$SITE" python3 -c 'import vllm; print(vllm.__version__)' 2>/dev/null)
    bench http://127.0.0.1:8100 vllm "vllm $VER serve, defaults + ${COMMON[*]}" $((LIMIT - (SECONDS - T0)))
  else
    tail -30 "$OUT/serve_vllm.log"
  fi
  stop $PID
  for _ in $(seq 20); do   # wait for vLLM's memory to come back before our engine sizes its KV cache
    [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)" -lt 2000 ] && break; sleep 1
  done
fi

if [ -z "${SKIP_OURS:-}" ]; then
  say "nanovllm_ref serve"
  # --engine-core process: the engine core in its own process (issue 28), the default on CUDA, named here so
  # the record says which split it measured.
  SAMPLE_PATH=()
  [ -n "${STACK_SAMPLE:-}" ] && SAMPLE_PATH=(env PYTHONPATH="$PWD/bench/stack_sample:$PWD:$SITE" NANOVLLM_STACK_SAMPLE="$OUT/stacks")
  PYTHONPATH="$PWD:$SITE" "${SAMPLE_PATH[@]}" python3 -m nanovllm_ref serve --model "$MODEL" "${COMMON[@]}" --engine-core process --port 8200 \
    --log-level warning > "$OUT/serve_nanovllm_ref.log" 2>&1 &
  PID=$! T0=$SECONDS LIMIT=${OURS_S:-220}
  if wait_health http://127.0.0.1:8200 $PID $((LIMIT - 60)); then
    # The device's copy of the checkout carries the working tree, not its git history: its HEAD can name an
    # older commit than the code that runs (2026-12-02: it said ae49a08 for 879ea8c). Pass the commit in.
    REV=${NANOVLLM_REF_COMMIT:-"unknown (NANOVLLM_REF_COMMIT not given)"}
    if [ -n "${STACK_SAMPLE:-}" ]; then
      for r in ${RATES//,/ }; do
        echo "rate-$r" > "$OUT/stacks.phase"
        timeout $((LIMIT - (SECONDS - T0))) "${CLIENT[@]}" run --base-url http://127.0.0.1:8200 --server nanovllm_ref \
          --notes "nanovllm_ref $REV serve (stacks sampled), defaults + ${COMMON[*]}" --rates "$r" \
          --record "$OUT/serve_profile_$r.json" --time-limit "${RATE_S:-60}"
        echo "client exit $?"
        rm -f "$OUT/stacks.phase"; sleep 0.5
      done
    else
      bench http://127.0.0.1:8200 nanovllm_ref "nanovllm_ref $REV serve, defaults + ${COMMON[*]}" $((LIMIT - (SECONDS - T0)))
    fi
  else
    tail -30 "$OUT/serve_nanovllm_ref.log"
  fi
  stop $PID
fi

if [ -n "${STACK_SAMPLE:-}" ]; then
  say "stack samples"
  sleep 1
  ls "$OUT"/stacks.*.json && env PYTHONPATH="$PWD:$SITE" python3 -m nanovllm_bench.stack_sampler report "$OUT"/stacks.*.json --json "$OUT/stacks_report.json" \
    > "$OUT/stacks_report.txt" 2>&1; head -150 "$OUT/stacks_report.txt"
fi

say "figure"
[ -f "$OUT/serve_h200.json" ] && "${CLIENT[@]}" plot --record "$OUT/serve_h200.json" \
  --figure "$OUT/serve_h200.png" --title "H200, Qwen3-0.6B shape (random weights, bf16)"
say "done"
