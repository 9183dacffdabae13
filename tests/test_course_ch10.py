"""Mutation tests of the chapter 10 check helpers (nanovllm_course/ch10.py).

Each check passes on the reference (printing exactly its one `E10.n ok` line), fails on a stub with 'not
implemented yet', and fails on each planted plausible mistake with a message that points at it. E10.4 runs on
the CPU stand-in graph (ch10.CPUGraphs) here, on the real CUDA graph where there is a GPU.
"""
import functools

import pytest
import torch

import course_checks

from nanovllm_course import ch10
from nanovllm_ref.attn.torch_backend import store_kvcache as masked_store

CHECKS = {tag: e.check for tag, e in ch10.EXERCISES.items()}
REFERENCE = {tag: e.reference[0] for tag, e in ch10.EXERCISES.items()}

fails = functools.partial(course_checks.fails_by_tag, CHECKS)


@pytest.mark.parametrize("tag", sorted(CHECKS))
def test_reference_passes_with_one_line(tag, capsys):
    for _ in range(1 if tag == "E10.4" else 3):                 # fresh random inputs each time
        CHECKS[tag](REFERENCE[tag])
        assert capsys.readouterr().out == f"{tag} ok\n"


@pytest.mark.parametrize("tag", sorted(CHECKS))
def test_stub_is_not_done(tag):
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise")
    fails(tag, stub, "not implemented yet")


# -- E10.1 --------------------------------------------------------------------------------------------------------
def powers_of_two(m):
    sizes, b = [], 1
    while b < m:
        sizes.append(b)
        b *= 2
    return sizes + [m]


def without_max(m):
    return [b for b in (1, 2, 4, 8) if b < m] + list(range(16, m, 16)) or [1]


def without_small(m):
    return sorted(set(list(range(16, m, 16)) + [m]))


def unsorted(m):
    return list(reversed(ch10.reference_graph_batch_sizes(m)))


def beyond_max(m):
    return sorted(set([b for b in (1, 2, 4, 8)] + list(range(16, m + 16, 16)) + [m]))


def test_graph_batch_sizes_mutants():
    fails("E10.1", powers_of_two, "idle rows (more than 15)", "every multiple of 16")
    fails("E10.1", without_max, "finds no captured graph", "capture max_num_seqs itself")
    fails("E10.1", without_small, "missing [1", "a batch of 1 should not run 16 rows")
    fails("E10.1", unsorted, "not sorted ascending")
    fails("E10.1", beyond_max, "outside 1..max_num_seqs")
    fails("E10.1", lambda m: torch.tensor(ch10.reference_graph_batch_sizes(m)), "list of ints")


# -- E10.2 --------------------------------------------------------------------------------------------------------
def no_fill(buf, ids, pos, meta):
    """Copies this step's rows and nothing else: padding rows and stale columns keep old values."""
    b = ids.shape[0]
    buf["input_ids"][:b] = ids
    buf["positions"][:b] = pos
    buf["slot_mapping"][:b] = meta.slot_mapping
    buf["context_lens"][:b] = meta.context_lens
    buf["block_tables"][:b, :meta.block_tables.shape[1]] = meta.block_tables


def padding_slot_zero(buf, ids, pos, meta):
    ch10.reference_fill_static_inputs(buf, ids, pos, meta)
    buf["slot_mapping"][ids.shape[0]:] = 0


def stale_columns(buf, ids, pos, meta):
    no_fill(buf, ids, pos, meta)
    b = ids.shape[0]
    buf["slot_mapping"][b:] = -1
    buf["context_lens"][b:] = 0
    buf["block_tables"][b:] = -1


def stale_context_lens(buf, ids, pos, meta):
    ch10.reference_fill_static_inputs(buf, ids, pos, meta)
    buf["context_lens"][ids.shape[0]:] = 7


def replaces_buffer(buf, ids, pos, meta):
    ch10.reference_fill_static_inputs(buf, ids, pos, meta)
    buf["slot_mapping"] = buf["slot_mapping"].clone()


def test_fill_static_inputs_mutants():
    fails("E10.2", no_fill, "slot_mapping should be -1", "previous step's slots")
    fails("E10.2", padding_slot_zero, "are 0, not -1", "slot 0 (block 0, offset 0)")
    fails("E10.2", stale_columns, "stale columns", "clear the columns past their width")
    fails("E10.2", stale_context_lens, "context_lens should be 0")
    fails("E10.2", replaces_buffer, "replaced by a new tensor", "in place")


# -- E10.3 --------------------------------------------------------------------------------------------------------
def _flat(cache):
    return cache.view(-1, *cache.shape[2:])


def clamp_only(key, value, k_cache, v_cache, slots):
    idx = slots.long().clamp(min=0)
    _flat(k_cache).index_copy_(0, idx, key)
    _flat(v_cache).index_copy_(0, idx, value)


def minus_one_index(key, value, k_cache, v_cache, slots):
    _flat(k_cache)[slots.long()] = key
    _flat(v_cache)[slots.long()] = value


def old_value_back(key, value, k_cache, v_cache, slots):
    """Padding rows write slot 0's old contents back: loses to nothing, except a real write to slot 0."""
    idx = slots.long().clamp(min=0)
    real = (slots >= 0)[:, None, None]
    for src, cache in ((key, k_cache), (value, v_cache)):
        flat = _flat(cache)
        flat.index_copy_(0, idx, torch.where(real, src, flat[idx]))


def host_loop(key, value, k_cache, v_cache, slots):
    for i in range(slots.shape[0]):
        if slots[i] >= 0:
            _flat(k_cache)[slots[i]] = key[i]
            _flat(v_cache)[slots[i]] = value[i]


def test_capture_safe_store_mutants():
    fails("E10.3", masked_store, "aten.index", "boolean mask", "cannot capture")
    # `if slots[i] >= 0` and `k_cache[slots[i]]` both read a value on the host; the 0-d index hint names the second
    fails("E10.3", host_loop, "aten._local_scalar_dense", "on the host")
    fails("E10.3", clamp_only, "wrote there", "clamping sends it to slot 0")
    fails("E10.3", minus_one_index, "wrote there", "a -1 index means 'the last row'")
    fails("E10.3", old_value_back, "slot 0 kept its old contents", "either may win")


def test_capture_safe_store_runs_in_the_cpu_engine():
    from nanovllm_ref import LLM, Parts, SamplingParams
    from nanovllm_course.common import tiny_model_dir
    prompts = [[5, 9, 11, 3, 7, 2, 8, 40], [100, 4, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for parts in (Parts(), Parts(store_kvcache=ch10.reference_store_kvcache)):
        llm = LLM(tiny_model_dir("qwen3"), device="cpu", kvcache_block_size=4, max_model_len=64, parts=parts)
        outs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.exit()
    assert outs[0] == outs[1]


# -- E10.4 (on the CPU stand-in here; on CUDA where there is one) -----------------------------------------------
def returns_a_copy(run_step, batch_size, cuda):
    graph, out = ch10.reference_capture_decode_graph(run_step, batch_size, cuda)
    return graph, out.clone()


def runs_outside_the_capture(run_step, batch_size, cuda):
    out = run_step(batch_size)
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        pass
    return graph, out


def captures_batch_one(run_step, batch_size, cuda):
    return ch10.reference_capture_decode_graph(run_step, 1, cuda)


def item_inside_capture(run_step, batch_size, cuda):
    run_step(batch_size)
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        out = run_step(batch_size)
        assert out.abs().max().item() >= 0
    return graph, out


def captures_without_warm_up(run_step, batch_size, cuda):
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        out = run_step(batch_size)
    return graph, out


def warms_up_at_batch_one(run_step, batch_size, cuda):
    run_step(1)
    cuda.synchronize()
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        out = run_step(batch_size)
    return graph, out


def warms_up_after_capture(run_step, batch_size, cuda):
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        out = run_step(batch_size)
    run_step(batch_size)
    return graph, out


@pytest.mark.parametrize("fn,says", [(captures_without_warm_up, "captured without an eager warm-up"),
                                     (warms_up_after_capture, "captured without an eager warm-up"),
                                     (warms_up_at_batch_one, "warm up with the batch size you capture")],
                         ids=["no_warm_up", "warm_up_after", "warm_up_at_1"])
def test_graph_replay_needs_the_warm_up_before_capture(fn, says):
    for _ in range(3):                      # on the CPU stand-in here, on CUDA where there is one
        fails("E10.4", fn, says)


def test_the_stand_in_says_when_it_captures():
    assert not ch10.CPUGraphs.is_current_stream_capturing()
    with ch10.CPUGraphs.graph(ch10.CPUGraphs.CUDAGraph()):
        assert ch10.CPUGraphs.is_current_stream_capturing()
    assert not ch10.CPUGraphs.is_current_stream_capturing()


def test_graph_replay_mutants():
    fails("E10.4", returns_a_copy, "replayed logits differ", "a copy stays stale")
    fails("E10.4", captures_batch_one, "captured output has 1 rows")
    if not torch.cuda.is_available():       # the stand-in can tell; a real CUDA graph cannot be inspected
        fails("E10.4", runs_outside_the_capture, "the graph recorded nothing")
    # The stand-in refuses the host read itself; CUDA reports it as an invalidated capture.
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing|failed due to a previous error "
                                           "during capture"):
        ch10.check_graph_replay(item_inside_capture)


def test_cpu_stand_in_graph_replays_new_inputs_and_refuses_host_reads():
    x = torch.zeros(3)
    graph = ch10.CPUGraphs.CUDAGraph()
    with ch10.CPUGraphs.graph(graph):
        y = (x + 1) * 2
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert y.tolist() == [4.0, 6.0, 8.0]
    with pytest.raises(ch10.CaptureError, match="nonzero|index"):
        with ch10.CPUGraphs.graph(ch10.CPUGraphs.CUDAGraph()):
            x[x > 1]


# -- every hint of the chapter's checks has a mutant that reaches it --------------------------------------------
def ids_not_copied(buf, ids, pos, meta):
    ch10.reference_fill_static_inputs(buf, ids, pos, meta)
    buf["input_ids"][:ids.shape[0]] = 0


def tables_not_copied(buf, ids, pos, meta):
    """Clears the block tables to -1 but never copies this step's in."""
    ch10.reference_fill_static_inputs(buf, ids, pos, meta)
    buf["block_tables"].fill_(-1)


def padding_table_rows_stale(buf, ids, pos, meta):
    """Clears the real rows' stale columns, but leaves the padding rows' tables from the previous step."""
    b, w = meta.block_tables.shape
    old = buf["block_tables"][b:].clone()
    ch10.reference_fill_static_inputs(buf, ids, pos, meta)
    buf["block_tables"][b:] = old


def clears_outputs(buf, ids, pos, meta):
    ch10.reference_fill_static_inputs(buf, ids, pos, meta)
    buf["outputs"].zero_()


def test_fill_static_inputs_hints_are_reached():
    for _ in range(3):
        fails("E10.2", ids_not_copied, "buffers['input_ids']", "does not hold this step's input_ids")
        fails("E10.2", tables_not_copied, "does not hold this step's block tables")
        fails("E10.2", padding_table_rows_stale, "of block_tables should be all -1")
        fails("E10.2", clears_outputs, "buffers['outputs'] changed")


def anchor_without_a_real_row(key, value, k_cache, v_cache, slots):
    """The capture-safe trick with a slip: with no real row in the step, the padding rows still send the first
    row's K/V to slot 0 (instead of slot 0's own contents)."""
    s = slots.long()
    real = s >= 0
    first = real.long().argmax().view(1)
    target = torch.where(real, s, s.index_select(0, first).clamp(min=0))
    for src, cache in ((key, k_cache), (value, v_cache)):
        rows = torch.where(real[:, None, None], src, src.index_select(0, first))
        _flat(cache).index_copy_(0, target, rows)


def kv_swapped_capture_safe(key, value, k_cache, v_cache, slots):
    ch10.reference_store_kvcache(value, key, k_cache, v_cache, slots)


def test_capture_safe_store_hints_are_reached():
    for _ in range(3):
        fails("E10.3", anchor_without_a_real_row, "changed although no real row writes it")
        fails("E10.3", kv_swapped_capture_safe, "does not hold the row written to it")


def test_graph_replay_hints_are_reached():
    fails("E10.4", lambda run_step, bs, cuda: ch10.reference_capture_decode_graph(run_step, bs, cuda)[::-1],
          "capture should return (the graph, the output tensor")
    if not torch.cuda.is_available():
        with pytest.raises(AssertionError, match="needs a CUDA GPU"):
            ch10.check_graph_replay(ch10.reference_capture_decode_graph, device="cuda")



# -- E10.5 --------------------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x, c, s, interleaved=False):
    xf = x.float()
    c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)
    a, b = xf.chunk(2, dim=-1)
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)


def _rms_eps_outside(x, w, eps):
    xf = x.float()
    return w * (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def qk_student(qkv, positions, cos_sin, qw, kw, eps, k_cache, v_cache, slots, h, hkv, d, mistake=None):
    """A student's version written from the spec (independent of ch10's own variants), with one mistake."""
    rms = _rms_eps_outside if mistake == "eps_outside_root" else _rms
    eps = {"no_eps": 0.0, "eps_hard_coded": 1e-6}.get(mistake, eps)
    if mistake == "row_index":
        positions = torch.arange(qkv.shape[0])
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    if mistake == "v_from_k":
        v = qkv[:, h * d:(h + hkv) * d]
    q, k, v = q.reshape(-1, h, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    c, s = (t[positions] for t in cos_sin.chunk(2, dim=-1))
    if mistake == "minus_sin":
        s = -s
    if qw is not None and mistake not in ("no_norm", "norm_after_rope"):
        if mistake == "whole_row":
            q = rms(q.flatten(1), qw.repeat(h), eps).view(-1, h, d)
            k = rms(k.flatten(1), kw.repeat(hkv), eps).view(-1, hkv, d)
        else:
            q, k = rms(q, qw, eps), rms(k, qw if mistake == "k_uses_q_weight" else kw, eps)
    k_unrotated = k
    q, k = _rotate(q, c, s, mistake == "interleaved"), _rotate(k, c, s, mistake == "interleaved")
    if qw is not None and mistake == "norm_after_rope":
        q, k = _rms(q, qw, eps), _rms(k, kw, eps)
    if mistake == "k_before_rope":
        k = k_unrotated
    if mistake == "v_rotated":
        v = _rotate(v, c, s)
    idx = slots.long()
    if mistake == "padding_to_slot_0":
        idx = idx.clamp(min=0)
        k_cache.view(-1, hkv, d).index_copy_(0, idx, k.contiguous())
        v_cache.view(-1, hkv, d).index_copy_(0, idx, v.contiguous())
    else:
        keep = idx >= 0
        k_cache.view(-1, hkv, d).index_copy_(0, idx[keep], k[keep])
        v_cache.view(-1, hkv, d).index_copy_(0, idx[keep], v[keep])
    if mistake == "flat_q":
        return q.flatten(1)
    if mistake == "in_place":
        qkv.mul_(1.0)
        qkv[0, 0] += 1
    return q


QK_MUTANTS = {
    "no_norm": ("without the q/k RMSNorm", "BEFORE RoPE"),
    "whole_row": ("not per head", "per head"),
    "norm_after_rope": ("after RoPE", "normalise first, then rotate"),
    "k_uses_q_weight": ("normalised with q_weight", "k is normalised with k_weight"),
    "interleaved": ("(2i, 2i+1) pairs", "rotate half"),
    "k_before_rope": ("k_cache holds k before RoPE", "never rotates them again"),
    "v_rotated": ("v_cache holds a rotated v", "no norm, no RoPE"),
    "v_from_k": ("v_cache holds the k columns", "(H + Hkv) * d"),
    "padding_to_slot_0": ("slot",),
    "flat_q": ("has shape", "split qkv"),
    "in_place": ("changed its input `qkv`",),
    "no_eps": ("without the eps given", "under the root"),
    "eps_hard_coded": ("without the eps given", "nor use a constant of your own"),
    "eps_outside_root": ("eps added after the square root", "eps goes inside the root"),
    "minus_sin": ("rotated by -theta", "rotate by +theta"),
    "row_index": ("row in the batch, not its position", "positions[t]"),
}


@pytest.mark.parametrize("mistake", sorted(QK_MUTANTS))
def test_qk_norm_rope_store_mutants(mistake):
    for _ in range(3):                                          # fresh random inputs each time
        fails("E10.5", functools.partial(qk_student, mistake=mistake), *QK_MUTANTS[mistake])


def test_qk_norm_rope_store_spec_version_passes(capsys):
    """The spec's maths written out independently (one fp32 rounding per step) passes at the stated tolerance."""
    for _ in range(3):
        ch10.check_qk_norm_rope_store(qk_student)
        assert capsys.readouterr().out == "E10.5 ok\n"


def test_qk_norm_rope_store_reference_agrees_with_the_fused_kernels_reference():
    """ch10's reference is the one tests/test_fused_kernels.py holds the Triton kernel to (same ops, same order)."""
    from nanovllm_ref.layers.rotary_embedding import RotaryEmbedding
    from test_fused_kernels import _reference_qk_norm_rope_store
    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(16, 32, 10000.0)
    qkv = torch.randn(5, 8 * 16, generator=g)
    pos, slots = torch.tensor([0, 3, 31, 7, 2]), torch.tensor([4, -1, 0, 9, 15], dtype=torch.int32)
    w = (torch.randn(16, generator=g) + 1, torch.randn(16, generator=g) + 1)
    caches = [torch.randn(4, 4, 2, 16, generator=g) for _ in range(2)]
    ours, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    q1 = ch10.reference_qk_norm_rope_store(qkv, pos, rope.cos_sin_cache, *w, 1e-6, *ours, slots, 4, 2, 16)
    q2 = _reference_qk_norm_rope_store(qkv, pos, rope, *w, 1e-6, *theirs, slots, 4, 2, 16)
    assert torch.equal(q1, q2) and all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_the_fused_triton_kernel_passes_its_own_exercise(capsys):
    """kernels/qk_norm_rope_store.py (the Triton interpreter on a CPU) meets E10.5's contract: the exercise
    states what the engine's fused kernel computes."""
    from nanovllm_ref.kernels import qk_norm_rope_store as fused
    ch10.check_qk_norm_rope_store(fused.qk_norm_rope_store)
    assert capsys.readouterr().out == "E10.5 ok\n"
