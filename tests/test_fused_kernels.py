"""The decode step's fused Triton kernels (nanovllm_ref/kernels/{rms_norm,qk_norm_rope_store,small_gemm}.py)
against the PyTorch reference ops they replace.

Without CUDA they run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so sizes are
tiny but awkward: one token, hidden sizes and head sizes that are not powers of two (72, 576, head_dim 24),
GEMM sides that are not multiples of the tile, qkv rows that are strided views, slot -1 rows, slot 0 and
slots on both sides of a block boundary, split-K partials with a ragged last split.

Tolerances (stated per dtype):
- fp32: atol = rtol = 1e-5 for norms, RoPE and the store; 1e-4 for GEMMs (the same products summed in
  another order);
- bf16: every value within one unit in the last place of bf16 (rtol 2**-7, atol 1e-6): the kernels round
  where the reference rounds, so only the order of fp32 sums differs, and it may flip a rounding. At
  least 95 % of the values must be bit-identical.
"""
import pytest
import torch
import torch.nn.functional as F

from nanovllm_ref.attn.torch_backend import store_kvcache_torch
from nanovllm_ref.kernels import qk_norm_rope_store as k2
from nanovllm_ref.kernels import rms_norm as k1
from nanovllm_ref.kernels import small_gemm
from nanovllm_ref.kernels.small_gemm import GemmConfig, choose_config
from nanovllm_ref.layers.activation import silu_and_mul
from nanovllm_ref.layers.layernorm import add_rms_norm, rms_norm
from nanovllm_ref.layers.rotary_embedding import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-6, rtol=2 ** -7)}
GEMM_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1e-6, rtol=2 ** -7)}


def assert_matches(got, expected, dtype, tol=TOL):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **tol[dtype])
    if dtype == torch.bfloat16 and got.numel() >= 64:
        same = (got == expected).float().mean().item()
        assert same >= 0.95, f"only {same:.1%} of the bf16 values are bit-identical to the reference"


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# -- 1. residual add + RMSNorm (kernels/rms_norm.py) --------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 72, 576])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_add_rms_norm_matches_reference_add_rms_norm(dtype, hidden, num_tokens):
    g = gen(hidden + num_tokens)
    x, residual = randn(g, num_tokens, hidden, dtype=dtype), randn(g, num_tokens, hidden, dtype=dtype)
    weight = randn(g, hidden, dtype=dtype, scale=0.5) + 1
    out, h = k1.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_h = add_rms_norm(x, residual, weight, 1e-6)
    assert_matches(h, ref_h, dtype)
    assert_matches(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_rms_norm_returns_x_itself_as_the_residual(dtype):
    g = gen(1)
    x, weight = randn(g, 2, 72, dtype=dtype), randn(g, 72, dtype=dtype) + 1
    out, h = k1.add_rms_norm(x, None, weight, 1e-5)
    assert h is x
    assert_matches(out, rms_norm(x, weight, 1e-5), dtype)
    assert_matches(k1.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_parts", [1, 3])
def test_add_rms_norm_sums_split_k_partials_as_the_gemm_output_would(dtype, num_parts):
    """x as split-K partials [S, T, D] fp32: summed, rounded to the model dtype (what a GEMM writes), then
    the reference add + RMSNorm."""
    g = gen(num_parts)
    partials = randn(g, num_parts, 2, 72)
    residual, weight = randn(g, 2, 72, dtype=dtype), randn(g, 72, dtype=dtype) + 1
    out, h = k1.add_rms_norm(partials, residual, weight, 1e-6)
    ref_out, ref_h = add_rms_norm(partials.sum(0).to(dtype), residual, weight, 1e-6)
    assert_matches(h, ref_h, dtype)
    assert_matches(out, ref_out, dtype)


def test_add_rms_norm_reads_strided_rows():
    g = gen(2)
    wide = randn(g, 3, 100)
    x, residual, weight = wide[:, :72], randn(g, 3, 72), randn(g, 72)
    assert not x.is_contiguous()
    out, h = k1.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_h = add_rms_norm(x, residual, weight, 1e-6)
    assert_matches(out, ref_out, torch.float32)
    assert_matches(h, ref_h, torch.float32)


@pytest.mark.parametrize("make, match", [
    (lambda: (torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8)), "residual must be"),
    (lambda: (torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(4)), "weight must be"),
    (lambda: (torch.zeros(2, 2, 8, dtype=torch.bfloat16), torch.zeros(2, 8), torch.ones(8)), "float32"),
    (lambda: (torch.zeros(8), None, torch.ones(8)), "x must be"),
    (lambda: (torch.zeros(8, 2).t(), None, torch.ones(8)), "stride"),
])
def test_add_rms_norm_refuses_bad_shapes_by_name(make, match):
    x, residual, weight = make()
    with pytest.raises(ValueError, match=match):
        k1.add_rms_norm(x.to(DEVICE), None if residual is None else residual.to(DEVICE), weight.to(DEVICE), 1e-6)


# -- 2. q/k-norm + RoPE + KV store (kernels/qk_norm_rope_store.py) ------------------------------------------

def _reference_qk_norm_rope_store(qkv, positions, rope, q_w, k_w, eps, k_cache, v_cache, slots, h, hkv, d):
    """The general route of models/qwen3.DecoderAttention: split, per-head RMSNorm, RoPE, torch store."""
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(-1, h, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    if q_w is not None:
        q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    q, k = rope(positions, q, k)
    store_kvcache_torch(k, v, k_cache, v_cache, slots)
    return q


# (heads, kv heads, head_dim, q/k norm, rope scaling): Qwen3-like GQA; Llama-like without norm, head_dim 24
# (half 12: not a power of two), one KV head; linear-scaled RoPE tables.
QK_SHAPES = [(4, 2, 16, True, None), (3, 1, 24, False, None), (2, 2, 16, True, {"rope_type": "linear", "factor": 2.0}),
             (16, 8, 8, True, None)]


# Head rows a program owns: the default (8), one row, a tile that straddles the q | k boundary (2 rows with 3 q
# heads), and all of a token's rows in one program (32). QK_SHAPES' last shape has Qwen3-0.6B's 32 rows (16 q,
# 8 k, 8 v heads), so the default splits a token over 4 programs there.
@pytest.mark.parametrize("block_rows", [None, 1, 2, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, qk_norm, scaling", QK_SHAPES)
def test_qk_norm_rope_store_matches_norm_rope_and_store(dtype, heads, kv_heads, head_dim, qk_norm, scaling,
                                                        block_rows):
    g = gen(heads * head_dim)
    block_size, num_blocks, max_pos = 4, 3, 64
    rope = RotaryEmbedding(head_dim, max_pos, 10000.0, scaling).to(DEVICE)
    width = (heads + 2 * kv_heads) * head_dim
    # qkv rows are strided (a view into a wider buffer), as q/k/v are column slices of one projection.
    qkv = randn(g, 6, width + 8, dtype=dtype)[:, :width]
    # Slot 0, -1 (a graph's padding row), the last slot of block 0 and the first of block 1, the last slot.
    slots = torch.tensor([0, -1, 3, 4, 11, 7], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([0, 5, 63, 1, 17, 2], device=DEVICE)
    weights = (randn(g, head_dim, dtype=dtype) + 1, randn(g, head_dim, dtype=dtype) + 1) if qk_norm else (None, None)
    # Caches start as random values: every slot not in the mapping (and the -1 row) must keep them.
    k_cache = randn(g, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = randn(g, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q = k2.qk_norm_rope_store(qkv, positions, rope.cos_sin_cache, *weights, 1e-6, k_cache, v_cache, slots,
                              heads, kv_heads, head_dim, block_rows=block_rows)
    ref_q = _reference_qk_norm_rope_store(qkv, positions, rope, *weights, 1e-6, ref_k, ref_v, slots,
                                          heads, kv_heads, head_dim)
    assert_matches(q, ref_q, dtype)
    assert_matches(k_cache, ref_k, dtype)
    assert torch.equal(v_cache, ref_v), "v must be copied unchanged into its slots, and nothing else written"


@pytest.mark.parametrize("block_rows", [None, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, qk_norm, scaling", QK_SHAPES)
def test_qk_norm_rope_without_the_store_matches_norm_and_rope(dtype, heads, kv_heads, head_dim, qk_norm, scaling,
                                                              block_rows):
    """The prefill form: q and k returned (k [T, Hkv, d], not into a cache), v left to the caller."""
    g = gen(7 * heads + head_dim)
    rope = RotaryEmbedding(head_dim, 64, 10000.0, scaling).to(DEVICE)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = randn(g, 5, width + 8, dtype=dtype)[:, :width]
    positions = torch.tensor([0, 5, 63, 1, 17], device=DEVICE)
    weights = (randn(g, head_dim, dtype=dtype) + 1, randn(g, head_dim, dtype=dtype) + 1) if qk_norm else (None, None)
    q, k = k2.qk_norm_rope(qkv, positions, rope.cos_sin_cache, *weights, 1e-6, heads, kv_heads, head_dim,
                           block_rows=block_rows)
    ref_q, ref_k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    ref_q, ref_k = ref_q.reshape(5, heads, head_dim), ref_k.reshape(5, kv_heads, head_dim)
    if qk_norm:
        ref_q, ref_k = rms_norm(ref_q, weights[0], 1e-6), rms_norm(ref_k, weights[1], 1e-6)
    ref_q, ref_k = rope(positions, ref_q, ref_k)
    assert q.shape == (5, heads, head_dim) and k.shape == (5, kv_heads, head_dim) and k.dtype == dtype
    assert_matches(q, ref_q, dtype)
    assert_matches(k, ref_k, dtype)


def test_qk_norm_rope_refuses_split_k_partials_and_bad_arguments_by_name():
    args = _qk_args()
    common = dict(positions=args["positions"], cos_sin_cache=args["cos_sin_cache"], q_weight=args["q_weight"],
                  k_weight=args["k_weight"], eps=1e-6, num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="partials"):
        k2.qk_norm_rope(torch.zeros(2, 2, 64, device=DEVICE), **common)
    with pytest.raises(ValueError, match="columns"):
        k2.qk_norm_rope(torch.zeros(2, 60, device=DEVICE), **common)
    with pytest.raises(ValueError, match="positions"):
        k2.qk_norm_rope(torch.zeros(2, 64, device=DEVICE), **{**common, "positions": args["positions"][:1]})


def test_qk_norm_rope_store_sums_split_k_partials():
    g = gen(5)
    heads, kv_heads, head_dim = 4, 2, 16
    rope = RotaryEmbedding(head_dim, 32, 10000.0).to(DEVICE)
    partials = randn(g, 3, 2, (heads + 2 * kv_heads) * head_dim)
    slots = torch.tensor([2, 5], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([3, 9], device=DEVICE)
    weights = randn(g, head_dim) + 1, randn(g, head_dim) + 1
    k_cache = torch.zeros(2, 4, kv_heads, head_dim, device=DEVICE)
    v_cache, ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(k_cache), torch.zeros_like(k_cache)
    q = k2.qk_norm_rope_store(partials, positions, rope.cos_sin_cache, *weights, 1e-6, k_cache, v_cache, slots,
                              heads, kv_heads, head_dim)
    ref_q = _reference_qk_norm_rope_store(partials.sum(0), positions, rope, *weights, 1e-6, ref_k, ref_v, slots,
                                          heads, kv_heads, head_dim)
    assert_matches(q, ref_q, torch.float32)
    assert_matches(k_cache, ref_k, torch.float32)
    assert_matches(v_cache, ref_v, torch.float32)


def _qk_args(**changes):
    args = dict(qkv=torch.zeros(2, 64), positions=torch.zeros(2, dtype=torch.long), cos_sin_cache=torch.zeros(8, 8),
                q_weight=torch.ones(8), k_weight=torch.ones(8), eps=1e-6, k_cache=torch.zeros(2, 4, 2, 8),
                v_cache=torch.zeros(2, 4, 2, 8), slot_mapping=torch.zeros(2, dtype=torch.int32), num_heads=4,
                num_kv_heads=2, head_dim=8)
    args.update(changes)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("changes, match", [
    (dict(qkv=torch.zeros(2, 60)), "columns"),
    (dict(k_weight=None), "both"),
    (dict(k_cache=torch.zeros(2, 4, 1, 8), v_cache=torch.zeros(2, 4, 1, 8)), "k_cache and v_cache"),
    (dict(k_cache=torch.zeros(4, 2, 2, 8).transpose(0, 1)), "contiguous"),
    (dict(slot_mapping=torch.zeros(3, dtype=torch.int32)), "slot_mapping"),
    (dict(cos_sin_cache=torch.zeros(8, 8, dtype=torch.float64)), "cos_sin_cache"),
    (dict(qkv=torch.zeros(2, 64, dtype=torch.bfloat16)), "dtype"),
    (dict(block_rows=3), "block_rows"),
    (dict(block_rows=0), "block_rows"),
])
def test_qk_norm_rope_store_refuses_bad_arguments_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        k2.qk_norm_rope_store(**_qk_args(**changes))


# -- 2b. SiLU-and-mul after cuBLAS (kernels/silu_mul.py) ---------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("tokens, d", [(5, 24), (3, 1100), (1, 8)])
def test_silu_and_mul_kernel_matches_the_reference(dtype, tokens, d):
    """d 1,100: two column blocks, the second partial; d 24: one block wider than the row; strided rows."""
    from nanovllm_ref.kernels import silu_mul
    from nanovllm_ref.layers.activation import silu_and_mul as reference
    g = gen(tokens * 1000 + d)
    x = randn(g, tokens, 2 * d + 8, dtype=dtype, scale=3.0)[:, :2 * d]
    assert_matches(silu_mul.silu_and_mul(x), reference(x), dtype, tol={**TOL, torch.float16: dict(atol=1e-6, rtol=2 ** -10)})


def test_silu_and_mul_kernel_refuses_bad_arguments_by_name():
    from nanovllm_ref.kernels import silu_mul
    with pytest.raises(ValueError, match="even"):
        silu_mul.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[T, 2 \* d\]"):
        silu_mul.silu_and_mul(torch.zeros(2, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul.silu_and_mul(torch.zeros(8, 2, device=DEVICE).t())
    assert silu_mul.silu_and_mul(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)


# -- 3. small-M GEMM (kernels/small_gemm.py) ----------------------------------------------------------------

def _reference_linear(x, w, b):
    """F.linear in fp32, rounded once to the model dtype (what cuBLAS computes)."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


# M = 1 and 3 take the dot-free GEMV by default, 5 and 16 the tl.dot path; N = 80 and K = 72 are not
# multiples of the tiles.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_f_linear(dtype, m, bias):
    g = gen(m)
    x, w = randn(g, m, 72, dtype=dtype), randn(g, 80, 72, dtype=dtype, scale=0.2)
    b = randn(g, 80, dtype=dtype) if bias else None
    assert_matches(small_gemm.linear(x, w, b), _reference_linear(x, w, b), dtype, GEMM_TOL)


@pytest.mark.parametrize("config", [
    GemmConfig(block_m=16, block_n=16, block_k=16, use_dot=True),          # tl.dot at M=1 (padded to 16)
    GemmConfig(block_m=8, block_n=32, block_k=64, use_dot=False),          # GEMV at M=5 (rows 5..7 idle)
    GemmConfig(block_m=8, block_n=16, block_k=128, use_dot=False),         # one K step longer than K
])
def test_small_linear_with_explicit_configs(config):
    g = gen(7)
    m = 1 if config.use_dot else 5
    x, w = randn(g, m, 72), randn(g, 48, 72)
    assert_matches(small_gemm.linear(x, w, config=config), _reference_linear(x, w, None), torch.float32, GEMM_TOL)


def test_small_linear_reads_strided_rows_of_x():
    g = gen(8)
    x = randn(g, 2, 100)[:, :72]
    w = randn(g, 40, 72)
    assert_matches(small_gemm.linear(x, w), _reference_linear(x, w, None), torch.float32, GEMM_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, config", [
    (1, GemmConfig(block_m=1, block_n=16, block_k=16, split_k=3)),      # K=72: splits of 32, 32 and a ragged 8
    (4, GemmConfig(block_m=16, block_n=16, block_k=16, split_k=2, use_dot=True)),
    (2, None),                                                          # the default choice
])
def test_split_k_partials_sum_to_the_linear_output_with_bias_added_once(dtype, m, config):
    g = gen(m + 10)
    x, w, b = randn(g, m, 72, dtype=dtype), randn(g, 40, 72, dtype=dtype, scale=0.2), randn(g, 40, dtype=dtype)
    partials = small_gemm.linear_partials(x, w, b, config=config)
    used = config or choose_config(m, 40, 72, "partials")
    assert partials.dtype == torch.float32 and partials.shape == (used.num_splits(72), m, 40)
    if config is not None:
        assert partials.shape[0] == 3 if config.split_k == 3 else partials.shape[0] == 2
    exact = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(partials.double().sum(0), exact, atol=1e-4, rtol=1e-4)
    if partials.shape[0] > 1:      # the bias sits in split 0 only, so no later split carries it
        no_bias = small_gemm.linear_partials(x, w, None, config=config)
        torch.testing.assert_close(partials[1:], no_bias[1:], atol=0, rtol=0)
        torch.testing.assert_close(partials[0] - no_bias[0], b.float().expand(m, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_with_silu_epilogue_matches_gemm_then_silu_and_mul(dtype, m, bias):
    g = gen(m + 20)
    x, w = randn(g, m, 72, dtype=dtype), randn(g, 2 * 40, 72, dtype=dtype, scale=0.2)
    b = randn(g, 80, dtype=dtype) if bias else None
    got = small_gemm.linear_silu_mul(x, w, b)
    assert got.shape == (m, 40)
    assert_matches(got, silu_and_mul(_reference_linear(x, w, b)), dtype, GEMM_TOL)


# More rows than one tile (small_gemm.TILE_M = 64): the rows are cut into tiles along grid axis 2, and every
# form must still give each row its own output (a kernel that ignored the row tile would repeat tile 0).
@pytest.mark.parametrize("m", [65, 130])
def test_rows_beyond_one_tile_take_row_tiles_in_every_form(m):
    g = gen(m + 30)
    x, w, b = randn(g, m, 72), randn(g, 80, 72, scale=0.2), randn(g, 80)
    cfg = choose_config(m, 80, 72, "full")
    assert cfg.use_dot and cfg.block_m == small_gemm.TILE_M < m
    assert_matches(small_gemm.linear(x, w, b), _reference_linear(x, w, b), torch.float32, GEMM_TOL)
    partials = small_gemm.linear_partials(x, w, b)
    torch.testing.assert_close(partials.double().sum(0), F.linear(x.double(), w.double(), b.double()),
                               atol=1e-4, rtol=1e-4)
    assert_matches(small_gemm.linear_silu_mul(x, w, b), silu_and_mul(_reference_linear(x, w, b)), torch.float32,
                   GEMM_TOL)


# Round 13: the first K step's weight tile is loaded before the PDL wait (GemmConfig.preload). Same tiles, same
# order: every form must give the loads-after-the-wait kernel's outputs bit for bit, with one K step or several,
# a ragged last step, K splits and the SiLU epilogue's second (up) tile.
@pytest.mark.parametrize("form", ["full", "partials", "silu"])
@pytest.mark.parametrize("m, config", [
    (1, GemmConfig(block_m=1, block_n=16, block_k=32, split_k=2)),            # GEMV, 3 K steps, ragged last
    (1, GemmConfig(block_m=1, block_n=16, block_k=128)),                      # GEMV, one K step only
    (6, GemmConfig(block_m=16, block_n=16, block_k=16, split_k=3, use_dot=True)),
])
def test_preloading_the_first_weight_tile_changes_no_value(form, m, config):
    import dataclasses
    g = gen(m + 40)
    x, w, b = randn(g, m, 72, dtype=torch.bfloat16), randn(g, 80, 72, dtype=torch.bfloat16, scale=0.2), None
    fn = {"full": small_gemm.linear, "partials": small_gemm.linear_partials, "silu": small_gemm.linear_silu_mul}[form]
    if form == "silu":
        b = randn(g, 80, dtype=torch.bfloat16)
    after = fn(x, w, b, config=dataclasses.replace(config, preload=False))
    before = fn(x, w, b, config=dataclasses.replace(config, preload=True))
    early = fn(x, w, b, config=dataclasses.replace(config, preload=True, launch_early=True))
    torch.testing.assert_close(before, after, atol=0, rtol=0)
    torch.testing.assert_close(early, after, atol=0, rtol=0)
    if form == "full":         # and the preloading kernel is still the GEMM
        assert_matches(before, _reference_linear(x, w, None), torch.bfloat16, GEMM_TOL)




@pytest.mark.parametrize("call, error, match", [
    (lambda: GemmConfig(block_m=1, block_n=16, block_k=16, launch_early=True), ValueError,
     "launch_early needs preload"),
    (lambda: GemmConfig(block_m=1, block_n=16, block_k=16, preload=1), TypeError, "preload must be a bool"),
    (lambda: GemmConfig(block_m=1, block_n=16, block_k=16, launch_early="yes"), TypeError, "launch_early"),
])
def test_gemm_config_refuses_bad_preload_options_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: small_gemm.linear(torch.zeros(0, 8), torch.zeros(4, 8)), "1 <= M <= 512"),
    (lambda: small_gemm.linear(torch.zeros(513, 8), torch.zeros(4, 8)), "F.linear"),
    (lambda: small_gemm.linear(torch.zeros(2, 8), torch.zeros(4, 6)), "x must be"),
    (lambda: small_gemm.linear(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.bfloat16)), "dtype"),
    (lambda: small_gemm.linear_silu_mul(torch.zeros(2, 8), torch.zeros(5, 8)), "even"),
    (lambda: small_gemm.linear(torch.zeros(5, 8), torch.zeros(4, 8), config=GemmConfig(4, 16, 16)), "block_m"),
    (lambda: GemmConfig(block_m=3, block_n=16, block_k=16), "power of two"),
    (lambda: GemmConfig(block_m=4, block_n=16, block_k=16, split_k=0), "split_k"),
    (lambda: choose_config(2, 8, 8, "sideways"), "kind"),
])
def test_small_gemm_refuses_bad_arguments_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_dot_tiles_under_16_are_refused_on_a_gpu(monkeypatch):
    """tl.dot needs every tile side >= 16 when compiled (the interpreter accepts smaller)."""
    monkeypatch.setattr(small_gemm, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="tiles >= 16"):
        small_gemm.linear(torch.zeros(2, 8), torch.zeros(4, 8), config=GemmConfig(4, 16, 16, use_dot=True))


QWEN3_0_6B = {"qkv": (4096, 1024, "full"), "o_proj": (1024, 2048, "partials"),
              "gate_up": (6144, 1024, "silu"), "down": (1024, 3072, "partials")}


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32, 48, 64])
@pytest.mark.parametrize("name", sorted(QWEN3_0_6B))
def test_default_configs_fill_an_h200_with_programs(name, m):
    """At every captured decode batch size each Qwen3-0.6B projection launches at least one program per SM
    of an H200 (132), at most 4 per SM, with tiles a GPU's tl.dot accepts. The SiLU and partial-sums forms at 2-64
    rows are the exception, by measurement: about one program an SM (96 of 32 columns for gate_up, 128-160 for
    o_proj and down) beat two in the decode GEMM chain by 0.3-3.8 us a layer
    (bench/results/kernels_round11_h100_2026-12-06.json)."""
    n, k, kind = QWEN3_0_6B[name]
    cfg = choose_config(m, n, k, kind, sms=132)
    n_out = n // 2 if kind == "silu" else n
    programs = -(-n_out // cfg.block_n) * (cfg.num_splits(k) if kind == "partials" else 1)
    low = 96 if kind != "full" and cfg.use_dot else 132
    assert low <= programs <= 4 * 132, (cfg, programs)
    assert cfg.block_m >= m
    assert cfg.use_dot == (m > small_gemm.GEMV_MAX_M)
    if cfg.use_dot:
        assert min(cfg.block_m, cfg.block_n, cfg.block_k) >= 16
    if kind == "partials":
        assert cfg.num_splits(k) > 1, "narrow N needs split-K to have enough programs"


def test_o_proj_at_batch_1_is_a_gemv_with_four_splits():
    """The worked example of choose_config's docstring."""
    cfg = choose_config(1, 1024, 2048, "partials", sms=132)
    assert (cfg.block_m, cfg.block_n, cfg.use_dot, cfg.k_per_split(2048), cfg.num_splits(2048)) == (1, 16, False, 512, 4)


def test_warm_batch_sizes_meet_every_variant_once():
    sizes = small_gemm.warm_batch_sizes(64)
    assert sizes == [1, 2, 17, 33]          # GEMV at M=1, tl.dot with BLOCK_M 16, 32, 64
    variants = {(choose_config(m, 1024, 2048, "partials").block_m, choose_config(m, 1024, 2048).use_dot)
                for m in range(1, 65)}
    assert len(variants) == len(sizes)


@pytest.mark.parametrize("name", sorted(QWEN3_0_6B))
def test_one_row_takes_its_whole_k_range_in_one_preloaded_step(name):
    """Round 13: at one row (the GEMV) each program's K range is one step, loaded before the PDL wait; with tl.dot
    (2-64 rows and the row tiles above) the preload made the chain slower and stays off. Never an early launch."""
    n, k, kind = QWEN3_0_6B[name]
    cfg = choose_config(1, n, k, kind, sms=132)
    assert cfg.preload and not cfg.launch_early and not cfg.use_dot
    assert cfg.block_k >= cfg.k_per_split(k) and cfg.block_k <= 1024, cfg
    assert {"qkv": 1, "gate_up": 1, "o_proj": 4, "down": 3}[name] == (cfg.num_splits(k) if kind == "partials" else 1)
    for m in (2, 16, 64, 65, 512):
        cfg = choose_config(m, n, k, kind, sms=132)
        assert not cfg.preload and not cfg.launch_early, (m, cfg)
    # a K too long for one tile of registers keeps several steps (and still preloads the first)
    long_k = choose_config(1, 4096, 8192, "full", sms=132)
    assert long_k.preload and long_k.block_k == 512
