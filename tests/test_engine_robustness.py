"""Regressions from a newcomer's attempt to break the engine: each test names the behaviour it guards."""
import json
import math
import os
import shutil
import tempfile

import numpy as np
import pytest

from nanovllm_ref import SamplingParams
from engine_helpers import LLM, hf_greedy, tiny_dir

G = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
P = [5, 6, 7]


def _copy_model(**edits):
    dst = tempfile.mkdtemp()
    shutil.copytree(tiny_dir("qwen3"), dst, dirs_exist_ok=True)
    return dst


def test_tp1_engine_stays_correct_while_a_tp2_engine_is_alive():
    path = tiny_dir("qwen3")
    single = LLM(path, kvcache_block_size=4, max_model_len=64)
    with LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64) as tp2:
        assert single.generate([P], G, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, P, 6)
        assert tp2.generate([P], G, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, P, 6)
        with pytest.raises(ValueError, match="another tensor-parallel engine"):
            LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64)
        late = LLM(path, kvcache_block_size=4, max_model_len=64)     # built after the TP engine
        assert tp2.generate([P], G, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, P, 6)
        assert late.generate([P], G, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, P, 6)


def test_failed_tp_start_does_not_block_the_next_tp_engine():
    path = tiny_dir("qwen3")
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64, num_kvcache_blocks=10**12)
    with LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64) as llm:
        assert llm.generate([P], G, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, P, 6)


def test_interrupted_generate_leaves_the_engine_usable():
    path = tiny_dir("qwen3")
    llm = LLM(path, kvcache_block_size=4, max_model_len=64)
    real_step, calls = llm._step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    llm._step = interrupted_step                  # what generate() calls once per step
    with pytest.raises(KeyboardInterrupt):
        llm.generate([P, [8, 9, 10, 11]], G, use_tqdm=False)
    llm._step = real_step
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and bm.num_free_blocks == len(bm.blocks)
    assert llm.generate([P], G, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, P, 6)


def test_tiny_temperature_is_greedy_and_sampling_params_are_frozen():
    path = tiny_dir("qwen3")
    sp = SamplingParams(temperature=1e-38, max_tokens=6, ignore_eos=True)
    assert sp.temperature == 0.0
    out = LLM(path, kvcache_block_size=4, max_model_len=64).generate([P], sp, use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(path, P, 6)
    with pytest.raises(AttributeError):
        sp.max_tokens = 0


def test_numpy_integers_are_accepted_as_token_ids_and_limits():
    path = tiny_dir("qwen3")
    sp = SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(6), ignore_eos=True)
    out = LLM(path, kvcache_block_size=4, max_model_len=64).generate([np.array(P, dtype=np.int64).tolist(),
                                                                      [np.int64(t) for t in P]], sp, use_tqdm=False)
    assert out[0]["token_ids"] == out[1]["token_ids"] == hf_greedy(path, P, 6)


def test_requests_whose_last_token_needs_no_kv_block_fit_exactly():
    # 3 prompt tokens + 10 new ones: K/V is written for 12 tokens (the last sampled one never is): 3 blocks of 4.
    path = tiny_dir("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = LLM(path, kvcache_block_size=4, max_model_len=64, num_kvcache_blocks=3).generate([P], sp, use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(path, P, 10)


def test_engine_after_exit_and_idle_step():
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, max_model_len=64)
    assert llm.step() == [] and llm.last_step is None
    llm.exit()
    for call in (lambda: llm.add_request(P, G), llm.step, lambda: llm.generate([P], G)):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(cpu_kvcache_space_gib=math.inf), ValueError, "cpu_kvcache_space_gib"),
    (dict(gpu_memory_utilization=True), TypeError, "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(cpu_kvcache_space_gib=10**400), ValueError, r"cpu_kvcache_space_gib must be a number in \(0, 2\*\*20\)"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(enforce_eager="no"), TypeError, "enforce_eager"),
    (dict(enable_prefix_caching=0), TypeError, "enable_prefix_caching"),
])
def test_more_bad_engine_arguments_name_themselves(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LLM(tiny_dir("qwen3"), **kwargs)


def test_numpy_engine_arguments_are_accepted():
    llm = LLM(tiny_dir("qwen3"), max_num_seqs=np.int64(3), max_model_len=np.int32(32), kvcache_block_size=np.int64(4),
              num_kvcache_blocks=np.int64(8), cpu_kvcache_space_gib=np.float32(0.5), device="cpu")
    assert llm.config.num_kvcache_blocks == 8 and type(llm.config.max_model_len) is int
    assert llm.generate([P], G, use_tqdm=False)[0]["token_ids"] == hf_greedy(tiny_dir("qwen3"), P, 6)


def _edit(path, name, text=None, data=None):
    with open(os.path.join(path, name), "w" if text is not None else "wb") as f:
        f.write(text if text is not None else data)


@pytest.mark.parametrize("case,match", [
    ("config_list", "JSON object"),
    ("config_invalid", "cannot read"),
    ("truncated_weights", "cannot read safetensors"),
    ("wrong_shape", "does not fit parameter"),
    ("no_tokenizer", "tokenizer"),
])
def test_broken_model_folders_raise_value_errors_that_say_what_is_wrong(case, match):
    path = _copy_model()
    if case == "config_list":
        _edit(path, "config.json", "[1, 2]")
    elif case == "config_invalid":
        _edit(path, "config.json", "{not json")
    elif case == "truncated_weights":
        _edit(path, "model.safetensors", data=b"\x05\x00")
    elif case == "wrong_shape":
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg["intermediate_size"] = 96
        _edit(path, "config.json", json.dumps(cfg))
    elif case == "no_tokenizer":
        for name in os.listdir(path):
            if name.startswith(("tokenizer", "chat_template", "special_tokens")):
                os.remove(os.path.join(path, name))
    with pytest.raises(ValueError, match=match):
        LLM(path)
