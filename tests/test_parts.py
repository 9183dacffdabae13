"""The engine's seams: Parts, pure input preparation, scoped attention metadata, no process globals, and the
course's export round trip (a student's exported parts run inside the engine with HF-equal greedy ids)."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nanovllm_ref
from nanovllm_ref import Parts, SamplingParams
from nanovllm_ref.attn import FunctionBackend
from nanovllm_ref.engine.inputs import prepare_decode, prepare_prefill, slot_mapping
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.layers.layernorm import rms_norm
from nanovllm_ref.utils.context import AttentionMetadata, attention_metadata, current_metadata
from nanovllm_ref.utils.parallel import get_tp_rank, get_tp_size, tensor_parallel

from engine_helpers import LLM, hf_greedy, run_checked, tiny_dir
import parts_spies

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 11, 3, 7, 2, 8], [100, 4], [7] * 13, [5, 9, 11, 3, 7, 2, 8, 40, 41]]


def greedy(n=8):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


# -- input preparation ------------------------------------------------------------------------------------
def test_prepare_prefill_is_a_pure_function_with_the_worked_values():
    a = Sequence(list(range(10)), 4)
    a.block_table, a.num_cached_tokens, a.num_scheduled_tokens = [7, 2, 5], 4, 5      # a cached first block
    b = Sequence([1, 2, 3], 4)
    b.block_table, b.num_cached_tokens, b.num_scheduled_tokens = [0], 0, 3
    step = prepare_prefill([a, b], 4, "cpu")
    assert step.input_ids.tolist() == [4, 5, 6, 7, 8, 1, 2, 3]
    assert step.positions.tolist() == [4, 5, 6, 7, 8, 0, 1, 2]
    m = step.metadata
    assert m.is_prefill and m.cu_seqlens_q.tolist() == [0, 5, 8] and m.cu_seqlens_k.tolist() == [0, 9, 12]
    assert (m.max_seqlen_q, m.max_seqlen_k) == (5, 9)
    assert m.slot_mapping.tolist() == [8, 9, 10, 11, 20, 0, 1, 2]
    assert m.block_tables.tolist() == [[7, 2, 5], [0, -1, -1]]
    assert m.slot_mapping.dtype == torch.int32 and step.input_ids.dtype == torch.int64
    assert a.block_table == [7, 2, 5] and a.num_cached_tokens == 4         # inputs untouched


def test_prepare_decode_values_and_custom_slot_fn():
    a = Sequence(list(range(9)), 4)
    a.block_table = [3, 1, 6]
    step = prepare_decode([a], 4, "cpu")
    assert step.input_ids.tolist() == [8] and step.positions.tolist() == [8]
    assert step.metadata.slot_mapping.tolist() == [6 * 4 + 0] and step.metadata.context_lens.tolist() == [9]
    same = prepare_decode([a], 4, "cpu", slot_fn=lambda t, s, e, bs: slot_mapping(t, s, e, bs))
    assert same.metadata.slot_mapping.tolist() == [24]


def test_slot_mapping_past_the_table_is_a_value_error():
    with pytest.raises(ValueError, match="block table has 1"):
        slot_mapping([0], 0, 5, 4)


# -- scoped metadata and no process globals ---------------------------------------------------------------
def test_attention_metadata_is_scoped_and_restored_after_an_exception():
    meta = AttentionMetadata(is_prefill=True, max_seqlen_q=3)
    with pytest.raises(RuntimeError):
        with attention_metadata(meta):
            assert current_metadata() is meta
            raise RuntimeError("forward failed")
    assert current_metadata() == AttentionMetadata()
    inner = AttentionMetadata(max_seqlen_q=1)
    with attention_metadata(meta):
        with attention_metadata(inner):
            assert current_metadata() is inner
        assert current_metadata() is meta
    with pytest.raises(TypeError, match="AttentionMetadata"):
        with attention_metadata({"is_prefill": True}):
            pass


def test_a_failing_step_leaves_no_stale_metadata_and_other_requests_still_finish():
    path = tiny_dir("qwen3")
    llm = LLM(path, kvcache_block_size=4, max_num_seqs=16, parts=Parts(rms_norm=parts_spies.rms_norm_breaks_on_7_tokens))
    assert len(PROMPTS[0]) == 7
    with pytest.raises(RuntimeError, match="rms_norm broke"):      # raised inside the forward
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)
    assert current_metadata() == AttentionMetadata()
    assert llm.is_finished()                       # the failed call's requests were dropped
    llm.exit()
    ok = LLM(path, kvcache_block_size=4)
    assert ok.generate([PROMPTS[1]], greedy(), use_tqdm=False)[0]["token_ids"] == hf_greedy(path, PROMPTS[1], 8)
    ok.exit()


def test_tensor_parallel_scope_does_not_outlive_the_block():
    with pytest.raises(RuntimeError):
        with tensor_parallel(1, 2):
            assert (get_tp_rank(), get_tp_size()) == (1, 2)
            raise RuntimeError
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    with pytest.raises(ValueError, match="rank"):
        with tensor_parallel(2, 2):
            pass


def test_fusion_is_chosen_per_model_not_per_process():
    from nanovllm_ref.models.qwen3 import Qwen3ForCausalLM
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(tiny_dir("qwen3"))
    fused = Qwen3ForCausalLM(hf, ops=Parts().model_ops(fuse=True))   # not run: compiling needs no GPU to be built
    plain = Qwen3ForCausalLM(hf)
    assert fused.model.norm.norm is rms_norm.compiled() and fused.model.layers[0].self_attn.fused_qk_norm_rope
    assert plain.model.norm.norm is rms_norm and plain.model.layers[0].self_attn.fused_qk_norm_rope is None
    mine = Qwen3ForCausalLM(hf, ops=Parts(rms_norm=parts_spies.rms_norm).model_ops(fuse=True))
    assert mine.model.norm.norm is parts_spies.rms_norm              # a part runs as written
    assert mine.model.layers[0].self_attn.fused_qk_norm_rope is None
    with pytest.raises(TypeError, match="ops must be a models.ops.ModelOps"):
        Qwen3ForCausalLM(hf, ops=Parts())


def test_with_the_qk_kernel_on_nothing_compiles_qk_norm_rope():
    from nanovllm_ref.utils.fusion import FusedKernels
    kernels = FusedKernels.all()
    assert Parts().model_ops(fuse=True, kernels=kernels).qk_norm_rope is None
    assert Parts().model_ops(fuse=True, kernels=dataclasses.replace(kernels, qk_norm_rope_store=False)).qk_norm_rope


def test_is_reference_answers_the_identity_question_for_every_field():
    from nanovllm_ref.attn import cpu_backend, torch_backend
    assert all(Parts().is_reference(f.name) for f in dataclasses.fields(Parts))
    mine = Parts(rms_norm=parts_spies.rms_norm, scheduler=parts_spies.SpyScheduler)
    assert not mine.is_reference("rms_norm") and not mine.is_reference("scheduler") and mine.is_reference("sampler")
    assert mine.replaced() == ["rms_norm", "scheduler"]
    # the stores the engine picks itself count as the reference store (they write what the fused kernel writes)
    for store in (torch_backend.store_kvcache, cpu_backend.store_kvcache):
        assert Parts(store_kvcache=store).is_reference("store_kvcache")
    assert not Parts(store_kvcache=parts_spies.store_kvcache).is_reference("store_kvcache")
    with pytest.raises(ValueError, match="'rms_nrom' is not a Parts field"):
        Parts().is_reference("rms_nrom")


def test_the_plan_is_resolved_once_and_logged_at_start_up(caplog):
    """The engine's choices, one frozen record per runner (Parts.resolve), logged at INFO as vLLM logs its own."""
    import logging
    with caplog.at_level(logging.INFO, logger="nanovllm_ref"):
        llm = LLM(tiny_dir("qwen3"), kvcache_block_size=4, parts=Parts(sampler=parts_spies.sample))
    plan = llm.model_runner.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.use_graphs = True
    assert plan.sampler is parts_spies.sample and plan.graph_sample_rows is None and plan.replaced == ("sampler",)
    text = plan.describe()
    assert "sampler: Parts.sampler, row draw as written; after the forward" in text
    assert "replaced parts: sampler" in text and text in caplog.text
    llm.exit()


def test_no_engine_file_but_parts_compares_functions_by_identity():
    """The identity question (is this the reference part?) is answered by Parts.is_reference alone: an `is`
    comparison between two objects (not None / True / False) anywhere else in nanovllm_ref fails this test,
    except the object identities of the server's request groups, listed here."""
    import ast
    allowed = {("entrypoints/openai/engine_loop.py", "other is group"),
               ("entrypoints/openai/engine_loop.py", "g is group"),
               ("entrypoints/openai/engine_loop.py", "a[0] is not group"),
               ("entrypoints/openai/engine_loop.py", "self._groups.get(rid) is group"),
               ("entrypoints/openai/sampling.py", "value is n")}
    root = ROOT / "nanovllm_ref"
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "parts.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot)) for o in node.ops):
                sides = [node.left, *node.comparators]
                if any(isinstance(x, ast.Constant) and x.value in (None, True, False) for x in sides):
                    continue
                if (rel, ast.unparse(node)) not in allowed:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "identity comparisons outside parts.py (ask Parts.is_reference instead): " + "; ".join(found)


def test_importing_the_engine_sets_no_environment_variable():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, nanovllm_ref, nanovllm_ref.kernels, nanovllm_ref.attn.triton_backend, nanovllm_bench.cli\n"
            "print(os.environ.get('TRITON_INTERPRET'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert out.stdout.strip() == "None"


def test_triton_on_cpu_without_the_interpreter_is_refused_by_name():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from nanovllm_ref.attn import resolve_backend\n"
            "try:\n    resolve_backend('triton', 'cpu')\nexcept ValueError as e:\n    print('ValueError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert out.stdout.startswith("ValueError") and "TRITON_INTERPRET=1" in out.stdout


# -- Parts --------------------------------------------------------------------------------------------------
def test_every_part_runs_inside_the_engine_and_greedy_ids_equal_hf():
    spies = Parts(rms_norm=parts_spies.rms_norm, add_rms_norm=parts_spies.add_rms_norm,
                  rope_cos_sin=parts_spies.rope_cos_sin, rotary=parts_spies.rotary,
                  silu_and_mul=parts_spies.silu_and_mul, qkv_weight_loader=parts_spies.qkv_weight_loader,
                  gate_up_weight_loader=parts_spies.gate_up_weight_loader,
                  prepare_prefill=parts_spies.prepare_prefill, prepare_decode=parts_spies.prepare_decode,
                  attention_backend=dataclasses.replace(FunctionBackend.of("torch"), paged_decode=parts_spies.paged_decode),
                  store_kvcache=parts_spies.store_kvcache, block_manager=parts_spies.SpyBlockManager,
                  scheduler=parts_spies.SpyScheduler, sampler=parts_spies.sample,
                  graph_batch_sizes=parts_spies.graph_sizes)
    assert spies.replaced() == [f.name for f in dataclasses.fields(Parts)]
    parts_spies.CALLS.clear()
    path = tiny_dir("qwen3")
    llm = LLM(path, kvcache_block_size=4, parts=spies)
    out = llm.generate(PROMPTS, greedy(), use_tqdm=False)        # all greedy: the sampler part still runs
    used_graphs = llm.model_runner.graph_runner is not None
    llm.exit()
    for prompt, o in zip(PROMPTS, out):
        assert o["token_ids"] == hf_greedy(path, prompt, 8)
    ran = {name for name, n in parts_spies.CALLS.items() if n > 0}
    # graph_batch_sizes is used only when CUDA graphs are captured (GPU); the GPU run covers it.
    expected = set(spies.replaced()) - (set() if used_graphs else {"graph_batch_sizes"})
    assert ran == expected


def test_parts_are_checked_before_anything_starts():
    with pytest.raises(TypeError, match="Parts.rms_norm must be callable"):
        Parts(rms_norm=3)
    with pytest.raises(TypeError, match="Parts.scheduler must be a class"):
        Parts(scheduler=parts_spies.sample)
    with pytest.raises(TypeError, match="attention_backend"):
        Parts(attention_backend=object())
    path = tiny_dir("qwen3")
    with pytest.raises(TypeError, match="parts must be a nanovllm_ref.Parts"):
        nanovllm_ref.LLM(path, parts={"rms_norm": rms_norm})
    with pytest.raises(ValueError, match="conflicts with Parts.attention_backend"):
        nanovllm_ref.LLM(path, attention_backend="torch", parts=Parts(attention_backend=FunctionBackend.of("torch")))
    with pytest.raises(TypeError, match="Parts.sampler cannot be sent to tensor-parallel workers"):
        nanovllm_ref.LLM(path, tensor_parallel_size=2, parts=Parts(sampler=lambda logits, meta: logits.argmax(-1)))


# -- the course's export round trip -------------------------------------------------------------------------
def _export(notebooks: str, tmp_path: Path):
    from nanovllm_course import export as ex
    out = tmp_path / "student"
    cli = subprocess.run([sys.executable, "-m", "nanovllm_course", "export", "--notebooks", str(ROOT / notebooks),
                          "--out", str(out)], capture_output=True, text=True, cwd=ROOT, check=True)
    parts, rows = ex.parts_from_student(out)
    return parts, rows, cli.stdout


@pytest.fixture(scope="module")
def exported_solutions(tmp_path_factory):
    """(parts, rows, printed) of the solutions exported once for this module's tests (the export command and the
    import of what it wrote: about 3 s of CPU); the tests only read them."""
    return _export("solutions", tmp_path_factory.mktemp("exported_solutions"))


def test_exported_solutions_run_in_the_engine_with_hf_equal_ids(exported_solutions):
    parts, rows, printed = exported_solutions
    assert {r["source"] for r in rows} == {"yours"}
    assert set(parts.replaced()) == {"rms_norm", "add_rms_norm", "rope_cos_sin", "rotary", "qkv_weight_loader",
                                     "gate_up_weight_loader", "prepare_prefill", "prepare_decode",
                                     "attention_backend", "store_kvcache", "block_manager", "scheduler",
                                     "sampler", "graph_batch_sizes"}
    assert "not done yet" not in printed
    # Chapter 09's rank-aware loaders win over chapter 03's (the highest chapter's done part runs).
    assert "qkv_weight_loader      yours      ch09 E9.1 load_qkv_shard" in printed
    assert "gate_up_weight_loader  yours      ch09 E9.1 load_gate_up_shard" in printed
    for arch in ("qwen3", "llama"):
        path = tiny_dir(arch)
        # Tight cache, small chunks and a shared prefix: chunked prefill, prefix hits and preemption all run
        # through the student's scheduler, block manager, slot mapping, store and decode attention.
        # enforce_eager keeps this test about the parts, not graphs (graph_batch_sizes is exercised on a GPU by
        # the spies test above). The store that runs is chapter 10's capture-safe one (the highest chapter).
        llm = LLM(path, parts=parts, kvcache_block_size=4, num_kvcache_blocks=12, max_num_batched_tokens=8,
                  max_model_len=64, enforce_eager=True)
        got, _ = run_checked(llm, PROMPTS, greedy(10))
        assert llm.scheduler.num_preemptions > 0
        llm.exit()
        for prompt, ids in zip(PROMPTS, got):
            assert ids == hf_greedy(path, prompt, 10), arch


def test_exported_parts_pickle_into_tensor_parallel_workers(exported_solutions):
    parts, _, _ = exported_solutions
    path = tiny_dir("qwen3")
    with LLM(path, parts=parts, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64) as llm:
        out = llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)
    for prompt, o in zip(PROMPTS[:2], out):
        assert o["token_ids"] == hf_greedy(path, prompt, 8)


def test_parts_from_an_importable_module_run_in_tensor_parallel_workers():
    spies = Parts(rms_norm=parts_spies.rms_norm, block_manager=parts_spies.SpyBlockManager, sampler=parts_spies.sample)
    path = tiny_dir("qwen3")
    with LLM(path, parts=spies, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64) as llm:
        out = llm.generate(PROMPTS[:2], greedy(), use_tqdm=False)
    for prompt, o in zip(PROMPTS[:2], out):
        assert o["token_ids"] == hf_greedy(path, prompt, 8)


def test_exported_unfilled_chapters_fall_back_to_the_reference_and_say_so(tmp_path):
    parts, rows, printed = _export("chapters", tmp_path)
    assert parts == Parts() and parts.replaced() == []
    assert {r["status"] for r in rows} == {"stub"} and {r["source"] for r in rows} == {"reference"}
    assert ("still the reference's (not done yet): E1.1, E1.2, E2.1, E2.2, E3.3, E4.1, E4.2, E4.3, E5.2, E5.3, "
            "E6.1, E6.3, E7.1-E7.3, E8.1-E8.4, E9.1, E10.1, E10.3") in printed
    assert "rms_norm               reference  ch01 E1.1 rms_norm (stub)" in printed


def test_the_plan_on_a_gpu_runs_every_kernel_the_reference_parts_allow(monkeypatch):
    """Parts.resolve for a CUDA engine, checked on the CPU (the facts of the device monkeypatched: Triton compiles,
    PDL is available): the decode kernels with PDL, the triton back-end's decode attention launched with PDL too,
    the sampler's row draw as the Triton kernel inside the graph, async scheduling; with decode_kernels="off"
    none of the kernels and the plain back-end; a sampler of yours runs as written, after the graph."""
    from nanovllm_ref import parts as parts_mod
    from nanovllm_ref.attn import triton_backend
    from nanovllm_ref.config import Config
    from nanovllm_ref.kernels import numerics, sampler as sampler_kernel
    from nanovllm_ref.utils.fusion import FusedKernels
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(numerics, "pdl_available", lambda device: True)
    config = Config(tiny_dir("qwen3"), kvcache_block_size=16, max_model_len=64, max_num_seqs=8)
    plan = Parts().resolve(config, "cuda", torch.bfloat16)
    assert plan.attention == "triton" and plan.use_graphs and plan.async_scheduling and plan.fuse
    # Not the persistent batch-1 step: slower than these kernels on the H200 (kernels/persistent_decode.py).
    assert plan.ops.kernels == FusedKernels.all(pdl=True) and not plan.ops.kernels.persistent
    assert plan.ops.attention_backend.paged_decode is triton_backend.paged_decode_pdl
    assert plan.graph_sample_rows is sampler_kernel.sample_rows and plan.graph_batch_sizes == (1, 2, 4, 8)
    assert "row draw Triton kernel" in plan.describe() and "PDL on" in plan.describe()
    # The q/k kernel serves prefill too: nothing compiles Qwen3's q/k norm + RoPE, and the plan says so.
    assert plan.ops.qk_norm_rope is None and "prefill steps: qk_norm_rope_store without its store" in plan.describe()
    off = Parts().resolve(Config(tiny_dir("qwen3"), kvcache_block_size=16, max_model_len=64, max_num_seqs=8,
                                 decode_kernels="off"), "cuda", torch.bfloat16)
    assert not off.ops.kernels.any() and off.ops.attention_backend is triton_backend
    mine = Parts(sampler=parts_spies.sample).resolve(config, "cuda", torch.bfloat16)
    assert mine.graph_sample_rows is None and mine.sampler is parts_spies.sample
    # decode_kernels="persistent": every kernel and the persistent batch-1 step; refused by name where it can't run.
    ask = Config(tiny_dir("qwen3"), kvcache_block_size=16, max_model_len=64, max_num_seqs=8, decode_kernels="persistent")
    on = Parts().resolve(ask, "cuda", torch.bfloat16)
    assert on.ops.kernels == FusedKernels.all(pdl=True, persistent=True) and on.attention == "triton"
    assert "a batch of one: one persistent kernel" in on.describe() and "persistent" not in plan.describe()
    # 'auto' picks the triton back-end for it even where flash-attn would be picked (installed, half dtype).
    from nanovllm_ref import attn as attn_mod
    monkeypatch.setattr(attn_mod, "resolve_backend", lambda name, *a, **k: "flash_attn" if name == "auto" else name)
    assert Parts().resolve(ask, "cuda", torch.bfloat16).attention == "triton"
    with pytest.raises(ValueError, match="not attention_backend='flash_attn'"):
        Parts().resolve(dataclasses.replace(ask, attention_backend="flash_attn"), "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="not Parts.attention_backend"):
        Parts(attention_backend=FunctionBackend(*(lambda *a: None,) * 3)).resolve(ask, "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="persistent' runs in the batch-1 decode graph"):
        Parts(graph_batch_sizes=lambda n: [2, 4]).resolve(ask, "cuda", torch.bfloat16)
    biased = Config(tiny_dir("qwen3", attention_bias=True), kvcache_block_size=16, max_model_len=64, max_num_seqs=8,
                    decode_kernels="persistent")
    with pytest.raises(ValueError, match="persistent' needs a model without attention_bias"):
        Parts().resolve(biased, "cuda", torch.bfloat16)
    for device, world, parts in (("cpu", 1, Parts()), ("cuda", 2, Parts())):
        with pytest.raises(ValueError, match="decode_kernels='persistent' needs CUDA with Triton and tensor_parallel"):
            parts.resolve(ask, device, torch.bfloat16, world_size=world)
    with pytest.raises(ValueError, match="decode_kernels='persistent' attends with its own Triton kernel"):
        Parts().resolve(dataclasses.replace(ask, attention_backend="torch"), "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="decode_kernels='persistent' needs every decode kernel"):
        Parts(add_rms_norm=parts_spies.add_rms_norm).resolve(ask, "cuda", torch.bfloat16)
