"""The persistent decode step (kernels/persistent_decode.py; FusedKernels.persistent): one sequence's decode step
as one kernel, under the Triton interpreter phase by phase (stepwise), against the layer-by-layer forward and HF.

- The engine with persistent=True gives HF transformers' greedy ids one sequence at a time (qwen3 with q/k norm,
  llama without; fp32; block size 4 so the decode slots cross block boundaries), and its decode steps really run
  the persistent kernel (counted), batches of several sequences the layers.
- The step's hidden state equals the layer-by-layer forward's (fp32, within 1e-5 relative) at several
  positions of a scattered block table, and the KV cache rows it writes equal those the layers write (1e-5 of the largest entry: fp32, another summation order);
  so does the fused path (one program: barriers, the merge count and the exit reset), which also clears a
  merge count a step left behind, so the next step is right again.
- So it does for a head_dim that is no power of two, K below 16 in the split-K projections, and more programs
  than any phase has items; the norm weights are random there (the checkpoint's are all 1).
- A batch of two sequences runs the layers and matches HF.
- Its tile choices spread every projection over the programs; bad configurations and inputs are refused by name;
  a weight off the 16-element alignment is taken without the alignment hint.
"""
import dataclasses

import pytest
import torch

from engine_helpers import LLM, hf_greedy, tiny_dir
from nanovllm_ref import SamplingParams
from nanovllm_ref.engine import model_runner
from nanovllm_ref.kernels import persistent_decode
from nanovllm_ref.utils.context import AttentionMetadata, attention_metadata
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


def test_a_batch_of_two_runs_the_layers_and_matches_hf(monkeypatch, step_calls):
    path = tiny_dir("qwen3")
    llm = _llm(monkeypatch, path, PERSISTENT)
    prompts, tokens = [[5, 6, 7, 8, 9, 10, 11], [20, 21]], 4
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    llm.exit()
    assert [o["token_ids"] for o in out] == [hf_greedy(path, p, tokens) for p in prompts]
    assert step_calls == [], "decode steps of two sequences run the layers, not the persistent kernel"


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
    with pytest.raises(ValueError, match="input_ids: the persistent decode step takes one sequence"):
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


def _decode_inputs(model, ctx, block_size, table):
    """One decode step's inputs for the token at position ctx - 1 of a sequence whose blocks are `table`."""
    pos = ctx - 1
    slot = int(table[0, pos // block_size]) * block_size + pos % block_size
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([slot], dtype=torch.int32),
                             context_lens=torch.tensor([ctx], dtype=torch.int32), block_tables=table)
    return torch.tensor([11]), torch.tensor([pos]), meta, slot


def _step_against_layers(model, caches, ctx, block_size, table, step=None):
    """(hidden error, k/v row error) of the persistent step against the layers at context ctx: the norm of the
    difference over the layers' norm, and the largest k/v difference over the layers' largest k/v entry."""
    ids, positions, meta, slot = _decode_inputs(model, ctx, block_size, table)
    rows = (slice(None), slice(None), slot // block_size, slot % block_size)

    def run(persistent):
        model.persistent = persistent
        with attention_metadata(meta), torch.inference_mode():
            if step is not None and persistent:
                return step(ids, positions, meta.slot_mapping, meta.block_tables, meta.context_lens)
            return model(ids, positions)
    ref = run(False)
    ref_kv = caches[rows].clone()
    caches[rows] = 0
    got = run(True)
    model.persistent = True
    return float((got - ref).norm() / ref.norm()), float((caches[rows] - ref_kv).abs().max() / ref_kv.abs().max())


def _cached_model(monkeypatch, **overrides):
    """The tiny qwen3 engine's model (fp32, block size 4; config `overrides`) with a random KV cache, random norm
    weights (the checkpoint's are all 1, under which a norm's weight could be swapped unseen) and a scattered
    block table."""
    llm = _llm(monkeypatch, tiny_dir("qwen3", **overrides), PERSISTENT)
    model = llm.model_runner.model.model
    g = torch.Generator().manual_seed(1)
    norms = [model.norm] + [m for layer in model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm,
                                                                   layer.self_attn.q_norm, layer.self_attn.k_norm)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=g))
    whole = llm.model_runner.kv_cache                    # [2, L, blocks, block_size, Hkv, d]: every layer's view
    one = model.layers[1].self_attn.attn.k_cache
    assert one.data_ptr() == whole[0, 1].data_ptr() and tuple(one.shape) == tuple(whole.shape[2:])
    whole.copy_(torch.randn(whole.shape, generator=torch.Generator().manual_seed(0)))
    block_size = one.shape[1]
    table = torch.arange(10, 0, -1, dtype=torch.int32)[None]     # blocks 10, 9, ... 1: out of order
    return llm, model, whole, block_size, table


@pytest.mark.parametrize("ctx", [1, 6, 13, 37])
def test_the_step_equals_the_layers_hidden_state_and_kv_rows(monkeypatch, ctx):
    llm, model, caches, block_size, table = _cached_model(monkeypatch)
    hidden, kv = _step_against_layers(model, caches, ctx, block_size, table)
    llm.exit()
    assert hidden < 1e-5, f"hidden state {hidden:.2e} (relative) from the layers' at context {ctx}"
    assert kv < 1e-5, f"the k/v rows the step wrote differ by {kv:.2e} from the layers' at context {ctx}"


@pytest.mark.parametrize("overrides, programs", [
    (dict(head_dim=12), None),                     # rotate-half RoPE over a head that is no power of two
    (dict(intermediate_size=8, head_dim=4), None),  # K below 16 in both split-K projections
    ({}, 300),                                     # more programs than any phase has items: some have none
])
def test_the_step_equals_the_layers_for_other_shapes_and_grids(monkeypatch, overrides, programs):
    llm, model, caches, block_size, table = _cached_model(monkeypatch, **overrides)
    ctx = 13
    step = model.persistent_step(programs=programs)
    hidden, kv = _step_against_layers(model, caches, ctx, block_size, table)
    llm.exit()
    assert programs is None or step.config.programs == programs
    assert hidden < 1e-5, f"hidden state {hidden:.2e} (relative) from the layers' at context {ctx}"
    assert kv < 1e-5, f"the k/v rows the step wrote differ by {kv:.2e} from the layers' at context {ctx}"


def test_the_fused_path_clears_a_left_over_merge_count(monkeypatch):
    """One program, no stepwise launches: the barriers, the merge count and the exit reset run as on a GPU. A
    count left behind (a step whose barriers gave up) spoils that step's merge; the exit reset clears it."""
    llm, model, caches, block_size, table = _cached_model(monkeypatch)
    a = model.layers[0].self_attn
    step = model.persistent_step()
    fused = persistent_decode.PersistentDecode(
        [{"qkv": x.self_attn.qkv_proj.weight, "o": x.self_attn.o_proj.weight, "gate_up": x.mlp.gate_up_proj.weight,
          "down": x.mlp.down_proj.weight, "input_norm": x.input_layernorm.weight,
          "post_norm": x.post_attention_layernorm.weight, "q_norm": x.self_attn.q_norm.weight,
          "k_norm": x.self_attn.k_norm.weight} for x in model.layers],
        model.embed_tokens.weight, model.norm.weight, model.norm.eps,
        [x.self_attn.attn.k_cache for x in model.layers], [x.self_attn.attn.v_cache for x in model.layers],
        a.rotary_emb.cos_sin_cache, a.num_heads, a.num_kv_heads, a.head_dim, a.attn.scale,
        programs=1, stepwise=False)
    assert not fused.stepwise and step.stepwise
    hidden, kv = _step_against_layers(model, caches, 13, block_size, table, step=fused)
    assert hidden < 1e-5 and kv < 1e-5, (hidden, kv)
    fused.counters[3] = 1                                  # KV head 0's count, left behind
    spoiled, _ = _step_against_layers(model, caches, 13, block_size, table, step=fused)
    assert spoiled > 1e-3, "a left-over merge count skips that KV head's merge (the test's premise)"
    assert int(fused.counters.abs().sum()) == 0, "the last program out resets every counter"
    hidden, kv = _step_against_layers(model, caches, 13, block_size, table, step=fused)
    llm.exit()
    assert hidden < 1e-5 and kv < 1e-5, "the step after it is right again"


def test_bad_inputs_are_refused_by_name(monkeypatch):
    llm, model, caches, block_size, table = _cached_model(monkeypatch)
    step = model.persistent_step()
    ids, positions, meta, _ = _decode_inputs(model, 6, block_size, table)
    good = dict(input_ids=ids, positions=positions, slot_mapping=meta.slot_mapping, block_tables=table,
                context_lens=meta.context_lens)
    i32 = torch.int32
    cases = {
        "input_ids": [torch.tensor([1.0]), [1], torch.tensor([1, 2]), torch.tensor([10 ** 6])],
        "positions": [torch.tensor([], dtype=torch.long), torch.tensor([4])],
        "slot_mapping": [torch.tensor([], dtype=i32), torch.tensor([10 ** 6], dtype=i32)],
        "block_tables": [table[0], torch.zeros(1, 0, dtype=i32), table.float(), torch.full_like(table, 10 ** 6),
                         torch.full_like(table, -1), torch.cat([table, table]).t()[:1]],
        "context_lens": [torch.tensor([], dtype=i32), torch.tensor([0], dtype=i32),
                         torch.tensor([table.shape[1] * block_size + 1], dtype=i32)],
    }
    for name, bads in cases.items():
        for bad in bads:
            with pytest.raises(ValueError, match=f"^{name}"):
                step(**{**good, name: bad})
    llm.exit()


def test_bad_constructor_arguments_are_refused_by_name(monkeypatch):
    llm = _llm(monkeypatch, tiny_dir("qwen3"), PERSISTENT)
    model = llm.model_runner.model.model
    a, layer = model.layers[0].self_attn, model.layers[0]
    good_layer = {"qkv": a.qkv_proj.weight, "o": a.o_proj.weight, "gate_up": layer.mlp.gate_up_proj.weight,
                  "down": layer.mlp.down_proj.weight, "input_norm": layer.input_layernorm.weight,
                  "post_norm": layer.post_attention_layernorm.weight, "q_norm": a.q_norm.weight,
                  "k_norm": a.k_norm.weight}
    k, v = a.attn.k_cache, a.attn.v_cache
    good = dict(weights=[good_layer], embed=model.embed_tokens.weight, final_norm=model.norm.weight, eps=1e-6,
                k_caches=[k], v_caches=[v], cos_sin_cache=a.rotary_emb.cos_sin_cache, num_heads=a.num_heads,
                num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, scale=a.attn.scale)
    unaligned = torch.empty(good_layer["input_norm"].numel() + 1)[1:]
    cases = [("programs", dict(programs=0)), ("programs", dict(programs=-2)), ("num_kv_heads", dict(num_kv_heads=0)),
             ("num_heads", dict(num_heads=2.0)), ("embed", dict(embed=model.embed_tokens.weight[0])),
             ("weights.0.", dict(weights=[list(good_layer.values())])),
             ("final_norm", dict(final_norm=model.norm.weight[:-1])),
             ("cos_sin_cache", dict(cos_sin_cache=a.rotary_emb.cos_sin_cache[:, :-2])),
             ("k_caches", dict(k_caches=[k[..., :-1]])), ("v_caches", dict(v_caches=[v.double()])),
             ("k_caches", dict(k_caches=[k, k], v_caches=[v, v], weights=[good_layer, good_layer])),
             ("stepwise", dict(stepwise=False, programs=2)), ("eps", dict(eps="x")), ("eps", dict(eps=-1.0)),
             ("eps", dict(eps=float("nan"))), ("scale", dict(scale="x")), ("weights must be a list", dict(weights=None)),
             ("k_caches must be a list", dict(k_caches=None)), ("embed", dict(embed=model.embed_tokens.weight.long())),
             ("q_norm and k_norm", dict(weights=[{**good_layer, "q_norm": None}])),
             ("k_caches", dict(k_caches=[k[:, :0]], v_caches=[v[:, :0]]))]
    for name, change in cases:
        with pytest.raises(ValueError, match=name):
            persistent_decode.PersistentDecode(**{**good, **change})
    assert persistent_decode.PersistentDecode(**good).aligned
    # A weight 1 element off 16: taken, without the alignment hint (its loads then are not 16-byte vectors).
    odd = persistent_decode.PersistentDecode(**{**good, "weights": [{**good_layer, "input_norm": unaligned.copy_(
        layer.input_layernorm.weight)}]})
    assert odd.num_layers == 1 and not odd.aligned
    llm.exit()


def test_max_resident_counts_registers_threads_and_shared_memory():
    """An H200's figures (132 SMs, 64 K registers, 2,048 threads, 228 KB of shared memory an SM)."""
    import types
    h200 = types.SimpleNamespace(multi_processor_count=132, regs_per_multiprocessor=65536,
                                 max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=233472)
    assert persistent_decode.max_resident(254, 8, 22528, h200) == 132          # registers: one program an SM
    assert persistent_decode.max_resident(249, 4, 38916, h200) == 264          # 256 a thread, allocated: two
    assert persistent_decode.max_resident(64, 4, 0, h200) == 132 * 8           # registers: 8 an SM (threads: 16)
    assert persistent_decode.max_resident(32, 1, 120000, h200) == 132          # shared memory: one
    assert persistent_decode.max_resident(16, 8, 0, h200) == 132 * 8           # threads: 2,048 / 256
    assert persistent_decode.max_resident(16, 1, 0, h200) == 132 * 32          # block slots: 32 an SM


def test_split_k_tiles_take_a_k_below_16_as_one_chunk():
    assert persistent_decode._split_k_tiles(64, 8, 3, 16384)[1] == 8
    assert persistent_decode._split_k_tiles(1024, 3072, 132, 16384)[1] == 4096       # Qwen3-0.6B down: one chunk
