"""Course machinery: solution notebooks -> student notebooks, and running notebooks headlessly.

Source of truth: `solutions/NN_slug.ipynb`, complete and executed top to bottom. Exercise code sits between

    ### BEGIN SOLUTION E1.1: normalise each row by its RMS
    ...
    ### END SOLUTION

(nbgrader's markers; the exercise id `E<chapter>.<n>` is required on the BEGIN line, the short task after
the colon is optional). `release` writes `chapters/NN_slug.ipynb` where each marked region is replaced by

    raise NotImplementedError("Exercise 1.1: normalise each row by its RMS")

at the indentation of the BEGIN line; code around the markers (signature, docstring, return) is kept. An
*exercise cell* is a code cell with at least one marked region. A *check cell* is a code cell tagged
`check` that runs a check helper inside `with check("E1.1"):` (nanovllm_course.common.check); in the
solution it prints one line `E1.1 ok` per exercise it checks. In the release both kinds have their outputs
cleared and their execution count set to None, so a student sees no `E1.1 ok` they did not earn. So does a
cell tagged `yours`, whose output shows the student's own work (chapter 13's table of which parts are
theirs). Every other cell is kept with its outputs. A cell tagged `gpu` needs CUDA and is skipped where there is none
(see tests/conftest.py and `execute_notebook`).

Grading (`grade`) lives in nanovllm_course/grading.py: the check cells restored from the release, the course's
checks run by the course (check_runner.py), one verdict per exercise.

Determinism: notebook metadata is reduced to the kernelspec and language_info a python3 kernel writes
(so opening a chapter in JupyterLab does not modify it), cell metadata to `tags`, streams are merged, and
execution counts are renumbered 1, 2, ... over the code cells that ran (not stripped: nbval only compares
the outputs of cells whose stored execution_count is not None, and fails a cell that has outputs but no
count). The drift check ignores the notebook metadata a kernel or JupyterLab rewrites (language_info, the
kernelspec's display name, widget state).

Command line: `python -m nanovllm_course --help`.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "solutions"
CHAPTERS = REPO / "chapters"
FIGURES = REPO / "figures"

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
NOTEBOOK_NAME = re.compile(r"^\d\d_[a-z0-9_]+\.ipynb$")
EXERCISE_ID = re.compile(r"^E(\d+)\.(\d+)$")
OK_LINE = re.compile(r"^(E\d+\.\d+) ok$")
CHECK_TAG, GPU_TAG, YOURS_TAG = "check", "gpu", "yours"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# What ipykernel reports (kernel_info_reply) and JupyterLab writes into a notebook it opens, for the course's
# Python (environment.yml: python=3.11). Stored as is, so opening a chapter leaves it unmodified; on another
# Python only `version` differs, and the drift check ignores language_info.
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                 "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                 "pygments_lexer": "ipython3", "version": "3.11.7"}
NOT_IMPLEMENTED = "not implemented yet"      # what common.call_student puts in the AssertionError
CHECK_CALL = re.compile(r"""\bcheck\(\s*["'](E\d+\.\d+)["']\s*\)""")   # `with check("E1.1"):` in a check cell
VERDICT = re.compile(r"^(E\d+\.\d+) (ok|not done yet|failed: .*)$")


class ReleaseError(ValueError):
    """A solution notebook breaks a convention; the message names the notebook, cell and line."""


# -- markers ----------------------------------------------------------------------------------------------
@dataclass
class Region:
    exercise: str      # "E1.1"
    task: str          # short task text ("" if none)
    indent: str
    begin: int         # line index of the BEGIN marker
    end: int           # line index of the END marker


def parse_begin(line: str, where: str) -> tuple[str, str]:
    """`### BEGIN SOLUTION E1.1: short task` -> ("E1.1", "short task")."""
    rest = line.strip()[len(BEGIN):].strip()
    head, _, task = rest.partition(":")
    head = head.strip()
    if not EXERCISE_ID.match(head):
        raise ReleaseError(f"{where}: the BEGIN line must name its exercise, like "
                           f"'{BEGIN} E1.1: short task'; got {line.strip()!r}")
    return head, task.strip()


def find_regions(source: str, where: str = "cell") -> list[Region]:
    """The marked regions of one cell's source, in order. Raises ReleaseError on unbalanced markers."""
    regions, open_ = [], None
    for i, line in enumerate(source.split("\n")):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if open_ is not None:
                raise ReleaseError(f"{where}, line {i + 1}: BEGIN inside an open region (nested markers)")
            ex, task = parse_begin(line, f"{where}, line {i + 1}")
            open_ = (ex, task, line[:len(line) - len(line.lstrip())], i)
        elif stripped.startswith(END):
            if open_ is None:
                raise ReleaseError(f"{where}, line {i + 1}: END without BEGIN")
            regions.append(Region(open_[0], open_[1], open_[2], open_[3], i))
            open_ = None
    if open_ is not None:
        raise ReleaseError(f"{where}: BEGIN on line {open_[3] + 1} has no END")
    return regions


def stub_message(exercise: str, task: str) -> str:
    num = exercise[1:]
    return f"Exercise {num}: {task}" if task else f"Exercise {num}: fill in this code"


def stub_source(source: str, where: str = "cell") -> str:
    """Replace every marked region (markers included) by a `raise NotImplementedError(...)` line."""
    lines = source.split("\n")
    out, last = [], 0
    for r in find_regions(source, where):
        out.extend(lines[last:r.begin])
        out.append(f"{r.indent}raise NotImplementedError({json.dumps(stub_message(r.exercise, r.task))})")
        last = r.end + 1
    out.extend(lines[last:])
    return "\n".join(out)


# -- cells ----------------------------------------------------------------------------------------------
def tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []) or [])


def is_exercise_cell(cell) -> bool:
    return cell.cell_type == "code" and BEGIN in cell.source


def is_check_cell(cell) -> bool:
    return cell.cell_type == "code" and CHECK_TAG in tags(cell)


def shows_student_work(cell) -> bool:
    """A code cell tagged `yours`: its output shows the student's own work (their folder, their parts), so
    the solution's output would mislead in the release and differ in every student's copy."""
    return cell.cell_type == "code" and YOURS_TAG in tags(cell)


def is_gpu_cell(cell) -> bool:
    return cell.cell_type == "code" and GPU_TAG in tags(cell)


# The course's helpers that run a student's code inside the engine: a cell calling one shows the student's work.
ENGINE_HELPERS = frozenset({"in_the_engine", "your_part_in_the_engine", "your_sampler_in_the_engine"})


def _parse_cell(source: str):
    """ast of a code cell with IPython's `%magic` and `!shell` lines blanked, or None if it still does not parse."""
    import ast
    lines = ["pass" if l.lstrip().startswith(("%", "!")) else l for l in source.split("\n")]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _bound_names(tree) -> set[str]:
    """Names a cell binds at its top level (assignments, defs, classes, imports, for/with targets)."""
    import ast
    found = set()

    def targets(node):
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                found.add(n.id)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets(node.target)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            targets(node.target)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    targets(item.optional_vars)
    return found


def student_dependent_cells(nb) -> list[int]:
    """Indices of the code cells whose output depends on the student's code, besides exercise and check cells:
    a cell tagged `yours`; a cell that calls an engine helper (ENGINE_HELPERS); a cell that reads a name an
    exercise cell defines (its functions, classes and top-level assignments), or a name bound by such a cell
    (`capstone = assemble(...)` taints `capstone`), until a cell rebinds it without reading one
    (`from nanovllm_ref... import store_kvcache` after the exercise). A cell that does not parse counts as
    dependent when it mentions a tainted name. The release clears these cells' outputs: the solution's
    output there would claim the student's code works before it has run."""
    import ast
    tainted: set[str] = set()
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tree = _parse_cell(cell.source)
        if is_exercise_cell(cell):
            if tree is not None:
                tainted |= _bound_names(tree) - {n for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                                                 for n in _bound_names(ast.Module([node], []))}
            continue
        if tree is None:
            words = set(re.findall(r"[A-Za-z_]\w*", cell.source))
            if words & (tainted | ENGINE_HELPERS) or shows_student_work(cell):
                found.append(i)
            continue
        reads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        dependent = bool(reads & tainted) or bool((reads | attrs) & ENGINE_HELPERS) or shows_student_work(cell)
        if is_check_cell(cell):
            continue
        if dependent:
            found.append(i)
            tainted |= _bound_names(tree)
        else:
            tainted -= _bound_names(tree)
    return found


def exercises_of(cell) -> list[str]:
    """Exercise ids defined (marked) in one cell, in order, without repeats."""
    seen = []
    for r in find_regions(cell.source) if is_exercise_cell(cell) else []:
        if r.exercise not in seen:
            seen.append(r.exercise)
    return seen


def ok_lines(cell) -> list[str]:
    """Exercise ids whose `Ex.y ok` line is in a cell's stored stream output."""
    found = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            for line in out.get("text", "").splitlines():
                m = OK_LINE.match(line.strip())
                if m:
                    found.append(m.group(1))
    return found


def checked_exercises(cell) -> list[str]:
    """Exercise ids a check cell checks: those its source names in `check("E1.1")` (a released chapter's
    check cells have no outputs), else its stored `E1.1 ok` lines."""
    ids = CHECK_CALL.findall(cell.source) or ok_lines(cell)
    return list(dict.fromkeys(ids))


# -- normalising -----------------------------------------------------------------------------------------
def _merge_streams(outputs):
    merged = []
    for out in outputs:
        out = copy.deepcopy(out)
        out.pop("transient", None)
        if out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream" \
                and merged[-1].get("name") == out.get("name"):
            merged[-1]["text"] += out["text"]
        else:
            merged.append(out)
    return merged


def cpu_budget(nb) -> float:
    """The chapter's stated CPU budget in seconds (notebook metadata `nanovllm.cpu_budget_s`): how long it may
    take to run top to bottom on the course's 2-core CPU. Raises ReleaseError if it is missing."""
    try:
        return float(nb.metadata["nanovllm"]["cpu_budget_s"])
    except (KeyError, TypeError, ValueError):
        raise ReleaseError("notebook metadata has no nanovllm.cpu_budget_s (the chapter's CPU budget, seconds)") from None


def normalize(nb):
    """Make a notebook deterministic in place (see module doc) and return it."""
    nb.nbformat, nb.nbformat_minor = 4, 5
    meta = {"kernelspec": dict(KERNELSPEC), "language_info": copy.deepcopy(LANGUAGE_INFO)}
    if "nanovllm" in nb.metadata:          # the chapter's own settings, e.g. {"cpu_budget_s": 45}
        meta["nanovllm"] = dict(nb.metadata["nanovllm"])
    nb.metadata = nbformat.from_dict(meta)
    count = 0
    for i, cell in enumerate(nb.cells):
        t = tags(cell)
        cell.metadata = nbformat.from_dict({"tags": t} if t else {})
        if not cell.get("id"):
            cell["id"] = f"cell-{i:03d}"
        if cell.cell_type != "code":
            continue
        if cell.execution_count is None and not cell.outputs:
            continue
        count += 1
        cell.execution_count = count
        outs = _merge_streams(cell.outputs)
        for out in outs:
            if out.get("output_type") == "execute_result":
                out["execution_count"] = count
        cell.outputs = [nbformat.from_dict(o) for o in outs]
    return nb


# -- release ---------------------------------------------------------------------------------------------
def validate_solution(nb, name: str) -> dict[str, list[str]]:
    """Check one solution notebook against the conventions. Returns {exercise id: [task, ...]}."""
    exercises: dict[str, list[str]] = {}
    checked: set[str] = set()
    chapter = int(name[:2])
    for i, cell in enumerate(nb.cells):
        where = f"{name} cell {i}"
        if is_exercise_cell(cell):
            if is_check_cell(cell):
                raise ReleaseError(f"{where}: an exercise cell must not be tagged '{CHECK_TAG}'")
            for r in find_regions(cell.source, where):
                if int(EXERCISE_ID.match(r.exercise).group(1)) != chapter:
                    raise ReleaseError(f"{where}: exercise {r.exercise} is not in chapter {chapter:02d}")
                exercises.setdefault(r.exercise, []).append(r.task)
        if is_check_cell(cell):
            ids = ok_lines(cell)
            if not ids:
                raise ReleaseError(f"{where}: check cell has no stored 'Ex.y ok' line; execute the solution "
                                   "notebook top to bottom (python -m nanovllm_course execute ...) first")
            named = CHECK_CALL.findall(cell.source)
            if sorted(set(named)) != sorted(set(ids)):
                raise ReleaseError(f"{where}: a check cell must run its helper inside `with check(\"{ids[0]}\"):` "
                                   f"naming exactly the exercises it prints ok lines for ({ids}); it names {named}")
            checked.update(ids)
    missing = sorted(set(exercises) - checked)
    if missing:
        raise ReleaseError(f"{name}: exercises {missing} have no check cell (tag '{CHECK_TAG}') that "
                           "printed their ok line")
    extra = sorted(checked - set(exercises))
    if extra:
        raise ReleaseError(f"{name}: check cells print ok lines for {extra}, which no marked region defines")
    if nb.metadata.get("kernelspec", {}).get("name") not in (None, "python3"):
        raise ReleaseError(f"{name}: kernelspec must be python3")
    return exercises


def release_notebook(nb, name: str = "notebook"):
    """The student version of a solution notebook (a new object; `nb` is not changed)."""
    validate_solution(nb, name)
    out = normalize(copy.deepcopy(nb))
    dependent = set(student_dependent_cells(out))
    for i, cell in enumerate(out.cells):
        exercise = is_exercise_cell(cell)
        if exercise:
            cell.source = stub_source(cell.source, f"{name} cell {i}")
        if exercise or is_check_cell(cell) or i in dependent:
            cell.outputs = []
            cell.execution_count = None
    return normalize(out)


def dumps(nb) -> str:
    return nbformat.writes(nb) + "\n"


def same_but_kernel_metadata(committed_text: str, fresh_text: str) -> bool:
    """True if a committed notebook equals a fresh release, ignoring the notebook metadata that a kernel
    or JupyterLab rewrites on opening (language_info, kernelspec display name, widget state)."""
    if committed_text == fresh_text:
        return True
    try:
        committed = nbformat.reads(committed_text, as_version=4)
    except Exception:
        return False
    fresh = nbformat.reads(fresh_text, as_version=4)
    if committed.metadata.get("kernelspec", {}).get("name") != fresh.metadata["kernelspec"]["name"]:
        return False
    committed.metadata = fresh.metadata
    return dumps(committed) == fresh_text


def solution_paths(solutions: Path = SOLUTIONS) -> list[Path]:
    """The chapter notebooks (NN_slug.ipynb) in a folder, solutions/ by default, in chapter order."""
    paths = sorted(p for p in Path(solutions).glob("*.ipynb") if NOTEBOOK_NAME.match(p.name))
    return paths


def chapter_key(name: str) -> str:
    """A notebook name as given on the command line, as the notebooks' names spell it: a chapter number is
    two digits ("9" -> "09"), a path is its file name."""
    return name.zfill(2) if name.isdigit() else Path(name).name


def pick(paths: list[Path], names: list[str] | None, command: str, what: str) -> list[Path]:
    """The notebooks of `paths` that `names` ask for, in order (all of them when `names` is empty). A name is
    a chapter number ("9" and "09" are the same), a stem or a file name (a path is taken by its file name).
    Raises ReleaseError naming every name that matches nothing, and the names there are, so that a typo is
    never a command that silently does nothing."""
    if not names:
        return list(paths)
    names = [chapter_key(n) for n in names]
    unknown = [n for n in names if not any(n in (p.name, p.stem, p.name[:2]) for p in paths)]
    if unknown:
        raise ReleaseError(f"{command}: no {what} named {unknown}; give a chapter number (09), a stem or a file "
                           f"name from {[p.name for p in paths]}")
    return [p for p in paths if any(n in (p.name, p.stem, p.name[:2]) for n in names)]


def release(solutions: Path = SOLUTIONS, chapters: Path = CHAPTERS, names: list[str] | None = None,
            check: bool = False) -> list[str]:
    """Release every solution notebook (or those in `names`). With check=True write nothing and return the
    names whose committed chapter differs from a fresh release (or is missing); else return names written."""
    solutions, chapters = Path(solutions), Path(chapters)
    result = []
    for path in pick(solution_paths(solutions), names, "release", "solution notebook"):
        text = dumps(release_notebook(nbformat.read(path, as_version=4), path.name))
        target = chapters / path.name
        if check:
            if not target.exists() or not same_but_kernel_metadata(target.read_text(encoding="utf-8"), text):
                result.append(path.name)
        else:
            chapters.mkdir(parents=True, exist_ok=True)
            if not target.exists() or target.read_text(encoding="utf-8") != text:
                target.write_text(text, encoding="utf-8")
            result.append(path.name)
    if check:
        stale = sorted(p.name for p in chapters.glob("*.ipynb")
                       if NOTEBOOK_NAME.match(p.name) and not (solutions / p.name).exists())
        result += [f"{n} (no solution notebook)" for n in stale if not names]
    return result


# -- executing ---------------------------------------------------------------------------------------------
@dataclass
class CellError:
    index: int
    ename: str
    evalue: str
    tags: list


def _kernel_manager():
    """A kernel in the *current* Python environment (like nbval --nbval-current-env)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())
    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnv())


# What a Linux machine on which torch.cuda could find a GPU has: NVIDIA's driver (/proc/driver/nvidia, the /dev/nvidia*
# nodes), ROCm's (/dev/kfd) or WSL2's GPU bridge (/dev/dxg).
_GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def cuda_available() -> bool:
    """torch.cuda.is_available(), False where torch cannot be imported. On Linux with none of the GPU drivers'
    files (_GPU_DRIVER_PATHS) the answer is False without importing torch: the grader's process (`grade`,
    `pytest --nbval`), which asks only to skip `gpu` cells, then saves torch's import (about 2 s of CPU for
    each notebook it grades)."""
    if sys.platform.startswith("linux") and not any(os.path.exists(p) for p in _GPU_DRIVER_PATHS):
        return False
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def execute_notebook(nb, cwd: str | Path, *, timeout: int = 300, skip_gpu: bool | None = None,
                     allow_errors: bool = True, preamble: str | None = None):
    """Run a notebook top to bottom in a fresh kernel of the current environment, cell by cell.

    Every cell runs even after an error (allow_errors). Cells tagged `gpu` are skipped when there is no
    CUDA (skip_gpu=None) or always (True); skipped cells keep their stored outputs. `preamble`: source run
    first, outside the notebook (no cell, not in the kernel's input history; grading's check_runner.arm);
    it must not raise. A cell that runs past `timeout` seconds, or a kernel that dies, stops the run there:
    that cell gets an error output (CellTimeoutError / DeadKernelError) and the cells after it do not run.
    Returns (executed notebook, [CellError, ...]). The notebook is not normalised.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = copy.deepcopy(nb)
    if skip_gpu is None:
        skip_gpu = not cuda_available()
    # log_level ERROR: the kernel's start-up warning about its local TCP transport went to our stderr and
    # landed in the middle of the grade output. Cell errors still arrive as messages, not logs.
    client = NotebookClient(nb, timeout=timeout, km=_kernel_manager(), allow_errors=True,
                            resources={"metadata": {"path": str(cwd)}},
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])
    errors = []
    # cleanup_kc: nbclient shuts down only a kernel it made its own manager for; ours comes from
    # _kernel_manager(), so without it every executed notebook left its kernel running (a test run that
    # executes the chapters a few times over held 11.5 GB in idle kernels and was OOM-killed on 24 GiB).
    with client.setup_kernel(cwd=str(cwd), cleanup_kc=True):
        if preamble is not None:          # run as a cell appended for the moment (nbclient stores cells by index)
            first = nbformat.v4.new_code_cell(preamble)
            nb.cells.append(first)
            try:
                client.execute_cell(first, len(nb.cells) - 1, store_history=False)
            finally:
                first = nb.cells.pop()
            failed = _error_output(first)
            if failed is not None:
                raise RuntimeError(f"the grader's preamble raised {failed[0]}: {failed[1]}")
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or (skip_gpu and is_gpu_cell(cell)):
                continue
            try:
                client.execute_cell(cell, i)
            except CellExecutionError as exc:     # only raised when allow_errors is False
                errors.append(CellError(i, exc.ename, exc.evalue, tags(cell)))
                continue
            except (CellTimeoutError, DeadKernelError) as exc:
                ename = type(exc).__name__
                evalue = (f"the cell ran past {timeout} s" if isinstance(exc, CellTimeoutError)
                          else f"the kernel died ({_first_line(exc)})")
                cell.outputs.append(nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[]))
                errors.append(CellError(i, ename, evalue, tags(cell)))
                break
            for out in cell.outputs:
                if out.get("output_type") == "error":
                    errors.append(CellError(i, out.get("ename", ""), out.get("evalue", ""), tags(cell)))
    if errors and not allow_errors:
        e = errors[0]
        raise RuntimeError(f"cell {e.index} raised {e.ename}: {e.evalue}")
    return nb, errors


def _error_output(cell) -> tuple[str, str] | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out.get("ename", ""), out.get("evalue", "")
    return None


def execute_in_place(path: Path, timeout: int = 300) -> list[CellError]:
    """Execute a solution notebook and write it back normalised. Cells tagged `raises-exception` may
    raise; any other error is returned (and the notebook is still written, so you can look at it)."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:                      # run from a clean slate: no stale outputs
        if cell.cell_type == "code" and not (is_gpu_cell(cell) and not cuda_available()):
            cell.outputs, cell.execution_count = [], None
    done, errors = execute_notebook(nb, path.parent, timeout=timeout)
    path.write_text(dumps(normalize(done)), encoding="utf-8")
    for i, cell in enumerate(done.cells):          # a check cell reports a failure without raising
        if is_check_cell(cell):
            for line in _stdout(cell).splitlines():
                m = VERDICT.match(line.strip())
                if m and m.group(2) != "ok":
                    errors.append(CellError(i, "CheckFailed", line.strip(), tags(cell)))
    return [e for e in errors if "raises-exception" not in e.tags]


def expected_failures(chapter_nb) -> list[int]:
    """Indices of the check cells of a released chapter: run unfilled, each must say `not done yet`."""
    return [i for i, c in enumerate(chapter_nb.cells) if is_check_cell(c)]


# -- grading (nanovllm_course/grading.py; these names stay importable from here) ---------------------------------
_GRADING_NAMES = frozenset({"Verdict", "Grade", "grade_notebook", "grade_path", "reference_for", "stub_failures_ok"})


def __getattr__(name):
    if name in _GRADING_NAMES:
        from nanovllm_course import grading
        return getattr(grading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _first_line(text: str, width: int = 200) -> str:
    line = next((l.strip() for l in str(text).splitlines() if l.strip()), "")
    return line if len(line) <= width else line[:width - 3] + "..."


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


def verdict_of(exercise: str, stdout: str, error: tuple[str, str] | None = None) -> str:
    """The verdict line of `exercise` from what its check cell printed on stdout, or raised (error =
    (ename, evalue)): the first of its verdict lines that is not `ok`, else `Ex.y ok`, else a line saying the
    cell printed none. What a solution's check cell says under `pytest --nbval` (the maintainers' gate); a
    student's notebook is graded by the course's own verdicts instead (grading.py), never by what it printed."""
    if error is not None:
        return f"{exercise} failed: its check cell raised {error[0]}: {_first_line(error[1])}"
    said = [l.strip() for l in stdout.splitlines() if VERDICT.match(l.strip()) and l.strip().split(" ")[0] == exercise]
    wrong = [l for l in said if l != f"{exercise} ok"]
    return wrong[0] if wrong else f"{exercise} ok" if said else f"{exercise} failed: its check cell printed no verdict"


def match_check_cells(student_nb, reference_nb) -> list[tuple[object, int | None]]:
    """[(reference check cell, index of the student's cell or None)]: see _match_check_cells."""
    return _match_check_cells(student_nb, reference_nb)


def _match_check_cells(student_nb, reference_nb) -> list[tuple[object, int | None]]:
    """[(reference check cell, index of the student's cell or None)]: matched by cell id, else by order
    among the cells tagged `check`."""
    ref_cells = [c for c in reference_nb.cells if is_check_cell(c)]
    by_id = {c.get("id"): i for i, c in enumerate(student_nb.cells) if c.cell_type == "code" and c.get("id")}
    tagged = [i for i, c in enumerate(student_nb.cells) if is_check_cell(c)]
    pairs = []
    for k, ref in enumerate(ref_cells):
        i = by_id.get(ref.get("id"))
        if i is None and len(tagged) == len(ref_cells):
            i = tagged[k]
        pairs.append((ref, i))
    return pairs


def main_release(args) -> int:
    if args.check:
        drift = release(args.solutions, args.chapters, args.names, check=True)
        for name in drift:
            print(f"stale: chapters/{name} differs from a fresh release of solutions/", file=sys.stderr)
        if drift:
            print("run `python -m nanovllm_course release` and commit chapters/", file=sys.stderr)
            return 1
        print("chapters/ is up to date")
        return 0
    for name in release(args.solutions, args.chapters, args.names):
        print(f"released chapters/{name}")
    return 0


# -- authoring aid: percent-format Python -> notebook ----------------------------------------------------
_CELL_LINE = re.compile(r"^# %%(?P<md> \[markdown\])?(?:\s+tags=(?P<tags>\[.*\]))?\s*$")


def py_to_notebook(text: str):
    """A notebook from jupytext-style percent format: cells start at `# %%` (code) or `# %% [markdown]`
    lines, optionally followed by `tags=["check", "gpu"]`; markdown lines are written as `# text`.
    Text before the first marker is ignored. Cells are unexecuted (run `execute` next)."""
    cells, kind, cell_tags, buf = [], None, [], []

    def flush():
        if kind is None:
            return
        lines = list(buf)
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        if kind == "markdown":
            src = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in lines)
            cell = nbformat.v4.new_markdown_cell(src)
        else:
            cell = nbformat.v4.new_code_cell("\n".join(lines))
        if cell_tags:
            cell.metadata["tags"] = cell_tags
        cell["id"] = f"cell-{len(cells):03d}"
        cells.append(cell)

    for line in text.split("\n"):
        m = _CELL_LINE.match(line)
        if m:
            flush()
            kind = "markdown" if m.group("md") else "code"
            cell_tags = json.loads(m.group("tags")) if m.group("tags") else []
            buf = []
        else:
            buf.append(line)
    flush()
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    return nb
