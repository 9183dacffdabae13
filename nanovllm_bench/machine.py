"""What a record says about where it ran: the machine's copy bandwidth and matmul rate (the floor's inputs),
software versions, and compile counters (a timed run that compiled paid for it)."""
import os
import platform
import subprocess
import time

# torch is imported where it is used: a peer process that stops before measuring (its engine is not installed,
# fails to start or dies) then never pays torch's import (~2 s of CPU).


def measure_machine(device: str) -> dict:
    """Copy bandwidth (read + write bytes / s) and bf16 (GPU) or fp32 (CPU) matmul FLOP/s."""
    import torch
    if device == "cuda":
        x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            y.copy_(x)
        torch.cuda.synchronize()
        bw = 2 * x.numel() * 20 / (time.perf_counter() - t)
        del x, y
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        flops = 2 * 8192**3 * 20 / (time.perf_counter() - t)
        del a, b
        torch.cuda.empty_cache()
    else:
        x = torch.empty(256 * 2**20, dtype=torch.uint8)
        y = torch.empty_like(x)
        y.copy_(x)
        t = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        bw = 2 * x.numel() * 5 / (time.perf_counter() - t)
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        a @ b
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        flops = 2 * 1024**3 * 10 / (time.perf_counter() - t)
    return dict(copy_bandwidth_Bps=bw, matmul_flops=flops)


def _version(module: str):
    try:
        return __import__(module).__version__
    except Exception:
        return None


def project_commit() -> str | None:
    """This checkout's commit: $NANOVLLM_REF_COMMIT when set (a device run: the device's copy of the tree may
    carry a .git whose HEAD is not the commit the files are from — seen on 2026-12-01, where it named the
    session's base), else `git rev-parse` of the checkout."""
    if os.environ.get("NANOVLLM_REF_COMMIT"):
        return os.environ["NANOVLLM_REF_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except Exception:
        pass
    return None


def versions() -> dict:
    """torch, triton, transformers and Python of this process."""
    import torch
    return dict(torch=torch.__version__, triton=_version("triton"), transformers=_version("transformers"),
                python=platform.python_version())


def device_name(device: str) -> str:
    import torch
    return torch.cuda.get_device_name(0) if device == "cuda" else (platform.processor() or platform.machine() or "cpu")


def compile_counts() -> dict:
    """Compiles so far in this process: torch.compile graphs (Dynamo's unique_graphs) and compiled binaries of
    nanovllm_ref's Triton kernels (their per-device caches; None when the engine is not loaded here). A
    difference across a timed run means it paid a compile."""
    import sys
    from torch._dynamo.utils import counters
    out = dict(dynamo_graphs=int(counters["stats"]["unique_graphs"]), triton_kernels=None)
    if "nanovllm_ref.kernels" in sys.modules:
        try:
            from nanovllm_ref.kernels import attention, store_kvcache
            n = 0
            for mod in (attention, store_kvcache):
                for fn in vars(mod).values():
                    caches = getattr(fn, "device_caches", None)
                    if isinstance(caches, dict):
                        n += sum(len(c[0]) for c in caches.values())
            out["triton_kernels"] = n
        except Exception:                               # another Triton layout: count Dynamo only
            pass
    return out


def compiles_between(before: dict, after: dict) -> dict:
    return {k: (after[k] - before[k]) if after[k] is not None and before[k] is not None else None for k in before}
