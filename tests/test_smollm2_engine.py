"""The real model: nanovllm_ref's greedy output on SmolLM2-135M-Instruct equals HF transformers' reference ids."""
import pytest
import torch

from engine_helpers import greedy, matches_hf
from nanovllm_models.download import ensure_model
from nanovllm_ref import LLM, SamplingParams

PROMPT_IDS = [504, 3575, 282, 4649, 314]          # "The capital of France is"
REFERENCE = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216]


@pytest.fixture(scope="module")
def smollm2():
    return str(ensure_model())


def test_smollm2_greedy_matches_hf_reference_ids_in_float32(smollm2):
    llm = LLM(smollm2, dtype="float32", max_model_len=256, kvcache_block_size=16)
    assert llm.tokenizer.encode("The capital of France is") == PROMPT_IDS
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert out[0]["token_ids"] == REFERENCE
    assert out[0]["text"] == " Paris.\n\nThe answer is: 2018-01-22 "


def test_smollm2_bfloat16_is_close_to_hf_bfloat16_on_this_cpu(smollm2):
    """bf16 on a CPU rounds by the CPU's kernels (oneDNN picks AMX-bf16 or AVX-512-bf16 where the CPU has them), so
    HF's own bf16 ids are not the same on every machine (on one with AMX-bf16, REFERENCE's token 17 flips). The
    check is the suite's bf16 rule against HF run here: ids equal up to the first divergence, and there a near
    tie within bf16's tolerance (engine_helpers.check_logprobs_close). The answer itself does not move."""
    llm = LLM(smollm2, dtype="bfloat16", max_model_len=256, kvcache_block_size=16)
    out = llm.generate([PROMPT_IDS], greedy(20, torch.bfloat16, ignore_eos=True), use_tqdm=False)[0]
    assert out["token_ids"][:8] == REFERENCE[:8] and out["text"].startswith(" Paris.")
    msg = matches_hf(smollm2, PROMPT_IDS, out.outputs[0], 20, torch.bfloat16)
    assert not msg, msg


def test_smollm2_chunked_prefill_and_prefix_hits_keep_reference_ids(smollm2):
    # fp32: the second prompt's continuation equals the reference only up to rounding, and bf16 rounding
    # differs between a prefill and a decode step (seen on the H200: one id flips at position 11).
    llm = LLM(smollm2, max_model_len=256, kvcache_block_size=2, max_num_batched_tokens=3, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=20)
    out = llm.generate([PROMPT_IDS, PROMPT_IDS + REFERENCE[:6]], sp, use_tqdm=False)
    assert out[0]["token_ids"] == REFERENCE
    assert out[1]["token_ids"][:14] == REFERENCE[6:]
