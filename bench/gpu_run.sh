#!/usr/bin/env bash
# Every GPU check and benchmark of the project, for the lent H200 (device tool), in one command.
#
#   call 1 (carry .carry/a):  bash bench/gpu_run.sh stage     # copies GGUF part 1 to /tmp on the device
#   call 2 (carry .carry/b):  bash bench/gpu_run.sh all       # everything below; results under $OUT
#   or:                       bash bench/gpu_run.sh bench     # the benchmark alone (no model needed)
#   or:                       bash bench/gpu_run.sh final     # equivalence tests (no SmolLM2) + benchmark
#   call 3 (optional):        bash bench/gpu_run.sh hf        # the HF continuous-batching peer alone
#   or:                       bash bench/gpu_run.sh check     # kernel checks + equivalence/Parts tests, graphs and eager
#   or:                       bash bench/gpu_run.sh round2    # thin-step/warm-up tests, equivalence with graphs,
#                             then the bench: median of 3, batch-1, step profile (kernels per step), graph sweep
#   or:                       bash bench/gpu_run.sh hfmerge   # HF continuous batching into $OUT's bench JSON (MERGE=...)
#   or:                       bash bench/gpu_run.sh round3    # no payload: decode kernels alone, engine tests with
#                             graphs and eager, ours with async + kernels vs without (one run each), step profile
#   or:                       bash bench/gpu_run.sh triton-check  # no payload, ~2-3 min: greedy equivalence in bf16
#                             (attention_backend=triton) with CUDA graphs and eager, told from faults by the
#                             logprob-closeness check (tests/engine_helpers.py); fp32 exactness of the same tests
#                             too (FP32=1, default on); junit XML into $OUT
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh ab4       # ~3-4 min: the baseline engine (.carry/ab/base.tgz,
#                             made by `bash bench/make_ab_base.sh [COMMIT]`) then this tree's, one workload
#                             profile each (plain generate, batch-1, decode probes 1:512 and 256:512), and the
#                             side-by-side table (nanovllm_bench/ab.py); $OUT/ab4.json, profile4_ab_*.json
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh round5    # ~5 min: bench/kernels_round5.py
#                             (decode layers at M = 1-256, the decode attention's launch options and splits, GEMMs
#                             against cuBLAS; SECTIONS picks), then ab4
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh round6    # ~6 min: bench/persistent_probe.py (grid
#                             barrier cost, persistent GEMV chain), bench/persistent_step.py (the persistent batch-1
#                             step against the layers at 4 contexts), then ab4 with the new side's run
#                             triton:graph:persistent (NEW_RUN overrides; decode_kernels="persistent")
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh round8    # ~6 min: bench/kernels_round8.py (the
#                             decode attention's launch order, the q/k kernel's head rows a program, against the base
#                             tree's kernel), then ab4 with the new side's probes profiled by kernel family
#                             (AB_NEW_PROFILE=1, its default here; AB_PROBES picks the probes)
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh round9    # ~6 min: bench/kernels_round9.py (the
#                             decode attention at the workload's own steps in arrival order and longest first; the
#                             decode GEMMs under cuBLAS and cuBLASLt), then ab4 (AB_NEW_PROFILE=1 profiles the new side)
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh round10   # ~2 min + ab4: bench/kernels_round10.py
#                             (the decode GEMM chain, 28 layers at 1-256 rows: weights from HBM, L2-hot, and
#                             prefetched into L2 from a side stream), then ab4 (ROUND10_AB=0: the script alone)
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh round11   # ~4 min + ab4: bench/kernels_round11.py
#                             (each decode projection as cuBLAS or the Triton small GEMM with each candidate tile, in
#                             the GEMM chain at 4-256 rows; the best plan per batch size; kernel time against the
#                             graph replay's span), then ab4 (ROUND11_AB=0: the script alone; R11_MS picks the sizes)
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh round12   # ~1-2 min + ab4: bench/kernels_round12.py
#                             (the decode GEMM chain with each add + RMSNorm inside the next GEMM, 1-32 rows, against
#                             the engine's chain), then ab4 (ROUND12_AB=0: the script alone; R12_MS picks the sizes)
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh round13   # ~1-2 min + ab4: bench/kernels_round13.py
#                             (the decode GEMM chain at 1-64 rows with each small GEMM's first weight tile loaded before
#                             the PDL wait, against the loads after it), then ab4 (ROUND13_AB=0: the script alone)
#   or (carry .carry/ab and .carry/wheels):  bash bench/gpu_run.sh round14   # ~2-3 min + ab4: bench/kernels_round14.py
#                             (read-only bandwidth against the copy's, the decode attention in TB/s, TMA Triton GEMMs
#                             against cuBLAS in the GEMM chain at 96-256 rows, cuBLAS's kernels by name), then ab4
#                             (ROUND14_AB=0: the script alone; R14_MS picks the sizes)
#   or:                       bash bench/gpu_run.sh profile4  # no payload, ~2-3 min: where the workload's time goes
#                             (nanovllm_bench/workload_profile.py): prefill vs decode steps, decode by batch bucket,
#                             device time vs GPU idle, probes at fixed batches (attention / GEMM / other), the LM
#                             head; $OUT/profile4_<TAG>.json + the table in gpu_run.log. RUN=triton:graph (default)
#   or:                       bash bench/gpu_run.sh host-watch  # no payload, WATCH_S + ~20 s: machine.host_probe every
#                             EVERY s (default 2) for WATCH_S (120), nothing else running: does the host's Python speed
#                             move by itself, with steal time, CPU or clock (nanovllm_bench/host_watch.py)
#   or:                       bash bench/gpu_run.sh prefill-step  # no payload, ~1-2 min: one served prefill
#                             step timed (wall, device, host) at 128-4096 tokens and profiled (bench/prefill_step.py);
#                             PREFILL_GRAPHS_RUNS="0 1" runs it without and with prefill CUDA graphs
#   or (carry .carry/wheels from `SERVE=1 bash bench/gpu_wheels.sh`):  bash bench/gpu_run.sh serve-profile
#                             no payload, ~2 min: our server alone at RATES (default 32,inf), one client call per
#                             rate, the Python stacks of the server and its engine core sampled per rate
#                             ($OUT/stacks.*.json, stacks_report.txt/json; nanovllm_bench/stack_sampler.py); STACK_SAMPLE=
#                             (empty) runs the same without the sampler, one client call (serve_h200.json)
#
# Peers (vLLM, upstream nano-vllm, HF, nanovllm_ref's back-ends) in one record: build the payload here first
# (`python -m nanovllm_bench.payload`: parts .carry/peers/p1 .. pN, each <= 40 MiB, so that
# a part and the checkout fit one call's 64 MiB), then back to back:
#   calls 1 .. N-1 (carry .carry/peers/pK):  bash bench/gpu_run.sh peers-stage   # copies part K to /tmp/payload
#   call N        (carry .carry/peers/pN):  NANOVLLM_REF_COMMIT=<commit> bash bench/gpu_run.sh peers
#     checks every part's sha256, unpacks vLLM's site + nano-vllm's source to /tmp/peers, and runs
#     `python3 -m nanovllm_bench` with every peer within DEADLINE_S (default 470 s; RUNS, TAG, REPEATS
#     override). $OUT gets bench_<tag>.json/.csv, its figures, gpu_run.log and peer_logs.tgz (7 files).
#     WARM_START=vllm gives vLLM an untimed start-up first, in a process of its own, so its timed one finds
#     its torch.compile cache (cold 94-108 s; vLLM's median fell as its start-up grew over six records: see
#     bench/results/README.md); it costs ~100 s, so leave HF out then (PEERS=nanovllm_ref,vllm,nano-vllm).
#   then, within 30 s (no carry: the payload is still unpacked), or after staging again:
#                                             bash bench/gpu_run.sh flash-check   # greedy equivalence with
#     attention_backend=flash_attn (vLLM's FA3), bf16, CUDA graphs and eager; junit XML into $OUT
#   or, the online serving benchmark (after the peers-stage calls, carry .carry/peers/pN; or within 30 s of
#   `peers` / `flash-check`, no carry):      bash bench/gpu_run.sh serve
#     `vllm serve` and `python -m nanovllm_ref serve` one after the other, the same client (nanovllm_bench/serve.py)
#     at the same Poisson rates (bench/gpu_serve.sh); $OUT gets serve_h200.json (the record), serve_h200.png, logs
#
# .carry/a/part_aa and .carry/b/part_ab are the two halves of SmolLM2-135M-Instruct.Q4_1.gguf (the device
# takes at most 64 MiB per call); .carry/b also holds the gguf wheel (the device has no PyPI).
# Results come back in $OUT: logs, pytest summaries, kernels.json, bench_h200.json/csv, figures.
set -uo pipefail
mode=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/smol
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" NANOVLLM_REF_HOME=/tmp/nanovllm_home HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
# The engine's own dependencies the device lacks (msgspec, pyzmq: engine/core_messages.py, core_client.py), as
# wheels made by `bash bench/gpu_wheels.sh` and carried in .carry/wheels: unpacked into /tmp/site once.
for whl in .carry/wheels/*.whl; do
  [ -e "$whl" ] || continue
  name=$(basename "$whl" | cut -d- -f1)
  [ -d "/tmp/site/$name" ] || python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/site')" "$whl"
done

if [ "$mode" = peers-stage ]; then
  mkdir -p /tmp/payload && cp .carry/peers/p*/part_* /tmp/payload/ && ls -la /tmp/payload
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  exit 0
fi
if [ "$mode" = stage ]; then
  cp .carry/a/part_aa /tmp/smol/ && ls -la /tmp/smol && nvidia-smi --query-gpu=name,memory.total --format=csv
  exit 0
fi

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
round3() {   # GPU speed round 3, first look: the new decode kernels, the engine's tests, ours A/B (no payload)
  step "versions"
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
  if [ -z "${SKIP_KERNELS:-}" ]; then
    step "decode kernels alone (bench/kernels_round3.py): old vs new layer, kernels per layer, GEMMs vs cuBLAS"
    timeout ${KERNELS_S:-100} python3 bench/kernels_round3.py --out "$OUT/kernels_round3.json" --budget ${KERNELS_BUDGET:-70} 2>&1 | tail -40
  fi
  for cfg in ${CFGS:-graphs eager}; do
    eager=$([ $cfg = eager ] && echo true || echo false)
    step "engine tests on the H200, fp32 vs HF: CUDA graphs $cfg, async scheduling and decode kernels (defaults)"
    NANOVLLM_TEST_ENGINE_ARGS="{\"dtype\": \"float32\", \"enforce_eager\": $eager, \"max_num_seqs\": 16}" \
      timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_engine_equivalence.py \
        tests/test_async_scheduling.py tests/test_engine_stops.py tests/test_engine_request_api.py tests/test_thin_step.py \
        tests/test_fused_kernels_model.py} -k "not tensor_parallel and not tp_engine and not exported" \
      --junitxml="$OUT/pytest_gpu_round3_$cfg.xml" 2>&1 | grep -v DEBUG | tail -12
    [ -n "${ONE_CFG:-}" ] && break
  done
  [ -n "${SKIP_BENCH:-}" ] && return 0
  step "bench: ours, async + decode kernels vs sync without them (round 2's engine): ${REPEATS:-1} run(s) each, batch-1, profile"
  timeout ${BENCH_S:-240} python3 -m nanovllm_bench --peers nanovllm_ref --runs ${RUNS:-triton:graph,triton:graph:sync:nokernels} \
    --repeats ${REPEATS:-1} --batch1-repeats ${B1:-1} --profile --out "$OUT" --tag ${TAG:-h200_round3_smoke} 2>&1 | grep -v DEBUG | tail -30
}
if [ "$mode" = round3 ]; then
  { round3; step "done"; } 2>&1 | tee "$OUT/gpu_run.log"
  exit 0
fi
equiv() {   # equivalence tests vs HF: $1 dtype, $2 back-end, $3 graphs|eager, $4 junit name; PYTHONPATH as set;
            # EQUIV_EXTRA: more engine arguments as JSON members, e.g. '"decode_kernels": "persistent"' 
  eager=$([ $3 = eager ] && echo true || echo false)
  step "greedy equivalence, $2, $1 vs HF $1, CUDA graphs: $3 (fp32 exact; half dtypes: logprob-closeness)"
  PYTHONPATH="${EQUIV_PYTHONPATH:-$PYTHONPATH}" \
  NANOVLLM_TEST_ENGINE_ARGS="{\"dtype\": \"$1\", \"attention_backend\": \"$2\", \"enforce_eager\": $eager, \"max_num_seqs\": 16${EQUIV_EXTRA:+, $EQUIV_EXTRA}}" \
    timeout ${EQUIV_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_engine_equivalence.py \
      ${EQUIV_TESTS:-} -k "not tensor_parallel and not tp_engine" -rs --junitxml="$OUT/$4.xml" 2>&1 | grep -v DEBUG | tail -25
}
if [ "$mode" = triton-check ]; then   # issue 29, item 5: bf16 equivalence on the Triton back-end (no payload)
  {
    step "versions"
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
    for cfg in ${CFGS:-graphs eager}; do equiv bfloat16 triton $cfg pytest_gpu_triton_bf16_$cfg; done
    if [ "${FP32:-1}" = 1 ]; then equiv float32 triton graphs pytest_gpu_triton_fp32_graphs; fi
    step "done"
  } 2>&1 | tee "$OUT/gpu_run.log"
  exit 0
fi
if [ "$mode" = ab4 ] || [ "$mode" = round5 ] || [ "$mode" = round6 ] || [ "$mode" = round8 ] || [ "$mode" = round9 ] || [ "$mode" = round10 ] || [ "$mode" = round11 ] || [ "$mode" = round12 ] || [ "$mode" = round13 ] || [ "$mode" = round14 ]; then   # issue 29: baseline vs this tree's (carry .carry/ab)
  {
    step "versions"
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
    if [ "$mode" = round5 ]; then   # round 5 first: the decode GEMMs and layers (bench/kernels_round5.py)
      step "decode layers, attention and GEMMs (bench/kernels_round5.py, sections ${SECTIONS:-layer,attention,gemm})"
      timeout ${KERNELS_S:-260} python3 bench/kernels_round5.py --out "$OUT/kernels_round5.json" --budget ${KERNELS_BUDGET:-200} \
        --sections ${SECTIONS:-layer,attention,gemm} 2>&1 | tail -${KERNELS_TAIL:-140}
      [ -e .carry/ab/base.tgz ] || { step "done (no .carry/ab: no A/B)"; exit 0; }
    fi
    if [ "$mode" = round6 ]; then   # round 6 first: the persistent batch-1 decode step (kernels/persistent_decode.py)
      step "grid barrier and persistent GEMV chain (bench/persistent_probe.py)"
      timeout ${PROBE_S:-120} python3 bench/persistent_probe.py --out "$OUT/persistent_probe.json" 2>&1 | grep -v '^ \|^[{}]' | tail -8
      step "the persistent step against the layers, Qwen3-0.6B shape, bf16 (bench/persistent_step.py)"
      # STEP_ARGS: more options (e.g. --breakdown --variants '[...]'); STEP2_ARGS: a second run (persistent_step2.json)
      eval "timeout ${STEP_S:-200} python3 bench/persistent_step.py --out $OUT/persistent_step.json ${STEP_ARGS:-}" 2>&1 \
        | tail -${STEP_TAIL:-12}
      if [ -n "${STEP2_ARGS:-}" ]; then
        step "the persistent step, second run: ${STEP2_ARGS}"
        eval "timeout ${STEP2_S:-120} python3 bench/persistent_step.py --out $OUT/persistent_step2.json ${STEP2_ARGS}" 2>&1 \
          | tail -${STEP_TAIL:-12}
      fi
      # No A/B when the step was wrong or its barriers gave up (the engine would run the same kernel).
      python3 -c "import json, sys; c = json.load(open(sys.argv[1]))['cases']; sys.exit(0 if c and all(r.get('layers_us') for r in c) else 1)" \
        "$OUT/persistent_step.json" || { step "done (the persistent step failed its checks: no A/B)"; exit 0; }
      [ -e .carry/ab/base.tgz ] || { step "done (no .carry/ab: no A/B)"; exit 0; }
    fi
    if [ "$mode" = round8 ]; then   # round 8 first: the large-batch attention launch order and q/k kernel
      mkdir -p /tmp/ab_base && tar xzf .carry/ab/base.tgz -C /tmp/ab_base || exit 1
      step "decode attention launch order, q/k norm + RoPE + store (bench/kernels_round8.py)"
      timeout ${KERNELS_S:-150} python3 bench/kernels_round8.py --out "$OUT/kernels_round8.json" --base /tmp/ab_base \
        --budget ${KERNELS_BUDGET:-100} --sections ${SECTIONS:-attention,qk,prefill,sampler,silu} 2>&1 | tail -${KERNELS_TAIL:-80}
      AB_NEW_PROFILE=${AB_NEW_PROFILE:-1}
    fi
    if [ "$mode" = round9 ]; then   # round 9 first: decode rows longest first at the workload's steps, cuBLAS vs Lt
      step "decode attention in arrival order and longest first, decode GEMMs' BLAS library (bench/kernels_round9.py)"
      timeout ${KERNELS_S:-150} python3 bench/kernels_round9.py --out "$OUT/kernels_round9.json" \
        --budget ${KERNELS_BUDGET:-100} --sections ${SECTIONS:-order,gemm} 2>&1 | tail -${KERNELS_TAIL:-60}
    fi
    if [ "$mode" = round10 ]; then   # round 10 first: the decode GEMM chain from HBM, from L2, and L2-prefetched
      step "decode GEMM chain: weights from HBM, L2-hot, prefetched into L2 from a side stream (bench/kernels_round10.py)"
      timeout ${KERNELS_S:-150} python3 bench/kernels_round10.py --out "$OUT/kernels_round10.json" \
        --budget ${KERNELS_BUDGET:-100} --sections ${SECTIONS:-chain} 2>&1 | tail -${KERNELS_TAIL:-40}
      [ "${ROUND10_AB:-1}" = 1 ] && [ -e .carry/ab/base.tgz ] || { step "done (no A/B asked)"; exit 0; }
    fi
    if [ "$mode" = round11 ]; then   # round 11 first: each projection's GEMM and tiles in the decode GEMM chain
      step "decode GEMM chain: cuBLAS or the small GEMM's tiles per projection and batch size (bench/kernels_round11.py)"
      timeout ${KERNELS_S:-290} python3 bench/kernels_round11.py --out "$OUT/kernels_round11.json" \
        --budget ${KERNELS_BUDGET:-230} --sections ${SECTIONS:-sweep,best,trace} ${R11_MS:+--ms $R11_MS} 2>&1 \
        | tail -${KERNELS_TAIL:-70}
      [ "${ROUND11_AB:-1}" = 1 ] && [ -e .carry/ab/base.tgz ] || { step "done (no A/B asked)"; exit 0; }
    fi
    if [ "$mode" = round12 ]; then   # round 12 first: the add + RMSNorm inside the next GEMM's prologue
      step "decode GEMM chain: the engine's against the norms inside the GEMMs, 1-32 rows (bench/kernels_round12.py)"
      timeout ${KERNELS_S:-150} python3 bench/kernels_round12.py --out "$OUT/kernels_round12.json" \
        --budget ${KERNELS_BUDGET:-100} --sections ${SECTIONS:-chain,trace} ${R12_MS:+--ms $R12_MS} 2>&1 \
        | tail -${KERNELS_TAIL:-30}
      [ "${ROUND12_AB:-1}" = 1 ] && [ -e .carry/ab/base.tgz ] || { step "done (no A/B asked)"; exit 0; }
    fi
    if [ "$mode" = round13 ]; then   # round 13 first: each small GEMM's first weight tile loaded before the PDL wait
      step "decode GEMM chain: weights preloaded before the PDL wait, and not, 1-64 rows (bench/kernels_round13.py)"
      timeout ${KERNELS_S:-150} python3 bench/kernels_round13.py --out "$OUT/kernels_round13.json" \
        --budget ${KERNELS_BUDGET:-100} --sections ${SECTIONS:-chain,trace} ${R13_MS:+--ms $R13_MS} 2>&1 \
        | tail -${KERNELS_TAIL:-30}
      [ "${ROUND13_AB:-1}" = 1 ] && [ -e .carry/ab/base.tgz ] || { step "done (no A/B asked)"; exit 0; }
    fi
    if [ "$mode" = round14 ]; then   # round 14 first: read bandwidth, TMA GEMMs at 96-256 rows, cuBLAS's kernels
      step "read bandwidth, decode attention, TMA Triton GEMMs against cuBLAS at 96-256 rows (bench/kernels_round14.py)"
      timeout ${KERNELS_S:-260} python3 bench/kernels_round14.py --out "$OUT/kernels_round14.json" \
        --budget ${KERNELS_BUDGET:-200} --sections ${SECTIONS:-bandwidth,prefill,chain,trace} ${R14_MS:+--ms $R14_MS} 2>&1 \
        | tail -${KERNELS_TAIL:-70}
      [ "${ROUND14_AB:-1}" = 1 ] && [ -e .carry/ab/base.tgz ] || { step "done (no A/B asked)"; exit 0; }
    fi
    # The new side's run: NEW_RUN, else RUN; round 6 asks for the persistent batch-1 step (decode_kernels).
    new_run=${NEW_RUN:-$([ "$mode" = round6 ] && echo triton:graph:persistent || echo "${RUN:-triton:graph}")}
    rm -rf /tmp/ab_base && mkdir -p /tmp/ab_base && tar xzf .carry/ab/base.tgz -C /tmp/ab_base || exit 1
    cat /tmp/ab_base/BASE_COMMIT 2>/dev/null
    for side in ${AB_SIDES:-base new}; do
      # base: the carried nanovllm_ref first on the path, this tree's bench and models; new: this tree only.
      # From /tmp, so that the working directory's own nanovllm_ref does not shadow the carried one.
      root=$([ $side = base ] && echo "/tmp/ab_base:$PWD" || echo "$PWD")
      commit=$([ $side = base ] && cat /tmp/ab_base/BASE_COMMIT 2>/dev/null || echo "${NANOVLLM_REF_COMMIT:-}")
      step "A/B: the $side engine, whole-workload profile (plain generate, batch-1, probes)"
      # AB_NEW_PROFILE=1: the new side's probes (and a prefill probe) also get torch.profiler's kernel families.
      profiled=$([ $side = new ] && [ "${AB_NEW_PROFILE:-0}" = 1 ] && echo 1 || echo 0)
      (cd /tmp && NANOVLLM_REF_COMMIT="$commit" PYTHONPATH="$root:/tmp/site" timeout $([ $profiled = 1 ] && echo ${AB_PROFILED_S:-240} || echo ${AB_S:-170}) python3 -m nanovllm_bench.workload_profile \
        --out "$OUT" --run $([ $side = new ] && echo "$new_run" || echo "${RUN:-triton:graph}") --tag ab_$side $([ $profiled = 1 ] || echo --no-kernel-profile) --probes ${AB_PROBES:-1:512,256:512} \
        --batch1 ${AB_BATCH1:-2} 2>&1 | grep -v DEBUG | grep -v USDT | tail -${AB_TAIL:-24})
    done
    step "A/B table"
    python3 -m nanovllm_bench.ab "$OUT/profile4_ab_base.json" "$OUT/profile4_ab_new.json" --out "$OUT/ab4.json"
    step "done"
  } 2>&1 | tee "$OUT/gpu_run.log"
  exit 0
fi
if [ "$mode" = host-watch ]; then   # issue 29: the host's own speed over time, nothing else running (no payload)
  {
    step "host probes every ${EVERY:-2} s for ${WATCH_S:-120} s (nanovllm_bench/host_watch.py)"
    timeout $(( ${WATCH_S:-120} + 60 )) python3 -m nanovllm_bench.host_watch --seconds ${WATCH_S:-120} \
      --every ${EVERY:-2} --out "$OUT/host_watch.json"
    step "done"
  } 2>&1 | tee "$OUT/gpu_run.log"
  exit 0
fi
if [ "$mode" = prefill-step ]; then   # issue 28: one served prefill step timed and profiled (no payload)
  {
    step "versions"
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
    for g in ${PREFILL_GRAPHS_RUNS:-default}; do
      step "prefill steps (bench/prefill_step.py), prefill graphs: $g"
      if [ "$g" = default ]; then unset PREFILL_GRAPHS; else export PREFILL_GRAPHS=$g; fi
      OUT="$OUT/$g" ; mkdir -p "$OUT"
      timeout ${PREFILL_S:-200} python3 bench/prefill_step.py 2>&1 | grep -v DEBUG | grep -v USDT
      OUT=$(dirname "$OUT")
    done
    step "done"
  } 2>&1 | tee "$OUT/gpu_run.log"
  exit 0
fi
if [ "$mode" = serve-profile ]; then   # issue 28: our server alone, its threads' stacks sampled (no payload)
  # Needs `SERVE=1 bash bench/gpu_wheels.sh` carried (.carry/wheels: FastAPI, uvicorn, pydantic, msgspec, pyzmq).
  {
    step "our server alone at ${RATES:-32,inf} req/s, every process's Python stacks sampled (nanovllm_bench/stack_sampler.py)"
    SITE=/tmp/site SKIP_VLLM=1 STACK_SAMPLE=${STACK_SAMPLE-1} RATES=${RATES:-32,inf} bash bench/gpu_serve.sh 2>&1 | grep -v DEBUG
    step "done"
  } 2>&1 | tee "$OUT/gpu_run.log"
  exit 0
fi
if [ "$mode" = profile4 ]; then   # issue 29: the whole workload profiled (no payload needed)
  {
    step "versions"
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
    step "whole-workload profile of nanovllm_ref[${RUN:-triton:graph}] (nanovllm_bench/workload_profile.py)"
    timeout ${PROFILE4_S:-230} python3 -m nanovllm_bench.workload_profile --out "$OUT" --run ${RUN:-triton:graph} \
      --tag ${TAG:-h200_profile4} ${PROFILE4_ARGS:-} 2>&1 | grep -v DEBUG | grep -v USDT
    step "done"
  } 2>&1 | tee "$OUT/gpu_run.log"
  exit 0
fi
assemble() {   # the staged payload parts (peers-stage) + the carried one -> /tmp/peers/{site,nanovllm_upstream}
  step "peers: assemble the payload (vLLM ${VLLM:-0.20.2} site, upstream nano-vllm source)"
  if [ -d /tmp/peers/site/vllm ]; then echo "already unpacked in this warm machine"; return 0; fi
  mkdir -p /tmp/payload /tmp/peers && cp .carry/peers/p*/part_* /tmp/payload/
  manifest=$(ls .carry/peers/p*/MANIFEST.json | head -1)
  python3 - "$manifest" <<'PY' || exit 1
import hashlib, json, os, sys
m = json.load(open(sys.argv[1]))
for p in m["parts"]:
  path = os.path.join("/tmp/payload", p["file"])
  if not os.path.exists(path):
      sys.exit(f"{p['file']} is missing: stage it first (bash bench/gpu_run.sh peers-stage, within 30 s)")
  if hashlib.sha256(open(path, "rb").read()).hexdigest() != p["sha256"]:
      sys.exit(f"{p['file']}: sha256 differs from MANIFEST.json")
print(f"{len(m['parts'])} parts ok, {m['total_bytes'] / 2**20:.1f} MiB")
PY
  cat /tmp/payload/part_* | xz -dc | tar x -C /tmp/peers || exit 1
  du -sh /tmp/peers/site /tmp/peers/nanovllm_upstream
}

ch13() {   # CH13_FIRST=1 runs it before the other steps, CH13=1 after them
  step "chapter 13, C.4: the capstone's parts (solutions/ exported) vs the reference on the H200"
  timeout 300 python3 bench/ch13_gpu.py --budget-s 240 2>&1 | grep -v DEBUG | tail -20
}
{
  step "versions"
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

  if [ "$mode" = all ]; then
    step "SmolLM2: reassemble + convert"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/b/gguf-*.whl
    cat /tmp/smol/part_aa .carry/b/part_ab > /tmp/smol/model.gguf
    python3 - <<'PY'
from nanovllm_models import download
download.verify_sha256("/tmp/smol/model.gguf", download.MODELS["smollm2"]["sha256"])
print(download.convert_gguf("/tmp/smol/model.gguf", download.model_dir("smollm2")))
PY

    step "kernel checks"
    python3 bench/gpu_kernels.py --out "$OUT/kernels.json" 2>&1 | tail -40

    for cfg in graphs eager; do
      eager=$([ $cfg = eager ] && echo true || echo false)
      step "equivalence tests on GPU, CUDA graphs: $cfg"
      NANOVLLM_TEST_ENGINE_ARGS="{\"dtype\": \"float32\", \"enforce_eager\": $eager, \"max_num_seqs\": 16}" \
        timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_engine_equivalence.py \
          tests/test_engine_tp_and_errors.py tests/test_smollm2_engine.py \
          -k "not tensor_parallel and not tp_engines and not tp_engine" --junitxml="$OUT/pytest_gpu_$cfg.xml" 2>&1 | tail -15
    done

  fi
  if [ "$mode" = check ] && [ -z "${SKIP_KERNELS:-}" ]; then
    step "kernel checks"
    timeout 120 python3 bench/gpu_kernels.py --out "$OUT/kernels.json" 2>&1 | tail -8
  fi
  if [ "$mode" = check ]; then
    for cfg in ${CFGS:-graphs eager}; do
      eager=$([ $cfg = eager ] && echo true || echo false)
      step "equivalence + Parts tests on GPU (fp32 vs HF), CUDA graphs: $cfg"
      NANOVLLM_TEST_ENGINE_ARGS="{\"dtype\": \"float32\", \"enforce_eager\": $eager, \"max_num_seqs\": 16}" \
        timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_engine_equivalence.py tests/test_parts.py \
          tests/test_engine_config_and_checkpoint_faults.py tests/test_triton_engine.py tests/test_sampler_top_k_top_p.py \
          -k "not tensor_parallel and not tp_engine and not exported" \
          --junitxml="$OUT/pytest_gpu_$cfg.xml" 2>&1 | grep -v DEBUG | tail -15
    done
    if [ -z "${NO_TP:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      step "tensor parallel on two GPUs over NCCL (TP=2 vs HF, exported parts in TP workers)"
      NANOVLLM_TEST_ENGINE_ARGS='{"dtype": "float32"}' timeout 240 python3 -m pytest -q -p no:cacheprovider \
        tests/test_engine_tp_and_errors.py tests/test_parts.py -k "(tensor_parallel or tp_engine) and not exported" \
        --junitxml="$OUT/pytest_gpu_tp2.xml" 2>&1 | grep -v DEBUG | tail -15
    fi
  fi
  if [ "$mode" = check ] && [ -n "${CH10:-}" ]; then
    step "chapter 10: E10.4 capture and replay on CUDA, the reference answer and two wrong ones"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_course_ch10.py -k "reference_passes or graph_replay or stub_is_not_done" \
      --junitxml="$OUT/pytest_gpu_ch10.xml" 2>&1 | grep -v DEBUG | tail -12
  fi
  if [ "$mode" = check ] && [ -n "${CH06:-}" ]; then
    step "chapter 06: the solution's decode kernel vs the engine's, timed"
    timeout 180 python3 bench/ch06_kernel_timing.py "$OUT/ch06_kernels_h200.json" 2>&1 | tail -12
  fi
  if [ "$mode" = final ]; then
    step "equivalence tests on GPU with fused kernels and CUDA graphs (fp32 vs HF)"
    NANOVLLM_TEST_ENGINE_ARGS='{"dtype": "float32", "max_num_seqs": 16}' timeout 150 python3 -m pytest -q \
      -p no:cacheprovider tests/test_engine_equivalence.py tests/test_triton_engine.py \
      --junitxml="$OUT/pytest_gpu_fused.xml" 2>&1 | grep -v DEBUG | tail -5
  fi
  if [ -n "${CH13_FIRST:-}" ]; then ch13; fi
  if [ -n "${TP_TESTS:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step "tensor parallel on two GPUs over NCCL (TP=2 vs HF with graphs and eager, compact step messages)"
    # Every Python process (engine subprocesses and TP workers too) dumps its stacks every DIAG_AFTER_S seconds
    # into $OUT/diag/<pid>.txt while it runs; files of processes that ended sooner are removed below.
    mkdir -p /tmp/diag "$OUT/diag" && cat > /tmp/diag/sitecustomize.py <<PYEOF
import faulthandler, os, sys
_f = open(os.path.join("$OUT/diag", "%d.txt" % os.getpid()), "w")
_f.write(" ".join(sys.argv)[:300] + "\n"); _f.flush()
faulthandler.dump_traceback_later(${DIAG_AFTER_S:-60}, repeat=True, exit=False, file=_f)
PYEOF
    PYTHONPATH="/tmp/diag:$PYTHONPATH" NANOVLLM_TEST_ENGINE_ARGS='{"dtype": "float32"}' timeout ${TP_TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider \
      tests/test_engine_tp_and_errors.py tests/test_parts.py -k "${TP_TESTS_K:-(tensor_parallel or tp_engine or tp_step) and not exported}" \
      --junitxml="$OUT/pytest_gpu_tp2.xml" > "$OUT/pytest_gpu_tp2.log" 2>&1
    grep -v DEBUG "$OUT/pytest_gpu_tp2.log" | grep -v "^  File \"/opt" | tail -25
    for f in "$OUT"/diag/*.txt; do [ "$(wc -l < "$f")" -le 1 ] && rm -f "$f"; done
    echo "stack dumps of processes that ran over ${DIAG_AFTER_S:-60} s: $(ls "$OUT/diag" | wc -l)"
  fi
  if [ -n "${TP_COMM:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step "TP=2 communication per decode step alone (NCCL all-reduces eager and in a CUDA graph, logits gather)"
    timeout 120 python3 bench/tp_comm.py --out "$OUT" 2>&1 | grep -v DEBUG | tail -6
  fi
  if [ -n "${TP_PROFILE:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step "TP=2 and TP=1 on the same host: one timed run, batch-1 decode, step profile (every step timed; graph step ms)"
    for tp in 2 1; do
      timeout 200 python3 -m nanovllm_bench --runs triton:graph --peers nanovllm_ref --repeats 1 --profile \
        --tensor-parallel-size $tp --out "$OUT" --tag tp${tp}_profile 2>&1 | grep -v DEBUG | grep -v torch_dtype | tail -9
    done
  fi
  if [ -n "${TP_BENCH:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step "benchmark: TP=1 and TP=2 on two H200s (triton, CUDA graphs), batch-1 decode"
    [ -z "${NO_TP1:-}" ] && timeout 200 python3 -m nanovllm_bench --runs triton:graph --peers nanovllm_ref --repeats ${TP_REPEATS:-3} --out "$OUT" --tag tp1 2>&1 | grep -v DEBUG | tail -12
    timeout ${TP2_TIMEOUT:-260} python3 -m nanovllm_bench --runs triton:graph --peers nanovllm_ref --repeats ${TP_REPEATS:-3} --tensor-parallel-size 2 --out "$OUT" --tag tp2 2>&1 | grep -v DEBUG | tail -12
  fi
  if [ "$mode" = all ] || [ "$mode" = bench ] || [ "$mode" = final ]; then
    step "benchmark: nanovllm_ref (triton, graphs and eager), HF continuous batching, batch-1 decode, CUDA-graph sweep"
    timeout ${BENCH_TIMEOUT:-540} python3 -m nanovllm_bench --runs ${BENCH_RUNS:-triton:graph,triton:eager} --graph-sweep \
      --out "$OUT" --figures "$OUT" 2>&1 | grep -v DEBUG
  fi

  if [ "$mode" = round2 ] && [ -z "${NO_TESTS:-}" ]; then
    step "thin step, warm-up (no compile in generate), equivalence, Parts, faults, top-k/top-p on GPU with CUDA graphs"
    NANOVLLM_TEST_ENGINE_ARGS='{"dtype": "float32", "enforce_eager": false, "max_num_seqs": 16}' \
      timeout 300 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_thin_step.py tests/test_engine_equivalence.py \
        tests/test_parts.py tests/test_engine_config_and_checkpoint_faults.py tests/test_triton_engine.py tests/test_sampler_top_k_top_p.py} \
        -k "not tensor_parallel and not tp_engine and not exported" --junitxml="$OUT/pytest_gpu_round2.xml" 2>&1 | grep -v DEBUG | tail -15
    if [ -n "${EAGER:-}" ]; then
      step "equivalence on GPU without graphs"
      NANOVLLM_TEST_ENGINE_ARGS='{"dtype": "float32", "enforce_eager": true, "max_num_seqs": 16}' \
        timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_engine_equivalence.py \
        --junitxml="$OUT/pytest_gpu_round2_eager.xml" 2>&1 | grep -v DEBUG | tail -5
    fi
  fi
  if [ "$mode" = round2 ] && [ -z "${NO_BENCH:-}" ]; then
    step "benchmark round 2: triton + CUDA graphs, median of 3 fresh engines, batch-1, step profile, graph sweep"
    timeout ${BENCH_TIMEOUT:-400} python3 -m nanovllm_bench --runs triton:graph --peers ${PEERS:-nanovllm_ref} --repeats 3 \
      --profile --graph-sweep --out "$OUT" --figures "$OUT" --tag ${TAG:-h200} 2>&1 | grep -v DEBUG
  fi
  if [ "$mode" = peers ]; then
    assemble || exit 1
    step "peers: nanovllm_ref (${RUNS:-triton:graph,flash_attn:graph}), vLLM, nano-vllm, HF continuous batching"
    PYTHONPATH="$PWD:/tmp/peers/site" timeout ${PEERS_TIMEOUT:-520} python3 -m nanovllm_bench \
      --runs ${RUNS:-triton:graph,flash_attn:graph} --peers ${PEERS:-nanovllm_ref,vllm,nano-vllm,hf} \
      --nanovllm-src /tmp/peers/nanovllm_upstream --repeats ${REPEATS:-3} --hf-repeats ${HF_REPEATS:-1} \
      --deadline-s ${DEADLINE_S:-470} --logs /tmp/peer_logs --out "$OUT" --figures "$OUT" \
      ${WARM_START:+--warm-start $WARM_START} --tag ${TAG:-h200_peers} 2>&1 | grep -v DEBUG
    tar czf "$OUT/peer_logs.tgz" -C /tmp peer_logs && ls -la "$OUT"
  fi
  if [ "$mode" = flash-check ]; then
    assemble || exit 1
    # bf16 greedy equivalence with attention_backend=flash_attn (vLLM's FA3), graphs and eager: a divergence
    # from HF bf16 passes only as a near tie on both sides (tests/engine_helpers.py, check_logprobs_close)
    for cfg in ${CFGS:-graphs eager}; do
      EQUIV_PYTHONPATH="$PWD:/tmp/peers/site" EQUIV_TIMEOUT=${FLASH_TIMEOUT:-200} equiv bfloat16 flash_attn $cfg pytest_gpu_flash_bf16_$cfg
    done
    if [ -n "${PROFILE:-}" ]; then
      step "step profile of ours (triton, graphs, async, decode kernels): every step of the workload, decode steps at 1/64/256"
      timeout ${PROFILE_S:-200} python3 -m nanovllm_bench --peers nanovllm_ref --runs triton:graph --repeats 1 \
        --batch1-repeats 0 --profile --out "$OUT" --tag ${PROFILE_TAG:-h200_round3_profile} 2>&1 | grep -v DEBUG | tail -12
    fi
  fi
  if [ "$mode" = serve ]; then
    assemble || exit 1
    step "online serving: vllm serve, then nanovllm_ref serve; same client, same Poisson rates (bench/gpu_serve.sh)"
    SITE=/tmp/peers/site bash bench/gpu_serve.sh 2>&1 | grep -v DEBUG
    ls -la "$OUT"
  fi
  if [ "$mode" = hfmerge ]; then
    step "HF transformers continuous batching, merged into ${MERGE}"
    timeout 400 python3 -m nanovllm_bench --peers hf --merge "$MERGE" --out "$OUT" --figures "$OUT" --tag ${TAG:-h200} 2>&1 | tail -8
  fi
  if [ -n "${CH13:-}" ]; then ch13; fi
  if [ "$mode" = hf ]; then
    step "HF transformers continuous batching peer"
    timeout 500 python3 -m nanovllm_bench --peers hf --merge bench/results/bench_h200.json --out "$OUT" --figures "$OUT" 2>&1 | tail -20
  fi
  step "done"
} 2>&1 | tee "$OUT/gpu_run.log"
