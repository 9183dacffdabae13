"""Export a student's exercises from the chapter notebooks into importable modules, and build the engine's
`Parts` from them (nbdev-style; course machinery).

    python -m nanovllm_course export                    # chapters/ -> chapters/student/chNN.py + manifest.json
    python -m nanovllm_course export --notebooks path/to/student --out /tmp/their_parts

Why a file and not the notebook's functions: a tensor-parallel engine starts worker processes, which receive
the parts pickled, and Python pickles a function by its module and name. A function defined in a notebook
cell has no importable module, so it cannot reach a worker; the same function in `student/ch01.py` can.

Which parts a chapter has is declared once, in the `EXERCISES` at the end of nanovllm_course/chNN.py (each
common.Exercise's `parts`, common.EnginePart: name, Parts field, exercise, adapter, the check the capstone
runs); `declared_parts()` reads them. The export writes beside the notebooks it reads (`<notebooks>/student/`) unless told where, and
the capstone exports into a fresh temporary package each time (`fresh_package_dir`), so grading one student's
folder never overwrites another's parts.

What is exported, per chapter notebook: for every declared part (and every helper function it names), the
*last* code cell that defines that function or class (so a student who redefines it further down is taken at their latest version), reduced to
its top-level imports, constants, functions and classes (demo code in the cell does not run on import),
plus every top-level import of the notebook. A part whose body still holds the release's
`raise NotImplementedError("Exercise ...")` stub (or a helper still a stub) counts as not done, and the engine
uses the reference.

`parts_from_student(folder)` reads the manifest and returns (Parts, table); `part_table(...)` says, for each
Parts field, whose code runs: the student's (with its exercise) or the reference's.
"""
import ast
import dataclasses
import functools
import importlib
import json
import secrets
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from nanovllm_course.common import EnginePart
from nanovllm_ref.parts import Parts

STUB_MARK = 'raise NotImplementedError("Exercise'
PACKAGE_DIR = Path(__file__).resolve().parent


# -- the registry: each chapter module declares its exercises once, in `EXERCISES` ----------------------------
@functools.lru_cache(maxsize=None)
def declared_exercises() -> dict:
    """chapter ("04") -> {id: common.Exercise}: the `EXERCISES` at the end of each nanovllm_course/chNN.py, in
    chapter order. This is the one place a chapter registers an exercise, its check, its reference and the engine
    parts it grades: `grade`, the export, the capstone and the graded engine runs (engine_check) all read it."""
    found = {}
    for path in sorted(PACKAGE_DIR.glob("ch[0-9][0-9].py")):
        module = importlib.import_module(f"nanovllm_course.{path.stem}")
        registry = getattr(module, "EXERCISES", None)
        if registry:
            found[path.stem[2:]] = dict(registry)
    return found


def declared_parts() -> dict:
    """chapter ("04") -> [common.EnginePart, ...]: the engine parts of each chapter's exercises (their `parts`), in
    chapter and exercise order; chapters without parts are left out."""
    found = {}
    for chapter, registry in declared_exercises().items():
        parts = [part for exercise in registry.values() for part in exercise.parts]
        if parts:
            found[chapter] = parts
    return found


class _Exports(Mapping):
    """`EXPORTS["04"]`: chapter 04's declared parts (read lazily from the chapter modules)."""

    def __getitem__(self, chapter):
        return declared_parts()[chapter]

    def __iter__(self):
        return iter(declared_parts())

    def __len__(self):
        return len(declared_parts())


EXPORTS = _Exports()
Export = EnginePart          # the old name of a registry entry


def all_parts() -> list:
    """Every declared part of every chapter, in chapter order."""
    return [part for parts in declared_parts().values() for part in parts]


def part_for(chapter: str, name: str, field: str | None = None):
    """The declared part of `chapter` named `name` (and filling `field`, where one name fills two)."""
    for part in declared_parts().get(chapter, []):
        if part.name == name and (field is None or part.field == field):
            return part
    raise KeyError(f"chapter {chapter} declares no part named {name!r}" + (f" for {field}" if field else ""))


# Several exercises may fill one field (04 in PyTorch, 06 in Triton, 10 capture-safe in PyTorch; 05's block
# manager without and with prefix caching): the highest chapter whose part is done wins, and within a chapter
# the later exercise, in parts_from_student, parts_from_functions and part_table alike. The capstone (ch13)
# lets the student write that choice (E13.1) and adds the fallbacks.


# -- adapters: notebook signature -> Parts signature (module-level, so the results pickle) ------------------
def _qkv_loader(fn, layer, param, loaded_weight, shard_id):
    """Chapter 03's qkv_weight_loader(param, w, shard_id, q_size, kv_size) knows one rank only: hand it this
    rank's heads of the checkpoint tensor and this rank's q/kv sizes."""
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    size = q_size if shard_id == "q" else kv_size
    if loaded_weight.shape[0] != size * layer.tp_size:
        raise RuntimeError(f"expected size {size * layer.tp_size} along dim 0, got {tuple(loaded_weight.shape)}")
    fn(param, loaded_weight.narrow(0, layer.tp_rank * size, size), shard_id, q_size, kv_size)


def _gate_up_loader(fn, layer, param, loaded_weight, shard_id):
    """Chapter 03's gate_up_weight_loader(param, w, shard_id, intermediate_size), per rank likewise."""
    size = layer.output_sizes[shard_id] // layer.tp_size
    if loaded_weight.shape[0] != layer.output_sizes[shard_id]:
        raise RuntimeError(f"expected size {layer.output_sizes[shard_id]} along dim 0, got {tuple(loaded_weight.shape)}")
    fn(param, loaded_weight.narrow(0, layer.tp_rank * size, size), shard_id, size)


def one_rank_qkv_loader(fn):
    """Adapter (ch03 E3.3): qkv_weight_loader(param, w, shard_id, q_size, kv_size) -> the Parts loader."""
    return functools.partial(_qkv_loader, fn)


def one_rank_gate_up_loader(fn):
    """Adapter (ch03 E3.3): gate_up_weight_loader(param, w, shard_id, intermediate_size) -> the Parts loader."""
    return functools.partial(_gate_up_loader, fn)


def prefill_with_slots(fn):
    """Adapter (ch04 E4.1): slot_mapping(block_table, start, end, block_size) -> Parts.prepare_prefill."""
    from nanovllm_ref.engine import inputs
    return functools.partial(inputs.prepare_prefill, slot_fn=fn)


def decode_with_slots(fn):
    """Adapter (ch04 E4.1): slot_mapping -> Parts.prepare_decode."""
    from nanovllm_ref.engine import inputs
    return functools.partial(inputs.prepare_decode, slot_fn=fn)


def torch_backend_with_decode(fn):
    """Adapter (ch04 E4.2, ch06 E6.3): paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale) ->
    the PyTorch attention back-end with that decode."""
    from nanovllm_ref.attn import FunctionBackend
    return dataclasses.replace(FunctionBackend.of("torch"), paged_decode=fn)


def parts_from_functions(**functions) -> tuple[Parts, list[str]]:
    """Parts from notebook-level objects named as the chapters declare them (e.g. rms_norm=...,
    BlockManager=...). An object that is still the release's stub (or calls a function of its notebook that
    still is) is skipped. Where two chapters declare the same name (store_kvcache: 04, 06, 10), the highest
    chapter's declaration is used. Returns (parts, names of the objects used)."""
    by_name = {}
    for part in all_parts():
        by_name.setdefault(part.name, {})[part.chapter] = part
    changes, used = {}, []
    for name, obj in functions.items():
        if name not in by_name:
            raise ValueError(f"{name!r} is not an exported exercise; known: {sorted(by_name)}")
        if is_stub(obj):
            continue
        used.append(name)
        chapter = max(by_name[name])
        for part in declared_parts()[chapter]:
            if part.name == name:
                changes[part.field] = part.value(obj)
    return Parts(**changes), used


def is_stub(obj, _seen=None) -> bool:
    """True when `obj` (a function or class) still contains the release's NotImplementedError stub, or calls,
    directly or not, a function of its own module that does (a launcher whose kernel factory is still a stub:
    chapter 06; a sampler built from helper functions: chapter 08)."""
    import inspect
    seen = _seen if _seen is not None else set()
    seen.add(id(obj))
    try:
        if STUB_MARK in inspect.getsource(obj):
            return True
    except (OSError, TypeError):
        return False
    code, module_globals = getattr(obj, "__code__", None), getattr(obj, "__globals__", {})
    for name in code.co_names if code else ():
        helper = inspect.unwrap(module_globals.get(name)) if callable(module_globals.get(name)) else None
        if helper is None or id(helper) in seen or getattr(helper, "__module__", None) != obj.__module__:
            continue
        if is_stub(helper, seen):
            return True
    return False


# -- export -------------------------------------------------------------------------------------------------
def _top_level(source: str):
    """ast of a cell, or None when it is not plain Python (IPython magics, syntax errors)."""
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _with_dependencies(names, defs: dict) -> set[str]:
    """`names` plus every notebook-defined function or class they reference, transitively.
    defs: name -> ast node of its last definition in the notebook."""
    found, todo = set(), [n for n in names if n in defs]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    return found


def code_cells(path: Path) -> list[str]:
    """The sources of a notebook's code cells, read with json alone: the export also runs where nbformat is not
    installed (the lent GPU machine has torch and triton but no Jupyter packages)."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    return [c["source"] if isinstance(c["source"], str) else "".join(c["source"])
            for c in nb["cells"] if c["cell_type"] == "code"]


def export_notebook(path: Path, out_dir: Path) -> list[dict]:
    """Write out_dir/chNN.py from one chapter notebook; return its manifest rows."""
    chapter = path.name[:2]
    cells = code_cells(path)
    trees = [_top_level(src) for src in cells]
    imports, seen = [], set()
    for src, tree in zip(cells, trees):
        for node in tree.body if tree else []:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                text = ast.get_source_segment(src, node)
                if text not in seen:
                    seen.add(text)
                    imports.append(text)
    # The last definition of each function and class in the notebook (a student may redefine one lower down).
    last = {}
    for i, tree in enumerate(trees):
        for node in tree.body if tree else []:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                last[node.name] = (i, node)
    defs = {name: node for name, (_, node) in last.items()}
    # Export the cells of the parts and of what they call; keep their defs, classes and constants.
    chosen = {name: last[name][0] for name in _with_dependencies({e.name for e in EXPORTS[chapter]}, defs)}
    body = []
    for i in sorted(set(chosen.values())):
        src, tree = cells[i], trees[i]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)):
                body.append(ast.get_source_segment(src, node, padded=True))
    text = (f'"""Exported by `python -m nanovllm_course export` from {path.name}. Do not edit: change the notebook\n'
            'and export again."""\n' + "\n".join(imports) + "\n\n\n" + "\n\n\n".join(body) + "\n")
    (out_dir / f"ch{chapter}.py").write_text(text, encoding="utf-8")
    rows = []
    for e in EXPORTS[chapter]:
        status = "missing"
        if e.name in chosen:
            text = "".join(ast.get_source_segment(cells[chosen[name]], defs[name])
                           for name in sorted(_with_dependencies({e.name}, defs)))
            status = "stub" if STUB_MARK in text else "done"
        rows.append(dict(chapter=chapter, exercise=e.exercise, name=e.name, field=e.field, status=status,
                         triton=e.triton))
    return rows


def default_out(notebooks_dir: Path) -> Path:
    """Where `export` writes when not told: `student/` beside the notebooks it reads, so exporting (or
    grading) one student's folder never touches another's parts."""
    return Path(notebooks_dir) / "student"


def fresh_package_dir(prefix: str = "nanovllm_parts_") -> Path:
    """A new, empty place for one export: <temp>/<prefix>XXXX/student_<hex>. The package name is unique too,
    so two exports imported into one process (two capstones, a test) never share modules, and two graders
    running at once never write into the same folder. The folder is removed when the process exits."""
    import atexit
    import shutil
    parent = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, parent, True)
    return parent / f"student_{secrets.token_hex(4)}"


def export(notebooks_dir: Path, out_dir: Path | None = None, chapters=None) -> list[dict]:
    """Export every chapter notebook in `notebooks_dir` that has parts (or those in `chapters`) into the
    package folder `out_dir` (default: `<notebooks_dir>/student`; created, with __init__.py and
    manifest.json). Returns the manifest rows."""
    out_dir = Path(out_dir) if out_dir is not None else default_out(notebooks_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "__init__.py").write_text('"""Your exercises, exported from the chapter notebooks."""\n')
    rows = []
    for path in sorted(Path(notebooks_dir).glob("[0-9][0-9]_*.ipynb")):
        if path.name[:2] in EXPORTS and (not chapters or path.name[:2] in chapters):
            rows += export_notebook(path, out_dir)
    (out_dir / "manifest.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def parts_from_student(out_dir: Path) -> tuple[Parts, list[dict]]:
    """Import the exported package `out_dir` (its parent goes on sys.path) and build Parts from its
    manifest: a part marked "done" is the student's (adapted), anything else the reference's; where several
    chapters fill one field (04 and 06), the highest chapter's done part runs.
    Returns (parts, rows) where each row also has "source": "yours" (done) or "reference"."""
    out_dir = Path(out_dir).resolve()
    rows = json.loads((out_dir / "manifest.json").read_text())
    package = import_package(out_dir).__name__        # a fresh export replaces an earlier import
    changes = {}
    for row in rows:
        row["source"] = "yours" if row["status"] == "done" else "reference"
    for field, row in shown_rows(rows).items():     # where chapters share a field, the highest done one runs
        if row["status"] == "done":
            module = importlib.import_module(f"{package}.ch{row['chapter']}")
            changes[field] = part_for(row["chapter"], row["name"], field).value(getattr(module, row["name"]))
    return Parts(**changes), rows


def import_package(out_dir: Path):
    """Import the exported package `out_dir` afresh (its parent goes on sys.path; an earlier import of the
    same name is dropped) and return it."""
    out_dir = Path(out_dir).resolve()
    if str(out_dir.parent) not in sys.path:
        sys.path.insert(0, str(out_dir.parent))
    package = out_dir.name
    for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[mod]
    importlib.invalidate_caches()
    return importlib.import_module(package)


def shown_rows(rows: list[dict]) -> dict[str, dict]:
    """Parts field -> the manifest row that fills it: the highest chapter whose part is done, else the
    highest chapter that offers it (still a stub)."""
    best = {}
    for row in rows:
        old = best.get(row["field"])
        key = (row["status"] == "done", row["chapter"])
        if old is None or key >= (old["status"] == "done", old["chapter"]):
            best[row["field"]] = row
    return best


def part_table(rows: list[dict]) -> str:
    """One line per Parts field: whose code runs and the exercise it comes from."""
    lines = [f"{'part':<22} {'runs':<10} from"]
    shown = shown_rows(rows)
    for field, row in shown.items():
        whose = row.get("source", "yours" if row["status"] == "done" else "reference")
        note = "" if whose == "yours" else f" ({row['status']})"
        lines.append(f"{field:<22} {whose:<10} ch{row['chapter']} {row['exercise']} {row['name']}{note}")
    for f in dataclasses.fields(Parts):
        if f.name not in shown:
            lines.append(f"{f.name:<22} {'reference':<10} (no exercise yet)")
    return "\n".join(lines)


# -- exporting from inside a notebook --------------------------------------------------------------------------
SAVED_NOTE = ("(read from the saved notebooks: save each chapter first, File > Save or Ctrl+S; an edit not saved "
              "yet is not seen)")


def report(rows: list[dict], source, out_dir) -> str:
    """What `export` prints: where from and to, the part table, the exercises still the reference's."""
    import re
    lines = [f"exported {len({r['chapter'] for r in rows})} chapter(s) from {source}/ into {out_dir}/ {SAVED_NOTE}",
             part_table(rows)]
    # in chapter order (E2.1 before E10.1): sort by the numbers in the id, not the text
    missing = sorted({r["exercise"] for r in rows if r["status"] != "done"},
                     key=lambda e: [int(n) for n in re.findall(r"\d+", e)])
    if missing:
        lines.append(f"still the reference's (not done yet): {', '.join(missing)}")
    return "\n".join(lines)


def _source(obj) -> str | None:
    """The code of a function or class as its syntax tree (so comments and layout do not count), or None."""
    import inspect
    import textwrap
    try:
        return ast.dump(ast.parse(textwrap.dedent(inspect.getsource(obj))))
    except (OSError, TypeError, SyntaxError):
        return None


def unsaved_edits(namespace, rows: list[dict], out_dir: Path) -> list[str]:
    """The parts `namespace` (a running notebook's globals) defines itself whose code is in none of the exported
    (saved) chapters: edits the notebook has run but not saved, which the export, reading files, cannot see.
    Each entry names the part and the chapters whose saved copy differs."""
    package = import_package(Path(out_dir)).__name__
    found = []
    for name in dict.fromkeys(r["name"] for r in rows):
        live = namespace.get(name)
        if live is None or getattr(live, "__module__", None) != "__main__":
            continue
        mine = _source(live)
        if mine is None:
            continue
        chapters = sorted({r["chapter"] for r in rows if r["name"] == name})
        saved = []
        for chapter in chapters:
            module = importlib.import_module(f"{package}.ch{chapter}")
            saved.append(_source(getattr(module, name, None)) if hasattr(module, name) else None)
        if mine not in saved:
            found.append(f"{name} (saved in chapter {', '.join(chapters)} as different code)")
    return found


def export_here(namespace=None, folder: str | Path = ".", chapters=None, out: str | Path | None = None) -> list[dict]:
    """`python -m nanovllm_course export`, from a notebook cell, in the kernel's own Python (a `!python` in a
    notebook may start another Python, one without torch): export the chapter notebooks in `folder` (the
    notebook's own by default) into `folder/student/` (or `out`) and print the report. Pass the notebook's
    `globals()` as `namespace` and it also names each part this notebook has run in a version that is not the
    saved one (save, then export again). Returns the manifest rows."""
    folder = Path(folder)
    out_dir = Path(out) if out is not None else default_out(folder)
    rows = export(folder, out_dir, chapters)
    print(report(rows, folder, out_dir))
    if namespace is not None:
        edits = unsaved_edits(namespace, rows, out_dir)
        if edits:
            print("not saved yet: this notebook runs another version of " + "; ".join(edits) +
                  ". Save it (Ctrl+S) and export again.")
    return rows
