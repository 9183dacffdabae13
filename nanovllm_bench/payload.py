"""Build the payload that carries vLLM, upstream nano-vllm and a few wheels to the lent GPU machine.

    python -m nanovllm_bench.payload [--out .carry/peers] [--cache .carry/cache]

The GPU machine has no package index and takes at most 64 MiB per call (the checkout, about 5 MiB,
included) and keeps /tmp only while warm (30 s between calls). So on this machine, from the package index:
1. `pip download` vllm==0.20.2 (its wheel is manylinux_2_35; vLLM 0.20 pins the device's torch 2.11 /
   CUDA 13.0) and walk its Requires-Dist (`closure`), leaving out what the device image already has
   (/work/.library/device/KINDS.md, "Python packages already there": `present_packages`) and the heavy
   optional kernels (`SKIP`); two fixes found on the device: add pycountry, take apache-tvm-ffi==0.1.11;
2. add the wheels other GPU steps need (`EXTRA_ROOTS`: FastAPI, uvicorn and the `openai` client for the
   serving benchmark; nbval, nbclient, ipykernel, ... for a notebook run; gguf), with their dependencies
   the device lacks;
3. unpack every wheel into one `site/` folder, delete the shared objects a Qwen3 run on Hopper never imports
   (`STRIP`: FA2, MoE, FlashMLA; each import is guarded in vLLM), add upstream nano-vllm's source (`git
   archive` of the local mirror at NANOVLLM_COMMIT, never committed here) as `nanovllm_upstream/`;
4. tar + xz -9e the lot (measured 2026-12-01: 468 MiB -> 114.0 MiB; zstd -19 --long=27 gave 118.3 MiB, which
   would not fit two parts), split it into parts of at most `--part-mib`, one folder per part (`pN/`), each part
   with its sha256 in MANIFEST.json, and print the device commands (bench/gpu_run.sh peers-stage / peers).
The parts live in a git-ignored folder. Nothing of vLLM or nano-vllm is committed.
"""
import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

VLLM = "vllm==0.20.2"
VLLM_PLATFORM = "manylinux_2_35_x86_64"
NANOVLLM_MIRROR = "/work/.mirror/GeeeekExplorer+nano-vllm/repo"
NANOVLLM_COMMIT = "bb823b3"
KINDS_MD = "/work/.library/device/KINDS.md"
PYTHON = "3.12"                                   # the device's Python 3.12.3, x86_64 Linux
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64"]
# Optional kernels vLLM lists but a Qwen3 run on Hopper with FA3 never imports, what the device has in
# another form (torch's own build), and optional imports of the tools carried (fastapi[standard]'s command
# line and its cloud client; ipykernel's debugger, IPython's completion): each is imported under a guard or
# by a command nobody runs there. Leaving them out keeps the payload small (114 MiB: three 40 MiB parts).
SKIP = {canonicalize_name(n) for n in (
    "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "tilelang", "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base", "quack-kernels", "fastsafetensors", "nvidia-cudnn-frontend", "torch",
    "torchaudio", "torchvision", "numba", "opencv-python-headless", "setuptools", "triton",
    "fastapi-cli", "fastapi-cloud-cli", "debugpy", "jedi")}
OVERRIDES = {"apache-tvm-ffi": "apache-tvm-ffi==0.1.11"}   # vLLM pins 0.1.9; xgrammar 0.2.9 needs >= 0.1.11
EXTRA_ROOTS = {
    "vllm fixes": ["pycountry"],                            # mistral_common imports it
    "serving": ["fastapi", "uvicorn", "starlette", "pydantic", "pydantic-core", "openai"],
    "notebooks": ["nbval", "nbclient", "nbformat", "ipykernel", "jupyter_client", "ipython"],
    "models": ["gguf"],
}
STRIP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C.abi3.so", "vllm/_flashmla_C.abi3.so",
         "vllm/_flashmla_extension_C.abi3.so")


def present_packages(kinds_md: str) -> set[str]:
    """Canonical names from KINDS.md's "Python packages already there" section ("Packages: a, b, c.")."""
    section = kinds_md.split("## Python packages already there", 1)[-1]
    listed = section.split("Packages:", 1)[-1].split("\n\n", 1)[0]
    return {canonicalize_name(n.strip().rstrip(".")) for n in listed.split(",") if n.strip().rstrip(".")}


def device_environment() -> dict:
    """Marker environment of the device's Python (3.12.3, CPython, x86_64 Linux)."""
    env = default_environment()
    env.update(python_version=PYTHON, python_full_version="3.12.3", platform_machine="x86_64", sys_platform="linux",
               platform_system="Linux", implementation_name="cpython", os_name="posix",
               platform_python_implementation="CPython")
    return env


def wanted(req: Requirement, env: dict, extras=()) -> bool:
    """Whether `req` applies on the device for a package installed with `extras`."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate(dict(env, extra=e)) for e in ("", *extras))


def wheel_requirements(wheel: str | os.PathLike) -> list[Requirement]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")]


def closure(roots, requirements_of, have: dict, skip: set = SKIP, overrides: dict = OVERRIDES, env=None):
    """Breadth-first walk of requirements from `roots` (Requirement objects or strings). Returns
    (specs to download in order, {name: why it was left out}). `requirements_of(spec) -> list[Requirement]`
    fetches one package by its download spec and returns its Requires-Dist. `have`: name -> why it needs no
    download (on the device already, brought by an earlier group). The first spec met for a name wins,
    except names in `overrides`, which take the override's spec; a later requirement of the same name with
    more extras walks the requirements those extras add."""
    env = env or device_environment()
    queue = [(Requirement(r) if isinstance(r, str) else r, ()) for r in roots]
    extras_of, spec_of, left_out, order = {}, {}, {}, []
    while queue:
        req, parent_extras = queue.pop(0)
        name = canonicalize_name(req.name)
        if not wanted(req, env, parent_extras):
            continue
        if name in have or name in skip:
            left_out.setdefault(name, have.get(name) or "optional kernel, not needed here")
            continue
        extras = set(req.extras)
        if name in extras_of:
            if not extras - extras_of[name]:
                continue
            extras_of[name] |= extras
        else:
            extras_of[name], spec_of[name] = extras, overrides.get(name) or f"{req.name}{req.specifier}"
            order.append(spec_of[name])
        for sub in requirements_of(spec_of[name]):
            queue.append((sub, tuple(sorted(extras_of[name]))))
    return order, left_out


def _cached_wheel(cache: Path, spec: str) -> Path | None:
    req = Requirement(spec)
    for whl in sorted(cache.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(whl.name)
        if name == canonicalize_name(req.name) and req.specifier.contains(version, prereleases=True):
            return whl
    return None


def pip_download(spec: str, cache: Path) -> Path:
    """The wheel for `spec` in `cache`, downloaded (no deps, binary only, for the device) when absent."""
    found = _cached_wheel(cache, spec)
    if found:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp", "--abi", "cp312",
           "--abi", "abi3", "--abi", "none", *[a for p in PLATFORMS for a in ("--platform", p)],
           "--platform", "any", "-d", str(cache), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = _cached_wheel(cache, spec)
    if proc.returncode or not found:
        raise RuntimeError(f"pip download {spec} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return found


def unpack_wheel(wheel: Path, site: Path) -> None:
    """Unzip a wheel into `site`, moving its *.data/purelib and platlib contents up (as an install does)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue                            # scripts, headers, data: not needed to import
                parts = parts[2:]
            target = site.joinpath(*parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)


def split_sizes(total: int, part_bytes: int) -> list[int]:
    """Sizes of the parts `total` bytes split into, each at most part_bytes, as even as possible."""
    n = max(1, -(-total // part_bytes))
    base, extra = divmod(total, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def nanovllm_source(dest: Path, mirror: str = NANOVLLM_MIRROR, commit: str = NANOVLLM_COMMIT) -> None:
    """Upstream nano-vllm's `nanovllm` package at `commit`, from the local mirror, into dest (+ COMMIT)."""
    data = subprocess.run(["git", "-C", mirror, "archive", commit, "nanovllm", "LICENSE"], capture_output=True,
                          check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        t.extractall(dest, filter="data")
    (dest / "COMMIT").write_text(commit + "\n")


def build(out: Path, cache: Path, part_mib: float, log=print) -> dict:
    cache.mkdir(parents=True, exist_ok=True)
    wheels_dir = cache / "wheels"
    wheels_dir.mkdir(exist_ok=True)
    present = present_packages(Path(KINDS_MD).read_text())
    got: dict[str, Path] = {}

    def requirements_of(spec):
        if spec.startswith("vllm=="):
            whl = _cached_wheel(wheels_dir, spec)
            if whl is None:                             # its wheel is for manylinux_2_35 only
                subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                "--python-version", PYTHON, "--implementation", "cp", "--abi", "abi3",
                                "--platform", VLLM_PLATFORM, "-d", str(wheels_dir), spec], check=True)
                whl = _cached_wheel(wheels_dir, spec)
        else:
            whl = pip_download(spec, wheels_dir)
        got[spec] = whl
        return wheel_requirements(whl)

    groups, left_out = {}, {}
    have = {name: "on the device already" for name in present}
    for group, roots in [("vllm", [VLLM])] + list(EXTRA_ROOTS.items()):
        specs, lo = closure(roots, requirements_of, have)
        groups[group] = specs
        left_out.update(lo)
        have.update({canonicalize_name(Requirement(s).name): f"in the {group} group" for s in specs})
        log(f"{group}: {len(specs)} wheels: {', '.join(specs)}")
    stage = cache / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    site = stage / "site"
    site.mkdir(parents=True)
    for whl in got.values():
        unpack_wheel(whl, site)
    stripped = []
    for rel in STRIP:
        p = site / rel
        if p.exists():
            stripped.append((rel, p.stat().st_size))
            p.unlink()
    nanovllm_source(stage / "nanovllm_upstream")
    raw = sum(f.stat().st_size for f in stage.rglob("*") if f.is_file())
    log(f"staged {raw / 2**20:.0f} MiB ({len(got)} wheels; stripped {sum(s for _, s in stripped) / 2**20:.0f} MiB "
        "of shared objects); compressing with xz -9e ...")
    blob = cache / "payload.tar.xz"
    with tarfile.open(cache / "payload.tar", "w") as t:
        for top in ("site", "nanovllm_upstream"):
            t.add(stage / top, arcname=top)
    subprocess.run(["xz", "-9e", "-T1", "-f", "-k", str(cache / "payload.tar")], check=True)
    (cache / "payload.tar").unlink()
    data = blob.read_bytes()
    shutil.rmtree(out, ignore_errors=True)
    parts, offset = [], 0
    for i, size in enumerate(split_sizes(len(data), int(part_mib * 2**20)), start=1):
        folder = out / f"p{i}"
        folder.mkdir(parents=True)
        chunk = data[offset:offset + size]
        offset += size
        (folder / f"part_{i:02d}").write_bytes(chunk)
        parts.append(dict(folder=str(folder), file=f"part_{i:02d}", bytes=size, sha256=hashlib.sha256(chunk).hexdigest()))
    manifest = dict(compression="xz -9e", total_bytes=len(data), uncompressed_bytes=raw, parts=parts,
                    sha256=hashlib.sha256(data).hexdigest(), vllm=VLLM, nanovllm_commit=NANOVLLM_COMMIT,
                    groups=groups, left_out=left_out, stripped=[r for r, _ in stripped])
    for p in parts:
        (Path(p["folder"]) / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def device_commands(manifest: dict, repo: Path) -> str:
    parts = manifest["parts"]
    lines = ["Device calls, back to back (each within 30 s of the last; carry paths relative to the repo root):"]
    for i, p in enumerate(parts[:-1], start=1):
        rel = os.path.relpath(p["folder"], repo)
        lines.append(f"  {i}. carry [\"{rel}\"]  command: bash bench/gpu_run.sh peers-stage   "
                     f"({p['bytes'] / 2**20:.1f} MiB)")
    rel = os.path.relpath(parts[-1]["folder"], repo)
    lines.append(f"  {len(parts)}. carry [\"{rel}\"]  command: NANOVLLM_REF_COMMIT=<commit> bash bench/gpu_run.sh peers"
                 f"   ({parts[-1]['bytes'] / 2**20:.1f} MiB; unpacks, runs every peer, results in $OUT)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanovllm_bench.payload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".carry/peers", help="folder for the parts (git-ignored)")
    ap.add_argument("--cache", default=".carry/cache", help="wheel cache and staging folder (git-ignored)")
    ap.add_argument("--part-mib", type=float, default=40.0,
                    help="largest part: 64 MiB per call less the checkout, which travels with every part "
                         "(7 MiB on 2026-12-02, when 57 MiB parts no longer fitted; 40 MiB gives three parts)")
    args = ap.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    manifest = build(Path(args.out).resolve(), Path(args.cache).resolve(), args.part_mib)
    sizes = ", ".join(f"{p['bytes'] / 2**20:.1f}" for p in manifest["parts"])
    print(f"payload: {manifest['total_bytes'] / 2**20:.1f} MiB in {len(manifest['parts'])} parts ({sizes} MiB), "
          f"from {manifest['uncompressed_bytes'] / 2**20:.0f} MiB")
    print(device_commands(manifest, repo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
