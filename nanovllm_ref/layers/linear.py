"""Linear layers split across tensor-parallel ranks (chapter 09; Megatron-LM, Shoeybi et al. 2019, §3).

- ColumnParallelLinear splits the *output* features: each rank computes a slice, no communication.
- RowParallelLinear splits the *input* features: each rank computes a partial sum; an all-reduce adds them.
A column-parallel layer followed by a row-parallel one (QKV -> O, gate_up -> down) needs one all-reduce.

Checkpoints store q/k/v and gate/up as separate tensors, but we run them as one fused matmul. Each
parameter has a `weight_loader(param, loaded_weight, shard_id)` that copies this rank's slice of a
checkpoint tensor into the right rows of the fused parameter (upstream nano-vllm `layers/linear.py`).
Weights are [out_features, in_features] like nn.Linear.

`forward` multiplies with F.linear (cuBLAS on a GPU, oneDNN on a CPU). The decode step's small batches
(M <= 64 rows) can go through the Triton kernels of kernels/small_gemm.py instead: `forward_small` (the
same result), `forward_partials` (split-K partial sums for the add + RMSNorm kernel to add up; row-parallel
layers all-reduce the partials, whose sum over splits is then the all-reduced output) and
`forward_silu_mul` (gate_up with SiLU-and-mul in the epilogue). The model calls them on its fused decode
route only (models/qwen3.py).
"""
import torch
from torch import nn

from nanovllm_ref.utils.onednn import linear
from nanovllm_ref.utils.parallel import all_reduce, get_tp_rank, get_tp_size


def _small_gemm():
    """kernels/small_gemm.py, imported at first use (defining Triton kernels fixes interpreter or compiler
    for the process: kernels/__init__.py)."""
    from nanovllm_ref.kernels import small_gemm
    return small_gemm


def _expect(loaded: torch.Tensor, dim: int, size: int) -> None:
    """The checkpoint tensor must have exactly `size` along `dim` (else config.json and weights disagree)."""
    if loaded.shape[dim] != size:
        raise RuntimeError(f"expected size {size} along dim {dim}, got shape {tuple(loaded.shape)}")


class LinearBase(nn.Module):
    USES_ONEDNN_LINEAR = True          # utils/onednn.pack gives its weight a oneDNN copy on CPU

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)     # F.linear (oneDNN on CPU: utils/onednn.py)

    def forward_small(self, x: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
        """`forward` for x [M <= 64, in] through the small-M Triton GEMM: [M, out] in x's dtype."""
        return _small_gemm().linear(x, self.weight, self.bias, use_pdl=use_pdl)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """y[:, slice of this rank] = x @ W[slice].T. Output: [num_tokens, output_size / tp_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        if output_size % get_tp_size():
            raise ValueError(f"output_size {output_size} is not divisible by tp size {get_tp_size()}")
        super().__init__(input_size, output_size // get_tp_size(), bias)

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
    `loader(layer, param, loaded_weight, shard_id)` fills one shard (load_gate_up_shard by default)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, loader=load_gate_up_shard):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        self.loader = loader

    def weight_loader(self, param, loaded_weight, shard_id):
        self.loader(self, param, loaded_weight, shard_id)

    def forward_silu_mul(self, x: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
        """silu(gate) * up of this rank's slice for x [M <= 64, in], in one Triton kernel: [M, out / 2].
        Needs two equal outputs (gate_proj, up_proj); raises ValueError otherwise."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"forward_silu_mul needs two equal outputs (gate, up), got {self.output_sizes}")
        return _small_gemm().linear_silu_mul(x, self.weight, self.bias, use_pdl=use_pdl)


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
                 loader=load_qkv_shard):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = num_heads // tp, num_kv_heads // tp
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)
        self.loader = loader

    def weight_loader(self, param, loaded_weight, shard_id):
        self.loader(self, param, loaded_weight, shard_id)


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x[:, slice] @ W[:, slice].T (+ bias once). Input: [num_tokens, input_size / tp]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        if input_size % get_tp_size():
            raise ValueError(f"input_size {input_size} is not divisible by tp size {get_tp_size()}")
        super().__init__(input_size // get_tp_size(), output_size, bias)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if param.dim() == 1:                       # the bias is not split: add it on one rank only
            _expect(loaded_weight, 0, param.shape[0])
            param.data.copy_(loaded_weight)
            return
        cols = param.shape[1]
        _expect(loaded_weight, 1, cols * self.tp_size)
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce(linear(x, self.weight, bias), self.tp_size)

    def forward_small(self, x: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce(_small_gemm().linear(x, self.weight, bias, use_pdl=use_pdl), self.tp_size)

    def forward_partials(self, x: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
        """Split-K partial sums [S, M, out] fp32 of `forward` for x [M <= 64, in / tp]: their sum over S is
        the output. The all-reduce adds them over the ranks split by split, so that sum stays right."""
        bias = self.bias if self.tp_rank == 0 else None
        return all_reduce(_small_gemm().linear_partials(x, self.weight, bias, use_pdl=use_pdl), self.tp_size)
