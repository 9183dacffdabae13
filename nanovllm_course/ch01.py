"""Checks for chapter 01, RMSNorm (reference: nanovllm_ref/layers/layernorm.py).

E1.1 `rms_norm(x, weight, eps) -> y`
E1.2 `fused_add_rms_norm(x, residual, weight, eps) -> (y, new_residual)`

Both are compared with `nanovllm_ref.layers.layernorm.RMSNorm` (weight and input in the same dtype, as in
the engine) on fresh random inputs: several hidden sizes (odd ones too), a row of zeros, a row of tiny
values where eps matters, fp32 and bf16.
Tolerances, |yours - reference| <= atol + rtol * |reference|:
    fp32: rtol 1e-5, atol 1e-6  (only the order of float operations may differ)
    bf16: rtol 2**-7 (= 0.0078, one bf16 rounding step), atol 1e-5
"""
import torch

from nanovllm_course.common import call_student, check_close, check_type, check_unchanged, fail, \
    fresh_generator, ok
from nanovllm_ref.layers.layernorm import RMSNorm, add_rms_norm, rms_norm

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-5)}
HIDDEN = (1, 7, 64, 576, 1000)
EPS = (1e-6, 1e-5)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference answer to E1.1, as a function (weight: [hidden], cast to x's dtype as the engine's
    RMSNorm module holds it). Pure tensor maths on x's device: a student's E1.2 may call it inside the
    engine, also while a CUDA graph is captured (so no module is built and no host tensor is copied)."""
    with torch.no_grad():
        return rms_norm(x, weight.to(x.dtype), eps)


def reference_fused_add_rms_norm(x, residual, weight, eps):
    """The reference answer to E1.2: (rms_norm(x + residual), x + residual)."""
    with torch.no_grad():
        return add_rms_norm(x, residual, weight.to(x.dtype), eps)


def _inputs(g: torch.Generator, hidden: int, dtype: torch.dtype, num_tokens: int):
    """x [num_tokens, hidden] with one all-zero row and one row of tiny values (|x| ~ 1e-4, so eps
    matters), the rest N(0, s^2) with a per-row scale s in [0.1, 10]; weight [hidden] in [0.5, 1.5)."""
    scale = torch.rand(num_tokens, 1, generator=g) * 9.9 + 0.1
    x = torch.randn(num_tokens, hidden, generator=g) * scale
    x[0] = 0.0
    x[1] *= 1e-4 / scale[1]
    weight = torch.rand(hidden, generator=g) + 0.5
    return x.to(dtype), weight.to(dtype)


def _cases(g):
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in HIDDEN:
            num_tokens = int(torch.randint(2, 20, (1,), generator=g))
            eps = EPS[int(torch.randint(0, len(EPS), (1,), generator=g))]
            yield dtype, hidden, num_tokens, eps


def check_rms_norm(rms_norm) -> None:
    """E1.1: `rms_norm(x, weight, eps)` must match RMSNorm.forward(x) (no residual)."""
    tag = "E1.1"
    g = fresh_generator()
    for dtype, hidden, num_tokens, eps in _cases(g):
        x, weight = _inputs(g, hidden, dtype, num_tokens)
        before = {"x": x.clone(), "weight": weight.clone()}
        expected = reference_rms_norm(x, weight, eps)
        with torch.no_grad():
            y = call_student(tag, rms_norm, x, weight, eps)
        where = f"x: [{num_tokens}, {hidden}] {str(dtype)[6:]}, eps={eps}"
        check_type(tag, y, torch.Tensor, "the result")
        check_unchanged(tag, before, {"x": x, "weight": weight})
        check_close(tag, y, expected, **TOL[dtype], what=f"rms_norm ({where})",
                    hint=_hint(dtype, y, expected))
    ok(tag)


def check_fused_add_rms_norm(fused_add_rms_norm) -> None:
    """E1.2: `fused_add_rms_norm(x, residual, weight, eps)` must return (rms_norm(x + residual),
    x + residual) like RMSNorm.forward(x, residual), and must not write into x or residual."""
    tag = "E1.2"
    g = fresh_generator()
    for dtype, hidden, num_tokens, eps in _cases(g):
        x, weight = _inputs(g, hidden, dtype, num_tokens)
        residual = (torch.randn(num_tokens, hidden, generator=g) * 2).to(dtype)
        residual[0] = 0.0                     # keep one row of zeros: x + residual = 0 there too
        before = {"x": x.clone(), "residual": residual.clone(), "weight": weight.clone()}
        expected_y, expected_r = reference_fused_add_rms_norm(x, residual, weight, eps)
        with torch.no_grad():
            result = call_student(tag, fused_add_rms_norm, x, residual, weight, eps)
        where = f"x, residual: [{num_tokens}, {hidden}] {str(dtype)[6:]}, eps={eps}"
        if not isinstance(result, tuple) or len(result) != 2:
            fail(tag, f"return a tuple (normed, new_residual); got {type(result).__name__}"
                      + (f" of length {len(result)}" if isinstance(result, tuple) else ""))
        y, r = result
        check_type(tag, y, torch.Tensor, "normed (first result)")
        check_type(tag, r, torch.Tensor, "new_residual (second result)")
        check_unchanged(tag, before, {"x": x, "residual": residual, "weight": weight})
        check_close(tag, r, expected_r, rtol=0, atol=0, what=f"new_residual ({where})",
                    hint="new_residual is x + residual, added in the input dtype; it is the residual "
                         "stream the next layer adds its output to (not the old residual)")
        # The hint follows what differs: the unrounded fp32 sum normalised, or something else.
        unrounded = reference_rms_norm(x.float() + residual.float(), weight.float(), eps).to(dtype)
        rounding = dtype != torch.float32 and torch.allclose(y.float(), unrounded.float(), **TOL[dtype]) \
            and not torch.allclose(y.float(), expected_y.float(), **TOL[dtype])
        check_close(tag, y, expected_y, **TOL[dtype], what=f"normed ({where})",
                    hint=("you normalised the fp32 sum before rounding it: round x + residual to the input "
                          "dtype first (that rounded sum is the new residual), then normalise it, as HF does"
                          if rounding else
                          "normed is rms_norm(x + residual): normalise the *sum*, not x alone"))
    ok(tag)


def _hint(dtype, y, expected) -> str:
    if not torch.isfinite(y.float()).all():
        return "a row of all zeros gives 0 / sqrt(0): add eps inside the square root"
    if dtype == torch.bfloat16:
        return ("compute mean(x^2) and the scaling in fp32 (x.float()), cast back to the input dtype "
                "before multiplying by weight")
    return "y = x / sqrt(mean(x^2 over the last dim) + eps) * weight; keep eps inside the square root"


# -- demo for the dtype section ---------------------------------------------------------------------------
def sequential_sum(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum the last dim one element at a time, rounding the running total to `dtype` after every add, as
    a naive kernel with a `dtype` accumulator does. values: [rows, n] -> [rows] fp32."""
    acc = torch.zeros(values.shape[:-1], dtype=dtype)
    v = values.to(dtype)
    for j in range(values.shape[-1]):
        acc = acc + v[..., j]
    return acc.float()


def accumulation_error(hidden_sizes, rows: int = 64, seed: int = 0) -> dict:
    """Median relative error of the RMS (sqrt(mean(x^2))) of N(0, 1) rows whose squares are summed with a
    bf16 running total vs an fp32 one; the exact value is computed in fp64."""
    g = torch.Generator().manual_seed(seed)
    out = {"hidden": list(hidden_sizes), "bf16": [], "fp32": []}
    for h in hidden_sizes:
        x = torch.randn(rows, h, generator=g, dtype=torch.float64).to(torch.bfloat16)
        sq = x.double() ** 2
        exact = (sq.sum(-1) / h).sqrt()
        for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            rms = (sequential_sum(sq, dt).double() / h).sqrt()
            out[name].append(((rms - exact).abs() / exact).median().item())
    return out


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402

EXERCISES = exercises(
    Exercise("E1.1", check_rms_norm, ("rms_norm",), (reference_rms_norm,), parts=(
        EnginePart("rms_norm", "rms_norm", "E1.1", check=lambda mod: check_rms_norm(mod.rms_norm)),)),
    Exercise("E1.2", check_fused_add_rms_norm, ("fused_add_rms_norm",), (reference_fused_add_rms_norm,), parts=(
        EnginePart("fused_add_rms_norm", "add_rms_norm", "E1.2",
                   check=lambda mod: check_fused_add_rms_norm(mod.fused_add_rms_norm)),)),
)
PARTS = parts_of(EXERCISES)
