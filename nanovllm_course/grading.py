"""Grading student notebooks: one verdict per exercise, decided by the course's own checks (course machinery).

    python -m nanovllm_course grade alice/ bob/ carol/ --csv class.csv --json class.json

One notebook (`grade_notebook`, `grade_path`): a `Session` made from the chapter's solution

1. restores the check cells from the released chapter (release.release_notebook of the solution): a check cell
   the student edited gets its released source back ("edited"), one they deleted is put back after the cell
   that precedes it in the release ("deleted"), and one that cannot be placed is a failed exercise ("missing");
2. replaces each check cell by `__nanovllm_grader__.run(token, ids)` and runs the notebook top to bottom in a
   fresh kernel, after a preamble that arms the course's check runner there (check_runner.py: the runner puts
   back whatever the notebook replaced in the course, the engine, torch or the builtins, runs the registered
   `EXERCISES[id]` itself, and returns each verdict signed with the session's secret);
3. reads the signed verdicts (`grade_executed`): the line of each exercise, its seconds, its check cell's
   state, what the runner put back. A line the notebook printed is no verdict.

A `Grade` is one notebook's result. `ok` is true when every required exercise is ok; an exercise its chapter
registers as optional (`Exercise.optional`, E4.3) never fails a notebook, and the total says so:
`04_kv_cache_paged_attention.ipynb: 2 of 2 required ok, optional E4.3 not done`.

A class (`grade_class`): many notebooks, each graded as above (one after another, or `jobs` at a time), each
row naming its student (`student_names`: the notebook's folder, as much of its path as tells the students
apart); `table`, `write_csv` and `write_json` give the report, `class_total` the total.

API for callers that execute notebooks themselves (tests that run each chapter once and feed several reports):

    session = Session(solution_nb, name="09_tensor_parallelism.ipynb")
    prepared = session.prepare(student_nb)           # check cells restored and replaced
    executed, _ = release.execute_notebook(prepared, cwd, preamble=session.preamble)
    grade = session.grade_executed(executed, seconds=...)
    session.close()                                  # removes the secret's file if the preamble never ran

`pytest --nbval` (nbval_grading.py) uses the same session per notebook: its collector is `.grading_session`.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import functools
import hmac
import json
import os
import secrets
import tempfile
import time
from pathlib import Path

import nbformat

from nanovllm_course import check_runner
from nanovllm_course import release as rel

RELEASED, EDITED, DELETED, MISSING, RETAGGED = "as released", "edited", "deleted", "missing", "untagged"
CHECK_CELL_STATES = {
    RELEASED: "",
    EDITED: "its check cell was edited; the course's check ran instead",
    RETAGGED: "its check cell had lost its 'check' tag; the course's check ran there",
    DELETED: "its check cell was deleted; the course put it back and ran it",
    MISSING: "its check cell is missing and the notebook no longer has the cells around it",
}


# -- results -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Verdict:
    exercise: str      # "E1.1"
    line: str          # "E1.1 ok", "E1.1 not done yet", "E1.1 failed: ..."
    expected: str      # "E1.1 ok"
    optional: bool = False
    seconds: float = 0.0             # the check's own time (0 when it did not run)
    check_cell: str = RELEASED       # RELEASED, EDITED, RETAGGED, DELETED or MISSING
    restored: list = dataclasses.field(default_factory=list)   # what the runner put back before this check

    @property
    def ok(self) -> bool:
        return self.line == self.expected

    @property
    def not_done(self) -> bool:
        return self.line == f"{self.exercise} not done yet"

    @property
    def verdict(self) -> str:
        """The line without its exercise id: "ok", "not done yet", "failed: ..."."""
        return self.line[len(self.exercise) + 1:] if self.line.startswith(self.exercise + " ") else self.line

    def notes(self) -> list[str]:
        """What a grader should know besides the line: the check cell's state, what the notebook had replaced."""
        found = []
        if self.check_cell != RELEASED:
            found.append(f"{self.exercise}: {CHECK_CELL_STATES[self.check_cell]}")
        if self.restored:
            shown = ", ".join(self.restored[:4]) + (f" and {len(self.restored) - 4} more" if len(self.restored) > 4 else "")
            found.append(f"{self.exercise}: before its check the notebook had replaced {shown}; the course put "
                         "the originals back")
        return found


@dataclasses.dataclass
class Grade:
    name: str                # the notebook's file name
    verdicts: list           # [Verdict], in notebook order: one per exercise
    notes: list              # other cells that raised (not graded): "the cell starting '...' raised NameError: ..."
    seconds: float = 0.0     # the whole notebook, top to bottom
    path: str = ""           # where the notebook is
    student: str = ""        # who it belongs to (grade_class: the folder's name)
    executed: object = dataclasses.field(default=None, repr=False, compare=False)   # the executed notebook

    @property
    def required(self) -> list:
        return [v for v in self.verdicts if not v.optional]

    @property
    def ok(self) -> bool:
        """Every required exercise ok (an optional one never fails a notebook), and at least one exercise."""
        return bool(self.verdicts) and all(v.ok for v in self.required)

    def total(self) -> str:
        """`01_rmsnorm.ipynb: 1 of 2 exercises ok`, or with optional exercises
        `04_kv_cache_paged_attention.ipynb: 2 of 2 required ok, optional E4.3 not done`."""
        optional = [v for v in self.verdicts if v.optional]
        required = self.required
        done = sum(v.ok for v in required)
        if not optional:
            return f"{self.name}: {done} of {len(required)} exercises ok"
        states = ", ".join(f"{v.exercise} {'ok' if v.ok else 'not done' if v.not_done else 'failed'}" for v in optional)
        return f"{self.name}: {done} of {len(required)} required ok, optional {states}"

    def lines(self) -> list[str]:
        return ([v.line for v in self.verdicts] + [f"note: {n}" for v in self.verdicts for n in v.notes()]
                + [f"note: {n}" for n in self.notes] + [self.total()])

    def as_dict(self) -> dict:
        return {"student": self.student, "path": self.path, "notebook": self.name, "seconds": round(self.seconds, 1),
                "complete": self.ok, "required": len(self.required), "required_ok": sum(v.ok for v in self.required),
                "total": self.total(), "notes": list(self.notes),
                "exercises": [{"exercise": v.exercise, "verdict": v.verdict, "line": v.line, "ok": v.ok,
                               "optional": v.optional, "seconds": round(v.seconds, 2), "check_cell": v.check_cell,
                               "notes": v.notes()} for v in self.verdicts]}


def stub_failures_ok(grade: Grade) -> list[str]:
    """Problems with how an unfilled released chapter graded (empty list = as designed): every exercise
    `not done yet`, at least one exercise, and no other cell raised."""
    problems = [f"{v.exercise}: expected '{v.exercise} not done yet', got {v.line!r}"
                for v in grade.verdicts if not v.not_done]
    if not grade.verdicts:
        problems.append("no check cell")
    problems += [f"not a check cell: {n}" for n in grade.notes]
    problems += [f"{v.exercise}: {n}" for v in grade.verdicts for n in v.notes()]
    return problems


# -- one notebook ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Prepared:
    index: int          # the cell's index in the prepared notebook
    token: str
    ids: list
    state: str


def _same_source(a: str, b: str) -> bool:
    return a.strip().replace("\r\n", "\n") == b.strip().replace("\r\n", "\n")


def _optional(exercise: str) -> bool:
    """Whether the chapter declares `exercise` ("E4.3") optional. Read from the chapter module's source
    (optional_in_source) where its declarations are literal, so that the grader's process, which runs no check
    itself (the kernel does), need not import the chapter, torch and the engine: 2-3 s of CPU for each notebook
    it grades. Otherwise the imported declaration (common.exercise_of) answers."""
    import re
    m = re.fullmatch(r"E(\d+)\.(\d+)", str(exercise))
    declared = optional_in_source(int(m.group(1))) if m else None
    if declared is not None:
        return exercise in declared
    from nanovllm_course.common import exercise_of
    found = exercise_of(exercise)
    return bool(found is not None and found.optional)


@functools.lru_cache(maxsize=None)
def optional_in_source(chapter: int) -> frozenset[str] | None:
    """The ids of the `Exercise("E4.3", ..., optional=True)` declarations in nanovllm_course.chNN's source (its
    EXERCISES), found without importing it; an empty set for a chapter with no module, None where an `optional=`
    is not a literal (the caller then imports the chapter). tests/test_course_grading.py holds this reading equal
    to every chapter's imported EXERCISES."""
    import ast
    import importlib.util
    spec = importlib.util.find_spec(f"nanovllm_course.ch{chapter:02d}")
    if spec is None or spec.origin is None:
        return frozenset()
    found = set()
    for node in ast.walk(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Exercise"):
            continue
        flag = next((k.value for k in node.keywords if k.arg == "optional"), None)
        if flag is None:
            continue
        if not (isinstance(flag, ast.Constant) and isinstance(flag.value, bool) and node.args
                and isinstance(node.args[0], ast.Constant)):
            return None
        if flag.value:
            found.add(node.args[0].value)
    return frozenset(found)


class Session:
    """Grading one notebook against its chapter (see the module doc). `reference_nb` is the solution notebook;
    `name` its file name (NN_slug.ipynb: the chapter)."""

    def __init__(self, reference_nb, name: str):
        if reference_nb is None:
            raise rel.ReleaseError(f"grade: no solution notebook for {name}, so there is no check to restore")
        if not rel.NOTEBOOK_NAME.match(name):
            raise rel.ReleaseError(f"grade: {name!r} is not a chapter notebook name (NN_slug.ipynb)")
        self.name, self.chapter = name, name[:2]
        self.reference = reference_nb
        self.released = rel.release_notebook(reference_nb, name)
        self._secret = secrets.token_bytes(32)
        self._secret_file = None
        self._prepared: list[_Prepared] = []
        self._missing: list = []
        self.prepared = None       # the notebook `prepare` made

    # the preamble ------------------------------------------------------------------------------------------
    @property
    def preamble(self) -> str:
        """Source to run in the kernel before the notebook's first cell (once per session): it loads
        check_runner as a private module, which reads and deletes the secret's file and arms the runner."""
        if self._secret_file is None:
            fd, path = tempfile.mkstemp(prefix="nanovllm_grade_", suffix=".key")
            with os.fdopen(fd, "w") as f:
                f.write(self._secret.hex())
            self._secret_file = path
        return ("import importlib.util as _nanovllm_u\n"
                f"_nanovllm_s = _nanovllm_u.spec_from_file_location('_nanovllm_check_runner', {check_runner.__file__!r})\n"
                "_nanovllm_m = _nanovllm_u.module_from_spec(_nanovllm_s)\n"
                "_nanovllm_s.loader.exec_module(_nanovllm_m)\n"
                f"_nanovllm_m.arm({self._secret_file!r}, {self.chapter!r}, globals())\n"
                "del _nanovllm_u, _nanovllm_s, _nanovllm_m\n")

    def close(self) -> None:
        if self._secret_file is not None and os.path.exists(self._secret_file):
            os.unlink(self._secret_file)

    # preparing ---------------------------------------------------------------------------------------------
    def prepare(self, student_nb):
        """The notebook to execute: the student's, with each check cell restored from the release (put back
        where it was deleted) and replaced by the runner's call. Remembers where each check cell is."""
        nb = copy.deepcopy(student_nb)
        pairs = rel.match_check_cells(nb, self.released)
        placed = []                       # (index in the student's notebook, released cell, state)
        for ref, i in pairs:
            if i is not None:
                cell = nb.cells[i]
                state = RELEASED if _same_source(cell.source, ref.source) else EDITED
                if state == RELEASED and not rel.is_check_cell(cell):
                    state = RETAGGED
                placed.append((i, ref, state))
        inserted = []
        ids_at = {c.get("id"): k for k, c in enumerate(nb.cells) if c.get("id")}
        released_ids = [c.get("id") for c in self.released.cells]
        for ref, i in pairs:
            if i is not None:
                continue
            at = released_ids.index(ref.get("id"))
            anchor = next((ids_at[cid] for cid in reversed(released_ids[:at]) if cid in ids_at), None)
            inserted.append((anchor, at, ref))
        # put deleted cells back, last first, so the indices of the earlier anchors stay right
        for anchor, _, ref in sorted([x for x in inserted if x[0] is not None], key=lambda x: (-x[0], -x[1])):
            cell = nbformat.v4.new_code_cell(ref.source)
            cell["id"] = ref.get("id")
            nb.cells.insert(anchor + 1, cell)
            placed = [(k + 1 if k > anchor else k, r, s) for k, r, s in placed]
            placed.append((anchor + 1, ref, DELETED))
        self._missing = [ref for anchor, _, ref in inserted if anchor is None]
        self._prepared = []
        for i, ref, state in sorted(placed, key=lambda x: x[0]):
            ids = rel.checked_exercises(ref)
            token = secrets.token_hex(12)
            cell = nb.cells[i]
            cell.source = (f"# graded by the course: the check of {', '.join(ids)} "
                           f"(nanovllm_course.ch{self.chapter}.EXERCISES)\n"
                           f"{check_runner.GRADER_NAME}.run({token!r}, {ids!r})")
            cell.metadata["tags"] = list(dict.fromkeys(rel.tags(cell) + [rel.CHECK_TAG]))
            cell.outputs, cell.execution_count = [], None
            self._prepared.append(_Prepared(i, token, ids, state))
        self.prepared = nb         # kept (unexecuted) for callers that rebuild the executed notebook from cell outputs
        return nb

    def check_cells(self) -> list:
        """[(index in the prepared notebook, [exercise ids])] of the check cells `prepare` made."""
        return [(p.index, list(p.ids)) for p in self._prepared]

    # reading the verdicts ------------------------------------------------------------------------------------
    def _records(self, outputs, token: str) -> tuple[list, int]:
        """(the records among `outputs` signed with this session's secret for `token`, how many others claimed
        to be verdicts)."""
        good, bad = [], 0
        for out in outputs or []:
            data = out.get("data") or {}
            if check_runner.VERDICT_MIME not in data:
                continue
            record = data[check_runner.VERDICT_MIME]
            if isinstance(record, str):
                try:
                    record = json.loads(record)
                except ValueError:
                    bad += 1
                    continue
            mac = record.get("mac") if isinstance(record, dict) else None
            if isinstance(mac, str) and record.get("token") == token and \
                    hmac.compare_digest(mac, check_runner.sign(self._secret, dict(record))):
                good.append(dict(record))
            else:
                bad += 1
        return good, bad

    def verdicts_of_cell(self, index: int, outputs, ran: bool = True, stopped: str | None = None) -> list[Verdict]:
        """The verdicts of the check cell `prepare` put at `index`, from its outputs as the kernel sent them
        (`ran`: the cell was executed; `stopped`: why the run ended before it)."""
        prep = next((p for p in self._prepared if p.index == index), None)
        if prep is None:
            raise ValueError(f"cell {index} is not a check cell this session prepared: {self.check_cells()}")
        good, bad = self._records(outputs, prep.token)
        error = rel._error_output({"outputs": outputs or []})
        verdicts = []
        for ex in prep.ids:
            mine = [r for r in good if r.get("exercise") == ex]
            lines = {r["line"] for r in mine}
            restored = list(dict.fromkeys(n for r in mine for n in r.get("restored", [])))
            seconds = max([float(r.get("seconds", 0.0)) for r in mine] or [0.0])
            if len(lines) == 1:
                line = lines.pop()
            elif len(lines) > 1:
                line = f"{ex} failed: its check cell gave two different verdicts"
            elif not ran:
                line = f"{ex} failed: its check cell did not run" + (f" ({stopped})" if stopped else "")
            elif error is not None:
                line = f"{ex} failed: its check cell raised {error[0]}: {rel._first_line(error[1])}"
            elif bad:
                line = f"{ex} failed: its check cell showed a verdict the course did not give"
            else:
                line = f"{ex} failed: the course's check gave no verdict (the notebook replaced {check_runner.GRADER_NAME}?)"
            verdicts.append(Verdict(ex, line, f"{ex} ok", _optional(ex), seconds, prep.state, restored))
        return verdicts

    def grade_executed(self, executed_nb, seconds: float = 0.0) -> Grade:
        """The Grade of a notebook `prepare` made and the kernel ran (its cells' outputs as executed)."""
        checks = {p.index for p in self._prepared}
        stopped = None
        for i, cell in enumerate(executed_nb.cells):
            err = rel._error_output(cell) if cell.cell_type == "code" else None
            if err is not None and err[0] in ("CellTimeoutError", "DeadKernelError"):
                stopped = f"the run stopped at cell {i}: {err[1]}"
                break
        verdicts = []
        for prep in self._prepared:
            cell = executed_nb.cells[prep.index]
            ran = cell.get("execution_count") is not None or bool(cell.get("outputs"))
            verdicts += self.verdicts_of_cell(prep.index, cell.get("outputs"), ran, stopped)
        for ref in self._missing:
            for ex in rel.checked_exercises(ref):
                verdicts.append(Verdict(ex, f"{ex} failed: {CHECK_CELL_STATES[MISSING]}", f"{ex} ok", _optional(ex),
                                        check_cell=MISSING))
        order = {ex: k for k, ex in enumerate(e for c in self.released.cells if rel.is_check_cell(c)
                                              for e in rel.checked_exercises(c))}
        verdicts.sort(key=lambda v: order.get(v.exercise, len(order)))
        notes = []
        for i, cell in enumerate(executed_nb.cells):
            if cell.cell_type != "code" or i in checks:
                continue
            err = rel._error_output(cell)
            if err is not None:
                notes.append(f"the cell starting {rel._first_line(cell.source, 60)!r} raised {err[0]}: "
                             f"{rel._first_line(err[1])}")
        return Grade(self.name, verdicts, notes, seconds, executed=executed_nb)


def grade_notebook(student_nb, reference_nb, cwd: str | Path = rel.CHAPTERS, *, name: str, timeout: int = 300,
                   path: str = "") -> Grade:
    """Grade one notebook (see the module doc): run it top to bottom in a fresh kernel in `cwd` with the course's
    check cells, and read each exercise's verdict. `grade.executed` is the executed notebook."""
    session = Session(reference_nb, name)
    try:
        prepared = session.prepare(student_nb)
        start = time.perf_counter()
        executed, _ = rel.execute_notebook(prepared, cwd, timeout=timeout, preamble=session.preamble)
        grade = session.grade_executed(executed, seconds=time.perf_counter() - start)
    finally:
        session.close()
    grade.path = path
    return grade


def reference_for(path: Path, solutions: Path = rel.SOLUTIONS):
    """The solution notebook a chapter is graded against (None if there is none)."""
    sol = Path(solutions) / Path(path).name
    return nbformat.read(sol, as_version=4) if sol.is_file() else None


def grade_path(path: Path, solutions: Path = rel.SOLUTIONS, timeout: int = 300) -> Grade:
    """Grade the notebook at `path` against the solution of the same name in `solutions`."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    return grade_notebook(nb, reference_for(path, solutions), path.parent, name=path.name, timeout=timeout,
                          path=str(path))


# -- a class ---------------------------------------------------------------------------------------------------
def student_names(paths) -> list[str]:
    """Who each notebook belongs to: its folder, given by as many trailing path parts as it takes to tell the
    folders apart (`alice`, or `2025/alice` and `2026/alice`)."""
    folders = [Path(os.path.abspath(p)).parent for p in paths]
    unique = list(dict.fromkeys(folders))
    depth = 1
    while depth < max((len(f.parts) for f in unique), default=1):
        names = {f: "/".join(f.parts[-depth:]) for f in unique}
        if len(set(names.values())) == len(unique):
            break
        depth += 1
    return ["/".join(f.parts[-depth:]) or str(f) for f in folders]


def _grade_one(args) -> Grade:
    path, solutions, timeout = args
    try:
        return grade_path(Path(path), Path(solutions), timeout=timeout)
    except Exception as exc:            # one notebook that cannot be graded does not stop the class
        return Grade(Path(path).name, [], [f"could not be graded: {type(exc).__name__}: {rel._first_line(exc)}"],
                     path=str(path))


def grade_class(paths, solutions: Path = rel.SOLUTIONS, *, timeout: int = 300, jobs: int = 1, on_grade=None) -> list:
    """Grade every notebook of `paths` (each in its own kernel), `jobs` at a time, in the order given; each Grade
    names its student (student_names). `on_grade(grade)` is called as each one finishes, in order."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    paths = [Path(p) for p in paths]
    names = student_names(paths)
    work = [(str(p), str(solutions), timeout) for p in paths]
    grades = []
    if jobs == 1:
        results = map(_grade_one, work)
    else:
        from concurrent.futures import ProcessPoolExecutor
        pool = ProcessPoolExecutor(max_workers=jobs)
        results = pool.map(_grade_one, work)
    try:
        for grade, student in zip(results, names):
            grade.student = student
            grade.executed = None if jobs > 1 else grade.executed
            grades.append(grade)
            if on_grade is not None:
                on_grade(grade)
    finally:
        if jobs > 1:
            pool.shutdown()
    return grades


def class_total(grades) -> dict:
    """{"notebooks", "complete", "exercises", "ok", "required", "required_ok"} over a class."""
    verdicts = [v for g in grades for v in g.verdicts]
    return {"notebooks": len(grades), "complete": sum(g.ok for g in grades), "exercises": len(verdicts),
            "ok": sum(v.ok for v in verdicts), "required": sum(not v.optional for v in verdicts),
            "required_ok": sum(v.ok for v in verdicts if not v.optional)}


def total_line(grades) -> str:
    t = class_total(grades)
    return (f"total: {t['complete']} of {t['notebooks']} notebooks complete; {t['required_ok']} of {t['required']} "
            f"required exercises ok" + (f", {t['ok'] - t['required_ok']} of {t['exercises'] - t['required']} optional"
                                        if t['exercises'] > t['required'] else ""))


COLUMNS = ("student", "notebook", "exercise", "verdict", "seconds", "optional", "check_cell", "notes", "path")


def rows(grades) -> list[dict]:
    """One row per exercise of every notebook (a notebook that could not be graded: one row with its note)."""
    found = []
    for g in grades:
        for v in g.verdicts:
            found.append({"student": g.student, "notebook": g.name, "exercise": v.exercise, "verdict": v.verdict,
                          "seconds": round(v.seconds, 2), "optional": v.optional, "check_cell": v.check_cell,
                          "notes": "; ".join(v.notes()), "path": g.path})
        if not g.verdicts:
            found.append({"student": g.student, "notebook": g.name, "exercise": "", "verdict": "not graded",
                          "seconds": 0.0, "optional": False, "check_cell": "", "notes": "; ".join(g.notes),
                          "path": g.path})
    return found


def table(grades, width: int = 70) -> str:
    """The class as text: student, exercise, verdict, seconds (a verdict cut at `width` characters), then one
    total line per notebook and the class total."""
    body = [(r["student"], r["exercise"] + (" (optional)" if r["optional"] else ""),
             r["verdict"] if len(r["verdict"]) <= width else r["verdict"][:width - 3] + "...", f"{r['seconds']:.1f}")
            for r in rows(grades)]
    head = ("student", "exercise", "verdict", "seconds")
    widths = [max(len(x[k]) for x in [head] + body) for k in range(4)]
    fmt = "{:<%d}  {:<%d}  {:<%d}  {:>%d}" % tuple(widths)
    lines = [fmt.format(*head)] + [fmt.format(*r).rstrip() for r in body]
    lines += [f"{g.student}: {g.total()} ({g.seconds:.0f} s)" for g in grades]
    lines.append(total_line(grades))
    return "\n".join(lines)


def write_csv(grades, path) -> None:
    """One row per exercise (COLUMNS), UTF-8 with a header."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows(grades):
            writer.writerow(row)


def write_json(grades, path, *, solutions: str = "") -> None:
    """{"solutions", "notebooks": [Grade.as_dict(), ...], "total": class_total}."""
    data = {"solutions": str(solutions), "notebooks": [g.as_dict() for g in grades], "total": class_total(grades)}
    Path(path).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
