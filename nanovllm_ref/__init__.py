"""nanovllm_ref: the reference engine of the nano-vLLM course.

    from nanovllm_ref import LLM, SamplingParams
    llm = LLM("path/to/model")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))[0]
    out.outputs[0].text                              # a RequestOutput (nanovllm_ref/outputs.py)

Swap parts of the engine for your own (the course's exercises) with `LLM(path, parts=Parts(...))`; see
nanovllm_ref/parts.py. Importing this package changes no environment variable: to run the Triton kernels on
a CPU, start Python with TRITON_INTERPRET=1 (nanovllm_ref/kernels/__init__.py says why).
"""
from nanovllm_ref.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm_ref.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "Parts", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

# `LLM` and `Parts` import torch (and the whole engine): they load on first use, so `import nanovllm_ref` (and
# the light modules under it: the scheduler, the request checks, the server's protocol) costs no torch start-up
# in a process that never builds an engine. `from nanovllm_ref import LLM` works as before. They are looked up
# each time, never stored here: this module's namespace stays as it was imported (the course's check runner
# snapshots it and counts a new name as a notebook's change).
_LAZY = {"LLM": "nanovllm_ref.llm", "Parts": "nanovllm_ref.parts"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nanovllm_ref' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
