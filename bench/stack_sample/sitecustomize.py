# Put this folder on PYTHONPATH with NANOVLLM_STACK_SAMPLE=<path prefix> set, and every Python process that
# starts samples its threads' stacks into <prefix>.<pid>.json (nanovllm_bench/stack_sampler.py says how).
import os

if os.environ.get("NANOVLLM_STACK_SAMPLE"):
    try:
        from nanovllm_bench.stack_sampler import start_from_env
        start_from_env()
    except Exception as exc:                      # never stop the program being profiled
        import sys
        print(f"stack sampler not started: {exc!r}", file=sys.stderr)
