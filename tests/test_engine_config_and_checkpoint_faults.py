"""Issue 12: config and checkpoint faults from public bug reports, each with HF transformers as the oracle
where a model is involved. Every test here failed on the engine before the fix it names."""
import json
import os
import random
import shutil
import warnings

import pytest
import torch

from safetensors.torch import load_file, save_file

from nanovllm_ref import SamplingParams
from nanovllm_ref.config import Config
from nanovllm_ref.engine.block_manager import BlockManager
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.layers.rope_scaling import rope_frequencies, rope_parameters_of
from nanovllm_ref.layers.sampler import exponential_race
from nanovllm_models.tiny import CHAT_TEMPLATE, make_tiny_model, make_tokenizer, tiny_config
from engine_helpers import LLM, hf_greedy, hf_model, tiny_dir


# -- 2. the exponential race's noise has a floor ---------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.01])
def test_zero_noise_never_picks_a_zero_probability_token(temperature):
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
    probs = torch.softmax(logits / temperature, dim=-1)
    if temperature == 1.0:                   # make the zero probability exact, as it is at T=0.01
        probs = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert probs[0, 1] == 0 and probs[1, 0] == 0
    noise = torch.tensor([[1.0, 0.0], [0.0, 1.0]])   # a draw of exactly 0 for the zero-probability token
    assert exponential_race(probs, noise).tolist() == [0, 1]
    # both draws 0: still the token with all the probability
    assert exponential_race(probs, torch.zeros(2, 2)).tolist() == [0, 1]


# -- 7. a prefix-cache hit also checks the block's parent ------------------------------------------------
def weak_hash(token_ids, prefix_hash=-1):
    """A 4-bit hash that ignores the prefix: every block with the same token sum collides."""
    return sum(token_ids) % 16


def _run_prefill(bm, tokens):
    seq = Sequence(tokens, bm.block_size)
    bm.allocate(seq)
    hit = seq.num_cached_tokens
    seq.num_cached_tokens = len(seq)          # as if the step computed the rest
    bm.hash_blocks(seq)
    return seq, hit


def test_prefix_hit_requires_the_cached_blocks_parent():
    bm = BlockManager(16, 4, True, hash_fn=weak_hash)
    x, x2, y = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 34]     # hashes 14, 6, 15
    _run_prefill(bm, x + y + [1])             # caches block y with parent x
    _run_prefill(bm, x2 + [40, 41, 42, 40] + [1])   # caches block x2
    _, hit = _run_prefill(bm, x + y + [1])    # the true prefix hits both blocks
    assert hit == 8
    # x2 hits; y's hash and tokens match, but y's K/V were computed after x, not x2: no hit.
    _, hit = _run_prefill(bm, x2 + y + [1])
    assert hit == 4


def test_duplicate_copies_of_a_prefix_still_hit():
    """Two requests that share a first block and prefill in one step each fill their own copy of it. The hash
    map keeps the copy hashed last (b's), while the cached second block is a's child. The parent check
    compares exact prefixes (lineages), not block ids, so a third request still hits both blocks."""
    bm = BlockManager(16, 4, True)
    first, second = [5, 6, 7, 8], [9, 10, 11, 12]
    a, b = Sequence(first + second + [1], 4), Sequence(first + [2], 4)
    bm.allocate(a)
    bm.allocate(b)                            # nothing hashed yet: two copies of the first block
    assert a.block_table[0] != b.block_table[0]
    for seq in (a, b):                        # the step wrote both; a's blocks are hashed first, then b's
        seq.num_cached_tokens = len(seq)
        bm.hash_blocks(seq)
    assert bm.hash_to_block_id[bm.blocks[b.block_table[0]].hash] == b.block_table[0]
    _, hit = _run_prefill(bm, first + second + [3])
    assert hit == 8



# -- 1. stop ids from generation_config.json ------------------------------------------------------------
def _hf_generate(path, prompt, max_new_tokens):
    """HF generate with the folder's own generation config (its stop ids), greedy."""
    model = hf_model(path)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_stop_ids_from_generation_config_json(tmp_path):
    src = tiny_dir("qwen3")
    path = str(tmp_path / "model")
    shutil.copytree(src, path)
    prompt, free_run = None, None
    for seed in range(50):                   # a prompt whose 3rd greedy token is new and not the eos (2)
        p = random.Random(seed).sample(range(3, 500), 6)
        run = hf_greedy(src, p, 8)
        if run[2] != 2 and run[2] not in run[:2] and 2 not in run[:3]:
            prompt, free_run = p, run
            break
    stop = free_run[2]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, stop], "bos_token_id": 1, "pad_token_id": 2}, f)
    expected = _hf_generate(path, prompt, 8)
    assert expected == free_run[:3]          # HF stops at the generation_config stop id
    out = LLM(path, kvcache_block_size=4, max_model_len=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0]["token_ids"] == expected and out[0]["finish_reason"] == "stop"


# -- 3. config keys that change the maths: implemented and tested against HF, or refused by name ----------
ROPE_SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16},
}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_hf(tmp_path, arch, scaling):
    path = make_tiny_model(str(tmp_path / "m"), arch, rope_scaling=dict(ROPE_SCALINGS[scaling]))
    prompt = random.Random(4).choices(range(3, 500), k=40)
    out = LLM(path, kvcache_block_size=16, max_model_len=128).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(path, prompt, 12)


def test_rope_scaling_frequencies_match_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for arch in ("qwen3", "llama"):
        for name, scaling in ROPE_SCALINGS.items():
            cfg = tiny_config(arch, rope_scaling=dict(scaling))
            want, want_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg)
            got, got_scale = rope_frequencies(16, 10000.0, rope_parameters_of(cfg), 512)
            torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0, msg=name)
            assert got_scale == pytest.approx(want_scale, rel=1e-12), name


def _config_only(tmp_path, arch, **overrides):
    path = str(tmp_path / "cfg")
    tiny_config(arch, **overrides).save_pretrained(path)
    return path


@pytest.mark.parametrize("arch, overrides, key", [
    ("qwen3", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type"),
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 128}), "rope_type"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act"),
    ("llama", dict(hidden_act="relu"), "hidden_act"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "sliding_window"),
])
def test_config_settings_the_engine_cannot_honour_are_refused_by_name(tmp_path, arch, overrides, key):
    path = _config_only(tmp_path, arch, **overrides)
    with pytest.raises(ValueError, match=key):
        Config(path)


@pytest.mark.parametrize("factor", [10**400, float("inf"), 0, -2.0, "2"])
def test_a_rope_factor_that_is_no_finite_positive_number_is_named(factor):
    """config.json may hold an integer no float holds (10**400): named like inf, not a bare OverflowError."""
    with pytest.raises(ValueError, match="config.json rope scaling 'factor' must be a number > 0"):
        rope_frequencies(8, 10000.0, {"rope_type": "linear", "factor": factor}, 64)


def test_qwen3_ignores_mlp_bias_as_hf_does(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), "qwen3", mlp_bias=True)
    prompt = random.Random(6).choices(range(3, 500), k=9)
    out = LLM(path, kvcache_block_size=4, max_model_len=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(path, prompt, 8)


# -- 4. a tied config whose checkpoint also stores lm_head.weight ---------------------------------------
def _add_stored_head(path, noise: float):
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    gen = torch.Generator().manual_seed(1)
    embed = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = embed + noise * torch.randn(embed.shape, generator=gen)
    save_file(sd, file, metadata={"format": "pt"})


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_tied_config_with_a_stored_lm_head_behaves_as_hf(tmp_path, arch, noise):
    path = make_tiny_model(str(tmp_path / "m"), arch, tie_word_embeddings=True)
    _add_stored_head(path, noise)
    prompts = [random.Random(s).choices(range(3, 500), k=7) for s in range(3)]
    llm = LLM(path, kvcache_block_size=4, max_model_len=64)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [g["token_ids"] for g in got] == [hf_greedy(path, p, 10) for p in prompts]
    model = llm.model_runner.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (noise == 0.0)


# -- 5. the loader follows model.safetensors.index.json -------------------------------------------------
def _sharded(tmp_path, num_shards=6):
    """A tiny Qwen3 saved as `num_shards` shards + model.safetensors.index.json; returns (path, state dict)."""
    path = make_tiny_model(str(tmp_path / "m"), "qwen3", seed=3)
    sd = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names, weight_map = sorted(sd), {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[i::num_shards]
        save_file({n: sd[n] for n in part}, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path, sd


@pytest.mark.parametrize("stray", ["consolidated", "model-old"])
def test_loader_reads_the_shards_the_index_lists_and_nothing_else(tmp_path, stray):
    path, sd = _sharded(tmp_path)
    if stray == "consolidated":      # the same tensors under other names
        save_file({n.removeprefix("model."): t for n, t in sd.items()},
                  os.path.join(path, "consolidated.safetensors"), metadata={"format": "pt"})
    else:                            # the same names, other values
        save_file({n: t.flip(0).contiguous() for n, t in sd.items()},
                  os.path.join(path, "model-old.safetensors"), metadata={"format": "pt"})
    prompts = [random.Random(s).choices(range(3, 500), k=9) for s in range(2)]
    got = LLM(path, kvcache_block_size=4, max_model_len=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [g["token_ids"] for g in got] == [hf_greedy(path, p, 10) for p in prompts]


def test_loader_refuses_a_tensor_defined_in_two_files(tmp_path):
    path, sd = _sharded(tmp_path, num_shards=2)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    second = "model-00002-of-00002.safetensors"
    name = next(n for n, s in index["weight_map"].items() if s != second)
    extra = load_file(os.path.join(path, second))
    extra[name] = sd[name]
    save_file(extra, os.path.join(path, second), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="defined twice"):
        LLM(path, kvcache_block_size=4, max_model_len=64)


def test_loader_without_index_refuses_several_files(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), "qwen3")
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "a.safetensors"))
    shutil.copy(os.path.join(path, "a.safetensors"), os.path.join(path, "b.safetensors"))
    with pytest.raises(ValueError, match="index"):
        LLM(path, kvcache_block_size=4, max_model_len=64)


# -- 6. chat prompts are tokenized as HF's apply_chat_template does (one BOS) ---------------------------
def _model_with_bos_tokenizer(tmp_path):
    """A tiny Qwen3 whose tokenizer adds BOS (<|im_start|> = 1) and whose chat template writes it too."""
    from tokenizers import processors
    path = make_tiny_model(str(tmp_path / "m"), "qwen3", tokenizer=False)
    tok = make_tokenizer(path)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", 1)])
    tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def test_chat_adds_one_bos_like_hf(tmp_path):
    from transformers import AutoTokenizer
    path = _model_with_bos_tokenizer(tmp_path)
    conv = [{"role": "user", "content": "Hello, world!"}]
    hf_ids = AutoTokenizer.from_pretrained(path).apply_chat_template(conv, tokenize=True, add_generation_prompt=True,
                                                                     return_dict=False)
    assert hf_ids[:3] == [1, 1, 291]         # the template's BOS, then <|im_start|>user
    llm = LLM(path, kvcache_block_size=4, max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one, = llm.chat(conv, sp, use_tqdm=False)
    assert one["prompt_token_ids"] == hf_ids
    assert one["token_ids"] == hf_greedy(path, hf_ids, 6)
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "x"}]], sp,
                   use_tqdm=False)
    assert dict(two[0]) == dict(one) and two[1]["prompt_token_ids"][:2] == [1, 1]
    with pytest.raises(TypeError, match=r"messages\[0\]\[0\]"):
        llm.chat([[{"role": "user"}]], sp)
    assert llm.is_finished()


def test_cli_chat_adds_one_bos_like_hf(tmp_path, capsys):
    from nanovllm_ref.__main__ import main
    path = _model_with_bos_tokenizer(tmp_path)
    # max-model-len = the chat prompt's length: one BOS fits, a second one would not
    from transformers import AutoTokenizer
    n = len(AutoTokenizer.from_pretrained(path).apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=True, add_generation_prompt=True, return_dict=False))
    assert main(["generate", "--model", path, "--chat", "--prompt", "Hi", "--max-model-len", str(n),
                 "--max-tokens", "3", "--device", "cpu"]) == 0
    assert "[cut short: reached max_model_len" in capsys.readouterr().out


# -- finish_reason and the CLI -----------------------------------------------------------------------------
def test_finish_reason_says_why_a_completion_ended():
    path = tiny_dir("qwen3")
    llm = LLM(path, kvcache_block_size=4, max_model_len=12)
    outs = llm.generate([[5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o["finish_reason"] for o in outs] == ["length", "length"]
    assert [len(o["token_ids"]) for o in outs] == [4, 2]        # max_tokens; max_model_len
    assert set(outs[0]) == {"text", "token_ids", "prompt_token_ids", "finish_reason"}


def _weightless_model(tmp_path):
    """config.json and a tokenizer, no weights: loading the weights fails, so an error about anything
    else proves the check ran before the weights were loaded."""
    path = make_tiny_model(str(tmp_path / "m"), "qwen3")
    os.remove(os.path.join(path, "model.safetensors"))
    return path


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--max-model-len", "4", "--prompt", "The quick brown fox jumps over the lazy dog."], "max_model_len=4"),
    (["--max-model-len", "4", "--chat"], "max_model_len=4"),
])
def test_cli_checks_settings_and_prompt_lengths_before_loading_weights(tmp_path, capsys, flags, message):
    from nanovllm_ref.__main__ import main
    path = _weightless_model(tmp_path)
    argv = ["generate", "--model", path, "--device", "cpu", *flags]
    if "--prompt" not in flags:
        argv += ["--prompt", "Hello"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "safetensors" not in err


def test_cli_help_shows_defaults_and_reports_length_cut(capsys):
    from nanovllm_ref.__main__ import main
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "(default: 64)" in flat and "at most 4096 (default: None)" in flat
    assert main(["generate", "--model", tiny_dir("qwen3"), "--prompt", "Hello", "--max-tokens", "2",
                 "--device", "cpu"]) == 0
    assert "[cut short: reached max_tokens=2 (--max-tokens)]" in capsys.readouterr().out
