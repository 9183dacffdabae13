"""oneDNN matmuls for the linear layers on CPU (issue 15).

On CPU a decode step is mostly its matmuls: at batch 8 the weights of SmolLM2 are ~90 % of the step. For these
skinny products (a few rows against a [out, in] weight) PyTorch's default `F.linear` ran at about half the
speed of oneDNN's inner-product primitive on the course's 2-core machine (measured: all matmuls of one
SmolLM2 decode step at batch 8, 52.7 ms against 24.0 ms at one thread, 30.7 against 14.7 ms at two). The
LM head alone (49152 x 576) was 2.7x faster at batch 1.

`pack(model)` keeps, next to each linear layer's weight, a oneDNN copy of it (`weight.onednn`, the same
values in oneDNN's tensor type), and `linear(x, weight, bias)` uses it when it is there, `F.linear`
otherwise. The dense weight stays: the tied embedding, the loader and the chapters read it. The cost is one
more copy of the linear weights in memory (0.5 GB for SmolLM2 in fp32).

The sums are the same products added in another order, so logits differ from `F.linear`'s in the last
bits (~1e-6 relative in fp32); the engine's greedy ids are tested against HF's with it on.
"""
import torch
import torch.nn.functional as F


def available(dtype: torch.dtype) -> bool:
    """oneDNN is built in and has the op; only fp32 is measured (and enabled)."""
    return (dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the weight's oneDNN copy if `pack` made one."""
    packed = getattr(weight, "onednn", None)
    if packed is None or x.device.type != "cpu" or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _linear_weights(model):
    """The weights of the modules that multiply through `linear` (they say so with USES_ONEDNN_LINEAR = True:
    a marker, so this module needs no import of the layers that import it)."""
    for module in model.modules():
        if getattr(module, "USES_ONEDNN_LINEAR", False):
            yield module.weight


@torch.no_grad()
def pack(model) -> int:
    """Give every linear weight of `model` (on CPU) a oneDNN copy. Returns how many were packed."""
    n = 0
    for weight in _linear_weights(model):
        if weight.device.type == "cpu" and available(weight.dtype):
            weight.onednn = weight.detach().to_mkldnn()
            n += 1
    return n


def unpack(model) -> None:
    """Drop the oneDNN copies: `linear` is plain `F.linear` again."""
    for weight in _linear_weights(model):
        if hasattr(weight, "onednn"):
            del weight.onednn
