"""The persistent decode step (kernels/persistent_decode.py; FusedKernels.persistent): one sequence's decode step
as one kernel, under the Triton interpreter phase by phase (stepwise), against the layer-by-layer forward and HF.

- The engine with persistent=True gives HF transformers' greedy ids one sequence at a time (qwen3 with q/k norm,
  llama without; fp32; block size 4 so the decode slots cross block boundaries), and its decode steps really run
  the persistent kernel (counted), batches of several sequences the layers.
- The step's hidden state equals the layer-by-layer forward's (fp32, max error 1e-5 relative) at several
  positions, and the KV cache rows it writes equal those the layers write.
- Its tile choices spread every projection over the programs; bad configurations are refused by name.
"""
import dataclasses

import pytest
import torch

from engine_helpers import LLM, hf_greedy, tiny_dir
from nanovllm_ref import SamplingParams
from nanovllm_ref.engine import model_runner
from nanovllm_ref.kernels import persistent_decode
from nanovllm_ref.utils.fusion import FusedKernels

PERSISTENT = FusedKernels.all(persistent=True)


@pytest.fixture
def step_calls(monkeypatch):
    calls = []
    real = persistent_decode.PersistentDecode.__call__

    def spy(self, input_ids, *args):
        calls.append(int(input_ids.shape[0]))
        return real(self, input_ids, *args)
    monkeypatch.setattr(persistent_decode.PersistentDecode, "__call__", spy)
    return calls


def _llm(monkeypatch, path, kernels, **engine_args):
    real = model_runner.get_model_class

    def model_class(hf):
        cls = real(hf)
        return lambda cfg, ops: cls(cfg, ops=dataclasses.replace(ops, kernels=kernels))
    monkeypatch.setattr(model_runner, "get_model_class", model_class)
    return LLM(path, **{"enforce_eager": True, "dtype": "float32", "kvcache_block_size": 4, "max_model_len": 64,
                        **engine_args})


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_with_the_persistent_step_matches_hf_greedy(arch, monkeypatch, step_calls):
    path = tiny_dir(arch)
    llm = _llm(monkeypatch, path, PERSISTENT)
    prompts, tokens = [[5, 6, 7, 8, 9, 10, 11], [20, 21]], 5
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    got = [llm.generate([p], greedy, use_tqdm=False)[0]["token_ids"] for p in prompts]
    llm.exit()
    assert got == [hf_greedy(path, p, tokens) for p in prompts]
    assert step_calls == [1] * (2 * (tokens - 1)), "every decode step of one sequence runs the persistent kernel"


def test_several_kv_splits_merged_by_the_last_split_match_hf(monkeypatch, step_calls):
    """8 programs over 2 KV heads: 4 splits a head, the last one to finish merging them (a 37-token context)."""
    path = tiny_dir("qwen3")
    llm = _llm(monkeypatch, path, PERSISTENT)
    step = llm.model_runner.model.model.persistent_step(programs=8)
    assert step.config.num_splits == 4
    prompt, tokens = list(range(30, 67)), 4
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                       use_tqdm=False)[0]["token_ids"]
    assert llm.model_runner.model.model.persistent_step() is step
    llm.exit()
    assert got == hf_greedy(path, prompt, tokens)
    assert step_calls == [1] * (tokens - 1)
    assert int(step.counters[3:].abs().sum()) == 0, "every merge count is reset for the next layer"


def test_persistent_needs_every_kernel_and_is_dropped_with_any():
    with pytest.raises(ValueError, match="FusedKernels.persistent needs every kernel field on"):
        FusedKernels(gemm=True, persistent=True)
    assert not PERSISTENT.large_batch().persistent
    assert PERSISTENT.restricted_to(FusedKernels.all()).persistent
    assert not PERSISTENT.restricted_to(FusedKernels.all(split_k=False)).persistent
    with pytest.raises(TypeError, match="FusedKernels.persistent must be a bool"):
        FusedKernels.all(persistent=1)


def test_tiles_spread_each_projection_over_the_programs():
    """Qwen3-0.6B on 132 SMs: every projection's busiest program reads at most ~1.3x the mean weight bytes."""
    cfg = persistent_decode.choose_config(1024, 3072, 16, 8, 128, 132, gpu=True)
    assert cfg.num_splits == 16 and cfg.block_n == 64
    for n, k, bn, kc in [(4096, 1024, cfg.bn_qkv, 1024), (3072, 2048, cfg.bn_gate_up, 1024),
                         (1024, 2048, cfg.bn_o, cfg.kc_o), (1024, 3072, cfg.bn_down, cfg.kc_down)]:
        items = -(-n // bn) * -(-k // kc)
        busiest = -(-items // 132) * bn * min(kc, k)
        assert busiest <= 1.3 * n * k / 132, (n, k, bn, kc)
    assert cfg.kc_o >= 2048 and cfg.kc_down >= 3072, "one K chunk: the next phase reads one partial row"


def test_the_step_refuses_a_batch_and_mismatched_tensors(monkeypatch):
    llm = _llm(monkeypatch, tiny_dir("qwen3"), PERSISTENT)
    model = llm.model_runner.model.model
    step = model.persistent_step()
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="takes one sequence"):
        step(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), one, torch.zeros(2, 4, dtype=torch.int32),
             one)
    a = model.layers[0].self_attn
    good = {"qkv": a.qkv_proj.weight, "o": a.o_proj.weight, "gate_up": model.layers[0].mlp.gate_up_proj.weight,
            "down": model.layers[0].mlp.down_proj.weight, "input_norm": model.layers[0].input_layernorm.weight,
            "post_norm": model.layers[0].post_attention_layernorm.weight, "q_norm": a.q_norm.weight,
            "k_norm": a.k_norm.weight}

    def make(layer):
        return persistent_decode.PersistentDecode([layer], model.embed_tokens.weight, model.norm.weight, 1e-6,
                                                  [a.attn.k_cache], [a.attn.v_cache], a.rotary_emb.cos_sin_cache,
                                                  a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale)
    assert make(good).num_layers == 1
    with pytest.raises(ValueError, match="weights.0. lacks down"):
        make({k: v for k, v in good.items() if k != "down"})
    with pytest.raises(ValueError, match="layer 0 qkv: expected a contiguous"):
        make({**good, "qkv": good["qkv"].t()})
    llm.exit()


def test_a_model_with_biases_refuses_the_persistent_step_by_name():
    import types
    from nanovllm_ref.models.ops import ModelOps
    from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM
    config = types.SimpleNamespace(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4,
                                   tie_word_embeddings=False, attention_bias=True, mlp_bias=False, hidden_act="silu")
    with pytest.raises(ValueError, match="FusedKernels.persistent needs tensor parallel size 1 and a model without"):
        Qwen3ForCausalLM(config, ops=ModelOps(kernels=PERSISTENT))
    config.attention_bias = False
    assert Qwen3ForCausalLM(config, ops=ModelOps(kernels=PERSISTENT)).model.persistent
