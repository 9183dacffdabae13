"""The Triton kernels (chapter 06) against the pure-PyTorch reference back-end.

Runs anywhere: without CUDA, `nanovllm_ref.kernels` switches on the Triton interpreter, which executes the
kernels in numpy. That is slow, so sizes are tiny, but they are chosen to hit the edges: sequence lengths
that are not multiples of the tile (1, 5, 17, 33), block sizes 1, 3 and 4 (per-token gather path) and 16
(one block per tile), GQA groups 1, 2 and 4, block tables padded with -1, prefix-cached prefill (k_len > q_len),
more decode splits than tiles, and K/V that are strided views of a fused QKV projection.

Tolerances: fp32 atol = rtol = 1e-4 (same maths, different summation order); fp16 2e-3 and bf16 2e-2 (both
sides compute in fp32 and round the output to fp16/bf16, whose spacing is 2**-10 / 2**-7 relative). Attention
checks also bound the relative error norm ||got - ref|| / ||ref||: 1e-5 fp32, 1e-3 fp16, 8e-3 bf16.
"""
import inspect

import pytest
import torch

from nanovllm_ref.attn import torch_backend as ref
from nanovllm_ref.attn import triton_backend as tb
from nanovllm_ref.kernels import attention as kattn
from nanovllm_ref.kernels.store_kvcache import store_kvcache, store_kvcache_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Relative error norm ||got - expected|| / ||expected|| that each attention check also states and bounds.
REL_NORM = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def assert_attention_close(got, expected, dtype):
    torch.testing.assert_close(got, expected, **TOL[dtype])
    rel = ((got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()
    assert rel <= REL_NORM[dtype], f"relative error norm {rel:.2e} > {REL_NORM[dtype]:.0e} for {dtype}"


def _gen(seed):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def _fused_kv(g, num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """q, k, v as the attention layer sees them: strided views into one [N, (H + 2Hkv) * D] matrix."""
    qkv = _randn(g, num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))


def _paged_cache(g, context_lens, block_size, num_kv_heads, head_dim, dtype, pad_blocks=2):
    """Random caches with each sequence's blocks scattered over the cache, tables padded with -1."""
    needed = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(needed) + 3                              # a few blocks nobody owns
    k_cache = _randn(g, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = _randn(g, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(context_lens), max(needed) + pad_blocks), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        table[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    return k_cache, v_cache, table.to(DEVICE)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def test_triton_backend_has_the_reference_signatures():
    for name in ("varlen_prefill", "paged_prefill", "paged_decode"):
        assert inspect.signature(getattr(tb, name)) == inspect.signature(getattr(ref, name)), name
    assert tb.store_kvcache is store_kvcache


# ---------------------------------------------------------------------------------------------- store

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_store_kvcache_writes_strided_rows_to_their_slots_and_skips_minus_one(block_size, dtype):
    g = _gen(block_size)
    num_tokens, num_heads, num_kv_heads, head_dim, num_blocks = 7, 4, 2, 16, 9
    _, key, value = _fused_kv(g, num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(torch.int32)
    slots[[1, 4]] = -1                                       # padding rows of a CUDA-graph batch
    slots = slots.to(DEVICE)
    k_cache = _randn(g, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = _randn(g, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            k_ref.view(-1, num_kv_heads, head_dim)[s] = key[i]
            v_ref.view(-1, num_kv_heads, head_dim)[s] = value[i]
    k_torch, v_torch = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots)
    store_kvcache_torch(key, value, k_torch, v_torch, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)       # a copy: bit-exact
    assert torch.equal(k_torch, k_ref) and torch.equal(v_torch, v_ref)


def test_store_kvcache_with_every_slot_skipped_leaves_the_cache_untouched():
    g = _gen(1)
    key, value = _randn(g, 3, 2, 16), _randn(g, 3, 2, 16)
    k_cache, v_cache = _randn(g, 2, 4, 2, 16), _randn(g, 2, 4, 2, 16)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int32, device=DEVICE))
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


@pytest.mark.parametrize("store", [store_kvcache, store_kvcache_torch])
@pytest.mark.parametrize("case", ["value_shape", "cache_heads", "cache_head_dim", "slot_len", "slot_dtype",
                                  "dtype", "key_rank", "cache_pair"])
def test_store_kvcache_rejects_mismatched_arguments(store, case):
    key, value = torch.zeros(3, 2, 16), torch.zeros(3, 2, 16)
    k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    slots = torch.arange(3, dtype=torch.int32)
    if case == "value_shape":
        value = torch.zeros(3, 2, 8)
    elif case == "cache_heads":
        k_cache = v_cache = torch.zeros(2, 4, 4, 16)
    elif case == "cache_head_dim":
        k_cache = v_cache = torch.zeros(2, 4, 2, 32)
    elif case == "slot_len":
        slots = torch.arange(4, dtype=torch.int32)
    elif case == "slot_dtype":
        slots = slots.float()
    elif case == "dtype":
        k_cache = v_cache = k_cache.to(torch.bfloat16)
    elif case == "key_rank":
        key = value = torch.zeros(3, 32)
    elif case == "cache_pair":
        v_cache = torch.zeros(3, 4, 2, 16)
    with pytest.raises(ValueError):
        store(key, value, k_cache, v_cache, slots)


# ---------------------------------------------------------------------------------------------- decode

DECODE_CASES = [  # (block_size, group, head_dim, dtype, num_splits)
    (1, 1, 16, torch.float32, None),
    (4, 2, 32, torch.float32, 3),     # 3 splits of a 1-token sequence: empty splits must merge to nothing
    (16, 4, 16, torch.float32, 1),    # one split: the kernel writes the output directly, no merge
    (16, 2, 32, torch.bfloat16, 2),
    (4, 2, 16, torch.float16, 2),
    (4, 4, 16, torch.bfloat16, None),
    (3, 2, 16, torch.float32, 2),     # a block size that is not a power of two
]


# head_major: the default launch order (grid (Hkv, B, splits)) and the one kept for batches past 65,535.
@pytest.mark.parametrize("head_major", [None, False])
@pytest.mark.parametrize("block_size,group,head_dim,dtype,num_splits", DECODE_CASES)
def test_paged_decode_matches_reference_with_padded_block_tables(block_size, group, head_dim, dtype,
                                                                 num_splits, head_major):
    g = _gen(100 + block_size * 10 + group)
    num_kv_heads = 2
    context_lens = [1, 5, 17, 33]
    k_cache, v_cache, table = _paged_cache(g, context_lens, block_size, num_kv_heads, head_dim, dtype)
    assert (table == -1).any()
    q = _randn(g, len(context_lens), num_kv_heads * group, head_dim, dtype=dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    expected = ref.paged_decode(q, k_cache, v_cache, table, lens, scale)
    got = kattn.paged_decode(q, k_cache, v_cache, table, lens, scale, num_splits=num_splits, head_major=head_major)
    assert got.dtype == dtype and got.shape == q.shape
    assert_attention_close(got, expected, dtype)


def test_paged_decode_backend_wrapper_uses_the_kernel():
    g = _gen(7)
    context_lens = [9, 2]
    k_cache, v_cache, table = _paged_cache(g, context_lens, 4, 2, 16, torch.float32)
    q = _randn(g, 2, 4, 16)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    torch.testing.assert_close(tb.paged_decode(q, k_cache, v_cache, table, lens, 0.25),
                               ref.paged_decode(q, k_cache, v_cache, table, lens, 0.25), **TOL[torch.float32])


def test_paged_decode_padding_row_with_no_context_gives_zeros_not_nan():
    # CUDA-graph padding rows have context_len 0 and an all -1 block table; their output is discarded but
    # must not be NaN/inf (and the kernel must not read the -1 entries).
    g = _gen(8)
    k_cache, v_cache, table = _paged_cache(g, [6, 1], 4, 2, 16, torch.float32)
    table[1] = -1
    q = _randn(g, 2, 4, 16)
    lens = torch.tensor([6, 0], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out = kattn.paged_decode(q, k_cache, v_cache, table, lens, 0.25, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[:1], ref.paged_decode(q[:1], k_cache, v_cache, table[:1], lens[:1], 0.25),
                                   **TOL[torch.float32])


def test_decode_num_splits_fills_an_h200_at_batch_one_and_is_one_for_big_batches(monkeypatch):
    monkeypatch.setattr(kattn, "_num_sms", lambda index: 132)            # an H200, without a GPU
    cuda = torch.device("cuda", 0)
    assert 8 * kattn.decode_num_splits(1, 8, 4096, cuda) >= 132         # batch 1: every SM busy
    assert kattn.decode_num_splits(64, 8, 4096, cuda) == 1               # 512 programs: no split, no merge
    assert kattn.decode_num_splits(1, 8, 60, cuda) == 1                  # too short to be worth splitting
    assert kattn.decode_num_splits(1, 8, 512, cuda) == 8                 # one 64-token tile per split
    assert kattn.decode_num_splits(1, 1, 1 << 20, cuda) == kattn.MAX_SPLITS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_with_another_launch_matches_reference(dtype):
    """A launch with other tiles, warps and stages than the engine's (bench/kernels_round5.py sweeps them):
    32-key tiles over 16-token blocks, two tiles a block."""
    g = _gen(9)
    context_lens = [1, 31, 32, 33, 70]
    k_cache, v_cache, table = _paged_cache(g, context_lens, 16, 2, 32, dtype)
    q = _randn(g, len(context_lens), 4, 32, dtype=dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    got = kattn.paged_decode(q, k_cache, v_cache, table, lens, 32 ** -0.5, num_splits=1, block_n=32, num_warps=2,
                             num_stages=3)
    assert_attention_close(got, ref.paged_decode(q, k_cache, v_cache, table, lens, 32 ** -0.5), dtype)


# --------------------------------------------------------------------------------------------- prefill

PREFILL_CASES = [  # (block_size, group, head_dim, dtype)
    (1, 2, 16, torch.float32),
    (4, 1, 32, torch.float32),
    (16, 4, 16, torch.float32),
    (16, 2, 32, torch.bfloat16),
    (4, 2, 16, torch.bfloat16),
    (4, 2, 16, torch.float16),
    (3, 2, 16, torch.float32),        # a block size that is not a power of two
]


@pytest.mark.parametrize("block_size,group,head_dim,dtype", PREFILL_CASES)
def test_paged_prefill_with_cached_prefix_matches_reference(block_size, group, head_dim, dtype):
    g = _gen(200 + block_size * 10 + group)
    num_kv_heads = 2
    q_lens = [1, 5, 17, 33]
    k_lens = [1, 12, 17, 40]          # seq 0/2: no prefix; seq 1/3: 7 cached tokens (prefix or earlier chunk)
    k_cache, v_cache, table = _paged_cache(g, k_lens, block_size, num_kv_heads, head_dim, dtype)
    q = _randn(g, sum(q_lens), num_kv_heads * group, head_dim, dtype=dtype)
    args = (q, k_cache, v_cache, table, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens), head_dim ** -0.5)
    got = tb.paged_prefill(*args)
    assert got.dtype == dtype and got.shape == q.shape
    assert_attention_close(got, ref.paged_prefill(*args), dtype)


@pytest.mark.parametrize("group,head_dim,dtype", [(1, 16, torch.float32), (4, 32, torch.float32),
                                                  (2, 16, torch.bfloat16), (2, 16, torch.float16)])
def test_varlen_prefill_on_fused_qkv_views_matches_reference(group, head_dim, dtype):
    g = _gen(300 + group)
    num_kv_heads = 2
    lens = [5, 1, 33, 17]
    q, k, v = _fused_kv(g, sum(lens), num_kv_heads * group, num_kv_heads, head_dim, dtype)
    cu = _cu(lens)
    args = (q, k, v, cu, cu, max(lens), max(lens), head_dim ** -0.5)
    got = tb.varlen_prefill(*args)
    assert_attention_close(got, ref.varlen_prefill(*args), dtype)


def test_varlen_prefill_takes_a_benchmark_launch_and_refuses_a_bad_one():
    """varlen_prefill's launch override (bench/kernels_round14.py): another tile shape gives the same attention
    within the dtype's tolerance; a launch that is not four positive ints (tiles and warps powers of two) is
    refused by name, also for an empty batch."""
    g = _gen(404)
    lens = [5, 1, 33, 17]
    q, k, v = _fused_kv(g, sum(lens), 4, 2, 16, torch.float32)
    cu = _cu(lens)
    args = (q, k, v, cu, cu, max(lens), max(lens), 0.25)
    assert_attention_close(kattn.varlen_prefill(*args, launch=(32, 16, 4, 1)), ref.varlen_prefill(*args), torch.float32)
    for bad in [(16, 16, 4), (16, 24, 4, 1), (16, 16, 4, 0), [16, 16, 4, 1], (16, 16, True, 1)]:
        with pytest.raises(ValueError, match="launch must be"):
            kattn.varlen_prefill(*args, launch=bad)
    empty = torch.zeros(0, 4, 16)
    with pytest.raises(ValueError, match="launch must be"):
        kattn.varlen_prefill(empty, empty[:, :2], empty[:, :2], _cu([]), _cu([]), 0, 0, 0.25, launch=(3, 16, 4, 1))
