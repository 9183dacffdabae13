"""`pytest --nbval` grades a student's chapter notebooks (a pytest plugin; course machinery).

    pytest --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg path/to/chapters/

The package registers this plugin with pytest (an entry point, `pytest11`, in pyproject.toml), so it is
active in every pytest run of the course's environment, whatever folder the notebooks are in (the repository's
conftest.py loads it too, through tests/conftest.py; `-p no:nanovllm_course` turns it off). It does nothing
without --nbval. It skips cells tagged `gpu` where there is no CUDA, and for every notebook nbval collects
whose name is a solution notebook's (`solutions/NN_slug.ipynb` of this checkout) it grades it as
`python -m nanovllm_course grade` does:

* the notebook is prepared by a grading.Session, as `grade` prepares it (the collector keeps it as
  `.grading_session`): check cells restored from the released chapter (an edited one gets its source back, a
  deleted one is put back where it was) and replaced by the course's runner; the session's preamble runs in
  nbval's kernel right after it starts (check_runner.py: the course's checks run there as the course's, whatever
  the notebook replaced). Each check cell is one test item named by its exercise ids under the notebook's own
  path (`/tmp/class/carol/04_kv_cache_paged_attention.ipynb::E4.1`: outside the rootdir pytest would name three
  students' notebooks alike, or a file argument `::E4.1`); it passes when every exercise got the course's signed
  `E4.1 ok` and fails with the verdict line as its message (`E4.1 not done yet`, `E4.1 failed: ... (hint: ...)`),
  read by the same function as `grade` (grading.Session.verdicts_of_cell), so both agree on every exercise; an
  optional exercise not ok xfails. A restored check cell is a warning naming the item. A check cell that cannot
  be put back is an item failing `E4.1 failed: its check cell is missing ...`.
* every other cell runs as the student left it and is not graded: its output is compared with the solution's
  stored one where the release keeps it (so a student's saved outputs neither pass nor fail anything), and a
  cell that raises, or prints something else, is reported as xfailed with the reason (`grade` prints it as a
  `note:`). Exercise cells and the cells that show the student's work are not compared.

The solution notebook itself is checked strictly, as before (the maintainers' gate in `make test`): check
items are named by exercise id too, and every cell's output must equal its stored output.
"""
from __future__ import annotations

import copy
import functools
import os
import warnings
from pathlib import Path

import pytest

GPU_TAG = "gpu"


class ExerciseNotOk(AssertionError):
    """An exercise's check cell gave a verdict other than `ok`; args[0] is the list of verdict lines."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def _rel():
    """nanovllm_course.release, imported on first use (it needs nbformat; the plugin loads in every pytest run)."""
    from nanovllm_course import release
    return release


def reference_of(path: Path):
    """(solution notebook, whether `path` is that solution itself), or (None, False) for a notebook that is not
    a chapter of this course."""
    rel = _rel()
    path = Path(path)
    if not rel.NOTEBOOK_NAME.match(path.name):
        return None, False
    solution = rel.SOLUTIONS / path.name
    if not solution.is_file():
        return None, False
    import nbformat
    return nbformat.read(solution, as_version=4), solution.resolve() == path.resolve()


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    collectors = yield
    if not collectors or file_path.suffix != ".ipynb":
        return collectors
    classes = _classes()
    if classes is None:
        return collectors
    out = []
    for c in collectors:
        if type(c) is classes["IPyNbFile"] and reference_of(file_path)[0] is not None:
            nodeid = _node_id(file_path, parent.config)
            kwargs = {"nodeid": nodeid} if nodeid is not None else {}
            out.append(classes["GradedNotebook"].from_parent(parent, path=file_path, **kwargs))
        else:
            out.append(c)
    return out


def _run_preamble(kernel, source: str, timeout: float) -> None:
    """Run the grading session's preamble in nbval's kernel before the first cell (no cell, no history); raise
    RuntimeError if it fails."""
    msg_id = kernel.kc.execute(source, store_history=False, allow_stdin=False, stop_on_error=False)
    error = None
    while True:                                   # its iopub messages, up to idle
        msg = kernel.get_message(stream="iopub", timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            error = f"{msg['content'].get('ename')}: {msg['content'].get('evalue')}"
        if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
            break
    kernel.await_reply(msg_id, timeout=timeout)
    if error is not None:
        raise RuntimeError(f"the grader's preamble raised {error}")


def _node_id(file_path: Path, config) -> str | None:
    """The id a notebook's items carry: pytest's own (relative to the rootdir) for a notebook inside it, else its
    path relative to where pytest runs, else the absolute path: so three students' `09_tensor_parallelism.ipynb`
    in three folders are three different notebooks in every report (pytest names one given outside the rootdir by
    its bare name, or by nothing at all: `FAILED ::E7.3`)."""
    path = Path(os.path.abspath(file_path))
    root = Path(os.path.abspath(config.rootpath))
    if path == root or root in path.parents:
        return None
    rel_to_cwd = os.path.relpath(path, config.invocation_params.dir)
    return Path(rel_to_cwd).as_posix() if not rel_to_cwd.startswith("..") else path.as_posix()


def _cell_tags(item) -> list:
    cell = getattr(item, "cell", None)           # nbval.plugin.IPyNbCell keeps its notebook cell here
    if cell is None:
        return []
    return list((cell.get("metadata") or {}).get("tags") or [])


def pytest_collection_modifyitems(config, items):
    """Without CUDA, notebook cells tagged `gpu` are skipped, like cells tagged `nbval-skip`."""
    gpu_items = [item for item in items if GPU_TAG in _cell_tags(item)]
    if not gpu_items:
        return
    if _rel().cuda_available():
        return
    skip = pytest.mark.skip(reason="notebook cell tagged 'gpu' needs CUDA")
    for item in gpu_items:
        item.add_marker(skip)


def _options_of(cell, default_check: bool) -> dict:
    """nbval's per-cell options (tags and `# NBVAL_...` comments) for `cell`."""
    from collections import defaultdict

    from nbval.plugin import find_comment_markers, find_metadata_tags
    options = defaultdict(bool, find_metadata_tags(cell.get("metadata", {})))
    options.update(dict(find_comment_markers(cell.source)))
    options.setdefault("check", default_check)
    return options


def _error_of(outputs) -> tuple[str, str] | None:
    for out in outputs or []:
        if out.get("output_type") == "error":
            return out.get("ename", ""), out.get("evalue", "")
    return None


def _stdout_of(outputs) -> str:
    return "".join(o.get("text", "") for o in outputs or [] if o.get("output_type") == "stream"
                   and o.get("name") == "stdout")


@functools.lru_cache(maxsize=None)
def _classes():
    """The plugin's nbval subclasses, made on first use (nbval is imported only when pytest --nbval runs)."""
    try:
        from nbval.plugin import IPyNbCell, IPyNbFile, NbCellError
    except ImportError:
        return None
    from _pytest._code.code import ReprFileLocation, TerminalRepr
    rel = _rel()

    class VerdictRepr(TerminalRepr):
        """A failed exercise as pytest shows it: its verdict lines, the first one also in the short summary."""

        def __init__(self, path, lines):
            self.lines = lines
            self.reprcrash = ReprFileLocation(str(path), 0, lines[0])

        def toterminal(self, tw) -> None:
            for line in self.lines:
                tw.line(line)

    class GradedNotebook(IPyNbFile):
        """A chapter notebook graded against its solution (see the module doc). On a student's notebook
        `.grading_session` is its grading.Session (the course's check cells, the signed verdicts)."""

        grading_session = None

        def setup(self):
            super().setup()
            if self.grading_session is not None:          # arm the course's check runner before the first cell
                _run_preamble(self.kernel, self.grading_session.preamble, self.config.option.nbval_cell_timeout or 300)

        def teardown(self):
            try:
                super().teardown()
            finally:
                if self.grading_session is not None:
                    self.grading_session.close()

        def collect(self):
            reference, is_solution = reference_of(self.path)
            items = list(super().collect())            # nbval reads self.nb and makes one item per code cell
            if is_solution:
                yield from self._collect_solution(items, reference)
                return
            from nanovllm_course import grading
            self.grading_session = grading.Session(reference, self.path.name)
            prepared = self.grading_session.prepare(self.nb)
            checks = dict(self.grading_session.check_cells())
            # what the release keeps: the solution's outputs of cells that show no student work
            kept = {c.get("id"): c for c in self.grading_session.released.cells
                    if c.cell_type == "code" and not rel.is_exercise_cell(c)}
            cell_num = 0
            for i, cell in enumerate(prepared.cells):
                if cell.cell_type != "code":
                    continue
                cell = copy.deepcopy(cell)
                if i in checks:
                    options = _options_of(cell, False)
                    options["check"] = False
                    yield GradedCheck.from_parent(self, name=", ".join(checks[i]), cell_num=cell_num, cell=cell,
                                                  options=options, exercises=checks[i], index=i)
                else:
                    ref = kept.get(cell.get("id"))
                    if ref is not None and not rel.is_check_cell(ref):
                        cell.outputs = copy.deepcopy(ref.outputs)
                        cell.execution_count = ref.execution_count
                        options = _options_of(ref, True)
                    else:                            # an exercise cell, a cleared cell or one the student added
                        cell.outputs, cell.execution_count = [], None
                        options = _options_of(cell, False)
                    yield UngradedCell.from_parent(self, name=f"Cell {cell_num}", cell_num=cell_num, cell=cell,
                                                   options=options)
                cell_num += 1
            for ref in self.grading_session._missing:
                ids = rel.checked_exercises(ref)
                yield MissingCheck.from_parent(self, name=", ".join(ids), exercises=ids)

        def _collect_solution(self, items, reference):
            """The solution itself: nbval's items, the check cells named by their exercises, every output compared."""
            pairs = rel.match_check_cells(self.nb, reference)
            check_at = {i: ref for ref, i in pairs if i is not None}
            index = {id(c): i for i, c in enumerate(self.nb.cells)}
            for item in items:
                i = index[id(item.cell)]
                if i in check_at:
                    ids = rel.checked_exercises(check_at[i])
                    yield SolutionCheck.from_parent(self, name=", ".join(ids), cell_num=item.cell_num,
                                                    cell=copy.deepcopy(item.cell), options=item.options, exercises=ids)
                else:
                    yield item

    class _Verdicts:
        """Mixed into the items that fail with ExerciseNotOk: its verdict lines are the report, under the
        notebook's own path."""

        def repr_failure(self, excinfo):
            if isinstance(excinfo.value, ExerciseNotOk):
                return VerdictRepr(self.path, excinfo.value.lines)
            return super().repr_failure(excinfo)

        def reportinfo(self):
            return self.path, None, f"{self.fspath.relto(self.config.rootdir) or self.path}::{self.name}"

    class GradedCheck(_Verdicts, IPyNbCell):
        """A student's check cell, run as the course's (grading.Session.prepare): passes when every exercise it
        checks got the course's signed `Ex.y ok`; a verdict line the notebook printed counts for nothing."""

        def __init__(self, name, parent, cell_num, cell, options, exercises, index):
            super().__init__(name, parent, cell_num, cell, options)
            self.exercises, self.index = list(exercises), index

        def runtest(self):
            try:
                super().runtest()
            except NbCellError:
                pass
            verdicts = self.parent.grading_session.verdicts_of_cell(self.index, self.test_outputs or [])
            for v in verdicts:
                self.user_properties.append((v.exercise, v.line))
                if v.check_cell != "as released":
                    self.user_properties.append((f"{v.exercise} check cell", v.check_cell))
                for note in v.notes():                 # "E4.2: its check cell was deleted; ..."
                    warnings.warn_explicit(f"{self.nodeid}: {note[len(v.exercise) + 2:]}", pytest.PytestWarning,
                                           filename=str(self.path), lineno=0)
            bad = [v.line + (" (optional)" if v.optional else "") for v in verdicts if not v.ok]
            if any(not v.ok and not v.optional for v in verdicts):
                raise ExerciseNotOk(bad)
            if bad:                                  # an optional exercise not done: not a failure
                pytest.xfail("; ".join(bad))

    class SolutionCheck(_Verdicts, IPyNbCell):
        """A check cell of the solution itself: its printed verdict must be `ok` (release.verdict_of), and its
        output equal to the stored one."""

        def __init__(self, name, parent, cell_num, cell, options, exercises):
            super().__init__(name, parent, cell_num, cell, options)
            self.exercises = list(exercises)

        def runtest(self):
            raised = None
            try:
                super().runtest()
            except NbCellError as exc:
                raised = exc
            outs = self.test_outputs or []
            lines = [rel.verdict_of(ex, _stdout_of(outs), _error_of(outs)) for ex in self.exercises]
            bad = [line for line in lines if line != f"{line.split(' ')[0]} ok"]
            if bad:
                raise ExerciseNotOk(bad)
            if raised is not None:                   # any other difference still fails
                raise raised

    class UngradedCell(IPyNbCell):
        """Any other cell of a student's notebook: runs, and reports a problem as xfailed (not graded)."""

        def runtest(self):
            try:
                super().runtest()
            except NbCellError as exc:
                error = _error_of(self.test_outputs)
                start = rel._first_line(self.cell.source, 60)
                if error is not None:
                    why = f"raised {error[0]}: {rel._first_line(error[1])}"
                else:
                    why = rel._first_line(str(exc))
                pytest.xfail(f"not graded: the cell starting {start!r} {why}")

    class MissingCheck(_Verdicts, pytest.Item):
        """An exercise whose check cell is not in the student's notebook."""

        def __init__(self, *, exercises, **kwargs):
            super().__init__(**kwargs)
            self.exercises = list(exercises)

        def runtest(self):
            from nanovllm_course import grading
            raise ExerciseNotOk([f"{ex} failed: {grading.CHECK_CELL_STATES[grading.MISSING]}" for ex in self.exercises])


    return {"IPyNbFile": IPyNbFile, "GradedNotebook": GradedNotebook, "GradedCheck": GradedCheck,
            "SolutionCheck": SolutionCheck, "UngradedCell": UngradedCell, "MissingCheck": MissingCheck}
