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


# -- what the engine hands to other processes, and its CPU KV cache ------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_pickled_config_carries_every_hf_config_attribute_and_a_copy_keeps_the_hf_object(arch):
    import copy
    import pickle

    from nanovllm_course.common import tiny_model_dir
    from nanovllm_ref.config import Config, ModelConfig
    config = Config(tiny_model_dir(arch), device="cpu")
    back = pickle.loads(pickle.dumps(config))
    assert isinstance(back.hf_config, ModelConfig) and back == config and back.eos == config.eos
    assert vars(config.hf_config) and all(getattr(back.hf_config, k) == v for k, v in vars(config.hf_config).items())
    assert not hasattr(back.hf_config, "no_such_key")
    assert pickle.loads(pickle.dumps(back)).hf_config.architectures == config.hf_config.architectures
    for twin in (copy.copy(config), copy.deepcopy(config), config.derived(num_kvcache_blocks=3)):
        assert type(twin.hf_config) is type(config.hf_config) and twin.hf_config.vocab_size == config.hf_config.vocab_size


def test_unpickling_a_config_imports_no_transformers_and_importing_the_package_no_torch(tmp_path):
    import pickle
    import subprocess
    import sys

    from nanovllm_course.common import tiny_model_dir
    from nanovllm_ref.config import Config
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(Config(tiny_model_dir("qwen3"), device="cpu")))
    code = ("import pickle, sys; import nanovllm_ref; from nanovllm_ref import SamplingParams; "
            "print('torch' in sys.modules); c = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "print('transformers' in sys.modules, c.hf_config.architectures, c.hf_config.num_hidden_layers); "
            "from nanovllm_ref import LLM, Parts; print(LLM.__module__, Parts.__module__, 'LLM' in vars(nanovllm_ref))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "config.pkl")], capture_output=True, text=True)
    assert out.stdout.split("\n")[:3] == ["False", "False ['Qwen3ForCausalLM'] 2",
                                          "nanovllm_ref.llm nanovllm_ref.parts False"], out.stdout + out.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_kv_cache_is_zeros_of_its_shape_in_a_storage_of_its_own_bytes(dtype):
    from nanovllm_ref.engine.kv_cache import cpu_zeros
    shape = (2, 3, 5, 4, 2, 8)
    cache = cpu_zeros(shape, dtype)
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert torch.equal(cache, torch.zeros(shape, dtype=dtype))
    assert cache.untyped_storage().nbytes() == cache.numel() * cache.element_size()
    cache[1, 2, 4] = 1.5
    assert cache.sum().item() == 1.5 * 4 * 2 * 8 and cache[0].abs().sum().item() == 0
