"""Back-end selection, and the FlashAttention adapter's argument mapping for each implementation it takes.

No FlashAttention is installed here, so stand-in modules with the signatures of the three (the flash-attn
package's FA2 API, vLLM's `vllm.vllm_flash_attn`, flash-attn-4's `flash_attn.cute`), computed by the torch
back-end, check that the adapter hands every argument to the right place and reshapes the results back.
Each stand-in also asserts the rules of the real one (FA3: a block table goes with seqused_k and no
cu_seqlens_k; decode's max_seqlen_k a host int, so no device sync inside a CUDA graph)."""
import sys
import types

import pytest
import torch

import nanovllm_ref.attn as attn
from nanovllm_ref.attn import flash_backend
from nanovllm_ref.attn import torch_backend as ref

H, HKV, D, BS = 4, 2, 16, 4


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _paged(q, k_cache, v_cache, table, cu_q, seqused_k, max_q, scale):
    """Reference for a paged call given per-sequence key counts."""
    cu_k = _cu(seqused_k.tolist())
    return ref.paged_prefill(q, k_cache, v_cache, table, cu_q, cu_k, max_q, int(seqused_k.max()), scale)


def fa2_module(calls):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, block_table=None):
        assert causal is True
        calls.append("varlen" if block_table is None else "varlen_paged")
        if block_table is None:
            return ref.varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
        return ref.paged_prefill(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale)

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                                causal=False):
        assert q.dim() == 4 and q.shape[1] == 1, "decode queries go in as [batch, 1, heads, head_dim]"
        calls.append("kvcache")
        return ref.paged_decode(q[:, 0], k_cache, v_cache, block_table, cache_seqlens, softmax_scale)[:, None]

    m = types.ModuleType("flash_attn")
    m.flash_attn_varlen_func, m.flash_attn_with_kvcache, m.__version__ = (flash_attn_varlen_func,
                                                                          flash_attn_with_kvcache, "2.8.3")
    return {"flash_attn": m}


def fa3_modules(calls):
    def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                               q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, block_table=None,
                               fa_version=2):
        assert causal is True and fa_version == 3
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int), "host ints: no device sync"
        if block_table is None:
            calls.append("varlen")
            return ref.varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
        assert cu_seqlens_k is None and seqused_k is not None, "a block table takes seqused_k, not cu_seqlens_k"
        assert seqused_k.dtype == torch.int32 and q.dim() == 3
        calls.append(("paged", max_seqlen_q, max_seqlen_k))
        return _paged(q, k, v, block_table, cu_seqlens_q, seqused_k, max_seqlen_q, softmax_scale)

    pkg, sub = types.ModuleType("vllm"), types.ModuleType("vllm.vllm_flash_attn")
    pkg.__version__, pkg.vllm_flash_attn = "0.20.2", sub
    sub.flash_attn_varlen_func = flash_attn_varlen_func
    sub.is_fa_version_supported = lambda v: v == 3
    return {"vllm": pkg, "vllm.vllm_flash_attn": sub}


def fa4_modules(calls):
    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                               gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False):
        assert causal is True
        lse = torch.zeros(1)
        if page_table is None:
            calls.append("varlen")
            return ref.varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale), lse
        assert cu_seqlens_k is None and page_table.dtype == torch.int32
        if q.dim() == 4:                          # batched decode: [batch, 1, heads, head_dim]
            assert cu_seqlens_q is None and isinstance(max_seqlen_k, int)
            calls.append(("decode", max_seqlen_k))
            b = q.shape[0]
            out = _paged(q[:, 0], k, v, page_table, torch.arange(b + 1, dtype=torch.int32), seqused_k, 1,
                         softmax_scale)
            return out[:, None], lse
        calls.append("paged")
        return _paged(q, k, v, page_table, cu_seqlens_q, seqused_k, max_seqlen_q, softmax_scale), lse

    ns, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")   # namespace: no FA2 API
    cute.flash_attn_varlen_func, ns.cute = flash_attn_varlen_func, cute
    return {"flash_attn": ns, "flash_attn.cute": cute}


ABSENT = {"flash_attn": None, "flash_attn.cute": None, "vllm": None, "vllm.vllm_flash_attn": None}


@pytest.fixture
def installed(monkeypatch):
    """installed(*makers): only these stand-ins import (sys.modules None = not importable); returns calls."""
    def install(*makers):
        calls = []
        modules = dict(ABSENT)
        for make in makers:
            modules.update(make(calls))
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(flash_backend, "_found", [])
        return calls
    return install


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [3, 5], [7, 5]
    q = torch.randn(sum(lens_q), H, D, generator=g, dtype=torch.float64).to(torch.bfloat16)
    k_cache = torch.randn(8, BS, HKV, D, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(8, BS, HKV, D, generator=g).to(torch.bfloat16)
    table = torch.tensor([[3, 0, -1], [5, 6, -1]], dtype=torch.int32)
    return q, k_cache, v_cache, table, _cu(lens_q), _cu(lens_k)


@pytest.mark.parametrize("makers,name", [((fa2_module,), "flash-attn"), ((fa3_modules,), "vllm-fa3"),
                                         ((fa4_modules,), "flash-attn-4")])
def test_flash_adapter_maps_our_three_calls_onto_each_implementation(installed, makers, name):
    calls = installed(*makers)
    impl = flash_backend.implementation()
    assert impl.name == name and impl.block_multiple == (256 if name == "flash-attn" else 16)
    q, k_cache, v_cache, table, cu_q, cu_k = _inputs()
    torch.testing.assert_close(flash_backend.paged_prefill(q, k_cache, v_cache, table, cu_q, cu_k, 5, 7, 0.25),
                               ref.paged_prefill(q, k_cache, v_cache, table, cu_q, cu_k, 5, 7, 0.25))
    g = torch.Generator().manual_seed(1)
    qd, lens = torch.randn(2, H, D, generator=g).to(torch.bfloat16), torch.tensor([7, 5], dtype=torch.int32)
    out = flash_backend.paged_decode(qd, k_cache, v_cache, table, lens, 0.25)
    assert out.shape == qd.shape
    torch.testing.assert_close(out, ref.paged_decode(qd, k_cache, v_cache, table, lens, 0.25))
    k, v = torch.randn(8, HKV, D, generator=g).to(torch.bfloat16), torch.randn(8, HKV, D, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(flash_backend.varlen_prefill(q, k, v, cu_q, cu_q, 5, 5, 0.25),
                               ref.varlen_prefill(q, k, v, cu_q, cu_q, 5, 5, 0.25))
    widest = table.shape[1] * BS                  # decode's max_seqlen_k: from shapes, a host int
    expected = {"flash-attn": ["varlen_paged", "kvcache", "varlen"],
                "vllm-fa3": [("paged", 5, 7), ("paged", 1, widest), "varlen"],
                "flash-attn-4": ["paged", ("decode", widest), "varlen"]}[name]
    assert calls == expected


def test_detection_order_is_flash_attn_then_vllm_fa3_then_flash_attn_4(installed):
    installed(fa3_modules, fa4_modules)
    assert flash_backend.find_implementation().name == "vllm-fa3"
    installed(fa2_module, fa3_modules)
    assert flash_backend.find_implementation().name == "flash-attn"
    installed(fa4_modules)
    assert flash_backend.find_implementation().name == "flash-attn-4"
    installed(fa2_module, fa3_modules)
    assert flash_backend.find_implementation(skip=("flash-attn",)).name == "vllm-fa3"   # the nano-vllm stand-in


def test_missing_flash_attention_gives_the_named_value_error(installed):
    installed()
    assert flash_backend.find_implementation() is None and not attn.flash_attn_available()
    with pytest.raises(ValueError, match="needs CUDA and a FlashAttention: the flash-attn package, vLLM"):
        attn.resolve_backend("flash_attn", "cuda", 256)
    q, k_cache, v_cache, table, _, _ = _inputs()
    with pytest.raises(ValueError, match="needs a FlashAttention"):
        flash_backend.paged_decode(q[:2], k_cache, v_cache, table, torch.tensor([7, 5], dtype=torch.int32), 0.25)


def test_flash_backend_refuses_float32_by_name(installed):
    installed(fa3_modules)
    q, k_cache, v_cache, table, cu_q, cu_k = _inputs()
    with pytest.raises(ValueError, match="float16 or bfloat16 only"):
        flash_backend.paged_prefill(q.float(), k_cache.float(), v_cache.float(), table, cu_q, cu_k, 5, 7, 0.25)
    with pytest.raises(ValueError, match="float16 or bfloat16 only"):
        attn.resolve_backend("flash_attn", "cuda", 256, dtype=torch.float32)
    assert attn.resolve_backend("flash_attn", "cuda", 256, dtype=torch.bfloat16) == "flash_attn"


@pytest.mark.parametrize("makers,block_size,ok", [
    ((fa2_module,), 256, True), ((fa2_module,), 16, False),      # FA2's paged KV: blocks of a multiple of 256
    ((fa3_modules,), 16, True), ((fa3_modules,), 8, False),
    ((fa4_modules,), 16, True), ((fa4_modules,), 4, False),
])
def test_flash_block_size_rule_follows_the_implementation(installed, makers, block_size, ok):
    installed(*makers)
    if ok:
        assert attn.resolve_backend("flash_attn", "cuda", block_size) == "flash_attn"
    else:
        with pytest.raises(ValueError, match=f"multiple of {flash_backend.implementation().block_multiple}, "
                                             f"got {block_size}"):
            attn.resolve_backend("flash_attn", "cuda", block_size)


@pytest.mark.parametrize("makers,device,block_size,dtype,expected", [
    ((fa2_module,), "cuda", 256, None, "flash_attn"),
    ((fa2_module,), "cuda", 16, None, "triton"),           # FA2's paged KV needs blocks of a multiple of 256
    ((fa4_modules,), "cuda", 16, None, "flash_attn"),
    ((fa2_module,), "cuda", 256, torch.float32, "triton"),  # no FlashAttention runs float32
    ((fa3_modules,), "cuda", 256, None, "triton"),          # auto never imports vLLM (it patches torch)
    ((), "cuda", 256, None, "triton"),
    ((fa2_module,), "cpu", 256, None, "cpu"),               # the CPU back-end; "torch" only when asked for
])
def test_auto_backend_choice(installed, monkeypatch, makers, device, block_size, dtype, expected):
    installed(*makers)
    monkeypatch.setattr(attn, "triton_available", lambda: True)
    assert attn.resolve_backend("auto", device, block_size, dtype=dtype) == expected


def test_flash_backend_on_a_cpu_is_refused(installed):
    installed(fa2_module)
    with pytest.raises(ValueError, match="needs CUDA"):
        attn.resolve_backend("flash_attn", "cpu", 256)
