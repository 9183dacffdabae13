"""Small engine units: CUDA-graph bucket coverage, layers that must not write into their inputs."""
import pytest
import torch

from nanovllm_ref.engine.cuda_graph import graph_batch_sizes
from nanovllm_ref.layers.layernorm import RMSNorm


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 8, 15, 16, 17, 100, 512])
def test_every_batch_size_maps_to_a_captured_graph_with_little_padding(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert max(sizes) == max_num_seqs and sizes == sorted(set(sizes))
    for batch in range(1, max_num_seqs + 1):
        graph_bs = next(b for b in sizes if b >= batch)
        assert graph_bs - batch < 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_with_residual_never_writes_into_its_inputs(dtype):
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = norm.to(dtype)(x, residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    assert torch.equal(new_residual, x0 + r0)
    xf = (x0 + r0).float()
    expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(out, expected)
