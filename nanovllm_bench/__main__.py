"""`python -m nanovllm_bench ...`: the benchmark (nanovllm_bench/cli.py); `python -m nanovllm_ref bench` forwards here."""
import sys

from nanovllm_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
