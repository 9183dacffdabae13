"""What the decode-step kernels share: rounding as PyTorch rounds, the interpreter switch, and PDL (chapter 10).

Rounding
    The fused kernels replace chains of PyTorch ops, and each op of the chain writes its result in the
    model dtype (bf16 on a GPU): the GEMM output, the residual sum, the normed value before the weight
    multiply. To give the same numbers the kernels keep their maths in fp32 and round to the model dtype
    at exactly the points where the PyTorch chain rounds (`round_to`). Under the Triton interpreter a
    cast from fp32 to bf16 truncates instead of rounding to nearest even, so there `round_to` rounds with
    integer bit operations (the same result a GPU's cvt.rn.bf16.f32 gives, NaN aside).

Interpreter
    On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, chosen before
    these modules are imported; see nanovllm_ref/kernels/__init__.py). Its arithmetic on bf16 values is not
    trustworthy, so every kernel casts its loads to fp32 first, as the attention kernels do.

Programmatic dependent launch (PDL)
    On Hopper a kernel launched with the PDL attribute may start while the kernel before it in the stream
    is still finishing; it must wait (`griddepcontrol.wait`, Triton's `tl.extra.cuda.gdc_wait`) before it
    reads what that kernel wrote or writes what it reads. Each kernel here calls the wait first when its
    USE_PDL constant is set, and `pdl_launch_kwargs` adds Triton's `launch_pdl=True` launch option. The
    engine leaves it off (`FusedKernels.pdl`); `bench/kernels_round3.py` measures it. Triton's tutorial
    11-programmatic-dependent-launch.py is the source of the API.
"""
import os

import torch
import triton
import triton.language as tl

# Triton picks interpreter or compiler when each @triton.jit below runs (see nanovllm_ref/kernels/__init__.py).
DEFINED_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """True when kernels run in the Triton interpreter (then every load is cast to fp32 first)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 `x` rounded to `dtype` (round to nearest even) and returned as fp32: the value a PyTorch op
    writing `dtype` would have stored. EMULATE: do the bf16 rounding with integer operations (the
    interpreter's own cast truncates)."""
    if dtype == tl.float32:
        return x
    elif EMULATE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


def pdl_available(device: torch.device) -> bool:
    """PDL needs a CUDA device of compute capability >= 9 (Hopper) and Triton's grid-dependency API."""
    if device.type != "cuda" or interpreting():
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    if cuda is None or not hasattr(cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch_kwargs(use_pdl: bool) -> dict:
    """Launch options for a kernel whose USE_PDL constant is `use_pdl` ({} when off, so Triton builds
    without the option keep working)."""
    return {"launch_pdl": True} if use_pdl else {}
