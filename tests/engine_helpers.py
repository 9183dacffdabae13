"""Shared helpers for the engine tests: tiny checkpoints, the HF transformers oracle, and `LLM`.

`LLM` here is nanovllm_ref.LLM with extra default engine arguments taken from the JSON in the environment
variable NANOVLLM_TEST_ENGINE_ARGS, so the GPU run (bench/gpu_run.sh) can repeat the same equivalence tests
with, e.g., {"dtype": "float32", "attention_backend": "triton", "enforce_eager": false}, or the FlashAttention
back-end, {"dtype": "bfloat16", "attention_backend": "flash_attn"}. Then a test whose own block size the
installed FlashAttention cannot take (flash-attn: multiples of 256; vLLM's FA3, flash-attn-4: of 16) is
skipped with that reason, and the HF oracle runs in the same half dtype (FlashAttention has no float32).

Equivalence that tells rounding from faults (`assert_matches_hf`): in float32 greedy ids must equal HF's
exactly. In a half dtype two correct engines round differently, and where HF's two best tokens are a near tie
either may win, after which the sequences part ways: there `check_logprobs_close` applies (vLLM's
`check_logprobs_close`, tests/models/utils.py, plus a stated gap tolerance): ids equal up to the first
divergence; at it, each side's token must be among the other side's CLOSE_TOP_K most likely, and no more than
`half_tolerance(top logit)` below that side's top logit; the comparison stops there. A token outside HF's top
few, or a gap beyond the tolerance, is a fault.
"""
import functools
import json
import math
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
def hf_model(path: str, dtype: torch.dtype | None = None):
    """HF transformers' model of the checkpoint, in `dtype` (default the oracle's, ORACLE_DTYPE)."""
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or ORACLE_DTYPE).eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None,
              dtype: torch.dtype | None = None) -> list[int]:
    """HF transformers greedy completion ids (the oracle, in `dtype`, default ORACLE_DTYPE). eos=None: never
    stop early."""
    model = hf_model(path, dtype)
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


# At a divergence in bf16/fp16 (module docstring): each side's token must be among the other side's top
# CLOSE_TOP_K and within HALF_ULPS steps of the dtype at the magnitude of the top logit (bf16 keeps 8
# significant bits, so a step at |x| is 2**(floor(log2|x|) - 7); fp16: 2**(floor(log2|x|) - 10)), and at least
# HALF_ABS_TOL logits: the logits of two correct engines differ by a few such steps after 2-4 layers of
# rounding (measured on the tiny models, CPU bf16 against HF bf16: tests/test_logprobs_close.py).
CLOSE_TOP_K = 5
HALF_ULPS = 8
HALF_ABS_TOL = 0.0625
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def half_tolerance(top_logit: float, dtype: torch.dtype = None) -> float:
    """The largest logit gap a near tie may have in `dtype` (default the oracle's): HALF_ULPS steps of the dtype
    at |top_logit|, and no less than HALF_ABS_TOL."""
    bits = _MANTISSA_BITS.get(dtype or ORACLE_DTYPE, 7)
    step = 2.0 ** (math.floor(math.log2(abs(top_logit))) - bits) if top_logit else 0.0
    return max(HALF_ULPS * step, HALF_ABS_TOL)


def check_logprobs_close(ours: list[int], ours_top: list[dict], ref: list[int], ref_logits, *,
                         k: int = CLOSE_TOP_K, tolerance=half_tolerance) -> str:
    """"" when `ours` is close to the reference `ref` (module docstring), else what is wrong.

    ours: our token ids; ours_top: per token, {token id: logprob} holding at least our k most likely tokens at
    that step (CompletionOutput.logprobs with SamplingParams(logprobs >= k), values floats or Logprob objects);
    ref: the reference's ids; ref_logits: [len(ref), vocab] (a tensor or nested lists) of the reference's raw
    logits at each of its steps; tolerance(top) -> the largest gap allowed below a top logit (logit units; a
    logprob gap is the same number). Compares up to the first divergence only, where both sides have computed
    the same prefix."""
    n = min(len(ours), len(ref))
    i = next((j for j in range(n) if ours[j] != ref[j]), None)
    if i is None:
        return "" if len(ours) == len(ref) else f"lengths differ: {len(ours)} tokens vs the reference's {len(ref)}"
    logits = torch.as_tensor(ref_logits[i], dtype=torch.float32)
    a, b = ours[i], ref[i]
    ref_top = float(logits.max())
    ref_rank = int((logits > logits[a]).sum())            # 0 = the reference's best
    ref_gap = ref_top - float(logits[a])
    where = f"first divergence at token {i}: ours {a}, reference {b}"
    if ref_rank >= k:
        return f"{where}; our token is the reference's rank {ref_rank + 1} (outside its top {k}): a fault, not rounding"
    if ref_gap > tolerance(ref_top):
        return (f"{where}; our token is {ref_gap:.4g} below the reference's top logit {ref_top:.4g} (tolerance "
                f"{tolerance(ref_top):.4g}): a fault, not rounding")
    mine = {t: float(getattr(v, "logprob", v)) for t, v in ours_top[i].items()}
    top_k = sorted(mine, key=lambda t: -mine[t])[:k]
    if b not in top_k:
        return f"{where}; the reference's token is not in our top {k} ({top_k}): a fault, not rounding"
    our_top = mine[top_k[0]]
    if our_top - mine[b] > tolerance(ref_top):
        return (f"{where}; the reference's token is {our_top - mine[b]:.4g} below our top logprob (tolerance "
                f"{tolerance(ref_top):.4g}): a fault, not rounding")
    return ""


@functools.lru_cache(maxsize=None)
def hf_greedy_logits(path: str, prompt: tuple, max_new_tokens: int, dtype: torch.dtype | None = None):
    """HF's greedy ids and its raw logits at each step ([max_new_tokens, vocab] fp32 of the `dtype` model,
    default the oracle's), never stopping early."""
    model = hf_model(path, dtype)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def greedy(max_tokens: int, dtype: torch.dtype | None = None, **kw):
    """SamplingParams of a greedy run checked against HF: with logprobs (CLOSE_TOP_K) in a half dtype (default
    the oracle's), where `assert_matches_hf` needs them; none in float32, where ids must match exactly."""
    from nanovllm_ref import SamplingParams
    half = (dtype or ORACLE_DTYPE) != torch.float32
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=CLOSE_TOP_K if half else None, **kw)


def matches_hf(path: str, prompt: list[int], got, max_new_tokens: int, dtype: torch.dtype | None = None) -> str:
    """"" when `got` (a CompletionOutput of a greedy, ignore_eos run of an engine in `dtype`, default the
    oracle's) is HF's greedy continuation in that dtype: exactly in float32, by check_logprobs_close in a half
    dtype (module docstring); else what differs."""
    ids, dtype = list(got.token_ids), dtype or ORACLE_DTYPE
    if dtype == torch.float32:
        want = hf_greedy(path, prompt, max_new_tokens, dtype=dtype)
        return "" if ids == want else divergence(path, prompt, ids, want)
    want, logits = hf_greedy_logits(path, tuple(prompt), max_new_tokens, dtype)
    if got.logprobs is None:
        raise ValueError("a half-dtype run needs logprobs to tell rounding from faults: use greedy(...)")
    return check_logprobs_close(ids, got.logprobs, want, logits, tolerance=lambda top: half_tolerance(top, dtype))


def assert_matches_hf(path: str, prompts, outs, max_new_tokens: int, what: str = "",
                      dtype: torch.dtype | None = None) -> None:
    """matches_hf for each (prompt, CompletionOutput or RequestOutput); AssertionError naming the first that
    does not."""
    for j, (p, o) in enumerate(zip(prompts, outs)):
        o = o.outputs[0] if hasattr(o, "outputs") else o
        msg = matches_hf(path, p, o, max_new_tokens, dtype)
        assert not msg, f"{what}prompt {j}: {msg}"


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


def sampling_batch(llm, seqs):
    """A StepBatch holding only the sampling rows of `seqs` (engine/sampling_inputs.sampling_rows): what
    ModelRunner.processing / sample read, for tests of the sampling side alone."""
    from nanovllm_ref.engine.sampling_inputs import sampling_rows
    from nanovllm_ref.engine.step_batch import StepBatch
    return StepBatch(False, None, sampling=sampling_rows(seqs, llm.config.eos, llm.config.hf_config.vocab_size))


def run_checked(llm, prompts, sampling_params, outputs: bool = False):
    """Like llm.generate, but checks the BlockManager invariants after every step.

    Returns (completions in input order, number of steps): their token id lists, or with `outputs` their
    CompletionOutputs (token_ids, logprobs)."""
    if not isinstance(sampling_params, list):
        sampling_params = [sampling_params] * len(prompts)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
    sched = llm.scheduler
    done, steps = {}, 0
    while not llm.is_finished():
        outs = llm.step()
        steps += 1
        done.update((o.request_id, o.outputs[0] if outputs else o.outputs[0].token_ids) for o in outs if o.finished)
        check_block_manager(sched.block_manager, list(sched.running) + list(sched.waiting))
    bm = sched.block_manager
    assert not sched.running and not sched.waiting
    assert bm.num_free_blocks == len(bm.blocks), "blocks leaked after all requests finished"
    assert all(b.ref_count == 0 for b in bm.blocks)
    return [done[i] for i in ids], steps


def live_parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process, from /proc (the process tests' way of seeing what a
    run left behind)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                out[int(entry)] = int(fields[1])
    return out
