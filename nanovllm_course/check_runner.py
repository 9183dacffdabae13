"""The course's own check cells: what runs inside a student's kernel while `grade` or `pytest --nbval` grades
the notebook (course machinery; the grader's side is nanovllm_course/grading.py).

A student's cell runs in the same Python as the check, so it can replace anything there: the check function
(`ch09.check_simulated_forward = lambda *a: print("E9.2 ok")`), the helpers it calls (`common.check_close`,
a tolerance such as `ch09.ATOL`), torch's comparisons (`torch.equal`, `torch.testing.assert_close`), `print`
or `sys.stdout`, or print an `E9.2 ok` line of its own. Under grading:

1. Before the first cell of the notebook, the grader runs a preamble (not stored in the notebook, not in the
   kernel's input history) that loads this module as a private module object (not in sys.modules), imports
   the chapter's module, the engine and torch, and takes a `Snapshot`: every attribute of the course's modules
   and classes (nanovllm_course, nanovllm_ref, nanovllm_bench, nanovllm_models), their functions' code and
   defaults, their module-level containers, the callables of torch, torch.nn.functional, torch.testing, math
   and the builtins, sys.stdout and sys.stderr, the trace and profile hooks, torch's function and dispatch
   mode stacks, the default dtype and device, and which module object each of those names is in
   sys.modules. The grader's secret (a per-session key it wrote into a file that the preamble reads and
   deletes) stays in the `Runner`.
2. Every check cell is replaced by `__nanovllm_grader__.run(token, ids)`. `run` first puts back everything
   the notebook changed in the snapshot (and reports it), then runs the registered exercise itself,
   `EXERCISES[id].run(namespace)` from the chapter module as it was at the start (the check, then the engine run of
   its parts), on the objects the notebook's namespace holds under the exercise's names. An object that is
   the course's own (a reference imported as the answer) fails. The verdict comes from the outcome (the
   exception, or a return with the check's own `E9.2 ok`), not from what was printed; then the snapshot is
   compared again, and a check during which the student's code changed it fails.
3. Each verdict goes back as a display_data output of type VERDICT_MIME: the token of its cell, the exercise,
   the line, seconds, what was put back, signed with HMAC-SHA256 under the secret. The grader accepts, per
   check cell, exactly the records signed with its secret that carry that cell's token (a token is new in
   every graded run and is used once: a second `run` with it is refused). A line a student's code prints,
   `E9.2 ok` included, is no verdict.

What this does not stop: code that deliberately goes after the grader's own objects (finds the Runner through
builtins or the garbage collector and rewrites it, or reads its secret), or a function that changes the course
only for the moment of one call and undoes it before returning. Those need the check in another process
against exported code, at the price of running every chapter twice.
"""
import ast
import builtins
import contextlib
import copy
import dataclasses
import hashlib
import hmac
import io
import json
import os
import sys
import time
import types

VERDICT_MIME = "application/vnd.nanovllm.verdict+json"
GRADER_NAME = "__nanovllm_grader__"
PACKAGES = ("nanovllm_course", "nanovllm_ref", "nanovllm_bench", "nanovllm_models")
# The libraries a check computes with: their callables (functions, classes, modules) are watched, not their data.
LIBRARIES = ("builtins", "torch", "torch.nn", "torch.nn.functional", "torch.testing", "torch.linalg", "torch.special",
             "torch.fft", "math", "cmath", "random", "operator", "functools", "itertools", "contextlib", "io",
             "inspect", "json", "re", "copy", "dataclasses", "collections", "numpy", "numpy.testing", "xxhash")
LIBRARY_CLASSES = ("torch.Tensor", "torch.nn.Module", "torch.nn.Parameter", "contextlib.redirect_stdout", "io.StringIO")
# What Python itself may add to a class after it is made.
_CLASS_LAZY = frozenset({"__abstractmethods__", "_abc_impl", "__orig_bases__", "__parameters__", "__weakref__",
                         "__annotations__", "__annotate__", "__slotnames__", "__static_attributes__"})
# What the kernel itself rebinds for every request it executes (ipykernel's stdin forwarding).
_KERNEL_OWN = {"builtins": frozenset({"input", "raw_input"}), "getpass": frozenset({"getpass"})}
_MISSING = object()


def sign(secret: bytes, record: dict) -> str:
    """HMAC-SHA256 (hex) of a verdict record (every field but "mac"), in a canonical JSON form."""
    body = json.dumps({k: v for k, v in record.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, body.encode("utf-8"), hashlib.sha256).hexdigest()


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _plain(value, depth: int = 0) -> bool:
    """True for data made only of str, bytes, numbers, bools, None and (nested) lists, tuples, dicts and sets."""
    if depth > 4:
        return False
    if value is None or isinstance(value, (str, bytes, int, float, complex, bool)):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _declared_global(module) -> set:
    """Names a module's own functions rebind with a `global` statement (its state, not the student's to change)."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return set()
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return set()
    return {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}


class _Function:
    """A Python function's code, defaults and closure, as they were."""

    def __init__(self, label, fn):
        self.label, self.fn = label, fn
        self.code, self.defaults, self.kwdefaults = fn.__code__, fn.__defaults__, copy.copy(fn.__kwdefaults__)
        self.cells = tuple(_cell(c) for c in (fn.__closure__ or ()))

    def restore(self) -> list:
        fn, changed = self.fn, []
        if fn.__code__ is not self.code:
            fn.__code__ = self.code
            changed.append(f"the code of {self.label}")
        if fn.__defaults__ is not self.defaults or fn.__kwdefaults__ != self.kwdefaults:
            fn.__defaults__, fn.__kwdefaults__ = self.defaults, copy.copy(self.kwdefaults)
            changed.append(f"the defaults of {self.label}")
        for cell, saved in zip(fn.__closure__ or (), self.cells):
            if saved is not _MISSING and _cell(cell) is not saved:
                cell.cell_contents = saved
                changed.append(f"a variable {self.label} closes over")
        return changed


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:          # an empty cell
        return _MISSING


def _own_change(package: str, value) -> bool:
    """True when a library replaced one of its own attributes with something of its own (importing torch._dynamo
    wraps torch.manual_seed; torch.set_default_dtype rebinds torch.Storage): a Python function of that top-level
    package in a file of the installed libraries, or a class of that package's modules."""
    if isinstance(value, type):
        module = sys.modules.get(value.__module__)
        where = getattr(module, "__file__", None) or ""
        return value.__module__.split(".")[0] == package and not _ours(value.__module__) \
            and os.path.abspath(where).startswith(_LIBRARY_DIRS)
    fn = value if isinstance(value, types.FunctionType) else getattr(value, "__wrapped__", None)
    if not isinstance(fn, types.FunctionType):
        return False
    module = fn.__module__ or ""
    return module.split(".")[0] == package and not _ours(module) \
        and os.path.abspath(fn.__code__.co_filename).startswith(_LIBRARY_DIRS)


_LIBRARY_DIRS = tuple(sorted({os.path.abspath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}))


class _Namespace:
    """The attributes of a module, a class or an instance, as they were.

    The course's own (`ours`): every attribute counts and new ones are removed, but for the names the module
    rebinds itself (`global`), submodules imported since, and what Python adds to a class lazily. A library's:
    only its callables, classes and modules count, a library's change to itself is taken as the new state, and
    a new attribute counts only on a class, where it hides one of a base class (`torch.Tensor.__eq__`)."""

    def __init__(self, label, owner, *, ours: bool, exempt=frozenset(), kind="module"):
        self.label, self.owner, self.ours, self.exempt, self.kind = label, owner, ours, set(exempt), kind
        self.package = label.split(".")[0]
        items = dict(vars(owner))
        self.known = set(items)                   # what is not new
        if not ours:
            items = {k: v for k, v in items.items() if callable(v) or isinstance(v, types.ModuleType)}
        self.saved = {k: v for k, v in items.items() if k not in self.exempt and k != "__warningregistry__"}

    def _set(self, key, value):
        if self.kind == "instance":
            vars(self.owner)[key] = value
        else:
            setattr(self.owner, key, value)

    def _delete(self, key):
        if self.kind == "instance":
            del vars(self.owner)[key]
        else:
            delattr(self.owner, key)

    def _lazy(self, key, value) -> bool:
        """A new attribute that is no one's change: a submodule imported since, what Python adds to a class."""
        if key == "__warningregistry__" or key in self.exempt:
            return True
        if self.kind == "class":
            return key in _CLASS_LAZY
        return self.kind == "module" and isinstance(value, types.ModuleType) and value.__name__ == f"{self.label}.{key}"

    def restore(self) -> list:
        now, changed = vars(self.owner), []
        for key, value in self.saved.items():
            current = now.get(key, _MISSING)
            if current is value:
                continue
            if not self.ours and current is not _MISSING and _own_change(self.package, current):
                self.saved[key] = current            # the library's own doing: the new state
                continue
            self._set(key, value)
            changed.append(f"{self.label}.{key}")
        for key in [k for k in now if k not in self.saved and (self.ours or k not in self.known)]:
            value = now[key]
            if self._lazy(key, value):
                continue
            if not self.ours:
                if self.kind != "class" or not any(key in vars(base) for base in self.owner.__mro__[1:]):
                    continue                          # a new name hides nothing: the library's business
                if _own_change(self.package, value):
                    self.saved[key] = value
                    self.known.add(key)
                    continue
            self._delete(key)
            changed.append(f"{self.label}.{key} (added)")
        return changed


class _Container:
    """A module-level list, dict or set of the course, as it was: the same items, and for plain data the same
    values all the way down (engine_check.PROMPTS emptied would leave the engine run nothing to compare)."""

    def __init__(self, label, value):
        self.label, self.value = label, value
        self.items = dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else set(value)
        self.deep = copy.deepcopy(value) if _plain(value) else _MISSING

    def _same(self) -> bool:
        v = self.value
        if isinstance(v, dict):
            if v.keys() != self.items.keys() or any(v[k] is not self.items[k] for k in v):
                return False
        elif isinstance(v, list):
            if len(v) != len(self.items) or any(a is not b for a, b in zip(v, self.items)):
                return False
        elif v != self.items:
            return False
        return self.deep is _MISSING or v == self.deep

    def restore(self) -> list:
        if self._same():
            return []
        v, source = self.value, (copy.deepcopy(self.deep) if self.deep is not _MISSING else self.items)
        if isinstance(v, dict):
            v.clear()
            v.update(source)
        elif isinstance(v, list):
            v[:] = list(source)
        else:
            v.clear()
            v.update(source)
        self.items = dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else set(v)
        return [f"the contents of {self.label}"]


class _Process:
    """State of the process a check depends on: sys.stdout/stderr, trace and profile hooks, sys.modules entries,
    torch's function/dispatch mode stacks, default dtype and device."""

    def __init__(self, module_names):
        import torch
        self.stdout, self.stderr = sys.stdout, sys.stderr
        self.modules = {name: sys.modules[name] for name in module_names if name in sys.modules}
        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device() if hasattr(torch, "get_default_device") else None

    def restore(self) -> list:
        import threading
        import torch
        changed = []
        if sys.stdout is not self.stdout:
            sys.stdout = self.stdout
            changed.append("sys.stdout")
        if sys.stderr is not self.stderr:
            sys.stderr = self.stderr
            changed.append("sys.stderr")
        if sys.gettrace() is not None:
            sys.settrace(None)
            changed.append("a trace function (sys.settrace)")
        if sys.getprofile() is not None:
            sys.setprofile(None)
            changed.append("a profile function (sys.setprofile)")
        if threading.gettrace() is not None or threading.getprofile() is not None:
            threading.settrace(None)
            threading.setprofile(None)
            changed.append("a trace or profile function for new threads (threading.settrace)")
        for name, module in self.modules.items():
            if sys.modules.get(name) is not module:
                sys.modules[name] = module
                changed.append(f"sys.modules[{name!r}]")
        while torch._C._len_torch_function_stack() > 0:
            mode = torch._C._pop_torch_function_stack()
            changed.append(f"a torch function mode left on ({type(mode).__name__})")
        from torch.utils import _python_dispatch
        while _python_dispatch._len_torch_dispatch_stack() > 0:
            mode = _python_dispatch._pop_mode()
            changed.append(f"a torch dispatch mode left on ({type(mode).__name__})")
        if torch.get_default_dtype() is not self.dtype:
            torch.set_default_dtype(self.dtype)
            changed.append("torch's default dtype (torch.set_default_dtype)")
        if self.device is not None and torch.get_default_device() != self.device:
            torch.set_default_device(self.device)
            changed.append("torch's default device (torch.set_default_device)")
        return changed


class Snapshot:
    """What the course's checks compute with, as it was when the snapshot was taken; `restore()` puts back
    whatever changed since and returns what that was (see the module doc)."""

    def __init__(self):
        self.watched = []
        seen_functions, seen_classes, seen_instances = set(), set(), set()
        names = sorted(n for n, m in list(sys.modules.items())
                       if isinstance(m, types.ModuleType) and (_ours(n) or n in LIBRARIES))
        for name in names:
            module = sys.modules[name]
            ours = _ours(name)
            exempt = _declared_global(module) if ours else _KERNEL_OWN.get(name, frozenset())
            self.watched.append(_Namespace(name, module, ours=ours, exempt=exempt))
            for key, value in list(vars(module).items()):
                label = f"{name}.{key}"
                if isinstance(value, types.FunctionType) and id(value) not in seen_functions:
                    seen_functions.add(id(value))
                    self.watched.append(_Function(label, value))
                    wrapped = getattr(value, "__wrapped__", None)
                    if isinstance(wrapped, types.FunctionType) and id(wrapped) not in seen_functions:
                        seen_functions.add(id(wrapped))
                        self.watched.append(_Function(label, wrapped))
                elif ours and isinstance(value, type) and value.__module__ == name and id(value) not in seen_classes:
                    seen_classes.add(id(value))
                    self._watch_class(label, value, seen_functions)
                elif ours and isinstance(value, (list, dict, set)) and not key.startswith("__"):
                    self.watched.append(_Container(label, value))
                    self._watch_instances(label, value, seen_instances, seen_functions)
                elif ours and dataclasses.is_dataclass(value) and not isinstance(value, type):
                    self._watch_instances(label, value, seen_instances, seen_functions)
        for dotted in LIBRARY_CLASSES:
            module, _, attr = dotted.rpartition(".")
            cls = getattr(sys.modules.get(module), attr, None)
            if isinstance(cls, type) and id(cls) not in seen_classes:
                seen_classes.add(id(cls))
                self._watch_class(dotted, cls, seen_functions)
        self.watched.append(_Process(names))

    def _watch_class(self, label, cls, seen_functions):
        if cls.__flags__ & (1 << 8):         # Py_TPFLAGS_IMMUTABLETYPE: a C type nobody can change
            return
        self.watched.append(_Namespace(label, cls, ours=_ours(cls.__module__), kind="class"))
        for key, value in vars(cls).items():
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(fn, property):
                fn = fn.fget
            if isinstance(fn, types.FunctionType) and id(fn) not in seen_functions:
                seen_functions.add(id(fn))
                self.watched.append(_Function(f"{label}.{key}", fn))

    def _watch_instances(self, label, value, seen, seen_functions, depth=0):
        """Dataclass instances of the course reachable from a module-level value (EXERCISES -> Exercise ->
        parts -> EnginePart): their fields as they were, and the functions they hold (a part's check lambda)."""
        if depth > 3:
            return
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if id(value) in seen or not _ours(type(value).__module__):
                return
            seen.add(id(value))
            self.watched.append(_Namespace(f"{label} ({type(value).__name__})", value, ours=True, kind="instance"))
            for key, field in vars(value).items():
                if isinstance(field, types.FunctionType) and id(field) not in seen_functions:
                    seen_functions.add(id(field))
                    self.watched.append(_Function(f"{label}.{key}", field))
                else:
                    self._watch_instances(f"{label}.{key}", field, seen, seen_functions, depth + 1)
        elif isinstance(value, dict):
            for k, v in list(value.items()):
                self._watch_instances(f"{label}[{k!r}]", v, seen, seen_functions, depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self._watch_instances(f"{label}[{i}]", v, seen, seen_functions, depth + 1)

    def restore(self) -> list:
        changed = []
        for item in self.watched:
            changed += item.restore()
        return list(dict.fromkeys(changed))


def _shown(names: list, limit: int = 3) -> str:
    text = ", ".join(names[:limit])
    return text + (f" and {len(names) - limit} more" if len(names) > limit else "")


class Runner:
    """`__nanovllm_grader__` in a graded kernel: runs the course's check of each exercise (see the module doc)."""

    def __init__(self, secret: bytes, chapter: str, namespace: dict):
        import importlib
        from IPython.display import publish_display_data
        from nanovllm_course import common
        self._secret, self._namespace, self._used = secret, namespace, set()
        self._module = importlib.import_module(f"nanovllm_course.ch{chapter}")
        self._exercises = dict(self._module.EXERCISES)
        self._verdict_line, self._publish, self._print = common.verdict_line, publish_display_data, builtins.print
        importlib.import_module("nanovllm_course.engine_check")       # what Exercise.run imports, watched too
        importlib.import_module("nanovllm_ref")
        self._snapshot = Snapshot()

    def _not_yours(self, exercise) -> str | None:
        """The first argument that is the course's own function or class (a reference imported as the answer)."""
        for name in exercise.args:
            obj = self._namespace.get(name)
            if isinstance(obj, (types.FunctionType, type, types.BuiltinFunctionType)) or hasattr(obj, "__wrapped__"):
                module = getattr(obj, "__module__", None) or ""
                if _ours(module) or module.split(".")[0] == "torch":
                    return f"{exercise.id} failed: {name} is {module}.{getattr(obj, '__qualname__', name)}, not your " \
                           f"code (hint: write {name} yourself in the exercise cell)"
        return None

    def _judge(self, exercise) -> tuple[str, str]:
        """(verdict line, what the check printed) for one exercise."""
        tag, held = exercise.id, io.StringIO()
        line = self._not_yours(exercise)
        if line is not None:
            return line, ""
        with contextlib.redirect_stdout(held):
            try:
                exercise.run(self._namespace)
                error = None
            except KeyboardInterrupt:
                return (f"{tag} failed: its check was interrupted (it ran past the grader's time limit per cell)",
                        held.getvalue())
            except BaseException as exc:          # SystemExit too: the student's code does not end the check
                error = exc
        text = held.getvalue()
        if error is not None:
            return self._verdict_line(tag, error, error.__traceback__), text
        if f"{tag} ok" not in [l.strip() for l in text.splitlines()]:
            return f"{tag} failed: its check returned without a verdict", text
        return f"{tag} ok", text

    def run(self, token: str, ids) -> None:
        """Grade the exercises `ids` of one check cell; `token` is the cell's, new in every graded run."""
        if token in self._used:
            raise RuntimeError("this check cell's verdict has been given already")
        self._used.add(token)
        before = self._snapshot.restore()
        records, shown = [], []
        for tag in ids:
            start = time.perf_counter()
            exercise = self._exercises.get(tag)
            if exercise is None:
                line, text = f"{tag} failed: chapter {self._module.__name__} registers no exercise {tag}", ""
            else:
                line, text = self._judge(exercise)
            during = self._snapshot.restore()
            if during and line == f"{tag} ok":
                line = (f"{tag} failed: while its check ran, your code replaced {_shown(during)} (the course put the "
                        "originals back) (hint: an exercise computes its answer; it must not change the course's code)")
            ok = line == f"{tag} ok"
            # what the student sees: as `check` shows it (held output, no "ok" line above a failure)
            kept = "".join(l for l in text.splitlines(keepends=True) if ok or l.strip() != f"{tag} ok")
            shown.append(kept + ("" if ok else line + "\n"))
            record = {"token": token, "exercise": tag, "line": line, "seconds": round(time.perf_counter() - start, 3),
                      "restored": before, "during": during}
            record["mac"] = sign(self._secret, record)
            records.append(record)
        sys.stdout.write("".join(shown))
        sys.stdout.flush()
        for record in records:
            self._publish({VERDICT_MIME: record}, metadata={})


def arm(secret_path: str, chapter: str, namespace: dict) -> None:
    """The grader's preamble: read (and delete) the session's secret, take the snapshot, install the Runner as
    builtins.__nanovllm_grader__. Prints nothing."""
    with open(secret_path, "rb") as f:
        secret = bytes.fromhex(f.read().decode("ascii").strip())
    os.unlink(secret_path)
    setattr(builtins, GRADER_NAME, Runner(secret, chapter, namespace))
