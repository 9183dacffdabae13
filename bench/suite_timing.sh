#!/usr/bin/env bash
# The test suite's own load test (issue 32): `make test` on a quiet machine, then with every core kept busy, each
# timed, both written to one record that the README's test section cites.
#
#   bench/suite_timing.sh [--only quiet|loaded] [--out FILE]      (or: make suite-timing)
#
# Busy: stress-ng (Debian: apt-get install -y stress-ng) with one CPU worker per core, or, without it, one shell
# busy loop per core. The stressors are started by this script and stopped by their ids when it ends. The
# install (make install model) runs first and is not timed. Quiet means nothing else runs: stop other jobs first;
# the load average before each run is in the record.
#
# Record (JSON, default bench/results/suite_timing_<date>.json): per run the wall seconds of `make test`, its exit
# status, pytest's summary line, the load average before and after, the stressor, and the chapter timings
# report of that run (artifacts/chapter_timings.json). SUITE_CMD times another command instead (e.g.
# SUITE_CMD='make test-fast'); the record names it.
set -euo pipefail
cd "$(dirname "$0")/.."
ONLY=""
OUT="bench/results/suite_timing_$(date +%Y-%m-%d).json"
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "suite_timing.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$ONLY" in ""|quiet|loaded) ;; *) echo "suite_timing.sh: --only takes quiet or loaded, got '$ONLY'" >&2; exit 2 ;; esac

SUITE_CMD="${SUITE_CMD:-make test}"
make install model >/dev/null
WORK="$(mktemp -d)"
STRESS_PIDS=()
stop_stress() {
  for pid in "${STRESS_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${STRESS_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  STRESS_PIDS=()
}
trap 'stop_stress; rm -rf "$WORK"' EXIT

STRESSOR=none
start_stress() {   # not in a subshell: the stressors' ids must reach STRESS_PIDS here
  local cores; cores="$(nproc)"
  if command -v stress-ng >/dev/null; then
    stress-ng --cpu "$cores" --quiet </dev/null >/dev/null 2>&1 &
    STRESS_PIDS+=($!)
    STRESSOR="stress-ng --cpu $cores"
  else
    for _ in $(seq "$cores"); do
      bash -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &
      STRESS_PIDS+=($!)
    done
    STRESSOR="$cores shell busy loops"
  fi
}

run() {   # run NAME: time `make test`, write $WORK/NAME.json
  local name="$1" start end rc
  STRESSOR=none
  if [ "$name" = loaded ]; then start_stress; sleep 5; fi
  local stressor="$STRESSOR"
  local load_before; load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
  echo "== $SUITE_CMD ($name; stressor: $stressor; load average $load_before)"
  rm -f artifacts/chapter_timings.json
  start="$(date +%s.%N)"
  set +e
  bash -c "$SUITE_CMD" 2>&1 | tee "$WORK/$name.log" | tail -n 40
  rc="${PIPESTATUS[0]}"
  set -e
  end="$(date +%s.%N)"
  local load_after; load_after="$(cut -d' ' -f1-3 /proc/loadavg)"
  [ "$name" = loaded ] && stop_stress
  .venv/bin/python - "$WORK/$name.json" "$name" "$stressor" "$start" "$end" "$rc" "$load_before" "$load_after" \
      "$WORK/$name.log" "$SUITE_CMD" <<'EOF'
import json, re, sys
from pathlib import Path
out, name, stressor, start, end, rc, before, after, log, cmd = sys.argv[1:]
lines = Path(log).read_text(errors="replace").splitlines()
summary = next((l.strip("= ") for l in reversed(lines) if re.search(r"\d+ (passed|failed)", l)), None)
timings = Path("artifacts/chapter_timings.json")
Path(out).write_text(json.dumps({
    "run": name, "command": cmd, "stressor": stressor, "wall_s": round(float(end) - float(start), 1), "exit_status": int(rc),
    "summary": summary, "load_average_before": before, "load_average_after": after,
    "chapter_timings": json.loads(timings.read_text()) if timings.is_file() else None}, indent=1))
EOF
  echo "== $name: $(.venv/bin/python -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['wall_s'], 's, exit', r['exit_status'], '|', r['summary'])" "$WORK/$name.json")"
}

[ "$ONLY" != loaded ] && run quiet
[ "$ONLY" != quiet ] && run loaded
mkdir -p "$(dirname "$OUT")"
.venv/bin/python - "$OUT" "$WORK" <<'EOF'
import json, os, platform, subprocess, sys
from pathlib import Path
out, work = sys.argv[1:]
runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(work).glob("*.json"))}
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                            text=True).stdout.strip())
record = {"what": "the test suite's wall time, quiet and with every core busy (bench/suite_timing.sh)",
          "commit": commit + ("+dirty" if dirty else ""), "cpus": os.cpu_count(), "machine": platform.machine(),
          "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "runs": runs}
old = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
if old.get("commit") == record["commit"]:
    record["runs"] = {**old.get("runs", {}), **runs}      # --only quiet, then --only loaded: one record
Path(out).write_text(json.dumps(record, indent=1) + "\n")
print(f"wrote {out}")
EOF
