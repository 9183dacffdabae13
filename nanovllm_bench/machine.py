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


SOURCE_PACKAGES = ("nanovllm_ref", "nanovllm_models", "nanovllm_bench")


def source_digest(root: str | None = None) -> dict:
    """sha256 (first 16 hex digits) of every .py file of the engine, its models and this harness, in path order,
    per package: what a record ran, where `commit` is only what the run was told (a device call copies the
    working tree, uncommitted edits included; on 2026-12-06 a planted fault in cli.py ran under a clean
    commit name). `git ls-files` of a checkout gives the same files, so a digest is checked against a commit by
    running this there. Returns {package: digest}, None for a package absent under root."""
    import hashlib
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for pkg in SOURCE_PACKAGES:
        base = os.path.join(root, pkg)
        if not os.path.isdir(base):
            out[pkg] = None
            continue
        h = hashlib.sha256()
        files = sorted(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
                       for d, dirs, fs in os.walk(base) if "__pycache__" not in d for f in fs if f.endswith(".py"))
        for rel in files:
            with open(os.path.join(root, rel), "rb") as f:
                h.update(rel.encode() + b"\0" + hashlib.sha256(f.read()).digest())
        out[pkg] = h.hexdigest()[:16]
    return out


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


def _cpu_times(path: str = "/proc/stat") -> tuple[int, int, int] | None:
    """(busy, steal, total) jiffies of all CPUs from /proc/stat (Linux; steal, the 8th field, is time the
    hypervisor gave another guest, and counts in busy); None elsewhere."""
    try:
        with open(path) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
    # guest and guest_nice (fields 9-10) are already inside user and nice: leave them out of the total
    total = sum(fields[:8])
    return total - idle, fields[7] if len(fields) > 7 else 0, total


def _this_cpu(stat: str = "/proc/self/stat", cpuinfo: str = "/proc/cpuinfo") -> tuple[int | None, float | None]:
    """(the CPU this process runs on now, its clock in MHz): /proc/self/stat's field 39 and that CPU's
    "cpu MHz" line in /proc/cpuinfo (a VM may report a fixed figure); None for what cannot be read."""
    cpu = mhz = None
    try:
        with open(stat) as f:
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])   # fields after the name start at field 3
    except (OSError, ValueError, IndexError):
        return None, None
    try:
        with open(cpuinfo) as f:
            current = None
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "processor":
                    current = int(value)
                elif key == "cpu MHz" and current == cpu:
                    mhz = float(value)
                    break
    except (OSError, ValueError):
        pass
    return cpu, mhz


class _Box:
    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


def python_loop_ns(n: int = 100_000, best_of: int = 1) -> float:
    """ns an iteration of a fixed pure-Python loop (an attribute, a dict lookup, list appends: the kind of work
    a host-bound engine step does), the best of `best_of` runs of n iterations; about 8 ms a run at 80 ns.
    host_probe's first figure; peer.measure takes one before each batch-1 run, since the lent hosts' speed
    flips within seconds (bench/results/README.md, 2026-12-06)."""
    def loop() -> float:
        box, table, items = _Box(), {i: i for i in range(64)}, []
        t = time.perf_counter()
        for i in range(n):
            box.n += table[i & 63]
            items.append(box.n)
            if len(items) > 32:
                items.clear()
        return time.perf_counter() - t
    return min(loop() for _ in range(best_of)) / n * 1e9


def host_probe(window_s: float = 0.25) -> dict:
    """How fast this host runs host-side engine work just now, and how busy its CPUs are (about 0.3 s; a
    process's first call also pays torch's import, about 1 s).

    A peer whose steps wait on Python and on PyTorch's op dispatch (vLLM and nano-vllm at batch 1) runs slower
    on a slow or busy host, while a GPU-bound one does not; so a record keeps, for every peer, this probe
    before its timed runs and after its batch-1 runs (`peer.measure`), and one at the start of the call.

    Returns python_loop_ns (ns an iteration of a fixed pure-Python loop: dict, attribute and list work; best of
    3), torch_op_us (us a `torch.add(a, b, out=c)` on 16-element CPU tensors: op dispatch; best of 3),
    cpu_busy (fraction 0-1 of all CPUs busy over `window_s` seconds while this process sleeps, from
    /proc/stat: other processes' work; None off Linux), cpu_steal (the part of that the hypervisor gave other
    guests), load_1m (the 1-minute load average), cpus, and cpu / cpu_mhz (the CPU the probe ran on and its
    clock as /proc/cpuinfo gives it; None where unreadable). Why the last three: on 2026-12-06's H100 machines
    the Python loop took 78 ns an iteration at some moments and 171-191 ns at others with no CPU busy, so the
    next record should say whether that was another guest, a clock, or where the process ran.
    """
    import torch

    python_ns = python_loop_ns(best_of=3)
    a, b, c = torch.ones(16), torch.ones(16), torch.empty(16)
    def ops(k: int) -> float:
        t = time.perf_counter()
        for _ in range(k):
            torch.add(a, b, out=c)
        return time.perf_counter() - t
    k = 2_000
    torch_us = min(ops(k) for _ in range(3)) / k * 1e6
    cpu, mhz = _this_cpu()
    before = _cpu_times()
    time.sleep(window_s)
    after = _cpu_times()
    busy = steal = None
    if before and after and after[2] > before[2]:
        busy = (after[0] - before[0]) / (after[2] - before[2])
        steal = (after[1] - before[1]) / (after[2] - before[2])
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return dict(python_loop_ns=python_ns, torch_op_us=torch_us, cpu_busy=busy, cpu_steal=steal, load_1m=load,
                cpus=os.cpu_count(), cpu=cpu, cpu_mhz=mhz)


def compile_cache_census() -> dict:
    """Entries (top-level files and folders) in the compile caches a peer can find from an earlier process of
    this machine: vLLM's torch.compile cache ($VLLM_CACHE_ROOT, else vllm under $XDG_CACHE_HOME or ~/.cache;
    in it torch_compile_cache), Inductor's ($TORCHINDUCTOR_CACHE_DIR or <tmp>/torchinductor_<user>) and
    Triton's ($TRITON_CACHE_DIR, else .triton/cache under $TRITON_HOME or ~). 0 where the folder is absent.
    A peer started with them empty compiles in its start-up (vLLM 0.20 on the H200: start-up 94-108 s cold,
    46 s warm)."""
    import getpass
    import tempfile
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    folders = dict(
        vllm=os.path.join(os.environ.get("VLLM_CACHE_ROOT") or os.path.join(xdg, "vllm"), "torch_compile_cache"),
        inductor=os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                           f"torchinductor_{user}"),
        triton=os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.environ.get("TRITON_HOME") or home,
                                                                  ".triton", "cache"))
    out = {}
    for name, path in folders.items():
        try:
            out[name] = len(os.listdir(path))
        except OSError:
            out[name] = 0
    return out
