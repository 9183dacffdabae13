"""The payload builder's pure logic (nanovllm_bench/payload.py): which wheels the closure walk downloads and
which it leaves out, the device's package list, part sizes, unpacking a wheel. No download here."""
import zipfile

from packaging.requirements import Requirement

from nanovllm_bench import payload

INDEX = {   # a small package index: name -> Requires-Dist lines
    "vllm": ["numpy", "fastapi[standard]>=0.115", "torch==2.11.0", "flashinfer-python==0.4",
             "pywin32; sys_platform == 'win32'", "ray[cgraph]; extra == 'ray'", "apache-tvm-ffi==0.1.9",
             "tokenizers>=0.21", "cachetools"],
    "fastapi": ["starlette>=0.40", "pydantic>=2", "fastapi-cli; extra == 'standard'"],
    "fastapi-cli": ["typer", "rich-toolkit"],                 # left out (SKIP), so rich-toolkit is never met
    "starlette": ["anyio"],
    "pydantic": ["pydantic-core==2.50.5", "typing-extensions"],
    "pydantic-core": [], "rich-toolkit": [], "cachetools": [], "apache-tvm-ffi": [], "typer": [],
}


DEVICE = ("numpy", "anyio", "typing-extensions", "tokenizers", "typer")


def _walk(roots, have):
    fetched = []

    def requirements_of(spec):
        fetched.append(spec)
        return [Requirement(r) for r in INDEX[Requirement(spec).name]]
    order, left_out = payload.closure(roots, requirements_of, have)
    return order, left_out, fetched


def test_closure_skips_the_device_packages_heavy_kernels_and_foreign_markers():
    have = {n: "on the device already" for n in DEVICE}
    order, left_out, fetched = _walk(["vllm==0.20.2"], have)
    assert order == ["vllm==0.20.2", "fastapi>=0.115", "apache-tvm-ffi==0.1.11", "cachetools", "starlette>=0.40",
                     "pydantic>=2", "pydantic-core==2.50.5"]
    assert fetched == order                                  # each package fetched once
    assert left_out["numpy"] == "on the device already" and left_out["anyio"] == "on the device already"
    assert "typer" not in left_out and "rich-toolkit" not in left_out   # only fastapi-cli needs them
    assert left_out["torch"].startswith("optional") and left_out["flashinfer-python"].startswith("optional")
    assert left_out["fastapi-cli"].startswith("optional")   # fastapi[standard]'s command line: not walked into
    assert "pywin32" not in order and "ray" not in left_out   # markers for another platform / an extra not asked


def test_a_later_group_takes_nothing_an_earlier_group_brought():
    have = {n: "on the device already" for n in DEVICE}
    first, _, _ = _walk(["vllm==0.20.2"], have)
    have.update({Requirement(s).name: "in the vllm group" for s in first})
    second, left_out, _ = _walk(["fastapi", "pydantic"], have)
    assert second == [] and left_out["fastapi"] == "in the vllm group"


def test_present_packages_reads_the_kinds_list():
    text = ("# kinds\n\n## Python packages already there\n\nsome words. Packages: absl-py, Jinja2, "
            "nvidia-cudnn-cu13, torch, zipp.\n\n## next\nPackages: not, these.")
    assert payload.present_packages(text) == {"absl-py", "jinja2", "nvidia-cudnn-cu13", "torch", "zipp"}


def test_split_sizes_are_even_and_under_the_limit():
    mib = 2**20
    sizes = payload.split_sizes(140 * mib, 58 * mib)
    assert len(sizes) == 3 and sum(sizes) == 140 * mib and max(sizes) - min(sizes) <= 1
    assert payload.split_sizes(10, 58 * mib) == [10]


def test_unpack_wheel_moves_purelib_up_and_drops_scripts(tmp_path):
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("demo/__init__.py", "x = 1\n")
        z.writestr("demo-1.0.data/purelib/demo_extra.py", "y = 2\n")
        z.writestr("demo-1.0.data/scripts/demo", "#!/bin/sh\n")
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nRequires-Dist: numpy\n")
    site = tmp_path / "site"
    payload.unpack_wheel(whl, site)
    assert (site / "demo" / "__init__.py").read_text() == "x = 1\n"
    assert (site / "demo_extra.py").exists() and not (site / "demo").joinpath("scripts").exists()
    assert [str(r) for r in payload.wheel_requirements(whl)] == ["numpy"]
