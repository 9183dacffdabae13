"""Kernel fusion of the small element-wise steps with torch.compile (chapter 10).

A decode step of a 0.6B model is ~60 tiny kernels per layer when RMSNorm, RoPE and SiLU-and-mul run as
separate PyTorch ops: each kernel costs a few microseconds even inside a CUDA graph, so at batch 1 the step
is launch-bound (~4 ms measured on an H200 for 28 layers) while the weights need ~0.3 ms to read. Compiling
each of those pure functions with torch.compile (Inductor) turns each into one generated Triton kernel.

Only the small functions are compiled, not the whole model: compile time stays a few seconds, the model
code stays plain PyTorch, and the attention back-ends are untouched.

The switch belongs to the engine, not to the process: `@fused` leaves the function as it is and only gives
it a `.compiled()` method; a model built with `fuse=True` (the model runner does this on CUDA) calls the
compiled version, one built with `fuse=False` calls the function itself. So a CPU engine and a GPU engine
in one process do not change each other.
"""
import functools

import torch


def fused(fn):
    """Decorator: give `fn` a `.compiled()` method that returns `fn` compiled by torch.compile (made once,
    with dynamic shapes and fullgraph=True), and `.eager` (= fn). Calling `fn` itself stays eager."""
    @functools.lru_cache(maxsize=None)
    def compiled():
        return torch.compile(fn, dynamic=True, fullgraph=True)

    fn.compiled = compiled
    fn.eager = fn
    return fn


def choose(fn, reference, fuse: bool):
    """The function a model should call for one part: the compiled reference when `fuse` is on and `fn`
    is the reference itself; otherwise `fn` unchanged (a student's part always runs as written)."""
    if fuse and fn is reference and hasattr(fn, "compiled"):
        return fn.compiled()
    return fn
