"""Checks and helpers for chapter 00, set-up and tour (reference: nanovllm_ref/llm.py,
nanovllm_ref/engine/llm_engine.py).

E0.1 `complete(llm, prompt, max_tokens) -> str`: the greedy completion of one prompt.
The check runs the student's function on a tiny random Qwen3 checkpoint (made once per process, no download)
for several prompts and lengths, and compares the text with `llm.generate` at temperature 0 exactly
(greedy decoding is deterministic). The spec says "no progress bar": the check also fails when the
student's call to `llm.generate` leaves `use_tqdm` on (the bar itself is not drawn during the check).
"""
import contextlib
import functools
import io
import os
import platform
import warnings

from nanovllm_course.common import call_student, check_type, fail, fresh_generator, ok, randint, \
    tiny_model_dir

PROMPTS = ("The capital of France is", "Hello", "def f(x):", "A paged KV cache",
           "Continuous batching adds", "0123", "The quick brown fox", "Tensor parallelism splits")


@contextlib.contextmanager
def quiet():
    """Swallow warnings, progress bars and anything printed to stdout/stderr (model loading)."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), \
            contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        except Exception:
            pass
        yield


@functools.lru_cache(maxsize=None)
def tiny_llm():
    """An LLM over a tiny random Qwen3 checkpoint on the CPU (fp32), made once per process."""
    from nanovllm_ref import LLM
    with quiet():
        return LLM(tiny_model_dir("qwen3"), max_model_len=128, kvcache_block_size=16, num_kvcache_blocks=64,
                   device="cpu", enforce_eager=True)


def reference_complete(llm, prompt: str, max_tokens: int) -> str:
    """The reference answer to E0.1."""
    from nanovllm_ref import SamplingParams
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return out[0]["text"]


class _RecordingLLM:
    """Passes everything through to the real LLM, but records each generate call's `use_tqdm` and runs it
    without a progress bar (so a left-on bar fails the check instead of drawing over the verdict)."""

    def __init__(self, llm):
        self._llm, self.tqdm_calls = llm, []

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True, **kwargs):
        self.tqdm_calls.append(bool(use_tqdm))
        return self._llm.generate(prompts, sampling_params, use_tqdm=False, **kwargs)


def check_complete(complete) -> None:
    """E0.1: `complete(llm, prompt, max_tokens)` must return the greedy completion text."""
    tag = "E0.1"
    g = fresh_generator()
    llm = tiny_llm()
    picks = [PROMPTS[randint(g, 0, len(PROMPTS) - 1)] for _ in range(3)]
    for prompt, max_tokens in zip(picks, (1, randint(g, 2, 6), randint(g, 7, 16))):
        with quiet():
            expected = reference_complete(llm, prompt, max_tokens)
        recorder = _RecordingLLM(llm)
        got = call_student(tag, complete, recorder, prompt, max_tokens)
        check_type(tag, got, str, f"complete(llm, {prompt!r}, {max_tokens})",
                   hint="return out[0]['text'], the decoded completion, not the dict or the token ids")
        if got != expected:
            if got.startswith(prompt) and got[len(prompt):] == expected:
                hint = "return only the completion: generate's 'text' does not include the prompt"
            elif len(got) > len(expected) * 2 + 8:
                hint = "pass max_tokens to SamplingParams (the default is 64 tokens)"
            else:
                hint = ("use SamplingParams(temperature=0, max_tokens=max_tokens): temperature 0 is greedy; "
                        "the default temperature 1.0 samples")
            fail(tag, f"complete(llm, {prompt!r}, max_tokens={max_tokens}) returned {got[:60]!r}, the greedy "
                      f"completion is {expected[:60]!r}", hint)
        if any(recorder.tqdm_calls):
            fail(tag, "complete(...) draws a progress bar: llm.generate was called with use_tqdm on (its default)",
                 "pass use_tqdm=False to llm.generate: the spec asks for no progress bar")
    ok(tag)


# -- environment doctor -----------------------------------------------------------------------------------
def _version(module: str):
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "installed")
    except Exception as exc:           # ImportError, or a broken install
        return None if isinstance(exc, ImportError) else f"broken ({type(exc).__name__})"


def environment_report() -> list[str]:
    """Human-readable lines about this machine: Python, torch, CUDA, Triton, flash-attn, cores."""
    import torch
    lines = [f"python        {platform.python_version()} ({platform.machine()})",
             f"torch         {torch.__version__}"]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        cap = torch.cuda.get_device_capability(0)
        lines.append(f"CUDA          {torch.version.cuda}: {len(names)} GPU(s), {names[0]}, sm_{cap[0]}{cap[1]}")
    else:
        lines.append("CUDA          not available: everything runs on the CPU (cells tagged 'gpu' are skipped)")
    for name, module, why in (("triton", "triton", "chapter 06 kernels"),
                              ("flash-attn", "flash_attn", "fastest attention back-end")):
        v = _version(module)
        lines.append(f"{name:<13} {v if v else 'not installed'}  ({why})")
    lines.append(f"transformers  {_version('transformers')}")
    lines.append(f"CPU cores     {os.cpu_count()}")
    from nanovllm_ref.attn import resolve_backend
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with contextlib.suppress(Exception):
        lines.append(f"attention     backend 'auto' resolves to '{resolve_backend('auto', device)}' on {device}")
    return lines


# -- throughput demo (GPU cell and figures_ch00) -------------------------------------------------------------
def decode_throughput(llm, batch_sizes, prompt_len: int = 16, max_tokens: int = 64, repeats: int = 1) -> dict:
    """Decode tokens/s of `llm` at each batch size: batch_size prompts of `prompt_len` tokens each generate
    `max_tokens` tokens (ignore_eos). Prefill time is measured separately (max_tokens=1) and subtracted."""
    import time

    from nanovllm_ref import SamplingParams

    def run(batch, n):
        prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        return best

    run(min(batch_sizes), 4)                                         # warm-up
    result = {}
    for b in batch_sizes:
        t_prefill, t_all = run(b, 1), run(b, max_tokens)
        result[b] = b * (max_tokens - 1) / max(t_all - t_prefill, 1e-9)
    return result


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import Exercise, exercises  # noqa: E402

EXERCISES = exercises(
    Exercise("E0.1", check_complete, ("complete",), (reference_complete,)),
)
