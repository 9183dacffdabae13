"""Shared helpers for the engine tests: tiny checkpoints, the HF transformers oracle, and `LLM`.

`LLM` here is nanovllm_ref.LLM with extra default engine arguments taken from the JSON in the environment
variable NANOVLLM_TEST_ENGINE_ARGS, so the GPU run (bench/gpu_run.sh) can repeat the same equivalence tests
with, e.g., {"dtype": "float32", "attention_backend": "triton", "enforce_eager": false}, or the FlashAttention
back-end, {"dtype": "bfloat16", "attention_backend": "flash_attn"}. Then a test whose own block size the
installed FlashAttention cannot take (flash-attn: multiples of 256; vLLM's FA3, flash-attn-4: of 16) is
skipped with that reason, and the HF oracle runs in the same half dtype (FlashAttention has no float32).
"""
import functools
import json
import os
import tempfile
import warnings

import pytest
import torch

import nanovllm_ref
from nanovllm_models.tiny import make_tiny_model
from nanovllm_ref.engine.invariants import check_block_manager


TEST_ENGINE_ARGS = json.loads(os.environ.get("NANOVLLM_TEST_ENGINE_ARGS") or "{}")
ORACLE_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(TEST_ENGINE_ARGS.get("dtype"), torch.float32)


def skip_unless_env_backend_takes(engine_args: dict) -> None:
    """Skip when the back-end named by NANOVLLM_TEST_ENGINE_ARGS (not by the test) is flash_attn and the
    installed FlashAttention cannot take the test's block size (the engine would refuse it by name)."""
    if TEST_ENGINE_ARGS.get("attention_backend") != "flash_attn" or "attention_backend" in engine_args:
        return
    from nanovllm_ref.attn import flash_attn_impl
    impl, block_size = flash_attn_impl(), engine_args.get("kvcache_block_size")
    if impl is not None and block_size and block_size % impl.block_multiple:
        pytest.skip(f"{impl.name} takes KV blocks of a multiple of {impl.block_multiple}; this test uses {block_size}")


def LLM(model, **engine_args):
    skip_unless_env_backend_takes(engine_args)
    return nanovllm_ref.LLM(model, **{**TEST_ENGINE_ARGS, **engine_args})


@functools.lru_cache(maxsize=None)
def tiny_dir(arch: str = "qwen3", **overrides) -> str:
    return make_tiny_model(tempfile.mkdtemp(prefix=f"tiny_{arch}_"), arch, **overrides)


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=ORACLE_DTYPE).eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None) -> list[int]:
    """HF transformers greedy completion ids (the oracle). eos=None: never stop early."""
    model = hf_model(path)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    ids = out[0, len(prompt):].tolist()
    if eos:   # HF pads after eos in a batch of one? keep up to and including the first eos
        for i, t in enumerate(ids):
            if t in eos:
                return ids[:i + 1]
    return ids


def divergence(path: str, prompt: list[int], got: list[int], want: list[int]) -> str:
    """Where `got` first leaves HF's greedy `want`, and how close HF's own choice was there: the gap between
    HF's top two logits at that position (float32 of the oracle dtype's logits) and the rank of our token.
    A gap near the dtype's rounding (bf16: ~1e-2 of the logit scale) is a near-tie that a different kernel
    may break either way; a wide one is a real fault. For assertion messages; "" when they agree."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if got == want:
        return ""
    if i >= min(len(got), len(want)):
        return f"lengths differ: {len(got)} tokens vs HF's {len(want)}"
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt + want[:i]])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    rank = int((logits > logits[got[i]]).sum())
    return (f"first differs at token {i}: ours {got[i]}, HF {want[i]}; HF's top-2 logit gap there "
            f"{float(top.values[0] - top.values[1]):.3g} ({ORACLE_DTYPE}), our token is HF's rank {rank} "
            f"({float(top.values[0] - logits[got[i]]):.3g} below its top)")


def run_checked(llm, prompts, sampling_params):
    """Like llm.generate, but checks the BlockManager invariants after every step.

    Returns (completions in input order, number of steps)."""
    if not isinstance(sampling_params, list):
        sampling_params = [sampling_params] * len(prompts)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
    sched = llm.scheduler
    done, steps = {}, 0
    while not llm.is_finished():
        outs = llm.step()
        steps += 1
        done.update((o.request_id, o.outputs[0].token_ids) for o in outs if o.finished)
        check_block_manager(sched.block_manager, list(sched.running) + list(sched.waiting))
    bm = sched.block_manager
    assert not sched.running and not sched.waiting
    assert bm.num_free_blocks == len(bm.blocks), "blocks leaked after all requests finished"
    assert all(b.ref_count == 0 for b in bm.blocks)
    return [done[i] for i in ids], steps
