"""What the kernel bench scripts share before torch and Triton are imported (bench/kernels_round5.py,
bench/kernels_round8.py): the common arguments, and the Triton interpreter switch, which must be set before
any @triton.jit kernel is defined (nanovllm_ref/kernels/__init__.py)."""
import argparse
import os


def parser(doc: str, budget: float, sections: str) -> argparse.ArgumentParser:
    """--out, --dry-run, --budget (seconds before no new case starts) and --sections (comma-separated)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, tiny shapes, no timings")
    p.add_argument("--budget", type=float, default=budget, help="seconds before no new case starts")
    p.add_argument("--sections", default=sections)
    return p


def choose_triton_mode(dry_run: bool) -> None:
    """The interpreter for a dry run on the CPU, the compiler otherwise."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
