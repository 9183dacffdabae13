"""Checks for chapter 02, rotary position embedding (reference: nanovllm_ref/layers/rotary_embedding.py).

E2.1 `rope_cos_sin(head_dim, max_position, base) -> (cos, sin)`, each [max_position, head_dim // 2] fp32
E2.2 `apply_rope(positions, q, k, cos, sin) -> (q_rot, k_rot)`

E2.1 is compared with `RotaryEmbedding(head_dim, max_position, base).cos_sin_cache` (first half cos, second
half sin), |yours - reference| <= 1e-3: angles p * theta_i reach a few thousand radians, where fp32 keeps
only ~1e-4 of absolute precision, so formulas that round differently may differ by that much.
E2.2 is compared with `RotaryEmbedding.forward` and, in fp32, with Hugging Face's
`transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb` (cos/sin from `Qwen3RotaryEmbedding`):
    fp32: rtol 1e-5, atol 1e-5;  bf16: rtol 2e-2, atol 2e-2 (about two bf16 steps of |q| ~ 1).
    bf16 outputs must moreover be the exact rotation rounded once: within half a bf16 step of the fp64
    rotation of the same inputs, plus 1e-6 of the terms' size for fp32 round-off (`_check_single_rounding`).
    Arithmetic in bf16 (cos/sin cast to bf16, products and sums rounded) lands up to a few steps away.
Inputs: packed sequences whose positions restart at 0, decode-style scattered positions, one token,
head_dim from 2 to 128, grouped KV heads.
"""
import warnings

import torch

from nanovllm_course.common import call_student, check_close, check_type, check_unchanged, fail, \
    fresh_generator, ok, randint
from nanovllm_ref.layers.rotary_embedding import RotaryEmbedding

CACHE_ATOL = 1e-3
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
BASES = (10000.0, 1000000.0, 500000.0)


def reference_rope_cos_sin(head_dim: int, max_position: int, base: float):
    """The reference answer to E2.1: (cos, sin), each [max_position, head_dim // 2] fp32."""
    cache = RotaryEmbedding(head_dim, max_position, base).cos_sin_cache
    cos, sin = cache.chunk(2, dim=-1)
    return cos.contiguous(), sin.contiguous()


def reference_apply_rope(positions, q, k, cos, sin):
    """The reference answer to E2.2 (what RotaryEmbedding.forward does with a given cos/sin table)."""
    from nanovllm_ref.layers.rotary_embedding import apply_rotary
    c, s = cos[positions], sin[positions]
    return apply_rotary(q, c, s), apply_rotary(k, c, s)


def hf_apply_rope(positions, q, k, head_dim: int, max_position: int, base: float):
    """Hugging Face transformers' Qwen3 RoPE on engine-layout q [T, H, d], k [T, Hkv, d]."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb
    num_heads, num_kv = q.shape[1], k.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Qwen3Config(hidden_size=num_heads * head_dim, head_dim=head_dim, num_attention_heads=num_heads,
                          num_key_value_heads=num_kv, max_position_embeddings=max_position, rope_theta=base,
                          num_hidden_layers=1, intermediate_size=8, vocab_size=8)
        rope = Qwen3RotaryEmbedding(cfg)
    cos, sin = rope(q, positions[None])                              # [1, T, d] each
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin, unsqueeze_dim=1)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


# -- E2.1 ---------------------------------------------------------------------------------------------------
def check_rope_cos_sin(rope_cos_sin) -> None:
    """E2.1: `rope_cos_sin(head_dim, max_position, base)` must return the reference (cos, sin) table."""
    tag = "E2.1"
    g = fresh_generator()
    cases = [(2, 1, 10000.0), (8, 5, BASES[randint(g, 0, 2)]), (64, randint(g, 100, 600), 10000.0),
             (128, 4096, 1000000.0), (randint(g, 1, 24) * 2, randint(g, 1, 300), float(randint(g, 50, 20000)))]
    for head_dim, max_position, base in cases:
        where = f"head_dim={head_dim}, max_position={max_position}, base={base:g}"
        result = call_student(tag, rope_cos_sin, head_dim, max_position, base)
        if not isinstance(result, tuple) or len(result) != 2:
            fail(tag, f"return a tuple (cos, sin); got {type(result).__name__}")
        cos, sin = result
        check_type(tag, cos, torch.Tensor, "cos")
        check_type(tag, sin, torch.Tensor, "sin")
        exp_cos, exp_sin = reference_rope_cos_sin(head_dim, max_position, base)
        hint = _cache_hint(cos, exp_cos, head_dim)
        check_close(tag, cos, exp_cos, rtol=0, atol=CACHE_ATOL, what=f"cos ({where})", hint=hint)
        check_close(tag, sin, exp_sin, rtol=0, atol=CACHE_ATOL, what=f"sin ({where})", hint=hint)
    ok(tag)


def _cache_hint(cos, exp_cos, head_dim) -> str:
    if cos.shape == (exp_cos.shape[0], head_dim):
        return "one column per channel *pair*: shape [max_position, head_dim // 2], not head_dim"
    if cos.dtype != torch.float32:
        return "build the table in fp32 (torch.float32): it is shared by bf16 and fp32 models"
    return ("row p, column i holds cos(p * theta_i) with theta_i = base ** (-2i / head_dim), "
            "i = 0 .. head_dim/2 - 1, p = 0 .. max_position - 1 (row 0 is position 0)")


# -- E2.2 ---------------------------------------------------------------------------------------------------
def _positions(g, kind: str, max_position: int) -> torch.Tensor:
    if kind == "packed":                      # two prompts in one batch: positions restart at 0
        a, b = randint(g, 1, 9), randint(g, 1, 9)
        return torch.cat([torch.arange(a), torch.arange(b)])
    if kind == "decode":                      # one new token per running sequence, anywhere in the cache
        return torch.randint(0, max_position, (randint(g, 2, 7),), generator=g)
    if kind == "chunk":                       # the second chunk of a long prompt (chunked prefill)
        start = randint(g, 1, max_position - 20)
        return torch.arange(start, start + randint(g, 1, 19))
    return torch.tensor([randint(g, 0, max_position - 1)])     # "one": a single token


def check_apply_rope(apply_rope) -> None:
    """E2.2: `apply_rope(positions, q, k, cos, sin)` must rotate q and k like RotaryEmbedding.forward
    (and like HF's apply_rotary_pos_emb), leaving q and k unchanged."""
    tag = "E2.2"
    g = fresh_generator()
    max_position = 4096
    shapes = [(2, 1, 1), (8, 3, 1), (64, 4, 2), (128, 16, 8)]       # (head_dim, num_heads, num_kv_heads)
    kinds = ["packed", "decode", "chunk", "one"]
    for n, (head_dim, heads, kv_heads) in enumerate(shapes):
        base = BASES[n % len(BASES)]
        cos, sin = reference_rope_cos_sin(head_dim, max_position, base)
        for dtype in (torch.float32, torch.bfloat16):
            kind = kinds[(n + (dtype == torch.bfloat16)) % len(kinds)]
            positions = _positions(g, kind, max_position)
            t = positions.numel()
            if n == 2:         # q and k as the attention layer may hold them: views of one fused projection
                qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
                q = qkv[:, :heads * head_dim].view(t, heads, head_dim)
                k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
            else:
                q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
                k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
            before = {"q": q.clone(), "k": k.clone(), "positions": positions.clone(),
                      "cos": cos.clone(), "sin": sin.clone()}
            exp_q, exp_k = reference_apply_rope(positions, q, k, cos, sin)
            result = call_student(tag, apply_rope, positions, q, k, cos, sin)
            if not isinstance(result, tuple) or len(result) != 2:
                fail(tag, f"return a tuple (q_rot, k_rot); got {type(result).__name__}")
            q_rot, k_rot = result
            check_type(tag, q_rot, torch.Tensor, "q_rot")
            check_type(tag, k_rot, torch.Tensor, "k_rot")
            check_unchanged(tag, before, {"q": q, "k": k, "positions": positions, "cos": cos, "sin": sin})
            where = (f"{kind} positions {positions.tolist()[:8]}{'...' if t > 8 else ''}, q: {list(q.shape)} "
                     f"k: {list(k.shape)} {str(dtype)[6:]}")
            hint = _rope_hint(positions, q, q_rot, cos, sin)
            check_close(tag, q_rot, exp_q, **TOL[dtype], what=f"q_rot ({where})", hint=hint)
            check_close(tag, k_rot, exp_k, **TOL[dtype], what=f"k_rot ({where})",
                        hint="rotate k exactly like q (same positions, same cos/sin), per KV head")
            if dtype == torch.bfloat16:
                for name, x, x_rot in (("q_rot", q, q_rot), ("k_rot", k, k_rot)):
                    _check_single_rounding(tag, name, x, x_rot, cos[positions], sin[positions], where)
            if dtype == torch.float32:
                hf_q, hf_k = hf_apply_rope(positions, q, k, head_dim, max_position, base)
                check_close(tag, q_rot, hf_q, **TOL[dtype], what=f"q_rot vs Hugging Face ({where})", hint=hint)
                check_close(tag, k_rot, hf_k, **TOL[dtype], what=f"k_rot vs Hugging Face ({where})", hint=hint)
    ok(tag)


def _rope_hint(positions, q, q_rot, cos, sin) -> str:
    if not isinstance(q_rot, torch.Tensor) or q_rot.shape != q.shape:
        return "q_rot has the shape of q: [num_tokens, num_heads, head_dim]"
    if q.dtype == torch.float32 and q_rot.dtype == torch.float32:
        if q.shape[-1] >= 4 and torch.allclose(q_rot, _interleaved(q, cos[positions], sin[positions]), atol=1e-4):
            return ("you rotated neighbouring pairs (x0, x1), (x2, x3), ...; Qwen3/Llama checkpoints pair "
                    "channel i with channel i + head_dim/2 ('rotate half')")
        arange = torch.arange(positions.numel())
        if not torch.equal(arange, positions):
            from nanovllm_ref.layers.rotary_embedding import apply_rotary
            if torch.allclose(q_rot, apply_rotary(q, cos[arange], sin[arange]), atol=1e-4):
                return ("you used positions 0, 1, 2, ... instead of `positions`: tokens of a packed batch "
                        "do not sit at their index (use cos[positions], sin[positions])")
    return ("with x1, x2 = the first and second half of each head: out = (x1*cos - x2*sin, x2*cos + x1*sin), "
            "cos = cos[positions] broadcast over heads, computed in fp32 and cast back to q.dtype")


def _check_single_rounding(tag, name, x, x_rot, cos, sin, where) -> None:
    """Fail unless bf16 `x_rot` is the exact rotation of `x` rounded once to bf16: |x_rot - exact| <= half a
    bf16 step of `exact`, plus 1e-6 * (|x1 c| + |x2 s|) for fp32 round-off (which can cancel)."""
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    size = torch.cat((x1.abs() * c.abs() + x2.abs() * s.abs(),) * 2, dim=-1)
    _, exponent = torch.frexp(exact)                       # exact = m * 2**e, 0.5 <= |m| < 1
    half_step = torch.ldexp(torch.ones_like(exact), exponent - 9)   # bf16: 8 significant bits
    err = (x_rot.double() - exact).abs()
    bad = err > half_step + 1e-6 * size + 1e-30
    if bad.any():
        steps = (err / (2 * half_step)).max().item()
        fail(tag, f"{name} ({where}): {int(bad.sum())} of {bad.numel()} values are not the exact rotation rounded "
                  f"once to bf16 (up to {steps:.1f} bf16 steps away, where one rounding at the end is at most half "
                  "a step)",
             "compute in fp32 and cast back once: upcast x with .float() and keep cos/sin in fp32; bf16 "
             "arithmetic rounds every product and sum")


def _interleaved(x, cos, sin):
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return out.to(x.dtype)


# -- demos ----------------------------------------------------------------------------------------------------
def relative_position_demo(head_dim: int = 64, base: float = 10000.0, seed: int = 0) -> bool:
    """True if q.k after RoPE depends only on the distance between the two positions: the same pair of
    vectors at positions (3, 1) and (103, 101) gives the same score."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = reference_rope_cos_sin(head_dim, 256, base)
    q = torch.randn(1, 1, head_dim, generator=g)
    k = torch.randn(1, 1, head_dim, generator=g)
    scores = []
    for pq, pk in ((3, 1), (103, 101)):
        q_rot, _ = reference_apply_rope(torch.tensor([pq]), q, q[:, :1], cos, sin)
        k_rot, _ = reference_apply_rope(torch.tensor([pk]), k, k[:, :1], cos, sin)
        scores.append((q_rot * k_rot).sum().item())
    return abs(scores[0] - scores[1]) < 1e-4 * max(1.0, abs(scores[0]))


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402

EXERCISES = exercises(
    Exercise("E2.1", check_rope_cos_sin, ("rope_cos_sin",), (reference_rope_cos_sin,), parts=(
        EnginePart("rope_cos_sin", "rope_cos_sin", "E2.1", check=lambda mod: check_rope_cos_sin(mod.rope_cos_sin)),)),
    Exercise("E2.2", check_apply_rope, ("apply_rope",), (reference_apply_rope,), parts=(
        EnginePart("apply_rope", "rotary", "E2.2", check=lambda mod: check_apply_rope(mod.apply_rope)),)),
)
PARTS = parts_of(EXERCISES)
