"""The real model: nanovllm_ref's greedy output on SmolLM2-135M-Instruct equals HF transformers' reference ids."""
import pytest

from nanovllm_ref import LLM, SamplingParams
from nanovllm_models.download import ensure_model

PROMPT_IDS = [504, 3575, 282, 4649, 314]          # "The capital of France is"
REFERENCE = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216]


@pytest.fixture(scope="module")
def smollm2():
    return str(ensure_model())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_greedy_matches_hf_reference_ids(smollm2, dtype):
    llm = LLM(smollm2, dtype=dtype, max_model_len=256, kvcache_block_size=16)
    assert llm.tokenizer.encode("The capital of France is") == PROMPT_IDS
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert out[0]["token_ids"] == REFERENCE
    assert out[0]["text"] == " Paris.\n\nThe answer is: 2018-01-22 "


def test_smollm2_chunked_prefill_and_prefix_hits_keep_reference_ids(smollm2):
    # fp32: the second prompt's continuation equals the reference only up to rounding, and bf16 rounding
    # differs between a prefill and a decode step (seen on the H200: one id flips at position 11).
    llm = LLM(smollm2, max_model_len=256, kvcache_block_size=2, max_num_batched_tokens=3, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=20)
    out = llm.generate([PROMPT_IDS, PROMPT_IDS + REFERENCE[:6]], sp, use_tqdm=False)
    assert out[0]["token_ids"] == REFERENCE
    assert out[1]["token_ids"][:14] == REFERENCE[6:]
