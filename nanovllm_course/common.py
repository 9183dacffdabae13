"""What every check helper shares (course machinery).

A check helper compares a student's function with the reference on fresh random inputs. On success it
prints exactly one fixed line, `E<chapter>.<n> ok`, and nothing else (nbval compares printed output). On
failure it raises `CheckFailed` (an AssertionError) with a teaching message: what differed, where, and a
hint; an unfilled exercise raises `NotDone` (a CheckFailed saying "not implemented yet").

Helpers raise, so tests (and anyone calling them directly) see the failure. A notebook's check cell wraps
the call in `check`, which turns the outcome into one verdict line and never raises:

    with check("E1.1"):
        ch01.check_rms_norm(rms_norm)

prints `E1.1 ok` (the helper's own line), `E1.1 not done yet`, or `E1.1 failed: <message> (hint: ...)`, so
Run All goes on and the student sees no traceback of the course's internals. Graders compare that output
with the solution's (`python -m nanovllm_course grade`).
"""
import dataclasses
import functools
import os
import re
import sys
import tempfile
import traceback
import warnings

import torch


def ok(tag: str) -> None:
    """Print the one success line of a check, e.g. `E4.1 ok`."""
    print(f"{tag} ok")


NOT_DONE_MESSAGE = "not implemented yet"     # how call_student's failure starts (tests match it)


class CheckFailed(AssertionError):
    """A check's verdict on wrong code. str() is `E4.1: <message>` plus a `  hint: ...` line (what tests
    match); `tag`, `message` and `hint` are kept for the one-line verdict of `check`."""

    def __init__(self, tag: str, message: str, hint: str | None = None):
        text = f"{tag}: {message}" + (f"\n  hint: {hint}" if hint else "")
        super().__init__(text)
        self.tag, self.message, self.hint = tag, message, hint


class NotDone(CheckFailed):
    """The student's code still raises the stub's NotImplementedError."""


def fail(tag: str, message: str, hint: str | None = None):
    """Raise the CheckFailed (an AssertionError) a student sees: `E4.1: <message>` plus a hint line."""
    raise CheckFailed(tag, message, hint)


def check_close(tag: str, actual, expected, *, rtol: float, atol: float, what: str, hint: str | None = None):
    """Fail with a readable message unless `actual` matches `expected` within |a - e| <= atol + rtol * |e|."""
    if not isinstance(actual, torch.Tensor):
        fail(tag, f"{what} should be a torch.Tensor, got {type(actual).__name__}", hint)
    if actual.shape != expected.shape:
        fail(tag, f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}", hint)
    if actual.dtype != expected.dtype:
        fail(tag, f"{what} has dtype {actual.dtype}, expected {expected.dtype}", hint)
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    if not torch.isfinite(a).all() and torch.isfinite(e).all():
        fail(tag, f"{what} contains NaN or inf", hint)
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        fail(tag, f"{what} differs from the reference at index {idx}: got {a[idx].item():.6g}, expected "
                  f"{e[idx].item():.6g} (max abs error {err.max().item():.3g}; tolerance atol={atol}, rtol={rtol})",
             hint)


def call_student(tag: str, fn, *args, **kwargs):
    """Call the student's code; turn 'not implemented yet' into a clear AssertionError."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        raise NotDone(tag, f"{NOT_DONE_MESSAGE} ({exc})",
                      "fill in the exercise cell above, run it, then run this check") from None


# -- the verdict of a check cell -----------------------------------------------------------------------------
_OURS = tuple(os.path.dirname(os.path.abspath(m)) + os.sep for m in (__file__,))
_LIBRARIES = tuple(sorted({os.path.abspath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}))


def _one_line(text: str) -> str:
    """`text` on one line: line breaks (and the blanks around them) become one space; runs of spaces inside a
    line are kept, so a message quoting `'  test'` still shows both spaces."""
    return re.sub(r"[ \t]*[\r\n]+[ \t]*", " ", str(text).strip())


def _student_frame(tb):
    """(function, line) of the innermost traceback frame in the student's own code (a notebook cell or
    a file outside this package, the reference engine and the installed libraries), else None."""
    import nanovllm_ref
    skip = _OURS + (os.path.dirname(os.path.abspath(nanovllm_ref.__file__)) + os.sep,) + _LIBRARIES
    found = None
    for frame, line in traceback.walk_tb(tb):
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(skip):
            found = (frame.f_code.co_name, line)
    return found


def verdict_line(tag: str, exc: BaseException | None, tb=None) -> str:
    """The one line a check cell prints for `exc` (None: `<tag> ok`)."""
    if exc is None:
        return f"{tag} ok"
    if isinstance(exc, (NotDone, NotImplementedError)) or \
            (isinstance(exc, CheckFailed) and exc.message.startswith(NOT_DONE_MESSAGE)):
        return f"{tag} not done yet"
    if isinstance(exc, CheckFailed):
        message, hint = exc.message, exc.hint
    elif isinstance(exc, AssertionError) and str(exc).startswith(f"{tag}:"):      # a plain assert-style fail
        message, _, hint = str(exc)[len(tag) + 1:].partition("\n  hint:")
    elif isinstance(exc, NameError):
        message, hint = f"NameError: {exc}", "run the cells above this one first, the exercise cell included"
    else:
        where = _student_frame(tb)
        message = f"your code raised {type(exc).__name__}: {exc}"
        if where and where[0] != "<module>":
            message += f" (in {where[0]}, line {where[1]})"
        exercise = exercise_of(tag)
        hint = (exercise.hint if exercise is not None and exercise.hint else
                "run your function on a small input in a new cell to see the full traceback")
    text = f"{tag} failed: {_one_line(message.split(chr(10))[0] if message else type(exc).__name__)}"
    if hint and _one_line(hint):
        text += f" (hint: {_one_line(hint)})"
    return text


class check:
    """Run a check helper in a notebook cell and print one verdict line instead of raising:

        with check("E1.1"):
            ch01.check_rms_norm(rms_norm)

    `E1.1 ok` is printed by the helper itself; on a failure this prints `E1.1 not done yet` or
    `E1.1 failed: <message> (hint: ...)` and swallows the exception, so Run All continues. Only
    Exceptions are turned into verdicts (a KeyboardInterrupt still stops the cell).

    What the block prints is held back until it ends, so that a later statement can still fail the
    exercise: in

        with check("E4.3"):
            ch04.check_store_kvcache(store_kvcache)              # prints "E4.3 ok" (held back)
            in_the_engine("E4.3", store_kvcache=store_kvcache)   # raises: the part breaks the engine

    the cell prints only `E4.3 failed: ...`, never an `E4.3 ok` above it."""

    def __init__(self, tag: str):
        self.tag = tag
        self._held = None

    def __enter__(self):
        import contextlib
        import io
        self._held = io.StringIO()
        self._redirect = contextlib.redirect_stdout(self._held)
        self._redirect.__enter__()
        return self

    def _release(self, drop_ok: bool) -> None:
        self._redirect.__exit__(None, None, None)
        text = self._held.getvalue()
        if drop_ok:
            text = "".join(line for line in text.splitlines(keepends=True) if line.strip() != f"{self.tag} ok")
        sys.stdout.write(text)
        sys.stdout.flush()

    def __exit__(self, etype, exc, tb):
        if exc is None or not isinstance(exc, Exception):
            self._release(drop_ok=exc is not None)
            return False
        self._release(drop_ok=True)
        print(verdict_line(self.tag, exc, tb), flush=True)
        return True

    def __repr__(self):
        return f"check({self.tag!r})"


def fresh_generator(seed: int | None = None) -> torch.Generator:
    """A generator seeded from the OS unless `seed` is given: every check run draws new inputs."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return g


@functools.lru_cache(maxsize=None)
def tiny_model_dir(arch: str = "qwen3") -> str:
    """A tiny random checkpoint (+ tokenizer), made once per process in a temp folder."""
    from nanovllm_models.tiny import make_tiny_model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_tiny_model(tempfile.mkdtemp(prefix=f"nanovllm_tiny_{arch}_"), arch)


# -- added for chapters 00-02 (course machinery) -------------------------------------------------------------
def check_unchanged(tag: str, before: dict, after: dict, hint: str | None = None) -> None:
    """Fail unless each named tensor in `after` equals (bit for bit) its copy in `before`.

    Use: `before = {"x": x.clone()}; call_student(...); check_unchanged(tag, before, {"x": x})`."""
    for name, saved in before.items():
        now = after[name]
        if now.shape != saved.shape or now.dtype != saved.dtype or not torch.equal(now, saved):
            fail(tag, f"your function changed its input `{name}` (an in-place operation such as `+=`, "
                      "`.mul_()` or `out=`); the caller may still need it",
                 hint or "build new tensors (x = x + r) instead of writing into the inputs")


def check_type(tag: str, value, types, what: str, hint: str | None = None) -> None:
    """Fail unless `value` is an instance of `types` (a type or tuple of types)."""
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        fail(tag, f"{what} should be a {names}, got {type(value).__name__}", hint)


def randint(g: torch.Generator, low: int, high: int) -> int:
    """A random int in [low, high] (inclusive) drawn from generator `g`."""
    return int(torch.randint(low, high + 1, (1,), generator=g).item())


# -- the engine parts a chapter declares (read by export, engine_check and the capstone) -----------------------
@dataclasses.dataclass(frozen=True)
class EnginePart:
    """One engine part a chapter's exercise provides; each chapter module lists its own in `PARTS`.

    name      the function or class the notebook defines ("store_kvcache", "Scheduler")
    field     the nanovllm_ref.Parts field it fills ("store_kvcache", "scheduler")
    exercise  the exercise it comes from: "E4.3", or a range "E7.1-E7.3" for a part built over several
              exercises (the last of them grades it inside the engine: `graded_by`)
    adapter   None when the notebook's signature is the field's; else adapter(fn) -> the field's value,
              a module-level function of the course (so the result pickles into tensor-parallel workers)
    check     check(module) -> None, raising as the chapter's check does: the chapter's check run again on a
              module that holds the part (the capstone passes the exported student/chNN.py); None when the
              chapter's check needs more than the exported part
    triton    True for a Triton kernel: on a machine without CUDA it runs in Triton's interpreter, far too
              slowly for the capstone's engine runs (the chapter's own check still runs it)
    """
    name: str
    field: str
    exercise: str
    adapter: object = None
    check: object = None
    triton: bool = False

    @property
    def graded_by(self) -> str:
        """The exercise whose check cell runs this part inside the engine: the last of a range."""
        return self.exercise.split("-")[-1]

    @property
    def chapter(self) -> str:
        """The part's chapter as two digits, "04"."""
        return f"{int(self.exercise[1:].split('.')[0]):02d}"

    def value(self, obj):
        """What goes into the Parts field for the notebook's (or exported module's) `obj`."""
        return self.adapter(obj) if self.adapter is not None else obj


# -- the exercises a chapter declares (read by grade, export, engine_check, the capstone and the tests) -----------
@dataclasses.dataclass(frozen=True)
class Exercise:
    """One exercise of a chapter (GPU-Puzzles' `CudaProblem`: spec, check and answer in one object). Each chapter
    module ends with `EXERCISES = exercises(Exercise(...), ...)`, a dict by id, in notebook order.

    id         "E9.2"
    check      check(*objects) -> None: the chapter's check helper (chNN.check_*); prints `<id> ok` on success,
               raises CheckFailed (an AssertionError) on wrong code and NotDone on the stub
    args       the notebook names the check cell hands to `check`, in order: ("column_forward", "row_forward",
               "vocab_embedding", "lm_head"); the check cell is `with check(id): chNN.check_x(*args)`
    reference  the reference answers for `args`, in the same order, so `check(*reference)` passes; None where an
               argument is made by the notebook's own cells (E13.1's `capstone`)
    parts      the engine parts (EnginePart) this exercise's check cell then runs inside the tiny engine
               (`in_the_engine(id, **{part.name: ...})`); a part built over several exercises ("E7.1-E7.3")
               belongs to the last of them. A chapter's `PARTS` is every exercise's parts, in order.
    optional   True: the chapter is complete without it (`grade` says "optional E4.3 not done" and its exit
               status ignores it)
    hint       what a failure of this exercise suggests when the failure brings no hint of its own (an
               exception raised inside the student's code); None: the generic "run your function on a small
               input" hint
    """
    id: str
    check: object
    args: tuple
    reference: tuple | None = None
    parts: tuple = ()
    optional: bool = False
    hint: str | None = None

    def __post_init__(self):
        m = re.fullmatch(r"E(\d+)\.(\d+)", str(self.id))
        if m is None:
            raise ValueError(f"Exercise id must look like 'E9.2', got {self.id!r}")
        if not callable(self.check):
            raise TypeError(f"Exercise {self.id}: check must be callable, got {type(self.check).__name__}")
        if isinstance(self.args, str) or not all(isinstance(a, str) and a.isidentifier() for a in self.args):
            raise TypeError(f"Exercise {self.id}: args must be a tuple of notebook names, got {self.args!r}")
        if self.reference is not None and len(self.reference) != len(self.args):
            raise ValueError(f"Exercise {self.id}: reference has {len(self.reference)} objects for the "
                             f"{len(self.args)} args {self.args}")
        for part in self.parts:
            if not isinstance(part, EnginePart) or part.graded_by != self.id:
                raise ValueError(f"Exercise {self.id}: parts must be EngineParts graded by {self.id}, got {part!r}")

    @property
    def chapter(self) -> str:
        """The exercise's chapter as two digits, "09"."""
        return f"{int(self.id[1:].split('.')[0]):02d}"

    def objects(self, namespace) -> list:
        """The objects the check takes, looked up by name in `namespace` (a notebook's globals). A missing one
        is a NameError, as the check cell itself would raise."""
        missing = [name for name in self.args if name not in namespace]
        if missing:
            raise NameError(f"name {missing[0]!r} is not defined")
        return [namespace[name] for name in self.args]

    def run(self, namespace) -> None:
        """What the exercise's check cell does, on the objects of `namespace`: the check, then the engine run of
        its parts. Raises as they do (CheckFailed, NotDone, the student's own exception); prints `<id> ok`."""
        self.check(*self.objects(namespace))
        if self.parts:
            from nanovllm_course.engine_check import in_the_engine
            names = list(dict.fromkeys(p.name for p in self.parts))
            missing = [name for name in names if name not in namespace]
            if missing:
                raise NameError(f"name {missing[0]!r} is not defined")
            in_the_engine(self.id, **{name: namespace[name] for name in names})


def exercises(*items: Exercise) -> dict:
    """{id: Exercise} in the order given (the notebook's), refusing a repeated id or exercises of two chapters."""
    found = {}
    for item in items:
        if not isinstance(item, Exercise):
            raise TypeError(f"exercises() takes Exercise objects, got {type(item).__name__}")
        if item.id in found:
            raise ValueError(f"exercise {item.id} is declared twice")
        found[item.id] = item
    chapters = {e.chapter for e in found.values()}
    if len(chapters) > 1:
        raise ValueError(f"one chapter's exercises, got chapters {sorted(chapters)}")
    return found


def parts_of(registry: dict) -> list:
    """A chapter's engine parts: every exercise's `parts`, in exercise order (the chapter's `PARTS`)."""
    return [part for exercise in registry.values() for part in exercise.parts]


def exercise_of(tag: str):
    """The Exercise `tag` ("E9.2") from its chapter's EXERCISES, or None if no chapter declares it."""
    m = re.fullmatch(r"E(\d+)\.(\d+)", str(tag))
    if m is None:
        return None
    import importlib
    try:
        module = importlib.import_module(f"nanovllm_course.ch{int(m.group(1)):02d}")
    except ImportError:
        return None
    return getattr(module, "EXERCISES", {}).get(tag)


# -- state a function keeps between calls (a mutable default argument, a module-level list) ----------------------
_CONTAINERS = (list, dict, set, bytearray)
_EMPTY = {list: "[]", dict: "{}", set: "set()"}


def _size(obj, depth: int = 2) -> int:
    """Items in a container, counting those of the containers inside it (two levels): a dict of lists grows too."""
    import collections
    if not isinstance(obj, _CONTAINERS + (collections.deque,)):
        return 0
    n = len(obj)
    if depth > 1:
        items = obj.values() if isinstance(obj, dict) else obj if not isinstance(obj, bytearray) else ()
        n += sum(_size(v, depth - 1) for v in items)
    return n


def _code_names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def held_state(fn) -> dict:
    """{where: items} of the mutable containers a function keeps from one call to the next: its default arguments
    (`added=[]` is made once, when `def` runs, and shared by every call), the variables of its closure, the
    module-level containers its code names, and attributes set on the function. Empty for other callables.
    Take it before and after a check's calls: a count that grew is state left behind (`check_no_state_kept`)."""
    import inspect
    fn = inspect.unwrap(fn) if callable(fn) else fn
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    out = {}
    params = [name for name, p in inspect.signature(fn).parameters.items()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for name, value in zip(params[len(params) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()):
        out[f"the default argument {name}={_EMPTY.get(type(value), type(value).__name__ + '()')}"] = _size(value)
    for name, value in (fn.__kwdefaults__ or {}).items():
        out[f"the default argument {name}={_EMPTY.get(type(value), type(value).__name__ + '()')}"] = _size(value)
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            out[f"the variable {name} of the enclosing function"] = _size(cell.cell_contents)
        except ValueError:                                   # an empty cell
            continue
    globs = getattr(fn, "__globals__", {})
    for name in sorted(_code_names(code)):
        value = globs.get(name)
        if isinstance(value, _CONTAINERS):
            out[f"the module-level {type(value).__name__} {name}"] = _size(value)
    for name, value in vars(fn).items() if hasattr(fn, "__dict__") else ():
        if isinstance(value, _CONTAINERS):
            out[f"the attribute {fn.__name__}.{name}"] = _size(value)
    return {k: v for k, v in out.items() if v or k.startswith("the default")}


def check_no_state_kept(tag: str, fn, before: dict, calls: int, what: str, hint: str | None = None) -> None:
    """Fail if a container `held_state(fn)` counts grew since `before` (taken before `calls` calls of fn). `what`
    says who calls the function how often (e.g. "the server calls it every tick")."""
    after = held_state(fn)
    grown = [(k, before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0)]
    if grown:
        where, was, now = grown[0]
        fail(tag, f"your function keeps state between calls: after {calls} calls {where} holds {now} items (it held "
                  f"{was}); {what}, so it grows without bound",
             hint or "a default argument such as added=[] is made once and shared by every call: write added=None and "
                     "added = [] inside (or just a local variable), and keep nothing outside the function")
