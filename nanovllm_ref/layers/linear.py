"""Linear layers split across tensor-parallel ranks (chapter 09; Megatron-LM, Shoeybi et al. 2019, §3).

- ColumnParallelLinear splits the *output* features: each rank computes a slice, no communication.
- RowParallelLinear splits the *input* features: each rank computes a partial sum; an all-reduce adds them.
A column-parallel layer followed by a row-parallel one (QKV -> O, gate_up -> down) needs one all-reduce.

Checkpoints store q/k/v and gate/up as separate tensors, but we run them as one fused matmul. Each
parameter has a `weight_loader(param, loaded_weight, shard_id)` that copies this rank's slice of a
checkpoint tensor into the right rows of the fused parameter (upstream nano-vllm `layers/linear.py`).
Weights are [out_features, in_features] like nn.Linear.

`forward` multiplies with F.linear (cuBLAS on a GPU, oneDNN on a CPU). A layer built with a `SmallGemm`
(the engine's choice on CUDA: models/ops.py, utils/fusion.FusedKernels) runs batches of up to `max_m` rows
through the Triton kernels of kernels/small_gemm.py instead, in the same forward:
- every layer: the same result from one small-M GEMM kernel;
- a row-parallel layer built with `split_k` (o_proj, down_proj): its output as `SplitK`, the GEMM's split-K
  partial sums, which the next add + RMSNorm kernel adds up (layers/layernorm.py), so the GEMM needs no
  reduction kernel; with tensor parallelism the all-reduce adds the partials split by split;
- a merged gate_up layer built with `act` and `silu_epilogue`: SiLU-and-mul in the GEMM's epilogue.
"""
from typing import NamedTuple

import torch
from torch import nn

from nanovllm_ref.utils.onednn import linear
from nanovllm_ref.utils.parallel import all_reduce, get_tp_rank, get_tp_size


def _small_gemm():
    """kernels/small_gemm.py, imported at first use (defining Triton kernels fixes interpreter or compiler
    for the process: kernels/__init__.py)."""
    from nanovllm_ref.kernels import small_gemm
    return small_gemm


class SmallGemm(NamedTuple):
    """How a linear layer runs small batches: the Triton small-M GEMM for 1..max_m rows (launched with PDL
    when `pdl`); `split_k`: a row-parallel layer returns SplitK partials there; `silu_epilogue`: a merged
    gate_up layer with an activation computes it in the GEMM's epilogue."""
    max_m: int = 64
    pdl: bool = False
    split_k: bool = False
    silu_epilogue: bool = False


class SplitK(NamedTuple):
    """The hand-off between a row-parallel GEMM (o_proj, down_proj) and the add + RMSNorm after it, for small
    batches: partials [S, M, N] fp32, the GEMM's split-K partial sums (sum over S = the layer's output, bias
    included). Only RMSNorm built with its kernel takes one (layers/layernorm.py); the engine builds split_k
    layers only in front of such a norm (FusedKernels.split_k needs add_rms_norm)."""
    partials: torch.Tensor

    @property
    def shape(self):
        """The shape of the output the partials stand for: [M, N]."""
        return self.partials.shape[1:]


def _expect(loaded: torch.Tensor, dim: int, size: int) -> None:
    """The checkpoint tensor must have exactly `size` along `dim` (else config.json and weights disagree)."""
    if loaded.shape[dim] != size:
        raise RuntimeError(f"expected size {size} along dim {dim}, got shape {tuple(loaded.shape)}")


class LinearBase(nn.Module):
    """small_gemm: a SmallGemm (small batches through the Triton GEMM), or None (F.linear for every batch)."""
    USES_ONEDNN_LINEAR = True          # utils/onednn.pack gives its weight a oneDNN copy on CPU

    def __init__(self, input_size: int, output_size: int, bias: bool = False, small_gemm: SmallGemm | None = None):
        super().__init__()
        self.small_gemm = small_gemm
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None):
        if loaded_weight.shape != param.shape:
            raise RuntimeError(f"expected shape {tuple(param.shape)}, got {tuple(loaded_weight.shape)}")
        param.data.copy_(loaded_weight)

    def small(self, x: torch.Tensor) -> bool:
        """Whether this batch goes through the small-M GEMM (built with one, 1..max_m rows)."""
        return self.small_gemm is not None and 0 < x.shape[0] <= self.small_gemm.max_m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> [M, out] in x's dtype."""
        if self.small(x):
            return _small_gemm().linear(x, self.weight, self.bias, use_pdl=self.small_gemm.pdl)
        return linear(x, self.weight, self.bias)     # F.linear (oneDNN on CPU: utils/onednn.py)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """y[:, slice of this rank] = x @ W[slice].T. Output: [num_tokens, output_size / tp_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, small_gemm: SmallGemm | None = None):
        if output_size % get_tp_size():
            raise ValueError(f"output_size {output_size} is not divisible by tp size {get_tp_size()}")
        super().__init__(input_size, output_size // get_tp_size(), bias, small_gemm)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        rows = param.shape[0]
        _expect(loaded_weight, 0, rows * self.tp_size)
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * rows, rows))


def load_gate_up_shard(layer: "MergedColumnParallelLinear", param: nn.Parameter, loaded_weight: torch.Tensor,
                       shard_id: int) -> None:
    """Copy this rank's slice of checkpoint tensor number `shard_id` (0 = gate_proj, 1 = up_proj, each
    [output_sizes[shard_id], in] or a bias [output_sizes[shard_id]]) into its rows of the fused `param`
    ([sum(output_sizes) / tp, in]). Raises RuntimeError if the checkpoint tensor has the wrong size."""
    tp = layer.tp_size
    offset = sum(layer.output_sizes[:shard_id]) // tp
    size = layer.output_sizes[shard_id] // tp
    _expect(loaded_weight, 0, layer.output_sizes[shard_id])
    param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, layer.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul, e.g. gate_proj and up_proj (shard ids 0, 1).
    `loader(layer, param, loaded_weight, shard_id)` fills one shard (load_gate_up_shard by default).
    act: None (forward returns the fused [gate | up] output), or the activation the layer applies to it
    (layers/activation.SiluAndMul): then forward returns act([gate | up]), computed in the GEMM's epilogue for
    small batches when built with small_gemm.silu_epilogue (two equal outputs needed: ValueError otherwise)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, loader=load_gate_up_shard,
                 small_gemm: SmallGemm | None = None, act: nn.Module | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, small_gemm)
        self.loader = loader
        self.act = act
        if small_gemm is not None and small_gemm.silu_epilogue and \
                (act is None or len(output_sizes) != 2 or output_sizes[0] != output_sizes[1]):
            raise ValueError(f"a SiLU epilogue needs an activation and two equal outputs (gate, up), got "
                             f"{output_sizes} and act={act!r}")

    def weight_loader(self, param, loaded_weight, shard_id):
        self.loader(self, param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> [gate | up] [M, out], or act of it [M, out / 2] when built with an activation."""
        if self.act is not None and self.small(x) and self.small_gemm.silu_epilogue:
            return _small_gemm().linear_silu_mul(x, self.weight, self.bias, use_pdl=self.small_gemm.pdl)
        y = super().forward(x)
        return y if self.act is None else self.act(y)


def load_qkv_shard(layer: "QKVParallelLinear", param: nn.Parameter, loaded_weight: torch.Tensor,
                   shard_id: str) -> None:
    """Copy this rank's heads of checkpoint tensor q_proj / k_proj / v_proj (shard_id "q" / "k" / "v";
    [heads * head_dim, in] or a bias) into the fused `param`: q rows first, then k, then v, each holding
    this rank's num_heads (or num_kv_heads) * head_dim rows. Raises RuntimeError on a size mismatch."""
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
    _expect(loaded_weight, 0, size * layer.tp_size)
    param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, layer.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. Each rank holds num_heads/tp query heads and
    num_kv_heads/tp KV heads; output [num_tokens, (H + 2 * Hkv) / tp * head_dim]. Shard ids "q", "k", "v";
    `loader(layer, param, loaded_weight, shard_id)` fills one shard (load_qkv_shard by default)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 loader=load_qkv_shard, small_gemm: SmallGemm | None = None):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads // tp, num_kv_heads // tp
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, small_gemm)
        self.loader = loader

    def weight_loader(self, param, loaded_weight, shard_id):
        self.loader(self, param, loaded_weight, shard_id)


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x[:, slice] @ W[:, slice].T (+ bias once). Input: [num_tokens, input_size / tp]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, small_gemm: SmallGemm | None = None):
        if input_size % get_tp_size():
            raise ValueError(f"input_size {input_size} is not divisible by tp size {get_tp_size()}")
        super().__init__(input_size // get_tp_size(), output_size, bias, small_gemm)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if param.dim() == 1:                       # the bias is not split: add it on one rank only
            _expect(loaded_weight, 0, param.shape[0])
            param.data.copy_(loaded_weight)
            return
        cols = param.shape[1]
        _expect(loaded_weight, 1, cols * self.tp_size)
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitK:
        """x [M, in / tp] -> [M, out], all-reduced over the ranks; built with small_gemm.split_k, a small batch
        returns SplitK (its partials all-reduced split by split, so their sum stays the output)."""
        bias = self.bias if self.tp_rank == 0 else None
        if self.small(x):
            gemm, pdl = _small_gemm(), self.small_gemm.pdl
            if self.small_gemm.split_k:
                return SplitK(all_reduce(gemm.linear_partials(x, self.weight, bias, use_pdl=pdl), self.tp_size))
            return all_reduce(gemm.linear(x, self.weight, bias, use_pdl=pdl), self.tp_size)
        return all_reduce(linear(x, self.weight, bias), self.tp_size)
