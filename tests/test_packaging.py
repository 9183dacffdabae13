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
