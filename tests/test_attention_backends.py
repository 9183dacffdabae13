"""Back-end selection, and the flash-attn wrapper's argument plumbing (flash-attn itself is optional and not
installed here: a stand-in module with flash-attn's signatures, computed by the torch back-end, checks that
our wrapper hands every argument to the right place and reshapes the results back)."""
import importlib
import sys
import types

import pytest
import torch

import nanovllm_ref.attn as attn
from nanovllm_ref.attn import torch_backend as ref


@pytest.fixture
def fake_flash(monkeypatch):
    calls = []

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

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    sys.modules.pop("nanovllm_ref.attn.flash_backend", None)
    yield importlib.import_module("nanovllm_ref.attn.flash_backend"), calls
    sys.modules.pop("nanovllm_ref.attn.flash_backend", None)


def test_flash_backend_wrappers_pass_arguments_through(fake_flash):
    fb, calls = fake_flash
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, bs = 4, 2, 16, 4
    lens_q, lens_k = [3, 5], [7, 5]
    q = torch.randn(sum(lens_q), H, D, generator=g)
    k_cache = torch.randn(8, bs, Hkv, D, generator=g)
    v_cache = torch.randn(8, bs, Hkv, D, generator=g)
    table = torch.tensor([[3, 0, -1], [5, 6, -1]], dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 7, 12], dtype=torch.int32)
    torch.testing.assert_close(fb.paged_prefill(q, k_cache, v_cache, table, cu_q, cu_k, 5, 7, 0.25),
                               ref.paged_prefill(q, k_cache, v_cache, table, cu_q, cu_k, 5, 7, 0.25))
    qd, lens = torch.randn(2, H, D, generator=g), torch.tensor([7, 5], dtype=torch.int32)
    out = fb.paged_decode(qd, k_cache, v_cache, table, lens, 0.25)
    assert out.shape == qd.shape
    torch.testing.assert_close(out, ref.paged_decode(qd, k_cache, v_cache, table, lens, 0.25))
    k, v = torch.randn(8, Hkv, D, generator=g), torch.randn(8, Hkv, D, generator=g)
    torch.testing.assert_close(fb.varlen_prefill(q, k, v, cu_q, cu_q, 5, 5, 0.25),
                               ref.varlen_prefill(q, k, v, cu_q, cu_q, 5, 5, 0.25))
    assert calls == ["varlen_paged", "kvcache", "varlen"]


@pytest.mark.parametrize("flash,device,block_size,expected", [
    (True, "cuda", 256, "flash_attn"),
    (True, "cuda", 16, "triton"),          # flash-attn's paged KV needs blocks of a multiple of 256
    (False, "cuda", 256, "triton"),
    (True, "cpu", 256, "cpu"),             # the CPU back-end (issue 15); "torch" only when asked for
])
def test_auto_backend_choice(monkeypatch, flash, device, block_size, expected):
    monkeypatch.setattr(attn, "flash_attn_available", lambda: flash)
    monkeypatch.setattr(attn, "triton_available", lambda: True)
    assert attn.resolve_backend("auto", device, block_size) == expected


def test_flash_backend_with_small_blocks_is_refused(monkeypatch):
    monkeypatch.setattr(attn, "flash_attn_available", lambda: True)
    with pytest.raises(ValueError, match="multiple of 256"):
        attn.resolve_backend("flash_attn", "cuda", 16)
    with pytest.raises(ValueError, match="needs CUDA"):
        attn.resolve_backend("flash_attn", "cpu", 256)
