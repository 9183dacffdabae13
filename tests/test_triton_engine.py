"""The whole engine on the Triton back-end (KV store + prefill + decode kernels), run by the Triton
interpreter on CPU: greedy ids equal HF transformers'. On a GPU the same kernels are compiled."""
import pytest
import torch

from nanovllm_ref import SamplingParams
from engine_helpers import LLM, hf_greedy, tiny_dir

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 47))]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_triton_backend_engine_matches_hf_with_prefix_hits_and_chunks(block_size):
    path = tiny_dir("qwen3")
    # The 4th prompt extends the 3rd: its prefix is a cache hit, so prefill reads the paged cache.
    prompts = PROMPTS + [PROMPTS[2] + [3, 4]]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(path, kvcache_block_size=block_size, max_model_len=64, attention_backend="triton", device=device,
              dtype="float32", max_num_batched_tokens=24 if block_size == 4 else 1024)
    assert llm.model_runner.backend_name == "triton"
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in out] == [hf_greedy(path, p, 6) for p in prompts]
