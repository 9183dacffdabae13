"""What the kernel bench scripts share before torch and Triton are imported (bench/kernels_round5.py,
bench/kernels_round8.py): the common arguments, and the Triton interpreter switch, which must be set before
any @triton.jit kernel is defined (nanovllm_ref/kernels/__init__.py)."""
import argparse
import os


def parser(doc: str, budget: float, sections: str, dry_ms: str | None = None) -> argparse.ArgumentParser:
    """--out, --dry-run, --budget (seconds before no new case starts) and --sections (comma-separated); with
    dry_ms (the dry run's batch sizes, e.g. "1,2") also --ms, read by `batch_sizes`."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, tiny shapes, no timings")
    p.add_argument("--budget", type=float, default=budget, help="seconds before no new case starts")
    p.add_argument("--sections", default=sections)
    if dry_ms is not None:
        p.add_argument("--ms", default=None,
                       help=f"comma-separated batch sizes (default: the GPU's list, or {dry_ms} dry)")
        p.set_defaults(dry_ms=dry_ms)
    return p


def batch_sizes(args, gpu_ms: list[int]) -> list[int]:
    """--ms if given, else the dry run's sizes (parser's dry_ms) on the CPU or gpu_ms."""
    if args.ms:
        return [int(v) for v in args.ms.split(",")]
    return [int(v) for v in args.dry_ms.split(",")] if args.dry_run else list(gpu_ms)


def choose_triton_mode(dry_run: bool) -> None:
    """The interpreter for a dry run on the CPU, the compiler otherwise."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
