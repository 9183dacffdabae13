"""Tests of the course machinery (nanovllm_course/release.py), over every notebook in solutions/.

* marker parsing and stubbing (unit tests);
* solution notebooks follow the conventions and are stored normalised; referenced figures exist;
* committed chapters equal a fresh release (drift);
* every released chapter, run unfilled with nbclient, grades `E1.1 not done yet` at every exercise and no
  other cell raises (later sections use the reference), within 90 s;
* the released chapter with the solution's exercise code pasted back grades all ok (`grade`, what a grader
  runs on a correct student copy); a wrong answer grades `E1.1 failed: ...` at that exercise only.
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


def _check_cell(source, text, tags=("check",), source_as_is=False):
    ids = re.findall(r"E\d+\.\d+", text)
    if ids and "check(" not in source and not source_as_is:
        source = f'with check("{ids[0]}"):\n    {source}'
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
    nb = _nb([nbformat.v4.new_markdown_cell("# t"), ex, _check_cell("ch03.check_f(f)", "E3.1 ok\n"), other])
    out = rel.release_notebook(nb, "03_x.ipynb")
    assert out.cells[1].outputs == [] and out.cells[1].execution_count is None
    assert "raise NotImplementedError" in out.cells[1].source and out.cells[1].metadata == {}
    assert out.cells[2].outputs == [] and out.cells[2].execution_count is None      # no unearned "E3.1 ok"
    assert rel.checked_exercises(out.cells[2]) == ["E3.1"]                          # named in its source
    assert out.cells[3].outputs[0]["text"] == "2\n" and out.cells[3].execution_count == 1
    assert out.metadata["kernelspec"]["name"] == "python3"
    assert out.metadata["language_info"] == rel.LANGUAGE_INFO                        # what a kernel writes
    assert rel.dumps(out) == rel.dumps(rel.release_notebook(nb, "03_x.ipynb"))      # deterministic
    assert "BEGIN SOLUTION" in nb.cells[1].source                                     # input untouched


def test_release_clears_the_output_of_a_cell_that_shows_student_work():
    """Chapter 12's table of which parts are yours: the solution's table would claim every part in the
    student's copy, and it differs in every student's run, so the release stores none."""
    ex = nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION E3.1: t\n    return 1\n    ### END SOLUTION")
    yours = nbformat.v4.new_code_cell("table(f)")
    yours.metadata["tags"] = ["yours"]
    yours.outputs = [nbformat.v4.new_output("stream", name="stdout", text="14 of 14 parts are yours\n")]
    yours.execution_count = 4
    out = rel.release_notebook(_nb([ex, yours, _check_cell("ch03.check_f(f)", "E3.1 ok\n")]), "03_x.ipynb")
    assert out.cells[1].outputs == [] and out.cells[1].execution_count is None
    assert out.cells[1].metadata["tags"] == ["yours"]
    released = nbformat.read(REPO / "chapters" / "12_capstone.ipynb", as_version=4)
    assert [c.outputs for c in released.cells if "yours" in c.metadata.get("tags", [])] == [[]]


@pytest.mark.parametrize("cells, message", [
    (lambda: [nbformat.v4.new_code_cell("### BEGIN SOLUTION E3.1\n### END SOLUTION")], "no check cell"),
    (lambda: [nbformat.v4.new_code_cell("### BEGIN SOLUTION E4.1\n### END SOLUTION"),
              _check_cell("c()", "E4.1 ok\n")], "not in chapter 03"),
    (lambda: [nbformat.v4.new_code_cell("### BEGIN SOLUTION E3.1\n### END SOLUTION"),
              _check_cell("c()", "")], "no stored 'Ex.y ok' line"),
    (lambda: [_check_cell("c()", "E3.2 ok\n")], "which no marked region defines"),
    (lambda: [nbformat.v4.new_code_cell("### BEGIN SOLUTION E3.1\n### END SOLUTION"),
              _check_cell("c()", "E3.1 ok\n", source_as_is=True)], "inside `with check"),
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


def test_drift_check_ignores_what_a_kernel_rewrites(tmp_path):
    """Opening a chapter in JupyterLab may rewrite language_info (another Python) or the kernelspec's display
    name: not drift. Anything else is."""
    name = NOTEBOOKS[0]
    (tmp_path / "chapters").mkdir()
    nb = nbformat.read(REPO / "chapters" / name, as_version=4)
    nb.metadata["language_info"]["version"] = "3.99.0"
    nb.metadata["kernelspec"]["display_name"] = "Python 3"
    (tmp_path / "chapters" / name).write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    assert rel.release(REPO / "solutions", tmp_path / "chapters", [name], check=True) == []
    nb.cells[0].source += " (edited)"
    (tmp_path / "chapters" / name).write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    assert rel.release(REPO / "solutions", tmp_path / "chapters", [name], check=True) == [name]


def test_check_command_exit_status(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    ok = subprocess.run([sys.executable, "-m", "nanovllm_course", "check"], cwd=REPO, env=env,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    if NOTEBOOKS:      # an empty chapters folder is stale
        bad = subprocess.run([sys.executable, "-m", "nanovllm_course", "check", "--chapters", str(tmp_path)],
                             cwd=REPO, env=env, capture_output=True, text=True)
        assert bad.returncode == 1 and "stale" in bad.stderr


def test_release_names_a_chapter_by_number_and_refuses_an_unknown_name(tmp_path):
    """`release 9` is chapter 09 (it used to match nothing and write nothing, silently); a name that is no
    solution notebook is an error that lists the names there are, before anything is written."""
    written = rel.release(chapters=tmp_path, names=["9"])
    assert written == ["09_tensor_parallelism.ipynb"] and [p.name for p in tmp_path.iterdir()] == written
    with pytest.raises(rel.ReleaseError, match=r"no solution notebook named \['99'\].*12_capstone.ipynb"):
        rel.release(chapters=tmp_path / "other", names=["09", "99"])
    assert not (tmp_path / "other").exists()
    assert rel.release(chapters=tmp_path, names=["solutions/09_tensor_parallelism.ipynb"]) == written  # a path


def test_verify_grade_and_export_name_chapters_like_release(tmp_path, capsys):
    """`verify 9`, `grade 9` and `export 9` mean chapter 09 too, and an unknown name is refused with the names
    there are (exit 2), where it used to select nothing and exit 0."""
    from nanovllm_course.__main__ import _chapter_paths, main
    assert [p.name for p in _chapter_paths(REPO / "chapters", ["9"])] == ["09_tensor_parallelism.ipynb"]
    for argv in (["verify", "99"], ["grade", "nosuch"], ["export", "11", "--out", str(tmp_path / "s")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{argv[0]}: no " in err and ("09_tensor_parallelism.ipynb" in err or "'10'" in err), err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_unfilled_chapter_fails_exactly_at_its_checks(name):
    grade = rel.grade_path(REPO / "chapters" / name, REPO / "solutions", timeout=NOTEBOOK_SECONDS)
    problems = rel.stub_failures_ok(grade)
    assert not problems, f"{name}:\n" + "\n".join(problems)
    nb = nbformat.read(REPO / "chapters" / name, as_version=4)
    assert [v.exercise for v in grade.verdicts] == [e for i in rel.expected_failures(nb)
                                                   for e in rel.checked_exercises(nb.cells[i])]
    assert all(v.line == f"{v.exercise} not done yet" for v in grade.verdicts)
    budget = rel.cpu_budget(nb)
    assert grade.seconds <= budget, f"{name} took {grade.seconds:.0f} s (its CPU budget is {budget:.0f} s)"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_chapter_states_its_cpu_budget(name):
    """The budget lives in the notebook metadata (nanovllm.cpu_budget_s), is at most the course's 90 s, and the
    chapter's first cell tells the student the same number."""
    for folder in ("solutions", "chapters"):
        nb = nbformat.read(REPO / folder / name, as_version=4)
        budget = rel.cpu_budget(nb)
        assert 0 < budget <= NOTEBOOK_SECONDS, (folder, budget)
        intro = next(c.source for c in nb.cells if c.cell_type == "markdown")
        assert f"**CPU budget:** {budget:.0f} s" in intro, (folder, name)


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
def test_filled_chapter_grades_all_ok(name, tmp_path):
    """What a grader runs on a correct student copy: `python -m nanovllm_course grade` exits 0 with one
    `Ex.y ok` line per exercise (the check cells' outputs compared with the solution's)."""
    target = tmp_path / name
    target.write_text(rel.dumps(filled_chapter(name)), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "nanovllm_course", "grade", str(target)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=4 * NOTEBOOK_SECONDS)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    sol = nbformat.read(REPO / "solutions" / name, as_version=4)
    want = [f"{e} ok" for c in sol.cells if rel.is_check_cell(c) for e in rel.ok_lines(c)]
    lines = proc.stdout.splitlines()
    assert lines[1:-1] == want and lines[-1].endswith(f"{len(want)} of {len(want)} exercises ok"), proc.stdout
    budget = rel.cpu_budget(sol)
    assert seconds <= budget + 30, f"{name}: grading took {seconds:.0f} s (CPU budget {budget:.0f} s + 30 s start-up)"


def test_grade_reports_one_line_per_exercise(tmp_path):
    """A wrong E1.1, an unfilled E1.2 and an edited check cell: one verdict line each, the check cells run
    the solution's source, exit status 1."""
    name = "01_rmsnorm.ipynb"
    if name not in NOTEBOOKS:
        pytest.skip(f"no {name}")
    nb = filled_chapter(name)
    ex = [i for i, c in enumerate(nb.cells) if "def rms_norm(" in c.source][0]
    nb.cells[ex].source = nb.cells[ex].source.replace("+ eps", "+ 0.0 * eps")       # eps dropped
    ex2 = [i for i, c in enumerate(nb.cells) if "def fused_add_rms_norm(" in c.source][0]
    nb.cells[ex2] = nbformat.read(REPO / "chapters" / name, as_version=4).cells[ex2]   # back to the stub
    first_check = rel.expected_failures(nb)[0]
    nb.cells[first_check].source = 'print("E1.1 ok")'                                 # a tampered check
    target = tmp_path / name
    target.write_text(rel.dumps(nb), encoding="utf-8")
    grade = rel.grade_path(target, REPO / "solutions", timeout=NOTEBOOK_SECONDS)
    lines = grade.lines()
    assert lines[0].startswith("E1.1 failed: ") and "(hint: " in lines[0], lines
    assert lines[1] == "E1.2 not done yet", lines
    assert lines[-1] == f"{name}: 0 of 2 exercises ok" and len(lines) == 3, lines
    assert not grade.ok
