"""The CPU attention back-end (issue 15) equals the readable torch back-end on random paged inputs, and the
engine with it (or with the torch back-end, which `auto` no longer picks on CPU) gives HF's greedy ids."""
import random

import pytest
import torch

import nanovllm_ref.attn as attn
from nanovllm_ref import SamplingParams
from nanovllm_ref.attn import cpu_backend as cpu
from nanovllm_ref.attn import torch_backend as ref
from engine_helpers import LLM, hf_greedy, run_checked, tiny_dir

HEADS = [(4, 4), (8, 2), (9, 3)]          # MHA, GQA 4:1, GQA 3:1 (SmolLM2's 9/3)


def random_paged(seed, block_size, k_lens, num_kv_heads, head_dim=16, extra_blocks=3, dtype=torch.float32):
    """A cache with the sequences' blocks scattered in random order (and -1 padding in the table)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [(n + block_size - 1) // block_size for n in k_lens]
    num_blocks = sum(per_seq) + extra_blocks
    ids = torch.randperm(num_blocks, generator=g).tolist()
    width = max(per_seq) + 1
    table = torch.full((len(k_lens), width), -1, dtype=torch.int32)
    for i, n in enumerate(per_seq):
        table[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype), table


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_paged_decode_equals_torch_backend(block_size, num_heads, num_kv_heads):
    lens = [1, 7, 16, 17, 70, 300][: 6 if block_size > 1 else 5]
    k_cache, v_cache, table = random_paged(block_size, block_size, lens, num_kv_heads)
    q = torch.randn(len(lens), num_heads, 16, generator=torch.Generator().manual_seed(1))
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = cpu.paged_decode(q, k_cache, v_cache, table, context_lens, 0.3)
    torch.testing.assert_close(out, ref.paged_decode(q, k_cache, v_cache, table, context_lens, 0.3))
    # The per-step plan is cached: new lengths written into the same tensor must not reuse it.
    context_lens[:] = torch.tensor([max(1, n - 1) for n in lens], dtype=torch.int32)
    torch.testing.assert_close(cpu.paged_decode(q, k_cache, v_cache, table, context_lens, 0.3),
                               ref.paged_decode(q, k_cache, v_cache, table, context_lens, 0.3))


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_prefill_paths_equal_torch_backend(block_size, num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(2)
    q_lens, k_lens = [3, 1, 20, 9], [3, 12, 40, 9]           # with and without a cached prefix
    k_cache, v_cache, table = random_paged(block_size + 5, block_size, k_lens, num_kv_heads)
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, 16, generator=g)
    args = (q, k_cache, v_cache, table, cu_q, cu_k, max(q_lens), max(k_lens), 0.25)
    torch.testing.assert_close(cpu.paged_prefill(*args), ref.paged_prefill(*args))
    k = torch.randn(sum(q_lens), num_kv_heads, 16, generator=g)
    v = torch.randn(sum(q_lens), num_kv_heads, 16, generator=g)
    args = (q, k, v, cu_q, cu_q, max(q_lens), max(q_lens), 0.25)
    torch.testing.assert_close(cpu.varlen_prefill(*args), ref.varlen_prefill(*args))


def test_bf16_cache_matches_torch_backend_within_bf16_rounding():
    k_cache, v_cache, table = random_paged(3, 16, [5, 33], 2, dtype=torch.bfloat16)
    q = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    lens = torch.tensor([5, 33], dtype=torch.int32)
    out = cpu.paged_decode(q, k_cache, v_cache, table, lens, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.paged_decode(q, k_cache, v_cache, table, lens, 0.25), atol=1e-2, rtol=1e-2)


def test_store_kvcache_equals_torch_backend_and_skips_minus_one():
    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    for slots in ([3, 0, 17, 9, 30], [3, -1, 17, -1, 30]):
        slot_mapping = torch.tensor(slots, dtype=torch.int32)
        caches = [torch.zeros(4, 8, 2, 8) for _ in range(4)]
        cpu.store_kvcache(key, value, caches[0], caches[1], slot_mapping)
        ref.store_kvcache(key, value, caches[2], caches[3], slot_mapping)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="dtype mismatch"):
        cpu.store_kvcache(key.double(), value.double(), caches[0], caches[1], slot_mapping)


def test_auto_picks_the_cpu_backend_on_cpu_and_torch_stays_selectable():
    assert attn.resolve_backend("auto", "cpu") == "cpu"
    assert attn.resolve_backend("torch", "cpu") == "torch"
    assert attn.get_backend("cpu") is cpu


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_engine_greedy_ids_equal_hf(backend, block_size):
    path = tiny_dir("llama")                       # GQA like SmolLM2
    rng = random.Random(block_size)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 18, 33)]
    llm = LLM(path, kvcache_block_size=block_size, max_model_len=128, attention_backend=backend, device="cpu")
    assert llm.model_runner.backend_name == backend
    got, _ = run_checked(llm, prompts, GREEDY)
    assert got == [hf_greedy(path, p, 12) for p in prompts]
    # Again, now through cached prefixes (paged prefill) for the repeated prompts.
    got, _ = run_checked(llm, prompts, GREEDY)
    assert got == [hf_greedy(path, p, 12) for p in prompts]


@pytest.mark.skipif(not __import__("nanovllm_ref.utils.onednn", fromlist=["x"]).available(torch.float32),
                    reason="no oneDNN in this torch build")
def test_onednn_linear_equals_f_linear_and_the_engine_packs_on_cpu():
    import torch.nn.functional as F

    from nanovllm_ref.layers.linear import RowParallelLinear
    from nanovllm_ref.utils import onednn
    layer = RowParallelLinear(24, 40, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(5, 24)
    plain = layer(x)
    assert onednn.pack(layer) == 1 and hasattr(layer.weight, "onednn")
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(onednn.linear(x[:, ::2].repeat(1, 2), layer.weight), F.linear(x[:, ::2].repeat(1, 2), layer.weight),
                               rtol=1e-5, atol=1e-5)                      # non-contiguous input source
    onednn.unpack(layer)
    assert not hasattr(layer.weight, "onednn") and torch.equal(layer(x), plain)
    llm = LLM(tiny_dir("llama"), max_model_len=64, device="cpu")
    packed = [m.weight for m in llm.model_runner.model.modules() if hasattr(m, "weight") and hasattr(m.weight, "onednn")]
    assert len(packed) == 4 * 2 + 1              # qkv, o, gate_up, down per layer (2 layers) and the LM head
