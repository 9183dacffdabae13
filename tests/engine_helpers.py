"""Shared helpers for the engine tests: tiny checkpoints, the HF transformers oracle, and `LLM`.

`LLM` here is nanovllm_ref.LLM with extra default engine arguments taken from the JSON in the environment
variable NANOVLLM_TEST_ENGINE_ARGS, so the GPU run (bench/gpu_run.sh) can repeat the same equivalence tests
with, e.g., {"dtype": "float32", "attention_backend": "triton", "enforce_eager": false}.
"""
import functools
import json
import os
import tempfile
import warnings

import torch

import nanovllm_ref
from nanovllm_ref.engine.invariants import check_block_manager
from nanovllm_ref.tiny import make_tiny_model


TEST_ENGINE_ARGS = json.loads(os.environ.get("NANOVLLM_TEST_ENGINE_ARGS") or "{}")


def LLM(model, **engine_args):
    return nanovllm_ref.LLM(model, **{**TEST_ENGINE_ARGS, **engine_args})


@functools.lru_cache(maxsize=None)
def tiny_dir(arch: str = "qwen3", **overrides) -> str:
    return make_tiny_model(tempfile.mkdtemp(prefix=f"tiny_{arch}_"), arch, **overrides)


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


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
