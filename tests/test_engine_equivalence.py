"""Greedy token ids of nanovllm_ref must equal HF transformers' on the same checkpoint (the oracle): exactly
in float32; in bf16 / fp16 (the GPU runs of bench/gpu_run.sh: triton-check, flash-check) up to rounding, as
`engine_helpers.assert_matches_hf` tells it from a fault (ids equal up to a first divergence that is a near tie
on both sides)."""
import random

import pytest
import torch

from nanovllm_ref import SamplingParams
from engine_helpers import ORACLE_DTYPE, LLM, assert_matches_hf, greedy, hf_greedy, run_checked, tiny_dir

GREEDY = greedy(10, ignore_eos=True)
EXACT = ORACLE_DTYPE == torch.float32


def varied_prompts(seed=0, n=5, vocab=500, lengths=(1, 3, 7, 16, 29)):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [1, 4, 16, 256])
def test_greedy_batch_of_varied_lengths_matches_hf(arch, block_size):
    path = tiny_dir(arch)
    prompts = varied_prompts(seed=block_size)
    llm = LLM(path, kvcache_block_size=block_size, max_model_len=128, max_num_seqs=8)
    got, _ = run_checked(llm, prompts, GREEDY, outputs=True)
    assert_matches_hf(path, prompts, got, 10)


def test_llama_with_tied_embeddings_matches_hf():
    path = tiny_dir("llama", tie_word_embeddings=True)
    prompts = varied_prompts(seed=11, n=3)
    got = LLM(path, kvcache_block_size=4, max_model_len=64).generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(path, prompts, got, 10)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_cache_hits_keep_outputs_identical(block_size):
    path = tiny_dir("qwen3")
    base = varied_prompts(seed=3, n=1, lengths=(20,))[0]
    same = list(base)
    shared = base[:12] + [7, 8, 9]
    block_multiple = base[:16]                        # a multiple of every block size tested
    prompts = [base, same, shared, block_multiple, block_multiple]
    llm = LLM(path, kvcache_block_size=block_size, max_model_len=64, max_num_seqs=2)
    first, _ = run_checked(llm, prompts, GREEDY, outputs=True)
    second, _ = run_checked(llm, prompts, GREEDY, outputs=True)    # everything now hits the cache from the first
    assert_matches_hf(path, prompts, first, 10, "first call: ")
    assert_matches_hf(path, prompts, second, 10, "second call (prefix-cache hits): ")


def test_prefix_hit_on_block_multiple_prompt_recomputes_last_block():
    path = tiny_dir("qwen3")
    prompt = varied_prompts(seed=5, n=1, lengths=(8,))[0]
    llm = LLM(path, kvcache_block_size=4, max_model_len=32)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.add_request(prompt, GREEDY)
    seq = llm.scheduler.waiting[0]
    llm.scheduler.schedule()
    # 8 tokens = 2 full blocks, both cached; the last block is recomputed so there is a token to sample from.
    assert seq.num_cached_tokens == 4 and seq.num_scheduled_tokens == 4
    done = []
    while not llm.is_finished():
        done += [o for o in llm.step() if o.finished]
    assert seq.completion_token_ids == done[0].outputs[0].token_ids
    assert_matches_hf(path, [prompt], done, 10)


def test_second_request_reuses_prefix_blocks_and_skips_their_compute():
    path = tiny_dir("qwen3")
    prompt = varied_prompts(seed=6, n=1, lengths=(13,))[0]
    llm = LLM(path, kvcache_block_size=4, max_model_len=32)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.add_request(prompt + [9, 9], GREEDY)
    seq = llm.scheduler.waiting[0]
    llm.scheduler.schedule()
    assert seq.num_cached_tokens == 12                # 3 full blocks of the first prompt


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_chunked_prefill_with_small_token_budget_matches_hf(budget):
    path = tiny_dir("qwen3")
    prompts = varied_prompts(seed=budget, n=4, lengths=(29, 3, 17, 40))
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, max_num_batched_tokens=budget)
    got, steps = run_checked(llm, prompts, GREEDY, outputs=True)
    assert_matches_hf(path, prompts, got, 10)
    assert steps >= sum(len(p) for p in prompts) // budget      # the prompts really were cut into chunks


def test_forced_preemption_with_few_blocks_matches_hf():
    path = tiny_dir("llama")
    prompts = varied_prompts(seed=9, n=6, lengths=(9, 14, 5, 11))
    llm = LLM(path, kvcache_block_size=4, max_model_len=64, num_kvcache_blocks=12)
    got, _ = run_checked(llm, prompts, greedy(24, ignore_eos=True), outputs=True)
    assert llm.scheduler.num_preemptions > 0
    assert_matches_hf(path, prompts, got, 24)


def test_max_tokens_1_returns_exactly_the_first_greedy_token():
    path = tiny_dir("qwen3")
    prompts = varied_prompts(seed=12, n=3)
    out = LLM(path, kvcache_block_size=4, max_model_len=64).generate(prompts, greedy(1), use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [1, 1, 1]
    assert_matches_hf(path, prompts, out, 1)


def test_eos_stops_generation_unless_ignore_eos():
    path = tiny_dir("qwen3")
    prompt = varied_prompts(seed=13, n=1, lengths=(6,))[0]
    free_run = hf_greedy(path, prompt, 12)
    eos_token = free_run[4]                                   # pretend the 5th greedy token is the EOS
    path_eos = tiny_dir("qwen3", eos_token_id=eos_token)
    stop_at = free_run.index(eos_token) + 1
    llm = LLM(path_eos, kvcache_block_size=4, max_model_len=64)
    stopped, ignored = llm.generate([prompt, prompt], [greedy(12), greedy(12, ignore_eos=True)], use_tqdm=False)
    assert_matches_hf(path_eos, [prompt], [ignored], 12)
    if EXACT:
        assert stopped["token_ids"] == free_run[:stop_at] == hf_greedy(path_eos, prompt, 12, eos=[eos_token, 2])
        assert ignored["token_ids"] == free_run
    else:         # in a half dtype our own run may part from HF's before the eos: ours must stop at our first eos
        ours = ignored["token_ids"]
        cut = ours.index(eos_token) + 1 if eos_token in ours else len(ours)
        assert stopped["token_ids"] == ours[:cut]


def test_per_prompt_sampling_params_and_mixed_greedy_sampled_batch():
    path = tiny_dir("qwen3")
    prompts = varied_prompts(seed=14, n=4)
    sps = [greedy(3, ignore_eos=True), SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True),
           greedy(9, ignore_eos=True), SamplingParams(temperature=0.5, max_tokens=1)]
    out = LLM(path, kvcache_block_size=4, max_model_len=64).generate(prompts, sps, use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [3, 7, 9, 1]
    assert_matches_hf(path, [prompts[0]], [out[0]], 3)
    assert_matches_hf(path, [prompts[2]], [out[2]], 9)


def test_string_prompts_decode_to_text():
    path = tiny_dir("qwen3")
    llm = LLM(path, kvcache_block_size=4, max_model_len=64)
    out = llm.generate(["Hello, world!", "The capital of France is"], GREEDY, use_tqdm=False)
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)      # noqa: E731
    for o in out:   # the text is decoded with the prompt's end as context (tests/test_engine_detokenizer.py)
        assert decode(o["prompt_token_ids"]) + o["text"] == decode(o["prompt_token_ids"] + o["token_ids"])
        assert len(o["token_ids"]) == 10


def test_sampling_with_same_seed_is_reproducible():
    path = tiny_dir("qwen3")
    prompts = varied_prompts(seed=15, n=3)
    sp = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True)
    a = LLM(path, kvcache_block_size=4, max_model_len=64, seed=1).generate(prompts, sp, use_tqdm=False)
    b = LLM(path, kvcache_block_size=4, max_model_len=64, seed=1).generate(prompts, sp, use_tqdm=False)
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
