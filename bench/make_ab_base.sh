#!/usr/bin/env bash
# The baseline engine for `bench/gpu_run.sh ab4`: .carry/ab/base.tgz holds nanovllm_ref and nanovllm_models of
# COMMIT (default 4c73287: the engine of ae49a08, measured in 2026-12-01's peers call, with the profiler) and a
# BASE_COMMIT file naming it. ~0.2 MB; carry .carry/ab in the device call.
set -euo pipefail
commit=${1:-4c73287}
mkdir -p .carry/ab
tmp=$(mktemp -d)
git archive "$commit" nanovllm_ref nanovllm_models | tar x -C "$tmp"
git rev-parse --short "$commit" > "$tmp/BASE_COMMIT"
tar czf .carry/ab/base.tgz -C "$tmp" .
rm -rf "$tmp"
ls -la .carry/ab/base.tgz && cat .carry/ab/base.tgz | tar tz | head -3
