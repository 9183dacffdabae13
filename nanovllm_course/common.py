"""What every check helper shares (course machinery).

A check helper compares a student's function with the reference on fresh random inputs. On success it
prints exactly one fixed line, `E<chapter>.<n> ok`, and nothing else (nbval compares printed output). On
failure it raises AssertionError with a teaching message: what differed, where, and a hint.
"""
import functools
import os
import tempfile
import warnings

import torch


def ok(tag: str) -> None:
    """Print the one success line of a check, e.g. `E4.1 ok`."""
    print(f"{tag} ok")


def fail(tag: str, message: str, hint: str | None = None):
    """Raise the AssertionError a student sees: `E4.1: <message>` plus a hint line."""
    text = f"{tag}: {message}"
    if hint:
        text += f"\n  hint: {hint}"
    raise AssertionError(text)


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
        fail(tag, f"not implemented yet ({exc})", "fill in the exercise cell above, run it, then run this check")


def fresh_generator(seed: int | None = None) -> torch.Generator:
    """A generator seeded from the OS unless `seed` is given: every check run draws new inputs."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return g


@functools.lru_cache(maxsize=None)
def tiny_model_dir(arch: str = "qwen3") -> str:
    """A tiny random checkpoint (+ tokenizer), made once per process in a temp folder."""
    from nanovllm_ref.tiny import make_tiny_model
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
