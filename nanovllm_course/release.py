"""Course machinery: solution notebooks -> student notebooks, and running notebooks headlessly.

Source of truth: `solutions/NN_slug.ipynb`, complete and executed top to bottom. Exercise code sits between

    ### BEGIN SOLUTION E1.1: normalise each row by its RMS
    ...
    ### END SOLUTION

(nbgrader's markers; the exercise id `E<chapter>.<n>` is required on the BEGIN line, the short task after
the colon is optional). `release` writes `chapters/NN_slug.ipynb` where each marked region is replaced by

    raise NotImplementedError("Exercise 1.1: normalise each row by its RMS")

at the indentation of the BEGIN line; code around the markers (signature, docstring, return) is kept. An
*exercise cell* is a code cell with at least one marked region: in the release its outputs are cleared and
its execution count set to None (nbval runs it but does not compare its output). Every other cell is kept
with its outputs. A *check cell* is a code cell tagged `check`; in the solution it prints one line
`E1.1 ok` per exercise it checks. A cell tagged `gpu` needs CUDA and is skipped where there is none (see
tests/conftest.py and `execute_notebook`).

Determinism: notebook metadata is reduced to kernelspec `python3` + language_info name, cell metadata to
`tags`, streams are merged, and execution counts are renumbered 1, 2, ... over the code cells that ran
(not stripped: nbval only compares the outputs of cells whose stored execution_count is not None, and
fails a cell that has outputs but no count).

Command line: `python -m nanovllm_course --help`.
"""
from __future__ import annotations

import copy
import json
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
CHECK_TAG, GPU_TAG = "check", "gpu"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
NOT_IMPLEMENTED = "not implemented yet"      # what common.call_student puts in the AssertionError


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


def is_gpu_cell(cell) -> bool:
    return cell.cell_type == "code" and GPU_TAG in tags(cell)


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
    """Exercise ids a check cell checks: from its stored `E1.1 ok` lines, else from ids named in its
    source (so a released chapter, whose check cells keep the solution's outputs, answers the same)."""
    ids = ok_lines(cell)
    if not ids:
        ids = re.findall(r"\bE\d+\.\d+\b", cell.source)
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


def normalize(nb):
    """Make a notebook deterministic in place (see module doc) and return it."""
    nb.nbformat, nb.nbformat_minor = 4, 5
    nb.metadata = nbformat.from_dict({"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}})
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
    for i, cell in enumerate(out.cells):
        if is_exercise_cell(cell):
            cell.source = stub_source(cell.source, f"{name} cell {i}")
            cell.outputs = []
            cell.execution_count = None
    return normalize(out)


def dumps(nb) -> str:
    return nbformat.writes(nb) + "\n"


def solution_paths(solutions: Path = SOLUTIONS) -> list[Path]:
    paths = sorted(p for p in Path(solutions).glob("*.ipynb") if NOTEBOOK_NAME.match(p.name))
    return paths


def release(solutions: Path = SOLUTIONS, chapters: Path = CHAPTERS, names: list[str] | None = None,
            check: bool = False) -> list[str]:
    """Release every solution notebook (or those in `names`). With check=True write nothing and return the
    names whose committed chapter differs from a fresh release (or is missing); else return names written."""
    solutions, chapters = Path(solutions), Path(chapters)
    result = []
    for path in solution_paths(solutions):
        if names and path.name not in names and path.stem not in names and path.name[:2] not in names:
            continue
        text = dumps(release_notebook(nbformat.read(path, as_version=4), path.name))
        target = chapters / path.name
        if check:
            if not target.exists() or target.read_text(encoding="utf-8") != text:
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


def cuda_available() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def execute_notebook(nb, cwd: str | Path, *, timeout: int = 300, skip_gpu: bool | None = None,
                     allow_errors: bool = True):
    """Run a notebook top to bottom in a fresh kernel of the current environment, cell by cell.

    Every cell runs even after an error (allow_errors). Cells tagged `gpu` are skipped when there is no
    CUDA (skip_gpu=None) or always (True); skipped cells keep their stored outputs. Returns
    (executed notebook, [CellError, ...]). The notebook is not normalised.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = copy.deepcopy(nb)
    if skip_gpu is None:
        skip_gpu = not cuda_available()
    client = NotebookClient(nb, timeout=timeout, km=_kernel_manager(), allow_errors=True,
                            resources={"metadata": {"path": str(cwd)}})
    errors = []
    with client.setup_kernel(cwd=str(cwd)):
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or (skip_gpu and is_gpu_cell(cell)):
                continue
            try:
                client.execute_cell(cell, i)
            except CellExecutionError as exc:     # only raised when allow_errors is False
                errors.append(CellError(i, exc.ename, exc.evalue, tags(cell)))
                continue
            for out in cell.outputs:
                if out.get("output_type") == "error":
                    errors.append(CellError(i, out.get("ename", ""), out.get("evalue", ""), tags(cell)))
    if errors and not allow_errors:
        e = errors[0]
        raise RuntimeError(f"cell {e.index} raised {e.ename}: {e.evalue}")
    return nb, errors


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
    return [e for e in errors if "raises-exception" not in e.tags]


def expected_failures(chapter_nb) -> list[int]:
    """Indices of the cells of a released chapter that must fail: its check cells."""
    return [i for i, c in enumerate(chapter_nb.cells) if is_check_cell(c)]


def stub_failures_ok(chapter_nb, errors: list[CellError]) -> list[str]:
    """Problems with how an unfilled released chapter failed (empty list = as designed): it must fail at
    every check cell, with an AssertionError saying 'not implemented yet', and nowhere else."""
    problems = []
    want = set(expected_failures(chapter_nb))
    got = {e.index: e for e in errors}
    for i in sorted(want - set(got)):
        problems.append(f"check cell {i} passed although its exercise is a stub")
    for i, e in sorted(got.items()):
        if i not in want:
            problems.append(f"cell {i} (not a check cell) raised {e.ename}: {e.evalue[:200]}")
        elif e.ename != "AssertionError" or NOT_IMPLEMENTED not in e.evalue:
            problems.append(f"check cell {i} raised {e.ename}: {e.evalue[:200]} "
                            f"(expected AssertionError '... {NOT_IMPLEMENTED} ...')")
    return problems


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
