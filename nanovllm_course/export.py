"""Export a student's exercises from the chapter notebooks into importable modules, and build the engine's
`Parts` from them (nbdev-style; course machinery).

    python -m nanovllm_course export                    # chapters/ -> student/chNN.py + student/manifest.json
    python -m nanovllm_course export --notebooks solutions --out /tmp/ref_student

Why a file and not the notebook's functions: a tensor-parallel engine starts worker processes, which receive
the parts pickled, and Python pickles a function by its module and name. A function defined in a notebook
cell has no importable module, so it cannot reach a worker; the same function in `student/ch01.py` can.

What is exported, per chapter notebook: for every part in EXPORTS (and every helper function it names), the
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
import sys
from dataclasses import dataclass
from pathlib import Path

from nanovllm_ref.parts import Parts

STUB_MARK = 'raise NotImplementedError("Exercise'


@dataclass(frozen=True)
class Export:
    name: str         # the function or class the notebook defines
    field: str        # the Parts field it fills
    exercise: str     # "E1.1"


# chapter -> the parts its exercises provide. Each entry's adapter (ADAPTERS) turns the notebook's function
# into the Parts field's signature.
EXPORTS: dict[str, list[Export]] = {
    "01": [Export("rms_norm", "rms_norm", "E1.1"), Export("fused_add_rms_norm", "add_rms_norm", "E1.2")],
    "02": [Export("rope_cos_sin", "rope_cos_sin", "E2.1"), Export("apply_rope", "rotary", "E2.2")],
    "03": [Export("qkv_weight_loader", "qkv_weight_loader", "E3.3"),
           Export("gate_up_weight_loader", "gate_up_weight_loader", "E3.3")],
    "04": [Export("slot_mapping", "prepare_prefill", "E4.1"), Export("slot_mapping", "prepare_decode", "E4.1"),
           Export("paged_decode", "attention_backend", "E4.2"), Export("store_kvcache", "store_kvcache", "E4.3")],
    "05": [Export("BlockManager", "block_manager", "E5.2"), Export("CachingBlockManager", "block_manager", "E5.3")],
    "06": [Export("store_kvcache", "store_kvcache", "E6.1"), Export("paged_decode", "attention_backend", "E6.3")],
    "07": [Export("Scheduler", "scheduler", "E7.1-E7.3")],
    "08": [Export("sample", "sampler", "E8.1-E8.4")],
    # Chapter 09's loaders have the Parts signature (layer, param, loaded_weight, shard_id) and know the rank.
    "09": [Export("load_qkv_shard", "qkv_weight_loader", "E9.1"),
           Export("load_gate_up_shard", "gate_up_weight_loader", "E9.1")],
    "10": [Export("graph_batch_sizes", "graph_batch_sizes", "E10.1"), Export("store_kvcache", "store_kvcache", "E10.3")],
}
# A part counts as done only when it and every notebook function it calls (directly or not: chapter 06's kernel
# factories, chapter 08's helpers) hold no stub; those functions are exported with it.
# Several exercises may fill one field (04 in PyTorch, 06 in Triton, 10 capture-safe in PyTorch; 05's block
# manager without and with prefix caching): the highest chapter whose part is done wins, and within a chapter the later exercise, in
# parts_from_student, parts_from_functions and part_table alike.


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


# Exported names that already have their Parts field's signature (chapter 09's rank-aware loaders).
AS_IS = {"load_qkv_shard", "load_gate_up_shard"}


def _adapt(field: str, fn, name: str | None = None):
    from nanovllm_ref.attn import FunctionBackend
    from nanovllm_ref.engine import inputs
    if name in AS_IS:
        return fn
    if field == "qkv_weight_loader":
        return functools.partial(_qkv_loader, fn)
    if field == "gate_up_weight_loader":
        return functools.partial(_gate_up_loader, fn)
    if field == "prepare_prefill":
        return functools.partial(inputs.prepare_prefill, slot_fn=fn)
    if field == "prepare_decode":
        return functools.partial(inputs.prepare_decode, slot_fn=fn)
    if field == "attention_backend":
        return dataclasses.replace(FunctionBackend.of("torch"), paged_decode=fn)
    return fn


def parts_from_functions(**functions) -> tuple[Parts, list[str]]:
    """Parts from notebook-level objects named as in EXPORTS (e.g. rms_norm=..., BlockManager=...).
    An object that is still the release's stub (or calls a function of its notebook that still is) is
    skipped. Returns (parts, names of the objects used)."""
    by_name = {e.name: e for chapter in EXPORTS.values() for e in chapter}
    changes, used = {}, []
    for name, obj in functions.items():
        if name not in by_name:
            raise ValueError(f"{name!r} is not an exported exercise; known: {sorted(by_name)}")
        if is_stub(obj):
            continue
        used.append(name)
        for e in (e for chapter in EXPORTS.values() for e in chapter if e.name == name):
            changes[e.field] = _adapt(e.field, obj, name)
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
        rows.append(dict(chapter=chapter, exercise=e.exercise, name=e.name, field=e.field, status=status))
    return rows


def export(notebooks_dir: Path, out_dir: Path, chapters=None) -> list[dict]:
    """Export every chapter notebook in `notebooks_dir` that has parts (or those in `chapters`) into the
    package folder `out_dir` (created, with __init__.py and manifest.json). Returns the manifest rows."""
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
    if str(out_dir.parent) not in sys.path:
        sys.path.insert(0, str(out_dir.parent))
    package = out_dir.name
    for mod in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[mod]                  # a fresh export replaces an earlier import
    importlib.invalidate_caches()
    changes = {}
    for row in rows:
        row["source"] = "yours" if row["status"] == "done" else "reference"
    for field, row in shown_rows(rows).items():     # where chapters share a field, the highest done one runs
        if row["status"] == "done":
            module = importlib.import_module(f"{package}.ch{row['chapter']}")
            changes[field] = _adapt(field, getattr(module, row["name"]), row["name"])
    return Parts(**changes), rows


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
