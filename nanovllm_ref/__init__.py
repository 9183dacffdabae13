"""nanovllm_ref: the reference engine of the nano-vLLM course.

    from nanovllm_ref import LLM, SamplingParams
    llm = LLM("path/to/model")
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))
"""
import os
import sys

import torch

# Without CUDA, Triton kernels can only run in the Triton interpreter, which must be on before triton is
# first imported (transformers and torch may import it early). Switch it on now unless the user decided.
TRITON_IMPORTED_WITHOUT_INTERPRETER = False
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    TRITON_IMPORTED_WITHOUT_INTERPRETER = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"

from nanovllm_ref.llm import LLM  # noqa: E402
from nanovllm_ref.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
