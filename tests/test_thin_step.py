"""The thin decode step and the start-up warm-up (issue: GPU speed round 2), checked on a CPU.

- StaticDecodeInputs.pack (one packed host buffer per step, from the step's batch record) gives exactly
  engine/inputs.prepare_decode's values, through growth, row reuse and preemption.
- The graph path of the model runner (packed upload, LM head and sampler inside the step, logits kept for
  samplers that run outside) is exercised on a CPU by a graph runner whose "graph" replays the captured step
  eagerly: greedy ids equal the engine without graphs and HF.
- Tensor-parallel workers receive a compact message per step (the batch record), not the sequences.
- After start-up, a varied workload compiles nothing (torch.compile counters); without the warm-up the
  same workload does, so the test can fail.
The real CUDA-graph replay, and Triton's compile cache, are checked on the H200 (bench/gpu_run.sh).
"""
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanovllm_ref import SamplingParams
from nanovllm_ref.engine import model_runner as model_runner_mod
from nanovllm_ref.engine import warmup
from nanovllm_ref.engine.cuda_graph import CUDAGraphRunner, StaticDecodeInputs
from nanovllm_ref.engine.inputs import prepare_decode, prepare_prefill
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.engine.step_batch import StepBatch, StepBuilder

from engine_helpers import LLM, hf_greedy, tiny_dir


class EagerReplayRunner(CUDAGraphRunner):
    """A CUDAGraphRunner whose "graph" runs the captured step again, eagerly: the whole data path of
    graph decode (packed inputs, views, in-step LM head and sampler) without CUDA."""

    def _record(self, bs, pool):
        return SimpleNamespace(replay=lambda: self._step(bs)), None


class CountingSampler:
    """Put in place of `runner.sampler` (the sampler that runs after the graph, on the logits): counts its calls,
    so a test sees which decode steps left the in-graph sampler."""

    def __init__(self, runner):
        self.inner, self.calls = runner.sampler, 0
        runner.sampler = self

    def __call__(self, logits, meta):
        self.calls += 1
        return self.inner(logits, meta)


def _seq(n, table, block_size=4, temperature=0.0):
    seq = Sequence(list(range(1, n + 1)), block_size, SamplingParams(temperature=temperature))
    seq.block_table = list(table)
    seq.num_cached_tokens = n - 1
    return seq


def _batch(seqs, block_size, is_prefill=False) -> StepBatch:
    """The engine's batch record of a step over `seqs` (engine/step_batch.py)."""
    config = SimpleNamespace(kvcache_block_size=block_size, eos=frozenset(), hf_config=SimpleNamespace(vocab_size=1000))
    return StepBuilder(prepare_prefill, prepare_decode, config).build(seqs, is_prefill)


def _assert_pack_matches(inputs: StaticDecodeInputs, seqs, block_size, padded):
    part = inputs.pack(_batch(seqs, block_size), padded)
    # what a step of `padded` rows reads, and no more: one slice of max_bs per field, then `padded` table rows
    assert len(part) == len(inputs.FIELDS) * inputs.max_bs + padded * inputs.max_blocks
    twin = StaticDecodeInputs(inputs.max_bs, inputs.max_blocks, "cpu")     # a TP worker receiving `part`
    twin.upload(part.copy())
    inputs.upload(part)
    assert torch.equal(twin.device_buf[:len(part)], inputs.device_buf[:len(part)])
    assert inputs.device_buf[:len(part)].tolist() == part.tolist()
    v = inputs.views(inputs.host)
    want = prepare_decode(seqs, block_size, "cpu")
    b = len(seqs)
    assert v["input_ids"][:b].tolist() == want.input_ids.tolist()
    assert v["positions"][:b].tolist() == want.positions.tolist()
    assert v["slot_mapping"][:b].tolist() == want.metadata.slot_mapping.tolist()
    assert v["context_lens"][:b].tolist() == want.metadata.context_lens.tolist()
    width = want.metadata.block_tables.shape[1]
    assert v["block_tables"][:b, :width].tolist() == want.metadata.block_tables.tolist()
    assert (v["block_tables"][:b, width:] == -1).all(), "columns past a table must not keep stale block ids"
    assert v["temperatures"][:b].tolist() == np.float32([s.temperature for s in seqs]).tolist()
    assert v["seeds"][:b].tolist() == [s.seed for s in seqs]
    assert (v["slot_mapping"][b:padded] == -1).all() and (v["context_lens"][b:padded] == 0).all()
    assert (v["block_tables"][b:padded] == -1).all(), "padding rows own no blocks"


def test_pack_equals_prepare_decode_through_growth_reuse_and_preemption():
    bs = 4
    inputs = StaticDecodeInputs(max_bs=8, max_blocks=6, device="cpu")
    a, b, c = _seq(5, [3, 9], temperature=0.6), _seq(4, [7]), _seq(9, [1, 2, 5])
    _assert_pack_matches(inputs, [a, b, c], bs, 4)
    # a decodes into a new block; b finishes and c moves into its row
    a.append_token(11); a.append_token(12); a.append_token(13); a.num_cached_tokens = 7
    a.block_table.append(4)
    _assert_pack_matches(inputs, [a, c], bs, 2)
    # c is preempted and comes back with other blocks, same count: its row must be rewritten
    c.block_table[:] = [6, 8, 0]
    _assert_pack_matches(inputs, [a, c], bs, 2)
    # a different, shorter table in a row that held a longer one
    d = _seq(2, [5])
    _assert_pack_matches(inputs, [d, a, c], bs, 4)


def test_pack_refuses_a_table_wider_than_the_graphs():
    inputs = StaticDecodeInputs(max_bs=2, max_blocks=2, device="cpu")
    with pytest.raises(ValueError, match="more than the 2"):
        inputs.pack(_batch([_seq(9, [0, 1, 2])], 4), 1)


def _graph_llm(**kw):
    llm = LLM(tiny_dir("qwen3"), enforce_eager=True, max_num_seqs=8, kvcache_block_size=16, **kw)
    runner = llm.model_runner
    runner.capture_cudagraph(EagerReplayRunner)
    assert runner.graph_samples
    return llm


def test_graph_decode_path_is_exact_greedy_and_samples_in_the_step():
    path = tiny_dir("qwen3")
    g = random.Random(3)
    prompts = [[g.randrange(1, 200) for _ in range(g.randrange(3, 30))] for _ in range(5)]
    llm = _graph_llm()
    runner = llm.model_runner
    calls = {"in_step": 0, "outside": 0}
    orig_sampler = runner.sampler

    def outside(logits, meta):
        calls["outside"] += 1
        return orig_sampler(logits, meta)

    runner.sampler = outside
    orig_step = runner.graph_runner._step

    def counted(bs):
        calls["in_step"] += 1
        return orig_step(bs)

    runner.graph_runner._step = counted
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o["token_ids"] == hf_greedy(path, p, 12)
    decode_steps = calls["in_step"]
    assert decode_steps >= 11, "decode steps must replay the captured step"
    # Only prefill steps sample outside the step (one per prefill step), decode samples inside it
    assert calls["outside"] <= 2, f"greedy decode sampled outside the graph step {calls['outside']} times"
    # top-k on a sampled row: the step's logits go to the sampler outside, ids still valid
    calls.update(in_step=0, outside=0)
    mixed = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
             SamplingParams(temperature=0.8, top_k=1, max_tokens=6, ignore_eos=True)]
    outs = llm.generate(prompts[:2], mixed, use_tqdm=False)
    assert outs[0]["token_ids"] == hf_greedy(path, prompts[0], 6)
    assert outs[1]["token_ids"] == hf_greedy(path, prompts[1], 6), "top_k=1 is greedy whatever T"
    assert calls["outside"] >= 6 and calls["in_step"] >= 5
    llm.exit()


def test_graph_decode_path_sampled_rows_follow_the_temperature():
    """T > 0 inside the step: rows draw different tokens (noise is not frozen) and the T=0 row stays greedy."""
    llm = _graph_llm()
    path = tiny_dir("qwen3")
    prompt = [5, 6, 7, 8]
    sps = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] + \
        [SamplingParams(temperature=5.0, max_tokens=8, ignore_eos=True)] * 6
    outs = llm.generate([prompt] * 7, sps, use_tqdm=False)
    assert outs[0]["token_ids"] == hf_greedy(path, prompt, 8)
    sampled = {tuple(o["token_ids"]) for o in outs[1:]}
    assert len(sampled) >= 4, "six hot rows drew nearly the same tokens: the noise is shared or frozen"
    llm.exit()


def test_tensor_parallel_step_message_is_compact():
    """What rank 0 sends each step is the prepared inputs (bytes ~ batch), not whole sequences."""
    llm = LLM(tiny_dir("qwen3"), enforce_eager=True, kvcache_block_size=16)
    runner = llm.model_runner
    seqs = []
    for i in range(32):
        seq = Sequence([(i + j) % 300 + 1 for j in range(900)], 16, SamplingParams())
        seq.block_table = list(range(i * 57, i * 57 + 57))
        seq.num_cached_tokens = 899
        seqs.append(seq)
    message = runner.message(_batch(seqs, 16))
    sent = len(pickle.dumps(message))
    whole = len(pickle.dumps(seqs))
    assert sent < 16_000 < whole, (sent, whole)
    # without the sampling rows (only rank 0 samples), and it round-trips to the same tensors
    assert isinstance(message, model_runner_mod.ModelStep) and message.batch.sampling is None
    back = pickle.loads(pickle.dumps(message)).batch.inputs
    want = prepare_decode(seqs, 16, "cpu")
    assert back.input_ids.dtype == torch.int64 and torch.equal(back.input_ids, want.input_ids)
    assert torch.equal(back.metadata.block_tables, want.metadata.block_tables)
    assert torch.equal(back.positions, want.positions)
    llm.exit()


def _recompile_reasons() -> dict:
    from torch._dynamo.utils import guard_failures
    return {getattr(code, "co_name", str(code)): reasons[-2:] for code, reasons in guard_failures.items()}


def _count_compiles():
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The engine with its compiled ops on a CPU; torch.compile with the "eager" backend (Dynamo traces and
    counts graphs, nothing is code-generated), so the test is about when compiles happen, and quick."""
    from nanovllm_ref import parts
    from nanovllm_ref.utils import fusion
    import torch._dynamo
    real_compile = torch.compile
    monkeypatch.setattr(parts, "fuse_by_default", lambda device_type: True)
    monkeypatch.setattr(fusion.torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw))
    compiled_fns = [f for f in _fused_functions()]
    for f in compiled_fns:
        f.compiled.cache_clear()
    torch._dynamo.reset()
    yield
    for f in compiled_fns:
        f.compiled.cache_clear()
    torch._dynamo.reset()


def _fused_functions():
    from nanovllm_ref.layers import activation, layernorm, rotary_embedding, sampler
    mods = (activation, layernorm, rotary_embedding, sampler)
    return {v for m in mods for v in vars(m).values() if callable(getattr(v, "compiled", None))
            and hasattr(getattr(v, "compiled"), "cache_clear")}


def _varied_workload(llm):
    g = random.Random(0)
    shared = [g.randrange(1, 200) for _ in range(40)]
    prompts = [[7], shared + [1, 2], shared + [3], [g.randrange(1, 200) for _ in range(70)]] + \
        [[g.randrange(1, 200) for _ in range(g.randrange(2, 20))] for _ in range(5)]
    sps = [SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0.7, max_tokens=9),
           SamplingParams(temperature=0.7, top_k=5, max_tokens=4), SamplingParams(temperature=1.0, top_p=0.8, max_tokens=7),
           # logits processors hand the sampler fp32 logits: a compiled variant of its own
           SamplingParams(temperature=0.8, repetition_penalty=1.2, max_tokens=6),
           SamplingParams(temperature=0.9, min_p=0.1, presence_penalty=0.5, max_tokens=5)]
    llm.generate(prompts[:1], sps[0], use_tqdm=False)                        # batch of one
    llm.generate(prompts[:1], sps[4], use_tqdm=False)
    llm.generate(prompts, [sps[i % len(sps)] for i in range(len(prompts))], use_tqdm=False)
    llm.generate(prompts[1:3], sps[1], use_tqdm=False)                        # prefix-cache hits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_compile_after_start_up(fused_on_cpu, dtype):
    # max_num_batched_tokens=32: the 70-token prompt is prefilled in chunks (paged-prefill continuation).
    # enforce_eager: decode runs eagerly, so the warm-up alone must cover it (graph capture covers it on a GPU).
    # bfloat16 (a GPU's dtype): the logits processors hand the sampler fp32 logits, a variant of its own.
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=16, max_num_batched_tokens=32, max_num_seqs=6, enforce_eager=True,
              dtype=dtype)
    assert llm.model_runner.plan.fuse
    before = _count_compiles()
    assert before > 0, "the engine compiled nothing at start-up: the fixture did not switch fusion on"
    _varied_workload(llm)
    assert _count_compiles() == before, ("a compile happened inside generate(): the start-up warm-up misses a "
                                         f"variant; recompile reasons: {_recompile_reasons()}")
    llm.exit()


def test_without_warm_up_the_workload_compiles(fused_on_cpu, monkeypatch):
    """The check above can fail: the same workload on an engine that skips the warm-up compiles."""
    monkeypatch.setattr(warmup, "warm_step_variants", lambda runner: 0)
    llm = LLM(tiny_dir("qwen3"), kvcache_block_size=16, max_num_batched_tokens=32, max_num_seqs=6, enforce_eager=True)
    before = _count_compiles()
    _varied_workload(llm)
    assert _count_compiles() > before
    llm.exit()


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (bench/gpu_run.sh)")


@cuda_only
def test_cuda_graph_draws_follow_softmax_and_change_every_replay():
    """Inside a real captured graph, the sampler's counter-based noise differs for every new sequence (a new
    seed) and the draws follow softmax(logits / T): a chi-square test over 40 replays of 64 rows with the
    same context and logits."""
    llm = LLM(tiny_dir("qwen3"), enforce_eager=False, max_num_seqs=64, kvcache_block_size=16)
    runner = llm.model_runner
    assert runner.graph_samples
    first = _seq(6, [1], block_size=16)
    first.num_cached_tokens, first.num_scheduled_tokens = 0, 6
    runner.run(_batch([first], 16, True))                   # the context's K/V, in block 1
    draws = []
    for _ in range(40):
        seqs = [_seq(7, [1], block_size=16, temperature=1.0) for _ in range(64)]     # 64 new seeds
        runner.run(_batch(seqs, 16))
        draws.append(runner.graph_runner.buffers["token_ids"][:64].clone())
    draws = torch.stack(draws)
    assert len({tuple(r.tolist()) for r in draws}) == 40, "two replays drew identical rows: frozen noise"
    probs = torch.softmax(runner.graph_runner.buffers["logits"][0].float(), -1).cpu()
    from test_sampler_top_k_top_p import chi_square_p
    p = chi_square_p(torch.bincount(draws.flatten().cpu(), minlength=probs.numel()), probs)
    assert p > 1e-4, f"graph draws do not follow softmax(logits / T): chi-square p = {p:.2g}"
    llm.exit()


@cuda_only
def test_cuda_no_compile_inside_generate_after_start_up():
    from nanovllm_bench.machine import compile_counts
    llm = LLM(tiny_dir("qwen3"), enforce_eager=False, kvcache_block_size=16, max_num_batched_tokens=32,
              max_num_seqs=6, attention_backend="triton")
    before = compile_counts()
    _varied_workload(llm)
    after = compile_counts()
    assert after == before, (f"compiles inside generate(): before {before}, after {after}; "
                             f"recompile reasons: {_recompile_reasons()}")
    llm.exit()


def _tp_graph_worker(config, rank, conn, port, parts):
    """A tensor-parallel worker whose decode runs the graph path (EagerReplayRunner): the CPU stand-in for
    TP with CUDA graphs, where rank 0 sends packed graph inputs."""
    from nanovllm_ref.engine.model_runner import ModelRunner
    runner = ModelRunner(config, rank, [conn], port, parts)
    runner.capture_cudagraph(EagerReplayRunner)
    runner.loop()


def test_tensor_parallel_graph_path_on_cpu_equals_hf(monkeypatch):
    from nanovllm_ref.engine import worker
    monkeypatch.setattr(worker, "run_worker", _tp_graph_worker)
    path = tiny_dir("qwen3")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 47))]
    with LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64, enforce_eager=True) as llm:
        llm.model_runner.capture_cudagraph(EagerReplayRunner)
        assert not llm.model_runner.graph_samples, "with TP the LM head gathers across ranks: no sampler in the graph"
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(path, p, 8) for p in prompts]


def test_to_device_takes_numpy_arrays_as_tp_workers_receive_them():
    """Workers rebuild a step from numpy arrays; on CUDA those go through pinned memory, which
    torch.tensor(ndarray, pin_memory=True) refuses (seen on the H200), so to_device converts them itself."""
    from nanovllm_ref.engine.inputs import to_device
    a = np.arange(6, dtype=np.int64)[::2]                      # not contiguous, same dtype
    t = to_device(a, torch.int64, "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [0, 2, 4]
    a[0] = 99
    assert t[0] == 0, "the tensor must not alias the received array"


def test_eager_steps_switches_graph_replay_off_inside_the_block_only():
    """ModelRunner.eager_steps(): the hook benchmarks use to run decode steps eagerly; the captured graphs
    come back after the block, also when the block raises."""
    llm = _graph_llm()
    runner = llm.model_runner
    graphs = runner.graph_runner
    assert runner.graph_samples
    with pytest.raises(RuntimeError, match="inside"):
        with runner.eager_steps():
            assert runner.graph_runner is None and not runner.graph_samples
            batch = _batch([_seq(5, [0], block_size=16)], 16)
            assert isinstance(runner.message(batch), model_runner_mod.ModelStep)
            raise RuntimeError("inside")
    assert runner.graph_runner is graphs and runner.graph_samples
    assert isinstance(runner.message(_batch([_seq(5, [0], block_size=16)], 16)), model_runner_mod.PackedDecodeStep)
    llm.exit()
