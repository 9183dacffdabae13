"""Tests of the course machinery (nanovllm_course/release.py), over every notebook in solutions/.

* marker parsing and stubbing (unit tests);
* solution notebooks follow the conventions and are stored normalised; referenced figures exist;
* committed chapters equal a fresh release (drift);
* each chapter is executed as few times as these guarantees need, twice, each run under `pytest --nbval` as a
  grader runs it, feeding nbval's items, `grade`'s verdict on the same run (grading.Session.grade_executed,
  recorded by tests/suite_plugin.py) and the stored-output comparison:
  - filled (the released chapter with the solution's exercise code pasted back, a correct student; cell for cell
    the solution's code): every exercise ok in nbval and in `grade`, and every other cell's output equal to the
    solution's stored one (the maintainers' gate: solutions/ stored outputs that no longer follow from the code
    fail here);
  - unfilled (as a student first opens it): it fails once per required exercise, under the exercise's id, with
    `Ex.y not done yet` (an optional one xfails), and nowhere else, in nbval and in `grade` alike;
* on a copy with right, wrong and missing answers (one run) `grade` and `pytest --nbval` agree line for line;
  `grade` run end to end (its own kernel) on a wrong, an unfilled and an edited exercise gives one line each;
* how long each run took is a report (tests/suite_plugin.py: the chapter timings table, artifacts/), never a
  pass or fail: a busy machine is slower, not wrong;
* a released chapter opens with no output that claims anything about the student's code;
* each chapter declares its engine parts once (chNN.PARTS), and every part declared is run inside the engine
  by its exercise's check cell, and every part run there is declared;
* `export` writes beside the notebooks it reads: two folders exported at once stay apart.
"""
import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from nanovllm_course import export as ex
from nanovllm_course import release as rel

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = [p.name for p in rel.solution_paths(REPO / "solutions")]
NOTEBOOK_SECONDS = 90      # the course's limit on a chapter's stated CPU budget (metadata), not a timeout
HANG_S = 600               # per cell and per run: a guard against a hang, far above any chapter's time


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
    """Chapter 13's table of which parts are yours: the solution's table would claim every part in the
    student's copy, and it differs in every student's run, so the release stores none."""
    ex = nbformat.v4.new_code_cell("def f():\n    ### BEGIN SOLUTION E3.1: t\n    return 1\n    ### END SOLUTION")
    yours = nbformat.v4.new_code_cell("table(f)")
    yours.metadata["tags"] = ["yours"]
    yours.outputs = [nbformat.v4.new_output("stream", name="stdout", text="14 of 14 parts are yours\n")]
    yours.execution_count = 4
    out = rel.release_notebook(_nb([ex, yours, _check_cell("ch03.check_f(f)", "E3.1 ok\n")]), "03_x.ipynb")
    assert out.cells[1].outputs == [] and out.cells[1].execution_count is None
    assert out.cells[1].metadata["tags"] == ["yours"]
    released = nbformat.read(REPO / "chapters" / "13_capstone.ipynb", as_version=4)
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
    with pytest.raises(rel.ReleaseError, match=r"no solution notebook named \['99'\].*13_capstone.ipynb"):
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
def test_a_filled_chapter_runs_the_solutions_code_cell_for_cell(name):
    """Why a correct student's filled chapter must reproduce the solution's stored outputs: it has the solution's
    code cells (source and tags, `gpu` included), and its check cells have the solution's ids."""
    sol = nbformat.read(REPO / "solutions" / name, as_version=4)
    filled = filled_chapter(name)
    code = lambda nb: [(c.source, rel.tags(c), c.get("id")) for c in nb.cells if c.cell_type == "code"]
    assert code(filled) == code(sol)
    assert [ref.get("id") for ref, i in rel.match_check_cells(filled, sol) if i is not None] == \
        [c.get("id") for c in sol.cells if rel.is_check_cell(c)]


def _optional(exercise: str) -> bool:
    from nanovllm_course.common import exercise_of
    return exercise_of(exercise).optional


def test_grade_reports_one_line_per_exercise(tmp_path):
    """A wrong E1.1, an unfilled E1.2 and an edited check cell: one verdict line each, the course's check runs in
    the edited cell (and a note says it was edited), exit status 1."""
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
    grade = rel.grade_path(target, REPO / "solutions", timeout=HANG_S)      # grade's own kernel (execute_notebook)
    lines = grade.lines()
    assert lines[0].startswith("E1.1 failed: ") and "(hint: " in lines[0], lines
    assert lines[1] == "E1.2 not done yet", lines
    assert lines[2] == "note: E1.1: its check cell was edited; the course's check ran instead", lines
    assert lines[-1] == f"{name}: 0 of 2 exercises ok" and len(lines) == 4, lines
    assert not grade.ok



# -- what a student sees on opening a chapter --------------------------------------------------------------------
def _code(source, tags=()):
    cell = nbformat.v4.new_code_cell(source)
    if tags:
        cell.metadata["tags"] = list(tags)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="something\n")]
    cell.execution_count = 1
    return cell


def test_cells_that_show_the_students_work_are_found_by_following_the_data():
    """A cell reading a name an exercise cell defines shows the student's work, and so does a cell reading a name
    such a cell bound; a later rebinding from the reference ends it. Engine helpers and the `yours` tag count."""
    cells = [_code("import torch\ndef f(x):\n    ### BEGIN SOLUTION E3.1: t\n    return x\n    ### END SOLUTION"),
             _check_cell("ch03.check_f(f)", "E3.1 ok\n"),
             _code("print(f(1))"),                                   # 2: calls the student's f
             _code("y = [f(k) for k in range(3)]"),                  # 3: binds y from f
             _code("print(len(y))"),                                 # 4: reads y
             _code("print(torch.ones(2))"),                          # 5: torch came from the exercise cell's import: not the student's
             _code("from nanovllm_course.ch03 import reference_f as f\ny = 3"),   # 6: rebinds both
             _code("print(f(2), y)"),                                # 7: the reference's f now
             _code("your_part_in_the_engine(g=g)"),                  # 8: an engine helper
             _code("ch08.your_sampler_in_the_engine(1)"),            # 9: an engine helper, as an attribute
             _code("table()", tags=("yours",)),                      # 10: tagged
             _code("%time print(2)"),                                # 11: a magic, nothing of the student's
             _code("def show():\n    return g(2)\n"),                # 12: g is not the student's
             _code("def demo():\n    return f(1)\nz = 1")]            # 13: f is the reference's here
    nb = _nb(cells)
    assert rel.student_dependent_cells(nb) == [2, 3, 4, 8, 9, 10]
    out = rel.release_notebook(nb, "03_x.ipynb")
    assert [i for i, c in enumerate(out.cells) if c.outputs] == [5, 6, 7, 11, 12, 13]
    assert all(out.cells[i].execution_count is None for i in (0, 1, 2, 3, 4, 8, 9, 10))


_CLAIMS = re.compile(r"ran inside the engine|\byours\b|\bYour\b|^E\d+\.\d+ (ok|not done yet|failed)", re.M)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_released_chapter_claims_nothing_about_the_students_code(name):
    """Every cell whose output depends on the student's code (release.student_dependent_cells of the solution)
    is stored without output in the released chapter, and, independently of that analysis, no stored output
    speaks of 'your' code, the parts that are 'yours', or a verdict."""
    sol = nbformat.read(REPO / "solutions" / name, as_version=4)
    chap = nbformat.read(REPO / "chapters" / name, as_version=4)
    dependent = rel.student_dependent_cells(sol)
    for i in dependent:
        assert chap.cells[i].outputs == [] and chap.cells[i].execution_count is None, (name, i)
    for i, cell in enumerate(chap.cells):
        if cell.cell_type != "code":
            continue
        calls = {getattr(n.func, "id", None) or getattr(n.func, "attr", None)
                 for n in ast.walk(rel._parse_cell(cell.source) or ast.Module([], [])) if isinstance(n, ast.Call)}
        if calls & rel.ENGINE_HELPERS and not rel.is_check_cell(cell) or rel.shows_student_work(cell):
            assert i in dependent, (name, i)
        text = "".join(o.get("text", "") + "".join(v for v in o.get("data", {}).values() if isinstance(v, str))
                       for o in cell.outputs)
        m = _CLAIMS.search(text)
        assert m is None, f"{name} cell {i} stores {m.group(0)!r}: {text[:200]!r}"


# -- pytest --nbval grades ---------------------------------------------------------------------------------------
NBVAL = ["--nbval", "--nbval-current-env", "--nbval-sanitize-with", str(REPO / "tests" / "nbval_sanitize.cfg")]


@dataclasses.dataclass
class Case:
    name: str          # "E1.1" or "Cell 3"
    outcome: str       # passed, failed, skipped, xfailed
    message: str
    seconds: float


def run_nbval(paths, out: Path, *options, timeout: int = HANG_S) -> dict[str, list[Case]]:
    """pytest --nbval on `paths` from the repository root (as a grader runs it), recording each notebook's run and
    `grade`'s verdict on it into `out` (--nbval-record, tests/suite_plugin.py). {notebook name: [Case]}."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    junit = out / "nbval.xml"
    # the recorder named with -p: a student's folder outside the repository does not load its conftest.py; no
    # hypothesis plugin: a notebook run needs none, and it takes a second or two to import
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                           "-p", "tests.suite_plugin", *NBVAL, f"--nbval-cell-timeout={HANG_S}", f"--junitxml={junit}",
                           f"--nbval-record={out}", *options, *map(str, paths)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert junit.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    found: dict[str, list[Case]] = {}
    for tc in ET.parse(junit).iter("testcase"):
        nb = re.search(r"(\d\d_[a-z0-9_]+\.ipynb)$", tc.get("classname", "")).group(1)
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message", "")
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                message = child.get("message", "")
        found.setdefault(nb, []).append(Case(tc.get("name"), outcome, message, float(tc.get("time", 0))))
    return found


def record_of_the_run(student: Path, out: Path) -> dict:
    """What run_nbval recorded for the notebook `student`: {"grade": grading.Grade.as_dict() and "lines", "nbval":
    {exercise: line}, "ran": [cell indices], "seconds"}; every code cell that should have run did."""
    record = json.loads((out / f"{student.stem}.json").read_text())
    assert record["grade"] is not None, f"{student.name} was not graded as a student's notebook"
    done = nbformat.read(out / student.name, as_version=4)
    skip_gpu = not rel.cuda_available()
    assert set(record["ran"]) == {i for i, c in enumerate(done.cells)
                                  if c.cell_type == "code" and not (skip_gpu and rel.is_gpu_cell(c))}
    return record


def grade_lines(record) -> dict[str, str]:
    return {e["exercise"]: e["line"] for e in record["grade"]["exercises"]}


def nbval_lines(cases: list[Case]) -> dict[str, str]:
    """{exercise: verdict line} as pytest --nbval reported each check item (an optional exercise not ok xfails,
    ' (optional)' added)."""
    return {c.name: f"{c.name} ok" if c.outcome == "passed" else c.message.removesuffix(" (optional)")
            for c in cases if re.match(r"E\d+\.\d+$", c.name)}


def exercises_of_notebook(nb) -> list[str]:
    return [e for c in nb.cells if rel.is_check_cell(c) for e in rel.checked_exercises(c)]


@pytest.fixture(scope="session")
def chapter_copies(tmp_path_factory):
    """(folder of the released chapters as committed, folder of them filled with the solutions' exercise code):
    each chapter runs from a folder of its own test session (xdist workers run chapters side by side, and
    chapters 09 and 13 export into their folder), beside the other chapters as a student has them (chapter 13
    reads them). The filled ones are in a folder named `solutions`, as the one the solutions ran in: chapter 13's
    stored output names its folder ("exported 10 chapter notebooks from solutions/")."""
    unfilled, filled = tmp_path_factory.mktemp("unfilled"), tmp_path_factory.mktemp("filled") / "solutions"
    filled.mkdir()
    for name in NOTEBOOKS:
        shutil.copy(REPO / "chapters" / name, unfilled / name)
        (filled / name).write_text(rel.dumps(filled_chapter(name)), encoding="utf-8")
    return unfilled, filled


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_correct_students_filled_chapter_passes_in_nbval_and_grade(name, chapter_copies, tmp_path, record_property):
    """A correct student's chapter, run once under `pytest --nbval` (with every non-check cell compared with the
    solution's stored output, --nbval-compare-solution): every item passes (a `gpu` cell skips without CUDA),
    and `grade`'s verdict on that same run is every exercise ok, optional ones included, with no note, line for
    line what nbval reported. The time it took goes to the chapter timings report, beside the CPU budget."""
    student = chapter_copies[1] / name
    cases = run_nbval([student], tmp_path, "--nbval-compare-solution")[name]
    record_property("chapter_run", {"chapter": name, "run": "filled", "seconds": sum(c.seconds for c in cases)})
    sol = nbformat.read(REPO / "solutions" / name, as_version=4)
    assert [c.name for c in cases if c.name.startswith("E")] == exercises_of_notebook(sol)
    bad = [(c.name, c.outcome, c.message) for c in cases
           if c.outcome not in ("passed", "skipped") or (c.outcome == "skipped" and "gpu" not in c.message)]
    assert not bad, bad
    record = record_of_the_run(student, tmp_path)
    want = [f"{e} ok" for c in sol.cells if rel.is_check_cell(c) for e in rel.ok_lines(c)]
    assert record["grade"]["lines"][:len(want)] == want, record["grade"]["lines"]
    assert record["grade"]["complete"] and record["grade"]["notes"] == [] and len(record["grade"]["lines"]) == len(want) + 1
    assert nbval_lines(cases) == grade_lines(record) == record["nbval"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_an_unfilled_chapter_fails_at_each_exercise_by_its_id_in_nbval_and_grade(name, chapter_copies, tmp_path,
                                                                                 record_property):
    """The released chapter, run once under `pytest --nbval` as a student first opens it: it fails once per
    required exercise, under its id, with `Ex.y not done yet`, an optional one xfails, and nothing else fails
    (later sections use the reference); `grade`'s verdict on that same run is `not done yet` at every exercise,
    with no note, line for line what nbval reported. The time goes to the chapter timings report."""
    student = chapter_copies[0] / name
    cases = run_nbval([student], tmp_path)[name]
    record_property("chapter_run", {"chapter": name, "run": "unfilled", "seconds": sum(c.seconds for c in cases)})
    nb = nbformat.read(student, as_version=4)
    failed = [(c.name, c.message) for c in cases if c.outcome in ("failed", "xfailed")]
    assert failed == [(e, f"{e} not done yet" + (" (optional)" if _optional(e) else ""))
                      for e in exercises_of_notebook(nb)], failed
    assert [c.name for c in cases if c.outcome == "xfailed"] == [e for e in exercises_of_notebook(nb) if _optional(e)]
    assert all(c.outcome in ("passed", "failed") or (c.outcome == "skipped" and "gpu" in c.message)
               or (c.outcome == "xfailed" and _optional(c.name)) for c in cases), \
        [(c.name, c.outcome, c.message) for c in cases if c.outcome not in ("passed", "failed")]
    record = record_of_the_run(student, tmp_path)
    grade = record["grade"]
    assert [e["exercise"] for e in grade["exercises"]] == exercises_of_notebook(nb)
    assert all(e["verdict"] == "not done yet" and e["notes"] == [] for e in grade["exercises"]), grade["exercises"]
    assert grade["notes"] == [] and not grade["complete"]
    assert nbval_lines(cases) == grade_lines(record) == record["nbval"]


def test_pytest_nbval_and_grade_agree_on_right_wrong_and_missing_answers(tmp_path):
    """Two notebooks of one student: 01 with E1.1 right but its check cell deleted and E1.2 wrong; 04 with E4.1
    right, E4.2 still the stub and E4.3 a store that reads V with K's strides (the engine sees it if the unit
    check does not). One `pytest --nbval` run of the folder; `grade`'s verdict on that same run gives every
    exercise the line nbval reported."""
    ch01 = filled_chapter("01_rmsnorm.ipynb")
    first_check = rel.expected_failures(ch01)[0]
    del ch01.cells[first_check]
    cell = next(c for c in ch01.cells if "def fused_add_rms_norm(" in c.source)
    lines = cell.source.split("\n")
    begin = next(i for i, l in enumerate(lines) if "### BEGIN SOLUTION" in l)
    lines.insert(begin + 1, lines[begin][:len(lines[begin]) - len(lines[begin].lstrip())] + "x = x * 1.01")
    cell.source = "\n".join(lines)                                     # a wrong E1.2: scales the input
    ch04 = filled_chapter("04_kv_cache_paged_attention.ipynb")
    stub04 = nbformat.read(REPO / "chapters" / "04_kv_cache_paged_attention.ipynb", as_version=4)
    i42 = next(i for i, c in enumerate(stub04.cells) if "def paged_decode(" in c.source and ex.STUB_MARK in c.source)
    ch04.cells[i42] = stub04.cells[i42]
    i43 = next(i for i, c in enumerate(ch04.cells) if "def store_kvcache(" in c.source)
    ch04.cells[i43].source = ch04.cells[i43].source + (
        "\n\n\n_right_store = store_kvcache\n\n\n"
        "def store_kvcache(key, value, k_cache, v_cache, slot_mapping):\n"
        "    _right_store(key, value.as_strided(value.shape, key.stride(), value.storage_offset()), k_cache, v_cache,"
        " slot_mapping)")
    folder, out = tmp_path / "student", tmp_path / "run"
    folder.mkdir()
    for name, nb in (("01_rmsnorm.ipynb", ch01), ("04_kv_cache_paged_attention.ipynb", ch04)):
        (folder / name).write_text(rel.dumps(nb), encoding="utf-8")
    cases = run_nbval([folder], out)
    graded, reported = {}, {}
    for name in ("01_rmsnorm.ipynb", "04_kv_cache_paged_attention.ipynb"):
        record = record_of_the_run(folder / name, out)
        assert not record["grade"]["complete"]
        graded.update(grade_lines(record))
        reported.update(nbval_lines(cases[name]))
        if name.startswith("01"):
            assert "note: E1.1: its check cell was deleted; the course put it back and ran it" in record["grade"]["lines"]
    assert sorted(graded) == ["E1.1", "E1.2", "E4.1", "E4.2", "E4.3"], graded
    assert graded["E1.1"] == "E1.1 ok"
    assert graded["E1.2"].startswith("E1.2 failed: ") and graded["E4.1"] == "E4.1 ok"
    assert graded["E4.2"] == "E4.2 not done yet" and graded["E4.3"].startswith("E4.3 failed: ")
    assert reported == graded                           # the same run: the same lines, numbers included
    others = [(c.name, c.outcome) for nb_cases in cases.values() for c in nb_cases
              if not c.name.startswith("E") and c.outcome not in ("passed", "skipped")]
    assert others == [], others


def test_the_plugin_knows_a_chapter_from_its_solution_and_from_other_notebooks(tmp_path):
    """A notebook named like a solution is graded against it; the solution itself is checked strictly (every
    output equal to the stored one: the maintainers' gate); any other notebook is left to nbval."""
    from nanovllm_course import nbval_grading
    sol, is_solution = nbval_grading.reference_of(REPO / "solutions" / "01_rmsnorm.ipynb")
    assert is_solution and rel.checked_exercises(next(c for c in sol.cells if rel.is_check_cell(c))) == ["E1.1"]
    copy_, is_solution = nbval_grading.reference_of(REPO / "chapters" / "01_rmsnorm.ipynb")
    assert copy_ is not None and not is_solution
    assert nbval_grading.reference_of(tmp_path / "notes.ipynb") == (None, False)


# -- one registry per chapter --------------------------------------------------------------------------------------
def _engine_calls(nb) -> set:
    """{(exercise, frozenset of names)} of the `in_the_engine("E4.3", store_kvcache=store_kvcache)` calls in a
    notebook's check cells, each inside `with check` of the same exercise."""
    calls = set()
    for cell in nb.cells:
        if not rel.is_check_cell(cell):
            continue
        named = set(rel.CHECK_CALL.findall(cell.source))
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "in_the_engine":
                tag = node.args[0].value
                assert tag in named, f"in_the_engine({tag!r}) outside `with check({tag!r})`"
                assert all(isinstance(k.value, ast.Name) and k.value.id == k.arg for k in node.keywords)
                calls.add((tag, frozenset(k.arg for k in node.keywords)))
    return calls


def registry_problems(declared: dict, notebooks: dict) -> list[str]:
    """What is wrong between the chapters' PARTS declarations and their solution notebooks."""
    fields = {f.name for f in dataclasses.fields(__import__("nanovllm_ref").Parts)}
    problems = []
    for chapter, nb in notebooks.items():
        defined = {}
        for cell in nb.cells:
            if rel.is_exercise_cell(cell):
                for node in ast.parse(cell.source).body:
                    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                        defined[node.name] = rel.exercises_of(cell)
        parts = declared.get(chapter, [])
        for p in parts:
            lo, hi = (p.exercise.split("-") + [p.exercise])[:2]
            span = [f"E{int(chapter)}.{n}" for n in range(int(lo.split(".")[1]), int(hi.split(".")[1]) + 1)]
            if p.field not in fields:
                problems.append(f"ch{chapter} {p.exercise}: {p.field!r} is not a Parts field")
            if not set(defined.get(p.name, [])) & set(span):
                problems.append(f"ch{chapter} {p.exercise}: no exercise cell of {sorted(span)} defines {p.name}")
        want = {}
        for p in parts:
            want.setdefault(p.graded_by, set()).add(p.name)
        want = {(t, frozenset(n)) for t, n in want.items()}
        got = _engine_calls(nb)
        for tag, names in sorted(want - got, key=str):
            problems.append(f"ch{chapter} {tag}: declares {sorted(names)}, which its check cell does not run "
                            "inside the engine (in_the_engine)")
        for tag, names in sorted(got - want, key=str):
            problems.append(f"ch{chapter} {tag}: its check cell runs {sorted(names)} inside the engine, which "
                            f"chapter {chapter}'s PARTS does not declare for {tag}")
    return problems


def _solutions_by_chapter():
    return {p.name[:2]: nbformat.read(p, as_version=4) for p in rel.solution_paths(REPO / "solutions")}


def test_each_chapter_declares_its_engine_parts_once_and_its_checks_run_them_in_the_engine():
    declared = ex.declared_parts()
    assert sorted(declared) == ["01", "02", "03", "04", "05", "06", "07", "08", "09", "10"]
    assert registry_problems(declared, _solutions_by_chapter()) == []
    # export and the capstone read the same declaration: every Parts field but silu_and_mul has an exercise
    from nanovllm_ref import Parts
    assert {p.field for p in ex.all_parts()} == {f.name for f in dataclasses.fields(Parts)} - {"silu_and_mul"}


def test_an_engine_part_missing_from_its_chapters_declaration_fails():
    declared = {c: list(ps) for c, ps in ex.declared_parts().items()}
    declared["04"] = [p for p in declared["04"] if p.exercise != "E4.3"]
    problems = registry_problems(declared, _solutions_by_chapter())
    assert problems == ["ch04 E4.3: its check cell runs ['store_kvcache'] inside the engine, which chapter 04's "
                        "PARTS does not declare for E4.3"]
    declared = {c: list(ps) for c, ps in ex.declared_parts().items()}
    declared["08"] = declared["08"] + [dataclasses.replace(declared["08"][0], name="top_k_top_p", exercise="E8.3")]
    problems = registry_problems(declared, _solutions_by_chapter())
    assert problems == ["ch08 E8.3: declares ['top_k_top_p'], which its check cell does not run inside the "
                        "engine (in_the_engine)"]


# -- export writes beside the notebooks --------------------------------------------------------------------------
def test_export_writes_beside_the_notebooks_and_two_graders_at_once_do_not_collide(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, source in ((a, "solutions"), (b, "chapters")):
        folder.mkdir()
        for name in ("01_rmsnorm.ipynb", "08_sampler.ipynb"):
            shutil.copy(REPO / source / name, folder / name)
    course = REPO / "student"
    before = {p: p.stat().st_mtime_ns for p in course.glob("*")} if course.exists() else None
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, "-m", "nanovllm_course", "export", "--notebooks", str(f)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in (a, b)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    import json
    rows_a = json.loads((a / "student" / "manifest.json").read_text())
    rows_b = json.loads((b / "student" / "manifest.json").read_text())
    assert [(r["exercise"], r["status"]) for r in rows_a] == [("E1.1", "done"), ("E1.2", "done"), ("E8.1-E8.4", "done")]
    assert [(r["exercise"], r["status"]) for r in rows_b] == [("E1.1", "stub"), ("E1.2", "stub"), ("E8.1-E8.4", "stub")]
    assert ex.STUB_MARK not in (a / "student" / "ch01.py").read_text()
    assert ex.STUB_MARK in (b / "student" / "ch01.py").read_text()
    after = {p: p.stat().st_mtime_ns for p in course.glob("*")} if course.exists() else None
    assert after == before                              # the course checkout's own student/ is untouched
