"""The model's Triton kernels (models/qwen3.py, layers/*: each module picks its kernel when built;
utils/fusion.FusedKernels; nanovllm_ref.Parts.model_ops) on tiny checkpoints.

- The engine with kernels on gives HF transformers' greedy ids (qwen3 and llama, fp32, several kernel sets,
  an awkward shape: hidden 72, head_dim 24), and the kernels really run: the small GEMM for batches of up to
  max_m rows (prefill too), the norm kernels every step, the q/k-norm + RoPE + store kernel in decode steps.
- Batches larger than max_m run cuBLAS GEMMs with the norm and q/k kernels; both kinds in one run match HF.
- A student's part keeps its kernel off and runs as written; asking for that kernel is refused by name.
- bf16: the kernels' logits stay within bf16 noise of the kernel-free model's, with the same ids.
- Tensor parallel (gloo, 2 ranks): the split-K partials are all-reduced before they are summed, so TP=2 with
  the kernels gives TP=1's logits.

The engine is built with a given kernel set by wrapping the model class so that its ModelOps carry it (the
engine's own choice, decode_kernels="auto", turns kernels on for CUDA only). Without CUDA the kernels run in
the Triton interpreter; with CUDA the same tests run them compiled (the TP test is the CPU's gloo path only).
"""
import dataclasses
import itertools
import multiprocessing as mp
import socket

import pytest
import torch

import parts_spies
from engine_helpers import LLM, hf_greedy, tiny_dir
from nanovllm_ref import Parts, SamplingParams
from nanovllm_ref.engine import model_runner
from nanovllm_ref.kernels import rms_norm as rms_norm_kernels, small_gemm
from nanovllm_ref.layers.attention import Attention
from nanovllm_ref.models import get_model_class, qwen3
from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM
from nanovllm_ref.utils.context import AttentionMetadata, attention_metadata
from nanovllm_ref.utils.fusion import FusedKernels
from nanovllm_ref.utils.loader import load_model
from nanovllm_ref.utils.parallel import tensor_parallel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 47))]
# Tokens per prompt of the greedy comparisons: 1 prefill and 3 decode steps (the decode slots of the 7- and 2-token
# prompts cross a block boundary at block size 4); each step under the Triton interpreter costs ~0.8 s of CPU.
TOKENS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
KERNEL_SETS = {
    "all": FusedKernels.all(),
    "gemm only": FusedKernels(gemm=True),
    "norms and qk": FusedKernels(rms_norm=True, add_rms_norm=True, qk_norm_rope_store=True),
    "no split-k, no silu epilogue": FusedKernels.all(split_k=False, gemm_silu=False),
}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Calls of each Triton kernel the model runs: the small GEMM's three forms (with the M of each call),
    the add + RMSNorm kernel, and the q/k-norm + RoPE + store kernel."""
    calls = {"linear": [], "partials": [], "silu": [], "norm": 0, "qk_store": 0, "qk_prefill": 0, "silu_kernel": []}

    def gemm(key, fn):
        def wrapper(x, *args, **kwargs):
            calls[key].append(x.shape[0])
            return fn(x, *args, **kwargs)
        return wrapper

    def count(key, fn):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(small_gemm, "linear", gemm("linear", small_gemm.linear))
    monkeypatch.setattr(small_gemm, "linear_partials", gemm("partials", small_gemm.linear_partials))
    monkeypatch.setattr(small_gemm, "linear_silu_mul", gemm("silu", small_gemm.linear_silu_mul))
    monkeypatch.setattr(rms_norm_kernels, "add_rms_norm", count("norm", rms_norm_kernels.add_rms_norm))
    monkeypatch.setattr(qwen3, "_qk_norm_rope_store", count("qk_store", qwen3._qk_norm_rope_store))
    monkeypatch.setattr(qwen3, "_qk_norm_rope_kernel", count("qk_prefill", qwen3._qk_norm_rope_kernel))
    monkeypatch.setattr(qwen3, "_silu_and_mul_kernel", gemm("silu_kernel", qwen3._silu_and_mul_kernel))
    return calls


def _reset(calls):
    calls.update(linear=[], partials=[], silu=[], norm=0, qk_store=0, qk_prefill=0, silu_kernel=[])


@pytest.fixture
def llm_with_kernels(monkeypatch, kernel_calls):
    """LLM(path, ...) whose model's ModelOps carry `kernels`. The counts start after start-up (a GPU engine runs
    warm-up steps)."""
    real = model_runner.get_model_class

    def make(path, kernels, **engine_args):
        def model_class(hf):
            cls = real(hf)
            return lambda cfg, ops: cls(cfg, ops=dataclasses.replace(ops, kernels=kernels))
        monkeypatch.setattr(model_runner, "get_model_class", model_class)
        # Eager and fp32: every decode step runs the model's Python forward (the spies count the kernels, a
        # CUDA graph would replay without it), and HF's fp32 ids are the oracle on a GPU too.
        llm = LLM(path, **{"enforce_eager": True, "dtype": "float32", **engine_args})
        _reset(kernel_calls)
        return llm
    return make


def split_k_in_16s(choose):
    """A choose_config that cuts K into 16-wide splits for the partial sums: the tiny models' K (32-128) then
    gives 2-8 splits, where the default configs (BLOCK_K 256-512, for real sizes) would give one."""
    def choose_many(m, n, k, kind="full", sms=132):
        cfg = choose(m, n, k, kind, sms)
        return dataclasses.replace(cfg, block_k=16, split_k=-(-k // 16)) if kind == "partials" else cfg
    return choose_many


@pytest.fixture
def many_splits(monkeypatch):
    monkeypatch.setattr(small_gemm, "choose_config", split_k_in_16s(small_gemm.choose_config))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert small_gemm.linear_partials(torch.ones(1, 64, device=device), torch.ones(8, 64, device=device)).shape[0] == 4


def _ids(outputs):
    return [o["token_ids"] for o in outputs]


LAYERS = 2                                    # the tiny models' layers


@pytest.mark.parametrize("kernel_set", sorted(KERNEL_SETS))
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_on_triton_kernels_matches_hf_greedy(arch, kernel_set, llm_with_kernels, kernel_calls):
    path = tiny_dir(arch)
    kernels = KERNEL_SETS[kernel_set]
    # Block size 4: the prompts of 2 and 7 tokens put decode slots on both sides of a block boundary.
    llm = llm_with_kernels(path, kernels, kvcache_block_size=4, max_model_len=64)
    assert llm.model_runner.model.kernels == kernels
    got = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.exit()
    assert got == [hf_greedy(path, p, TOKENS) for p in PROMPTS]
    steps = TOKENS                            # one prefill (26 rows <= max_m: the small GEMM too), TOKENS - 1 decodes
    gemms = kernel_calls["linear"] + kernel_calls["partials"] + kernel_calls["silu"]
    assert len(gemms) == (steps * LAYERS * 4 if kernels.gemm else 0)
    assert len(kernel_calls["partials"]) == (steps * LAYERS * 2 if kernels.split_k else 0)
    assert len(kernel_calls["silu"]) == (steps * LAYERS if kernels.gemm_silu else 0)
    assert kernel_calls["norm"] == (steps * (2 * LAYERS + 1) if kernels.add_rms_norm else 0)
    assert kernel_calls["qk_store"] == ((TOKENS - 1) * LAYERS if kernels.qk_norm_rope_store else 0), "decode steps only"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_with_several_k_splits_matches_hf_greedy(arch, llm_with_kernels, kernel_calls, many_splits):
    path = tiny_dir(arch)
    llm = llm_with_kernels(path, FusedKernels.all(), kvcache_block_size=4, max_model_len=64)
    got = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.exit()
    assert got == [hf_greedy(path, p, TOKENS) for p in PROMPTS]
    assert len(kernel_calls["partials"]) == TOKENS * LAYERS * 2


def test_decode_batches_over_4_use_the_tl_dot_gemm_and_match_hf(llm_with_kernels, kernel_calls):
    """Six sequences: decode batches of 6 and 5 take small_gemm's tl.dot path (M > GEMV_MAX_M)."""
    path = tiny_dir("qwen3")
    prompts = PROMPTS + [[3, 4, 5], [40, 41, 42, 43], [7] * 9]
    sps = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 5 + \
        [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    llm = llm_with_kernels(path, FusedKernels.all(), kvcache_block_size=4, max_model_len=64)
    got = _ids(llm.generate(prompts, sps, use_tqdm=False))
    llm.exit()
    assert got == [hf_greedy(path, p, sp.max_tokens) for p, sp in zip(prompts, sps)]
    assert {6, 5} <= set(kernel_calls["linear"]) and small_gemm.GEMV_MAX_M < 5
    assert kernel_calls["qk_store"] == 3 * LAYERS


def test_awkward_shape_on_triton_kernels_matches_hf(llm_with_kernels, kernel_calls):
    """hidden 72 and intermediate 120 (not powers of two), head_dim 24 (half 12), 3 heads over 1 KV head."""
    path = tiny_dir("qwen3", hidden_size=72, intermediate_size=120, head_dim=24, num_attention_heads=3,
                    num_key_value_heads=1)
    llm = llm_with_kernels(path, FusedKernels.all(), kvcache_block_size=4, max_model_len=64)
    got = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.exit()
    assert got == [hf_greedy(path, p, TOKENS) for p in PROMPTS]
    assert kernel_calls["qk_store"] == (TOKENS - 1) * LAYERS and kernel_calls["partials"]


def test_batches_over_max_m_run_cublas_gemms_with_the_norm_and_qk_kernels(llm_with_kernels, kernel_calls):
    """max_m=2: the 3-row decode steps and the 26-row prefill run F.linear (no small GEMM is called), the 2- and
    1-row decode steps the small GEMM; the norm kernels run every step and the q/k kernel every decode step;
    the ids are HF's either way."""
    path = tiny_dir("qwen3")
    llm = llm_with_kernels(path, FusedKernels.all(max_m=2), kvcache_block_size=4, max_model_len=64)
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]
    got = _ids(llm.generate(PROMPTS, sps, use_tqdm=False))
    llm.exit()
    assert got == [hf_greedy(path, p, n) for p, n in zip(PROMPTS, (3, 5, 7))]
    # decode steps: 2 of batch 3 (cuBLAS), 2 of batch 2 and 2 of batch 1 (small GEMM); the prefill (cuBLAS).
    assert sorted(set(kernel_calls["linear"])) == [1, 2], "more than max_m rows must use cuBLAS, not the small GEMM"
    assert len(kernel_calls["linear"]) == 4 * LAYERS
    assert kernel_calls["qk_store"] == 6 * LAYERS and kernel_calls["norm"] == 7 * (2 * LAYERS + 1)
    # The prefill's q/k norm + RoPE is the same kernel without its store; SiLU-and-mul after cuBLAS is the
    # SiLU kernel (the prefill's 26 rows and the two 3-row decode steps), the small GEMM's epilogue below.
    assert kernel_calls["qk_prefill"] == LAYERS
    assert sorted(kernel_calls["silu_kernel"]) == [3] * (2 * LAYERS) + [26] * LAYERS
    assert sorted(set(kernel_calls["silu"])) == [1, 2]


def test_a_replaced_part_keeps_its_kernel_off_and_runs_as_written(llm_with_kernels, kernel_calls):
    parts = Parts(rms_norm=parts_spies.rms_norm)
    allowed = parts.kernels_allowed(qk_norm=True)
    # q/k norm is an rms_norm call, so its fused kernel goes too; the GEMMs and add + RMSNorm stay.
    assert allowed.enabled() == ["add_rms_norm", "gemm", "gemm_silu", "split_k"]
    path = tiny_dir("qwen3")
    llm = llm_with_kernels(path, FusedKernels.all().restricted_to(allowed), kvcache_block_size=4,
                           max_model_len=64, parts=parts)
    before = parts_spies.CALLS["rms_norm"]
    got = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    spied = parts_spies.CALLS["rms_norm"] - before
    llm.exit()
    assert got == [hf_greedy(path, p, TOKENS) for p in PROMPTS]
    # q_norm and k_norm of every layer, and layer 0's input norm, in each of the TOKENS steps are the student's.
    assert spied == TOKENS * (2 * LAYERS + 1)
    assert kernel_calls["qk_store"] == 0 and kernel_calls["norm"] == TOKENS * 2 * LAYERS


def test_asking_for_a_kernel_that_a_part_replaced_is_refused_by_name():
    with pytest.raises(ValueError, match="FusedKernels.rms_norm .*rms_norm"):
        Parts(rms_norm=parts_spies.rms_norm).model_ops(kernels=FusedKernels.all())
    with pytest.raises(ValueError, match="FusedKernels.gemm_silu"):
        Parts(silu_and_mul=parts_spies.silu_and_mul).model_ops(kernels=FusedKernels.all())
    with pytest.raises(TypeError, match="kernels must be a FusedKernels"):
        Parts().model_ops(kernels=True)
    # A store of one's own: the fused kernel would write the cache in its place, so it stays off.
    assert not Parts(store_kvcache=parts_spies.store_kvcache).kernels_allowed(qk_norm=True).qk_norm_rope_store
    assert Parts().kernels_allowed(qk_norm=True) == FusedKernels.all()


def test_fuse_on_a_cpu_builds_no_kernels_and_an_explicit_record_is_kept():
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(tiny_dir("llama"))
    assert Qwen3ForCausalLM(hf, ops=Parts().model_ops(fuse=True)).kernels == FusedKernels()
    assert not Qwen3ForCausalLM(hf).kernels.any()
    # Llama has no q/k norm, so a replaced rms_norm leaves the q/k + RoPE + store kernel allowed.
    assert Parts(rms_norm=parts_spies.rms_norm).kernels_allowed(qk_norm=False).qk_norm_rope_store
    kernels = FusedKernels(gemm=True, max_m=8)
    model = Qwen3ForCausalLM(hf, ops=Parts().model_ops(kernels=kernels, qk_norm=False))
    assert model.kernels is kernels and model.model.layers[0].mlp.gate_up_proj.small_gemm.max_m == 8


def test_fused_kernels_max_m_bound_is_the_small_gemm_kernels_limit():
    """utils/fusion.py cannot import the kernel module (it would fix interpreter or compiler), so it repeats
    small_gemm.MAX_M: the two must agree."""
    from nanovllm_ref.utils import fusion
    assert fusion.MAX_M == small_gemm.MAX_M
    FusedKernels(max_m=small_gemm.MAX_M)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(split_k=True, gemm=True), ValueError, "add_rms_norm"),
    (dict(gemm_silu=True), ValueError, "gemm=True"),
    (dict(max_m=0), ValueError, "max_m"),
    (dict(max_m=513), ValueError, "max_m"),
    (dict(gemm=1), TypeError, "bool"),
])
def test_fused_kernels_record_refuses_combinations_it_cannot_run(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FusedKernels(**kwargs)


def test_restricting_a_record_drops_what_depends_on_a_removed_kernel():
    narrowed = FusedKernels.all(pdl=True).restricted_to(FusedKernels(gemm=True, rms_norm=True))
    assert narrowed.enabled() == ["rms_norm", "gemm"] and narrowed.pdl
    assert FusedKernels.all(max_m=2).large_batch().enabled() == ["rms_norm", "add_rms_norm", "qk_norm_rope_store"]


# -- the model alone: a greedy session with hand-made metadata (bf16, tensor parallel) -----------------------

def build_model(path: str, dtype: torch.dtype, kernels: FusedKernels | None, rank: int = 0, world: int = 1):
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)                      # as the model runner builds it (RoPE tables stay fp32)
    try:
        with torch.device(DEVICE), tensor_parallel(rank, world):
            model = get_model_class(hf)(hf, ops=Parts().model_ops(kernels=kernels, qk_norm=get_model_class(hf).QK_NORM))
    finally:
        torch.set_default_dtype(default)
    load_model(model, path)
    return model.eval()


@torch.inference_mode()
def greedy_session(model, prompts, steps: int, block_size: int = 4, blocks_per_seq: int = 8):
    """One prefill step and `steps` decode steps of all prompts together. Returns (ids per
    prompt, [logits of each step] on rank 0). Under tensor parallelism rank 0 broadcasts the ids."""
    with torch.device(model.model.embed_tokens.weight.device):
        return _greedy_session(model, prompts, steps, block_size, blocks_per_seq)


def _greedy_session(model, prompts, steps, block_size, blocks_per_seq):
    import torch.distributed as dist
    dtype = model.model.embed_tokens.weight.dtype
    for a in (m for m in model.modules() if isinstance(m, Attention)):
        a.k_cache = torch.zeros(len(prompts) * blocks_per_seq, block_size, a.num_kv_heads, a.head_dim, dtype=dtype)
        a.v_cache = torch.zeros_like(a.k_cache)
    tables = torch.arange(len(prompts) * blocks_per_seq, dtype=torch.int32).view(len(prompts), blocks_per_seq)

    def slot(i, pos):
        return int(tables[i, pos // block_size]) * block_size + pos % block_size

    def sample(hidden):
        logits = model.compute_logits(hidden)
        ids = logits.argmax(-1) if logits is not None else torch.zeros(hidden.shape[0], dtype=torch.long)
        if dist.is_initialized():
            dist.broadcast(ids, 0)
        return ids.tolist(), logits

    lens = [len(p) for p in prompts]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    meta = AttentionMetadata(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                             max_seqlen_k=max(lens), slot_mapping=torch.tensor(
                                 [slot(i, p) for i, n in enumerate(lens) for p in range(n)], dtype=torch.int32))
    with attention_metadata(meta):
        hidden = model(torch.tensor(sum(prompts, [])), torch.tensor([p for n in lens for p in range(n)]))
    ids, logits = sample(hidden[cu[1:].long() - 1])
    out, all_logits = [[t] for t in ids], [logits]
    for step in range(steps):
        pos = [n + step for n in lens]                       # position of the token fed in this step
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=torch.tensor([slot(i, p) for i, p in enumerate(pos)], dtype=torch.int32),
            context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int32), block_tables=tables)
        with attention_metadata(meta):
            hidden = model(torch.tensor([o[-1] for o in out]), torch.tensor(pos))
        ids, logits = sample(hidden)
        for o, t in zip(out, ids):
            o.append(t)
        all_logits.append(logits)
    return out, all_logits


def test_bf16_kernels_stay_within_bf16_noise_of_the_model_without_them(kernel_calls):
    path = tiny_dir("qwen3")
    general_ids, general = greedy_session(build_model(path, torch.bfloat16, None), PROMPTS, 4)
    fused_ids, fused = greedy_session(build_model(path, torch.bfloat16, FusedKernels.all()), PROMPTS, 4)
    assert kernel_calls["qk_store"] == 4 * LAYERS
    assert fused_ids == general_ids
    for a, b in zip(general, fused):
        rel = ((a.float() - b.float()).norm() / a.float().norm()).item()
        assert rel < 2e-2, f"the kernels' logits differ from the general route's by {rel:.1e} (relative norm)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_worker(rank: int, world: int, port: int, paths: dict, kernels, steps: int, queue) -> None:
    """One rank of the tensor-parallel session, over each of `paths` ({arch: checkpoint}) in turn (importable: spawn
    pickles it by name)."""
    import torch.distributed as dist
    # Several K splits per rank (o_proj: K = 32 per rank, down: 64), so the all-reduce adds real partials.
    small_gemm.choose_config = split_k_in_16s(small_gemm.choose_config)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for arch, path in paths.items():
            ids, logits = greedy_session(build_model(path, torch.float32, kernels, rank, world), PROMPTS, steps)
            # numpy, not tensors: a tensor travels as a shared-memory handle that dies with this process
            results[arch] = (ids, [t.numpy().copy() for t in logits] if rank == 0 else None)
        if rank == 0:
            queue.put(results)
        # Both ranks past their last all-reduce before either closes its sockets: a rank that finishes its
        # half of the last ring all-reduce first and exits resets the other's connection (seen once in a
        # loaded full run: the result arrived, then a rank exited non-zero).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _result_or_failure(queue, procs, timeout: float):
    """Rank 0's result, or AssertionError as soon as a rank exits without one (never a silent wait)."""
    import queue as queue_mod
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not failed, f"a tensor-parallel rank exited with code {failed[0]} before sending its result"
    raise AssertionError(f"no result from the tensor-parallel ranks within {timeout} s")


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on CPU tensors; over NCCL the engine's TP tests run "
                    "the fused route (fuse=True on CUDA)")
def test_tensor_parallel_fused_decode_all_reduces_split_k_partials():
    """Both tiny architectures in one tensor-parallel session: the two ranks start once (a rank's start, torch and
    the model code, is ~3 s of CPU) and run qwen3, then llama."""
    paths, steps = {arch: tiny_dir(arch) for arch in ("qwen3", "llama")}, 3
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=tp_worker, args=(r, 2, port, paths, FusedKernels.all(), steps, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = _result_or_failure(queue, procs, timeout=480)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0], f"tensor-parallel ranks' exit codes {[p.exitcode for p in procs]}"
    assert sorted(results) == sorted(paths)
    for arch, path in paths.items():
        tp_ids, tp_logits = results[arch]
        ids, logits = greedy_session(build_model(path, torch.float32, None), PROMPTS, steps)
        assert tp_ids == ids == [hf_greedy(path, p, steps + 1) for p in PROMPTS], arch
        for a, b in zip(logits, tp_logits):
            torch.testing.assert_close(torch.from_numpy(b), a, atol=1e-4, rtol=1e-4, msg=lambda m, arch=arch: f"{arch}: {m}")
