"""The project's install routes agree with each other."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!;\[ ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_lists_the_same_packages_and_versions_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    py_reqs = project["dependencies"] + extras["course"] + extras["test"]     # flash is optional
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_list = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    env_reqs = [r for r in pip_list if not r.startswith("-e")]
    assert sorted(map(_name, py_reqs)) == sorted(map(_name, env_reqs))
    # Same version bounds too, not only the same names.
    norm = lambda r: r.replace(" ", "")
    assert sorted(map(norm, py_reqs)) == sorted(map(norm, env_reqs))


def test_makefile_test_target_is_what_ci_runs():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^test:", (ROOT / "Makefile").read_text(), re.M)
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


def test_the_engine_imports_nothing_from_the_course_the_bench_or_the_checkpoint_tools():
    """nanovllm_ref is the engine only: no module of it names the course, the benchmark or the checkpoint
    tooling, and importing the whole engine (every submodule) loads nothing of them. Their commands reach
    `python -m nanovllm_ref` as entry points (nanovllm_ref/plugins.py) instead."""
    import subprocess
    import sys
    others = ("nanovllm_course", "nanovllm_bench", "nanovllm_models")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "nanovllm_ref").rglob("*.py")
                 if any(o in p.read_text(encoding="utf-8") for o in others)]
    assert offenders == []
    code = ("import pkgutil, importlib, sys, nanovllm_ref\n"
            "for m in pkgutil.walk_packages(nanovllm_ref.__path__, 'nanovllm_ref.'):\n"
            "    importlib.import_module(m.name)\n"
            f"print(sorted(k for k in sys.modules if k.split('.')[0] in {others!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_pyproject_registers_the_bench_and_download_commands_and_ships_every_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = project["project"]["entry-points"]
    assert eps["nanovllm_ref.commands"] == {"bench": "nanovllm_bench.cli:main",
                                            "download": "nanovllm_models.download:main"}
    assert eps["nanovllm_ref.models"] == {"smollm2": "nanovllm_models.download:locate_smollm2"}
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(include) == sorted(f"{p}*" for p in ("nanovllm_ref", "nanovllm_course", "nanovllm_bench",
                                                        "nanovllm_models"))
