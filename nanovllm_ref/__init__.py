"""nanovllm_ref: the reference engine of the nano-vLLM course.

    from nanovllm_ref import LLM, SamplingParams
    llm = LLM("path/to/model")
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))
"""
from nanovllm_ref.llm import LLM
from nanovllm_ref.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
