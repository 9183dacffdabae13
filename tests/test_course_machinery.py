"""Tests of the course machinery (nanovllm_course/release.py), over every notebook in solutions/.

* marker parsing and stubbing (unit tests);
* solution notebooks follow the conventions and are stored normalised; referenced figures exist;
* committed chapters equal a fresh release (drift);
* every released chapter, run unfilled with nbclient, fails exactly at its check cells with
  "not implemented yet" and nowhere else (later sections use the reference), within 90 s;
* the released chapter with the solution's exercise code pasted back passes `pytest --nbval` (what a
  grader runs on a correct student copy).
"""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from nanovllm_course import release as rel

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = [p.name for p in rel.solution_paths(REPO / "solutions")]
NOTEBOOK_SECONDS = 90


# -- markers -----------------------------------------------------------------------------------------------
SRC = '''def f(x):
    """Doc stays."""
    y = 1
    ### BEGIN SOLUTION E1.1: square it
    z = x * x
    return z
    ### END SOLUTION


def g(x):
    if x:
        ### BEGIN SOLUTION E1.2
        return -x
        ### END SOLUTION
    return 0'''


def test_stub_replaces_regions_keeps_the_rest():
    out = rel.stub_source(SRC)
    assert out == '''def f(x):
    """Doc stays."""
    y = 1
    raise NotImplementedError("Exercise 1.1: square it")


def g(x):
    if x:
        raise NotImplementedError("Exercise 1.2: fill in this code")
    return 0'''
    compile(out, "stub", "exec")
    assert [r.exercise for r in rel.find_regions(SRC)] == ["E1.1", "E1.2"]


@pytest.mark.parametrize("src, message", [
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "must name its exercise"),
    ("### BEGIN SOLUTION Ex1: t\nx = 1\n### END SOLUTION", "must name its exercise"),
    ("### BEGIN SOLUTION E1.1\nx = 1", "has no END"),
    ("x = 1\n### END SOLUTION", "END without BEGIN"),
    ("### BEGIN SOLUTION E1.1\n### BEGIN SOLUTION E1.2\n### END SOLUTION\n### END SOLUTION", "nested"),
])
def test_bad_markers_are_rejected(src, message):
    with pytest.raises(rel.ReleaseError, match=message):
        rel.stub_source(src)


def _nb(cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    return nb


def _check_cell(source, text, tags=("check",)):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = list(tags)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    cell.execution_count = 3
    return cell


def test_release_clears_exercise_outputs_and_keeps_the_rest():
    ex = nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION E3.1: t\n    return 1\n    ### END SOLUTION")
    ex.outputs = [nbformat.v4.new_output("stream", name="stdout", text="noise\n")]
    ex.execution_count = 7
    ex.metadata["collapsed"] = True
    other = nbformat.v4.new_code_cell("print(2)")
    other.outputs = [nbformat.v4.new_output("stream", name="stdout", text="2\n")]
    other.execution_count = 9
    nb = _nb([nbformat.v4.new_markdown_cell("# t"), ex, _check_cell("check(f)", "E3.1 ok\n"), other])
    out = rel.release_notebook(nb, "03_x.ipynb")
    assert out.cells[1].outputs == [] and out.cells[1].execution_count is None
    assert "raise NotImplementedError" in out.cells[1].source and out.cells[1].metadata == {}
    assert out.cells[2].outputs[0]["text"] == "E3.1 ok\n" and out.cells[2].execution_count == 1
    assert out.cells[3].outputs[0]["text"] == "2\n" and out.cells[3].execution_count == 2
    assert out.metadata["kernelspec"]["name"] == "python3"
    assert rel.dumps(out) == rel.dumps(rel.release_notebook(nb, "03_x.ipynb"))      # deterministic
    assert "BEGIN SOLUTION" in nb.cells[1].source                                     # input untouched


@pytest.mark.parametrize("cells, message", [
    (lambda: [nbformat.v4.new_code_cell("### BEGIN SOLUTION E3.1\n### END SOLUTION")], "no check cell"),
    (lambda: [nbformat.v4.new_code_cell("### BEGIN SOLUTION E4.1\n### END SOLUTION"),
              _check_cell("c()", "E4.1 ok\n")], "not in chapter 03"),
    (lambda: [nbformat.v4.new_code_cell("### BEGIN SOLUTION E3.1\n### END SOLUTION"),
              _check_cell("c()", "")], "no stored 'Ex.y ok' line"),
    (lambda: [_check_cell("c()", "E3.2 ok\n")], "which no marked region defines"),
])
def test_release_rejects_broken_conventions(cells, message):
    with pytest.raises(rel.ReleaseError, match=message):
        rel.release_notebook(_nb(cells()), "03_x.ipynb")


def test_py_to_notebook_round_trip():
    nb = rel.py_to_notebook('# %% [markdown]\n# # Title\n# text\n\n# %%\nx = 1\n\n# %% tags=["check", "gpu"]\nprint(x)\n')
    assert [c.cell_type for c in nb.cells] == ["markdown", "code", "code"]
    assert nb.cells[0].source == "# Title\ntext" and nb.cells[1].source == "x = 1"
    assert nb.cells[2].metadata["tags"] == ["check", "gpu"]


# -- the committed notebooks -------------------------------------------------------------------------------
def test_there_are_notebooks():
    assert NOTEBOOKS, "no solutions/NN_slug.ipynb found"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_solution_follows_conventions(name):
    path = REPO / "solutions" / name
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    exercises = rel.validate_solution(nb, name)
    assert exercises, f"{name} has no exercise"
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert path.read_text(encoding="utf-8") == rel.dumps(rel.normalize(nbformat.read(path, as_version=4))), \
        f"{name} is not normalised: run `python -m nanovllm_course execute solutions/{name}`"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and cell.execution_count is None and not rel.is_gpu_cell(cell):
            raise AssertionError(f"{name} cell {i} was not executed")
    nbformat.validate(nbformat.read(REPO / "chapters" / name, as_version=4))
    for fig in re.findall(r"\.\./figures/([\w.-]+\.png)", "\n".join(c.source for c in nb.cells)):
        assert (REPO / "figures" / fig).is_file(), f"{name} shows figures/{fig}, which does not exist"


def test_chapters_match_a_fresh_release():
    drift = rel.release(REPO / "solutions", REPO / "chapters", check=True)
    assert drift == [], f"stale chapters {drift}: run `python -m nanovllm_course release` and commit"


def test_check_command_exit_status(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    ok = subprocess.run([sys.executable, "-m", "nanovllm_course", "check"], cwd=REPO, env=env,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    if NOTEBOOKS:      # an empty chapters folder is stale
        bad = subprocess.run([sys.executable, "-m", "nanovllm_course", "check", "--chapters", str(tmp_path)],
                             cwd=REPO, env=env, capture_output=True, text=True)
        assert bad.returncode == 1 and "stale" in bad.stderr


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_unfilled_chapter_fails_exactly_at_its_checks(name):
    path = REPO / "chapters" / name
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    _, errors = rel.execute_notebook(nb, path.parent, timeout=NOTEBOOK_SECONDS)
    seconds = time.perf_counter() - start
    problems = rel.stub_failures_ok(nb, errors)
    assert not problems, f"{name}:\n" + "\n".join(problems)
    assert rel.expected_failures(nb), f"{name} has no check cell"
    assert seconds <= NOTEBOOK_SECONDS, f"{name} took {seconds:.0f} s (limit {NOTEBOOK_SECONDS} s)"


def filled_chapter(name: str):
    """The released chapter with each exercise cell's source taken from the solution: a correct student."""
    sol = nbformat.read(REPO / "solutions" / name, as_version=4)
    chap = nbformat.read(REPO / "chapters" / name, as_version=4)
    assert len(sol.cells) == len(chap.cells)
    for s, c in zip(sol.cells, chap.cells):
        if rel.is_exercise_cell(s):
            c.source = s.source
    return chap


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_filled_chapter_passes_nbval(name, tmp_path):
    target = tmp_path / name
    target.write_text(rel.dumps(filled_chapter(name)), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "--nbval",
         "--nbval-current-env", "--nbval-sanitize-with", str(REPO / "tests" / "nbval_sanitize.cfg"),
         "--rootdir", str(tmp_path), str(target)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=4 * NOTEBOOK_SECONDS)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert seconds <= NOTEBOOK_SECONDS + 30, f"{name}: nbval took {seconds:.0f} s"
