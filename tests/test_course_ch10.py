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

CHECKS = {"E10.1": ch10.check_graph_batch_sizes, "E10.2": ch10.check_fill_static_inputs,
          "E10.3": ch10.check_capture_safe_store, "E10.4": ch10.check_graph_replay}
REFERENCE = {"E10.1": ch10.reference_graph_batch_sizes, "E10.2": ch10.reference_fill_static_inputs,
             "E10.3": ch10.reference_store_kvcache, "E10.4": ch10.reference_capture_decode_graph}

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
