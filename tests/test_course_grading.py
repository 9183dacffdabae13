"""Tests of grading a class (nanovllm_course/grading.py, check_runner.py, nbval_grading.py, the grade command).

* three students' folders, anywhere on disk (right with the optional E4.3 skipped and a deleted check cell, the
  unfilled chapter, one wrong answer): one `grade` command gives the table, a CSV and a JSON with the right
  verdicts and totals and exit status 1; `pytest --nbval` over the same three folders names every item, failure
  and JUnit record by the student's own notebook path, and agrees with `grade` on every exercise;
* cheats fail to cheat: in chapter 09 the issue's two lines that replace `ch09.check_simulated_forward` (and
  print `E9.2 ok`), the reference imported as the answer; in chapter 08 an edited check cell with a forged
  verdict record, `common.verdict_line` replaced, torch's comparisons patched, the check's `call_student`
  replaced, sys.stdout filtered. Each one makes the check cell print `Ex.y ok` in a plain run (what the student's
  own kernel shows: the cheat works there), and none of them passes under `grade` (nor, for chapter 09, under
  `pytest --nbval`);
* the verdict machinery without a kernel: forged, foreign and repeated records, the check cells' states, the
  snapshot putting back what a notebook replaced, the optional exercise's total, the student names.
"""
import csv
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from nanovllm_course import check_runner, grading
from nanovllm_course import release as rel

REPO = Path(__file__).resolve().parents[1]
NBVAL = ["--nbval", "--nbval-current-env", "--nbval-sanitize-with", str(REPO / "tests" / "nbval_sanitize.cfg")]
CH04, CH08, CH09 = "04_kv_cache_paged_attention.ipynb", "08_sampler.ipynb", "09_tensor_parallelism.ipynb"
ENV = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


def released(name):
    return nbformat.read(REPO / "chapters" / name, as_version=4)


def solved(name, skip=()):
    """The released chapter with the solution's exercise cells pasted back, except those defining `skip`'s ids."""
    sol = nbformat.read(REPO / "solutions" / name, as_version=4)
    chap = released(name)
    for s, c in zip(sol.cells, chap.cells):
        if rel.is_exercise_cell(s) and not set(rel.exercises_of(s)) & set(skip):
            c.source = s.source
    return chap


def cell_defining(nb, name) -> int:
    return next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and f"def {name}(" in c.source
                and not rel.is_check_cell(c))


def check_cell_of(nb, exercise) -> int:
    return next(i for i, c in enumerate(nb.cells) if rel.is_check_cell(c) and exercise in rel.checked_exercises(c))


def write(nb, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rel.dumps(nb), encoding="utf-8")
    return path


def grade_cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "nanovllm_course", "grade", *map(str, args)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def nbval(paths, junit: Path, *options, timeout=900):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *NBVAL,
                           f"--junitxml={junit}", *options, *map(str, paths)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=timeout)
    assert junit.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = {}
    for tc in ET.parse(junit).iter("testcase"):
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message", "")
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
                message = child.get("message", "")
        cases[(tc.get("classname"), tc.get("name"))] = (outcome, message, tc.get("file"))
    return proc, cases


def shape(line: str) -> str:
    """A verdict with its numbers and lists blanked: each run draws fresh random cases."""
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", re.sub(r"\[[^\]]*\]", "[...]", line))


def plain_check_lines(nb, cwd) -> dict:
    """What each check cell prints when the notebook runs as in the student's own kernel (no grader):
    {exercise: the verdict line it printed}."""
    done, _ = rel.execute_notebook(nb, cwd, timeout=300)
    found = {}
    for cell in done.cells:
        if rel.is_check_cell(cell):
            for ex in rel.checked_exercises(cell):
                found[ex] = rel.verdict_of(ex, rel._stdout(cell), rel._error_output(cell))
    return found


# -- a class of three ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def three_students(tmp_path_factory):
    """alice: E4.1 and E4.2 right, her E4.2 check cell deleted, the optional E4.3 skipped; bob: the chapter as
    released; carol: E4.1 indexes the block table by the position inside the chunk (p - start), E4.2 right."""
    root = tmp_path_factory.mktemp("class")
    alice = solved(CH04, skip=("E4.3",))
    del alice.cells[check_cell_of(alice, "E4.2")]
    carol = solved(CH04, skip=("E4.3",))
    i = cell_defining(carol, "slot_mapping")
    right = "block_table[p // block_size] * block_size + p % block_size for p in range(start, end)"
    assert right in carol.cells[i].source
    carol.cells[i].source = carol.cells[i].source.replace(
        right, "block_table[(p - start) // block_size] * block_size + (p - start) % block_size for p in range(start, end)")
    folders = {who: root / "2026" / who for who in ("alice", "bob", "carol")}
    for who, nb in (("alice", alice), ("bob", released(CH04)), ("carol", carol)):
        write(nb, folders[who] / CH04)
    return root, folders


@pytest.fixture(scope="module")
def graded_class(three_students, tmp_path_factory):
    root, folders = three_students
    out = tmp_path_factory.mktemp("report")
    proc = grade_cli(*folders.values(), "--csv", out / "class.csv", "--json", out / "class.json", "--jobs", "2")
    return proc, out


def test_one_command_grades_three_students_into_a_table_csv_and_json(three_students, graded_class):
    _, folders = three_students
    proc, out = graded_class
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-3000:]
    with open(out / "class.csv", newline="", encoding="utf-8") as f:
        got = [(r["student"], r["exercise"], r["verdict"].split(":")[0], r["optional"], r["check_cell"])
               for r in csv.DictReader(f)]
    assert got == [("alice", "E4.1", "ok", "False", "as released"), ("alice", "E4.2", "ok", "False", "deleted"),
                   ("alice", "E4.3", "not done yet", "True", "as released"),
                   ("bob", "E4.1", "not done yet", "False", "as released"),
                   ("bob", "E4.2", "not done yet", "False", "as released"),
                   ("bob", "E4.3", "not done yet", "True", "as released"),
                   ("carol", "E4.1", "failed", "False", "as released"), ("carol", "E4.2", "ok", "False", "as released"),
                   ("carol", "E4.3", "not done yet", "True", "as released")], got
    report = json.loads((out / "class.json").read_text())
    assert report["total"] == {"notebooks": 3, "complete": 1, "exercises": 9, "ok": 3, "required": 6, "required_ok": 3}
    by = {n["student"]: n for n in report["notebooks"]}
    assert {s: (n["complete"], n["total"]) for s, n in by.items()} == {
        "alice": (True, f"{CH04}: 2 of 2 required ok, optional E4.3 not done"),
        "bob": (False, f"{CH04}: 0 of 2 required ok, optional E4.3 not done"),
        "carol": (False, f"{CH04}: 1 of 2 required ok, optional E4.3 not done")}
    assert {s: Path(n["path"]).parent for s, n in by.items()} == folders
    carol_e41 = by["carol"]["exercises"][0]
    assert carol_e41["line"].startswith("E4.1 failed: slot_mapping(") and "absolute position" in carol_e41["line"]
    assert by["alice"]["exercises"][1]["notes"] == ["E4.2: its check cell was deleted; the course put it back and ran it"]
    assert all(e["seconds"] > 0 for n in report["notebooks"] for e in n["exercises"] if e["ok"])   # the check ran
    lines = proc.stdout.splitlines()
    head = next(i for i, l in enumerate(lines) if l.split() == ["student", "exercise", "verdict", "seconds"])
    table = [l.split()[:3] for l in lines[head + 1:head + 10]]
    assert table == [["alice", "E4.1", "ok"], ["alice", "E4.2", "ok"], ["alice", "E4.3", "(optional)"],
                     ["bob", "E4.1", "not"], ["bob", "E4.2", "not"], ["bob", "E4.3", "(optional)"],
                     ["carol", "E4.1", "failed:"], ["carol", "E4.2", "ok"], ["carol", "E4.3", "(optional)"]], lines[head:]
    assert lines[-3:-2] == ["total: 1 of 3 notebooks complete; 3 of 6 required exercises ok, 0 of 3 optional"], lines
    assert f"alice: {CH04}: 2 of 2 required ok, optional E4.3 not done" in proc.stdout


def test_pytest_nbval_names_each_students_notebook_and_agrees_with_grade(three_students, graded_class, tmp_path):
    _, folders = three_students
    proc, cases = nbval(list(folders.values()), tmp_path / "class.xml")
    report = json.loads((graded_class[1] / "class.json").read_text())
    for who, folder in folders.items():
        path = (folder / CH04).as_posix()
        classname = path.replace("/", ".")                   # what JUnit makes of the node id
        mine = {name: v for (cls, name), v in cases.items() if cls == classname}
        assert sorted(n for n in mine if n.startswith("E")) == ["E4.1", "E4.2", "E4.3"], (who, sorted(cases))

        graded = {e["exercise"]: e for e in next(n for n in report["notebooks"] if n["student"] == who)["exercises"]}
        for ex in ("E4.1", "E4.2", "E4.3"):
            outcome, message, _ = mine[ex]
            want = graded[ex]
            if want["ok"]:
                assert outcome == "passed", (who, ex, mine[ex])
            elif want["optional"]:
                assert outcome == "xfailed" and message.endswith(f"{want['line']} (optional)"), (who, ex, mine[ex])
            else:
                assert outcome == "failed" and shape(message) == shape(want["line"]), (who, ex, mine[ex], want)
                assert f"FAILED {path}::{ex} - {want['line'][:40]}" in proc.stdout or \
                    shape(f"FAILED {path}::{ex} - {message}")[:60] in shape(proc.stdout), proc.stdout[-3000:]
        others = [(n, v[0]) for n, v in mine.items() if not n.startswith("E") and v[0] not in ("passed", "skipped")]
        assert others == [], (who, others)
    assert "FAILED ::" not in proc.stdout


# -- cheats ---------------------------------------------------------------------------------------------------------
CH09_MONKEYPATCH = '''

from nanovllm_course import ch09
ch09.check_simulated_forward = lambda *a: print("E9.2 ok")
print("E9.2 ok")
'''
CH09_REFERENCE = '''from nanovllm_course.ch09 import reference_load_qkv_shard as load_qkv_shard
from nanovllm_course.ch09 import reference_load_gate_up_shard as load_gate_up_shard
from nanovllm_course.ch09 import reference_load_row_shard as load_row_shard
from nanovllm_course.ch09 import reference_load_vocab_shard as load_vocab_shard
'''


@pytest.fixture(scope="module")
def ch09_cheat(tmp_path_factory):
    """E9.1: the reference's loaders imported as the answer; E9.2: the four stubs and the issue's two lines."""
    nb = released(CH09)
    nb.cells[cell_defining(nb, "load_qkv_shard")].source = CH09_REFERENCE
    nb.cells[cell_defining(nb, "column_forward")].source += CH09_MONKEYPATCH
    return write(nb, tmp_path_factory.mktemp("mallory") / CH09)


def test_chapter_09_cheats_fool_the_plain_check_cells(ch09_cheat):
    lines = plain_check_lines(nbformat.read(ch09_cheat, as_version=4), ch09_cheat.parent)
    assert lines == {"E9.1": "E9.1 ok", "E9.2": "E9.2 ok"}, lines


def test_chapter_09_cheats_fail_under_grade_and_pytest_nbval(ch09_cheat, tmp_path):
    """One `pytest --nbval` run of the cheat feeds both verdicts: nbval's items and `grade`'s verdict on that same
    run (grading.Session.grade_executed, recorded by tests/suite_plugin.py --nbval-record, as the chapter runs of
    test_course_machinery.py are; `grade`'s own kernel runs the chapter 08 cheats below and the three students)."""
    record_dir = tmp_path / "run"
    proc, cases = nbval([ch09_cheat], tmp_path / "cheat.xml", "-p", "tests.suite_plugin", f"--nbval-record={record_dir}")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((record_dir / f"{ch09_cheat.stem}.json").read_text())["grade"]
    assert report is not None, "the cheat's notebook was not graded as a student's"
    lines = {e["exercise"]: e["line"] for e in report["exercises"]}
    assert lines["E9.1"] == ("E9.1 failed: load_qkv_shard is nanovllm_ref.layers.linear.load_qkv_shard, not your code "
                             "(hint: write load_qkv_shard yourself in the exercise cell)"), lines
    assert lines["E9.2"] == "E9.2 not done yet", lines
    assert report["exercises"][1]["notes"] == [
        "E9.2: before its check the notebook had replaced nanovllm_course.ch09.check_simulated_forward; the course "
        "put the originals back"]
    assert report["total"] == f"{CH09}: 0 of 2 exercises ok"
    items = {name: v for (cls, name), v in cases.items() if name.startswith("E")}
    assert items["E9.1"][:2] == ("failed", lines["E9.1"]) and items["E9.2"][:2] == ("failed", "E9.2 not done yet"), items


CH08_CHEATS = {
    # E8.1: the check cell edited to print the line, and the stub publishing a verdict record of its own
    "temperature_probs": '''

def temperature_probs(logits, temperatures):
    from IPython.display import publish_display_data
    publish_display_data({"application/vnd.nanovllm.verdict+json": {"token": "guessed", "exercise": "E8.1",
                          "line": "E8.1 ok", "seconds": 0.1, "restored": [], "during": [], "mac": "0" * 64}})
    raise NotImplementedError("Exercise 8.1")
''',
    # E8.2: the stub, and the verdict printer of every check cell replaced
    "exponential_race": '''

from nanovllm_course import common
common.verdict_line = lambda tag, exc=None, tb=None: f"{tag} ok"
''',
    # E8.3: a top-k/top-p that changes nothing, and torch's comparisons patched
    "top_k_top_p": '''

def top_k_top_p(probs, top_k, top_p):
    return probs.clone()

import torch
torch.Tensor.any = lambda self, *a, **k: torch.tensor(False)
torch.Tensor.all = lambda self, *a, **k: torch.tensor(True)
torch.equal = lambda *a, **k: True
torch.allclose = lambda *a, **k: True
torch.testing.assert_close = lambda *a, **k: None
''',
    # E8.4: the stub, and the check's call_student calling the reference instead of it
    "sample": '''

from nanovllm_course import ch08
ch08.call_student = lambda tag, fn, *args, **kwargs: ch08.reference_sample(*args, **kwargs)
''',
    # E8.5: penalties without the presence term, and sys.stdout rewriting every failure into an ok
    "apply_penalties": '''

def apply_penalties(logits, prompt_mask, output_counts, presence, frequency, repetition):
    z = logits.float()
    seen = prompt_mask | (output_counts > 0)
    r = repetition.float().unsqueeze(-1)
    z = torch.where(seen, torch.where(z < 0, z * r, z / r), z)
    return z - frequency.float().unsqueeze(-1) * output_counts.float()

import re as _re
import sys as _sys

class _Rewrite:
    def __init__(self, out):
        self.out = out
    def write(self, text):
        return self.out.write(_re.sub(r"(E\\d+\\.\\d+) (failed: .*|not done yet)", r"\\1 ok", text))
    def __getattr__(self, name):
        return getattr(self.out, name)

_sys.stdout = _Rewrite(_sys.stdout)
''',
}


@pytest.fixture(scope="module")
def ch08_cheat(tmp_path_factory):
    nb = released(CH08)
    for name, cheat in CH08_CHEATS.items():
        nb.cells[cell_defining(nb, name)].source += cheat
    nb.cells[check_cell_of(nb, "E8.1")].source = 'print("E8.1 ok")'
    return write(nb, tmp_path_factory.mktemp("trudy") / CH08)


def test_chapter_08_cheats_fool_the_plain_check_cells(ch08_cheat):
    lines = plain_check_lines(nbformat.read(ch08_cheat, as_version=4), ch08_cheat.parent)
    assert lines == {f"E8.{n}": f"E8.{n} ok" for n in range(1, 6)}, lines


def test_chapter_08_cheats_fail_under_grade(ch08_cheat, tmp_path):
    proc = grade_cli(ch08_cheat, "--json", tmp_path / "g.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "g.json").read_text())["notebooks"][0]
    by = {e["exercise"]: e for e in report["exercises"]}
    assert [by[f"E8.{n}"]["line"].split(":")[0] for n in range(1, 6)] == [
        "E8.1 not done yet", "E8.2 not done yet", "E8.3 failed", "E8.4 not done yet", "E8.5 failed"], by
    assert by["E8.1"]["check_cell"] == "edited"
    notes = {ex: " ".join(e["notes"]) for ex, e in by.items()}
    assert "nanovllm_course.common.verdict_line" in notes["E8.2"], notes
    assert all(n in notes["E8.3"] for n in ("torch.Tensor.any", "torch.equal", "torch.allclose",
                                             "torch.testing.assert_close")), notes
    assert "nanovllm_course.ch08.call_student" in notes["E8.4"], notes
    assert "sys.stdout" in notes["E8.5"], notes
    assert "presence" in by["E8.5"]["line"] or "differs" in by["E8.5"]["line"], by["E8.5"]
    # what the grader's kernel showed in the cells: the course's lines, not the cheats'
    assert "E8.3 ok" not in proc.stdout and "E8.5 ok" not in proc.stdout


# -- the verdict machinery, without a kernel ------------------------------------------------------------------------
def _session(name=CH04):
    return grading.Session(nbformat.read(REPO / "solutions" / name, as_version=4), name)


def _record(session, token, exercise, line, secret=None):
    rec = {"token": token, "exercise": exercise, "line": line, "seconds": 0.5, "restored": [], "during": []}
    rec["mac"] = check_runner.sign(secret if secret is not None else session._secret, rec)
    return nbformat.v4.new_output("display_data", data={check_runner.VERDICT_MIME: rec})


def test_only_a_record_signed_for_its_cell_is_a_verdict():
    session = _session()
    prepared = session.prepare(released(CH04))
    (i1, ids1), (i2, _), (i3, _) = session.check_cells()
    token1 = session._prepared[0].token
    assert ids1 == ["E4.1"] and f"{check_runner.GRADER_NAME}.run({token1!r}, ['E4.1'])" in prepared.cells[i1].source
    printed = nbformat.v4.new_output("stream", name="stdout", text="E4.1 ok\n")
    assert session.verdicts_of_cell(i1, [printed])[0].line.startswith("E4.1 failed: the course's check gave no verdict")
    forged = _record(session, token1, "E4.1", "E4.1 ok", secret=b"x" * 32)
    assert session.verdicts_of_cell(i1, [forged])[0].line == "E4.1 failed: its check cell showed a verdict the course did not give"
    foreign = _record(session, session._prepared[1].token, "E4.1", "E4.1 ok")      # another cell's token
    assert not session.verdicts_of_cell(i1, [foreign])[0].ok
    good = _record(session, token1, "E4.1", "E4.1 ok")
    assert session.verdicts_of_cell(i1, [forged, printed, good])[0].ok
    two = [good, _record(session, token1, "E4.1", "E4.1 not done yet")]
    assert session.verdicts_of_cell(i1, two)[0].line == "E4.1 failed: its check cell gave two different verdicts"
    error = nbformat.v4.new_output("error", ename="NameError", evalue="name '__nanovllm_grader__' is not defined",
                                   traceback=[])
    assert session.verdicts_of_cell(i2, [error])[0].line == \
        "E4.2 failed: its check cell raised NameError: name '__nanovllm_grader__' is not defined"
    assert session.verdicts_of_cell(i3, [], ran=False, stopped="the run stopped at cell 9")[0].line == \
        "E4.3 failed: its check cell did not run (the run stopped at cell 9)"
    # tokens are new in every session
    other = _session()
    other.prepare(released(CH04))
    assert {p.token for p in other._prepared}.isdisjoint(p.token for p in session._prepared)


def test_prepare_restores_edited_untagged_and_deleted_check_cells_where_they_were():
    session = _session()
    nb = released(CH04)
    ids = [c.get("id") for c in nb.cells]
    e41, e42, e43 = (check_cell_of(nb, e) for e in ("E4.1", "E4.2", "E4.3"))
    nb.cells[e41].source = 'print("E4.1 ok")'
    nb.cells[e42].metadata["tags"] = []
    del nb.cells[e43]
    prepared = session.prepare(nb)
    states = {p.ids[0]: (p.index, p.state) for p in session._prepared}
    assert states == {"E4.1": (e41, "edited"), "E4.2": (e42, "untagged"), "E4.3": (e43, "deleted")}
    assert [c.get("id") for c in prepared.cells] == ids               # the deleted cell is back in its place
    assert all(check_runner.GRADER_NAME in prepared.cells[i].source for i, _ in session.check_cells())
    # a notebook whose cells no longer match the release: the check cell cannot be placed
    lost = nbformat.v4.new_notebook()
    lost.cells = [nbformat.v4.new_code_cell("x = 1")]
    session.prepare(lost)
    grade = session.grade_executed(lost)
    assert [(v.exercise, v.line, v.check_cell) for v in grade.verdicts] == [
        (e, f"{e} failed: its check cell is missing and the notebook no longer has the cells around it", "missing")
        for e in ("E4.1", "E4.2", "E4.3")]


def test_the_total_honours_optional_exercises():
    def grade(*lines_optional):
        return grading.Grade(CH04, [grading.Verdict(l.split()[0], l, f"{l.split()[0]} ok", o) for l, o in lines_optional], [])
    skipped = grade(("E4.1 ok", False), ("E4.2 ok", False), ("E4.3 not done yet", True))
    assert skipped.ok and skipped.total() == f"{CH04}: 2 of 2 required ok, optional E4.3 not done"
    wrong = grade(("E4.1 ok", False), ("E4.2 ok", False), ("E4.3 failed: no", True))
    assert wrong.ok and wrong.total() == f"{CH04}: 2 of 2 required ok, optional E4.3 failed"
    missing = grade(("E4.1 ok", False), ("E4.2 not done yet", False), ("E4.3 ok", True))
    assert not missing.ok and missing.total() == f"{CH04}: 1 of 2 required ok, optional E4.3 ok"
    plain = grading.Grade("01_rmsnorm.ipynb", [grading.Verdict("E1.1", "E1.1 ok", "E1.1 ok")], [])
    assert plain.ok and plain.total() == "01_rmsnorm.ipynb: 1 of 1 exercises ok"


def test_the_grader_reads_each_chapters_optional_exercises_from_its_source_as_the_chapter_declares_them():
    """The grader's process runs no check (the kernel does), so it reads which exercises are optional from the
    chapter modules' source (grading.optional_in_source) instead of importing them with torch and the engine: the
    same ids as every chapter's imported EXERCISES, and a verdict's `optional` without torch in the process."""
    import importlib
    for n in range(14):
        module = importlib.import_module(f"nanovllm_course.ch{n:02d}")
        assert grading.optional_in_source(n) == {e for e, x in module.EXERCISES.items() if x.optional}, n
    assert grading.optional_in_source(4) == {"E4.3"} and grading.optional_in_source(6) == {"E6.4"}
    assert grading.optional_in_source(99) == frozenset()
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['rfc3987_syntax'] = None\n"
                           "from nanovllm_course import grading\n"
                           "print(grading._optional('E4.3'), grading._optional('E4.1'), grading._optional('E99.1'), "
                           "'torch' in sys.modules)"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["True", "False", "False", "False"], proc.stdout + proc.stderr


def test_the_graders_cuda_question_is_torchs_answer_and_needs_no_torch_where_no_gpu_driver_is_installed(monkeypatch):
    """release.cuda_available() (which `gpu` cells the grader skips) is torch.cuda.is_available(); on a Linux machine
    with none of the GPU drivers' files it answers without importing torch (the grader's process then needs none)."""
    import torch
    assert rel.cuda_available() == torch.cuda.is_available()
    no_driver = sys.platform.startswith("linux") and not any(os.path.exists(p) for p in rel._GPU_DRIVER_PATHS)
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['rfc3987_syntax'] = None\n"
                           "from nanovllm_course import release\n"
                           "print(release.cuda_available(), 'torch' in sys.modules)"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == [str(torch.cuda.is_available()), str(not no_driver)], proc.stdout + proc.stderr
    monkeypatch.setattr(rel, "_GPU_DRIVER_PATHS", (str(REPO),))          # "a driver is there": torch decides
    assert rel.cuda_available() == torch.cuda.is_available()


def test_student_names_tell_the_folders_apart():
    assert grading.student_names(["/c/2026/alice/04.ipynb", "/c/2026/bob/04.ipynb", "/c/2026/bob/09.ipynb"]) == \
        ["alice", "bob", "bob"]
    assert grading.student_names(["/c/2025/alice/04.ipynb", "/c/2026/alice/04.ipynb"]) == ["2025/alice", "2026/alice"]


def test_grade_refuses_bad_arguments(tmp_path, capsys):
    from nanovllm_course.__main__ import main
    assert main(["grade", str(tmp_path)]) == 2
    assert "no chapter notebook (NN_slug.ipynb) in" in capsys.readouterr().err
    assert main(["grade", "--jobs", "0", str(REPO / "chapters" / CH04)]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        grading.grade_class([], jobs=0)


SNAPSHOT_SCRIPT = r'''
import builtins, sys, torch, importlib
import torch.nn.functional as F
from nanovllm_course import check_runner, common, ch04, engine_check
import nanovllm_ref
snap = check_runner.Snapshot()
originals = (torch.equal, F.softmax.__code__, common.check_close, ch04.check_slot_mapping, builtins.print,
             sys.stdout, len(engine_check.PROMPTS), ch04.EXERCISES["E4.1"].check, ch04.LONG_CONTEXT)
torch.equal = lambda *a: True
F.softmax.__code__ = (lambda *a, **k: 0).__code__
torch.Tensor.__eq__ = lambda *a: True
common.check_close = lambda *a, **k: None
ch04.check_slot_mapping = lambda fn: None
ch04.LONG_CONTEXT = (1, 1)
ch04.ATOL = 1.0
engine_check.PROMPTS.clear()
object.__setattr__(ch04.EXERCISES["E4.1"], "check", print)
builtins.print = lambda *a, **k: None
sys.stdout = open("/dev/null", "w")
sys.modules["nanovllm_course.ch04"] = object()
torch.set_default_dtype(torch.float64)
changed = snap.restore()
now = (torch.equal, F.softmax.__code__, common.check_close, ch04.check_slot_mapping, builtins.print, sys.stdout,
       len(engine_check.PROMPTS), ch04.EXERCISES["E4.1"].check, ch04.LONG_CONTEXT)
assert now == originals, (now, originals)
assert "__eq__" not in vars(torch.Tensor) and not hasattr(ch04, "ATOL") and sys.modules["nanovllm_course.ch04"] is ch04
assert torch.get_default_dtype() is torch.float32
print(sorted(changed))
again = snap.restore(); assert again == [], again
'''


def test_the_snapshot_puts_back_what_a_notebook_replaced():
    proc = subprocess.run([sys.executable, "-c", SNAPSHOT_SCRIPT], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    changed = eval(proc.stdout.strip().splitlines()[-1])
    assert changed == sorted([
        "builtins.print", "nanovllm_course.ch04.ATOL (added)", "nanovllm_course.ch04.EXERCISES['E4.1'] (Exercise).check",
        "nanovllm_course.ch04.LONG_CONTEXT", "nanovllm_course.ch04.check_slot_mapping",
        "nanovllm_course.common.check_close", "sys.modules['nanovllm_course.ch04']", "sys.stdout",
        "the code of torch.nn.functional.softmax", "the contents of nanovllm_course.engine_check.PROMPTS",
        "torch's default dtype (torch.set_default_dtype)", "torch.Tensor.__eq__ (added)", "torch.equal"]), changed


# -- one Exercise per exercise ---------------------------------------------------------------------------------------
SOLUTIONS = [p.name for p in rel.solution_paths(REPO / "solutions")]


def _check_call(cell) -> list:
    """[(exercise, check function name, [arg names], [in_the_engine keyword names] or None)] of a check cell of the
    form `with check("E4.1"): chNN.check_x(a, b); in_the_engine("E4.1", a=a)`. Raises AssertionError otherwise."""
    import ast
    found = []
    for node in ast.parse(cell.source).body:
        assert isinstance(node, ast.With) and len(node.items) == 1, ast.unparse(node)
        call = node.items[0].context_expr
        assert isinstance(call, ast.Call) and getattr(call.func, "id", None) == "check", ast.unparse(node)
        tag = call.args[0].value
        body = [s.value for s in node.body]
        assert all(isinstance(s, ast.Call) for s in body) and 1 <= len(body) <= 2, ast.unparse(node)
        first = body[0]
        assert isinstance(first.func, ast.Attribute) and not first.keywords, ast.unparse(first)
        assert all(isinstance(a, ast.Name) for a in first.args), ast.unparse(first)
        engine = None
        if len(body) == 2:
            assert getattr(body[1].func, "id", None) == "in_the_engine" and body[1].args[0].value == tag
            assert all(isinstance(k.value, ast.Name) and k.value.id == k.arg for k in body[1].keywords)
            engine = sorted(k.arg for k in body[1].keywords)
        found.append((tag, first.func.value.id, first.func.attr, [a.id for a in first.args], engine))
    return found


@pytest.mark.parametrize("name", SOLUTIONS)
def test_each_check_cell_runs_its_registered_exercise(name):
    """`grade` runs EXERCISES[id].run(namespace) in place of a check cell: so every check cell must be exactly that
    (the registered check on the registered names, then the engine run of the registered parts), every exercise of
    the notebook registered, in notebook order, and `optional` exactly where the exercise's heading says so."""
    import importlib
    module = importlib.import_module(f"nanovllm_course.ch{name[:2]}")
    nb = nbformat.read(REPO / "solutions" / name, as_version=4)
    calls = [c for cell in nb.cells if rel.is_check_cell(cell) for c in _check_call(cell)]
    assert [c[0] for c in calls] == list(module.EXERCISES), (calls, list(module.EXERCISES))
    for tag, mod_name, fn_name, args, engine in calls:
        exercise = module.EXERCISES[tag]
        assert mod_name == f"ch{name[:2]}" and getattr(module, fn_name) is exercise.check, (tag, fn_name)
        assert tuple(args) == exercise.args, (tag, args, exercise.args)
        parts = sorted({p.name for p in exercise.parts})
        assert (engine or []) == parts, (tag, engine, parts)
    headings = {m.group(1): "(optional)" in m.group(0) for c in nb.cells if c.cell_type == "markdown"
                for m in re.finditer(r"^#+ (E\d+\.\d+)\b.*$", c.source, re.M)}
    assert {t: e.optional for t, e in module.EXERCISES.items()} == {t: headings[t] for t in module.EXERCISES}


def test_exercise_refuses_what_it_cannot_run():
    from nanovllm_course.common import EnginePart, Exercise, exercises
    from nanovllm_course import ch04
    with pytest.raises(ValueError, match="id must look like 'E9.2'"):
        Exercise("4.1", ch04.check_slot_mapping, ("slot_mapping",))
    with pytest.raises(TypeError, match="args must be a tuple of notebook names"):
        Exercise("E4.1", ch04.check_slot_mapping, "slot_mapping")
    with pytest.raises(ValueError, match="reference has 2 objects for the 1 args"):
        Exercise("E4.1", ch04.check_slot_mapping, ("slot_mapping",), (1, 2))
    with pytest.raises(ValueError, match="parts must be EngineParts graded by E4.1"):
        Exercise("E4.1", ch04.check_slot_mapping, ("slot_mapping",), parts=(EnginePart("x", "rms_norm", "E4.2"),))
    e = Exercise("E4.1", ch04.check_slot_mapping, ("slot_mapping",))
    with pytest.raises(ValueError, match="E4.1 is declared twice"):
        exercises(e, e)
    with pytest.raises(NameError, match="'slot_mapping' is not defined"):
        e.run({})


def test_an_exercise_hint_is_the_fallback_of_its_failures(monkeypatch):
    """A failure that brings no hint of its own (an exception raised in the student's code) takes the exercise's
    `hint` where it has one, else the generic one; a check's own message keeps its runs of spaces."""
    import dataclasses
    from nanovllm_course import ch12, common
    exc = IndexError("list index out of range")
    assert common.verdict_line("E12.2", exc).endswith(
        "(hint: run your function on a small input in a new cell to see the full traceback)")
    monkeypatch.setitem(ch12.EXERCISES, "E12.2", dataclasses.replace(ch12.EXERCISES["E12.2"], hint="mind the prefix"))
    assert common.verdict_line("E12.2", exc).endswith("(hint: mind the prefix)")
    line = common.verdict_line("E12.2", common.CheckFailed(
        "E12.2", "at step 3 you emitted ' test' where the engine's detokenizer emits '  test'\nsecond line",
        "keep  both\n   lines"))
    assert line == ("E12.2 failed: at step 3 you emitted ' test' where the engine's detokenizer emits '  test' "
                    "(hint: keep  both lines)")


# -- what students met: one line from a "your part" cell, unsaved edits, `!python` --------------------------------
def test_a_your_part_cell_prints_one_line_and_returns_nothing(capsys):
    """`your_part_in_the_engine` returns None, so a cell ending with it shows its one line and no `True`/`False`
    after it (chapter 04's text promises one line); the solutions store exactly that: one stream, no result."""
    from nanovllm_course import ch01
    from nanovllm_course.engine_check import your_part_in_the_engine

    def stub(x, weight, eps):
        raise NotImplementedError("Exercise 1.1")

    def broken(x, weight, eps):
        raise IndexError("oops")

    for fn, start in ((ch01.reference_rms_norm, "Your rms_norm ran inside the engine: greedy ids equal"),
                      (stub, "Your rms_norm: still a stub"), (broken, "The engine with your rms_norm failed: IndexError")):
        assert your_part_in_the_engine(rms_norm=fn) is None
        out = capsys.readouterr().out
        assert len(out.splitlines()) == 1 and out.startswith(start), out
    for name in SOLUTIONS:
        nb = nbformat.read(REPO / "solutions" / name, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code" and re.search(r"your_(part|sampler)_in_the_engine\(", cell.source) \
                    and not rel.is_check_cell(cell):
                kinds = [(o.output_type, len(o.get("text", "").splitlines())) for o in cell.outputs]
                assert [k for k, _ in kinds] == ["stream"], (name, cell.source, kinds)     # no True/False after it
                if "your_part_in_the_engine(" in cell.source:
                    assert kinds == [("stream", 1)], (name, cell.source, kinds)


def test_export_here_names_a_part_that_differs_from_its_saved_notebook(tmp_path, capsys):
    """The export reads the saved notebooks: run in a notebook with its globals, it names the part this notebook
    runs in another version than the saved one (an edit not saved), and says nothing when they agree."""
    import linecache
    from nanovllm_course import export as ex
    write(solved("01_rmsnorm.ipynb"), tmp_path / "01_rmsnorm.ipynb")
    saved = next(c.source for c in solved("01_rmsnorm.ipynb").cells if "def rms_norm(" in c.source)

    def notebook_namespace(source, cell):
        linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)     # as IPython keeps cells
        namespace = {"__name__": "__main__", "torch": __import__("torch")}
        exec(compile(source, cell, "exec"), namespace)
        return namespace

    edited = notebook_namespace("import torch\n\ndef rms_norm(x, weight, eps):\n    return x * 2\n", "<cell-a>")
    rows = ex.export_here(edited, tmp_path)
    out = capsys.readouterr().out
    assert [r["status"] for r in rows] == ["done", "done"]
    assert out.startswith(f"exported 1 chapter(s) from {tmp_path}/ into {tmp_path / 'student'}/ {ex.SAVED_NOTE}")
    assert out.splitlines()[-1] == ("not saved yet: this notebook runs another version of rms_norm (saved in chapter "
                                    "01 as different code). Save it (Ctrl+S) and export again.")
    ex.export_here(notebook_namespace(saved, "<cell-b>"), tmp_path)
    assert "runs another version" not in capsys.readouterr().out


def test_make_lab_puts_the_venvs_python_first_on_labs_path():
    """A `!python` in a notebook is found on the PATH of the Lab that started its kernel: `make lab` puts the venv's
    bin/ first there, so it is the Python with torch (chapter 09's export found one without)."""
    proc = subprocess.run(["make", "-n", "lab"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if "jupyter lab" in l)
    venv_bin = REPO / ".venv" / "bin"
    assert line.startswith(f'PATH="{venv_bin}:$PATH" '), line
