"""Mutation tests for chapter 09's checks: each passes the reference answers and fails, with a message chosen
from what differs, on the realistic wrong versions the chapter names."""
import re

import pytest
import torch
import torch.nn.functional as F

from nanovllm_course import ch09
from nanovllm_course.common import NotDone

LOADERS = dict(load_qkv=ch09.reference_load_qkv_shard, load_gate_up=ch09.reference_load_gate_up_shard,
               load_row=ch09.reference_load_row_shard, load_vocab=ch09.reference_load_vocab_shard)
FORWARD = dict(column_forward=ch09.reference_column_forward, row_forward=ch09.reference_row_forward,
               vocab_embedding=ch09.reference_vocab_embedding, lm_head=ch09.reference_lm_head)


def loaders(**swap):
    return {**LOADERS, **swap}


def forward(**swap):
    return {**FORWARD, **swap}


def test_reference_answers_pass(capsys):
    for _ in range(3):                                     # fresh random sizes each time
        ch09.check_shard_loaders(**LOADERS)
        ch09.check_simulated_forward(**FORWARD)
    assert capsys.readouterr().out == "E9.1 ok\nE9.2 ok\n" * 3


def test_sharded_mlp_equals_the_unsharded_one():
    assert ch09.sharded_mlp_error(2) < 1e-5 and ch09.sharded_mlp_error(4) < 1e-5


def test_stubs_are_not_done():
    def stub(*args):
        raise NotImplementedError("Exercise 9.1")
    with pytest.raises(NotDone):
        ch09.check_shard_loaders(**loaders(load_qkv=stub))
    with pytest.raises(NotDone):
        ch09.check_simulated_forward(**forward(row_forward=stub))


# -- E9.1 mutants -------------------------------------------------------------------------------------------
def gate_up_sliced_as_one_block(layer, param, loaded_weight, shard_id):
    """Treats [gate | up] as one column-parallel weight of 2I rows: rank r takes rows [r * 2I/tp, ...) of the
    concatenation, so with tp = 2 rank 0 gets all of gate and rank 1 all of up."""
    tp, rank, inter = layer.tp_size, layer.tp_rank, layer.output_sizes[shard_id]
    n = param.shape[0]                                      # 2I / tp rows on this rank
    lo, hi = rank * n, (rank + 1) * n                       # this rank's rows of the concatenation
    src_lo, src_hi = shard_id * inter, (shard_id + 1) * inter
    a, b = max(lo, src_lo), min(hi, src_hi)
    if a < b:
        param.data[a - lo:b - lo] = loaded_weight[a - src_lo:b - src_lo]


def kv_with_q_offsets(layer, param, loaded_weight, shard_id):
    """k and v sliced from the checkpoint at the rank offset of q (rank * H/tp * d) instead of rank * Hkv/tp * d."""
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
    param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, layer.tp_rank * q_size, size))


def kv_at_q_rows(layer, param, loaded_weight, shard_id):
    """k and v written into the fused parameter at q's rows (offset 0) instead of after q."""
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    size = q_size if shard_id == "q" else kv_size
    param.data.narrow(0, 0, size).copy_(loaded_weight.narrow(0, layer.tp_rank * size, size))


def vocab_start_from_hidden(layer, param, loaded_weight):
    """start = rank * hidden (param.shape[1]) instead of rank * V/tp (param.shape[0])."""
    start = layer.tp_rank * param.shape[1]
    param.data.copy_(loaded_weight[start:start + param.shape[0]])


def row_bias_split(layer, param, loaded_weight):
    """Slices the bias like the weight, along its last dim at rank * param.shape[-1]."""
    n = param.shape[-1]
    param.data.copy_(loaded_weight.narrow(-1, layer.tp_rank * n, n))


@pytest.mark.parametrize("swap,expect", [
    (dict(load_gate_up=gate_up_sliced_as_one_block), ["gate_proj", "up_proj", "rows"]),
    (dict(load_qkv=kv_with_q_offsets), ["loading k_proj", "kv heads"]),
    (dict(load_qkv=kv_at_q_rows), ["the k rows", "never written"]),
    (dict(load_vocab=vocab_start_from_hidden), ["rank", "vocabulary (ids|loading the embedding"]),
    (dict(load_row=row_bias_split), ["loading the bias", "not split"]),
])
def test_loader_mutants_fail_with_a_message_about_what_differs(swap, expect):
    with pytest.raises(AssertionError) as err:
        for _ in range(3):               # some sizes hide a mutant on one draw (e.g. vocab == hidden): retry
            ch09.check_shard_loaders(**loaders(**swap))
    text = str(err.value)
    assert text.startswith("E9.1:") and not isinstance(err.value, NotDone)
    for word in expect:                  # "a|b": either (a start past the end makes the copy raise instead)
        assert any(w in text for w in word.split("|")), (word, text)


def test_gate_up_mutant_names_the_rows_it_took():
    with pytest.raises(AssertionError, match=r"the up rows .* hold (gate_proj|up_proj) rows"):
        ch09.check_shard_loaders(**loaders(load_gate_up=gate_up_sliced_as_one_block))


# -- E9.2 mutants -------------------------------------------------------------------------------------------
def row_bias_on_every_rank(x_shards, weight_shards, bias=None):
    return sum(F.linear(x, w, bias) for x, w in zip(x_shards, weight_shards))


def row_concat(x_shards, weight_shards, bias=None):
    return torch.cat([F.linear(x, w, bias if r == 0 else None) for r, (x, w) in enumerate(zip(x_shards, weight_shards))], -1)


def embedding_start_off_by_one_rank(ids, weight_shards):
    """start = (rank + 1) * V/tp - 1 style slip: here rank * (V/tp - 1)."""
    out = 0
    for rank, w in enumerate(weight_shards):
        start = rank * (w.shape[0] - 1)
        local = ids - start
        mine = (local >= 0) & (local < w.shape[0])
        out = out + F.embedding(local.clamp(0, w.shape[0] - 1), w) * mine.unsqueeze(-1)
    return out


def embedding_start_from_hidden(ids, weight_shards):
    out = 0
    for rank, w in enumerate(weight_shards):
        local = ids - rank * w.shape[1]
        mine = (local >= 0) & (local < w.shape[0])
        out = out + F.embedding(local.clamp(0, w.shape[0] - 1), w) * mine.unsqueeze(-1)
    return out


def embedding_unmasked(ids, weight_shards):
    return sum(F.embedding((ids - r * w.shape[0]).clamp(0, w.shape[0] - 1), w) for r, w in enumerate(weight_shards))


def column_sum(x, weight_shards, bias_shards=None):
    biases = bias_shards if bias_shards is not None else [None] * len(weight_shards)
    return sum(F.linear(x, w, b) for w, b in zip(weight_shards, biases))


def lm_head_reversed(hidden, weight_shards):
    return torch.cat([F.linear(hidden, w) for w in reversed(weight_shards)], -1)


@pytest.mark.parametrize("swap,expect", [
    (dict(row_forward=row_bias_on_every_rank), "bias was added"),
    (dict(row_forward=row_concat), "concatenated, not summed"),
    (dict(vocab_embedding=embedding_start_off_by_one_rank), "rank r owns ids"),
    (dict(vocab_embedding=embedding_start_from_hidden), "rank r owns ids"),
    (dict(vocab_embedding=embedding_unmasked), "not masked to zero"),
    (dict(column_forward=column_sum), "one rank's slice"),
    (dict(lm_head=lm_head_reversed), "rank 0's) differ"),
])
def test_forward_mutants_fail_with_a_message_about_what_differs(swap, expect):
    with pytest.raises(AssertionError) as err:
        for _ in range(3):
            ch09.check_simulated_forward(**forward(**swap))
    assert str(err.value).startswith("E9.2:") and expect in str(err.value), str(err.value)


def test_chapter_09_loaders_reach_the_engine_unadapted():
    from nanovllm_course import export as ex
    from nanovllm_ref.layers import linear
    parts, used = ex.parts_from_functions(load_qkv_shard=linear.load_qkv_shard,
                                          load_gate_up_shard=linear.load_gate_up_shard)
    assert used == ["load_qkv_shard", "load_gate_up_shard"]
    assert parts.qkv_weight_loader is linear.load_qkv_shard            # Parts signature already: no adapter
    assert parts.gate_up_weight_loader is linear.load_gate_up_shard
    assert [(e.name, e.field) for e in ex.EXPORTS["09"]] == [("load_qkv_shard", "qkv_weight_loader"),
                                                             ("load_gate_up_shard", "gate_up_weight_loader")]


# -- the kinds of issue 22: what a loader leaves behind, inputs changed in place, the optional bias -------------
def vocab_rebound(layer, param, loaded_weight):
    """`param.data = ` a slice of the checkpoint: right values, the checkpoint's dtype and memory."""
    n = param.shape[0]
    param.data = loaded_weight[layer.tp_rank * n:(layer.tp_rank + 1) * n]


def row_rebound(layer, param, loaded_weight):
    if param.dim() == 1:
        param.data = loaded_weight
    else:
        n = param.shape[1]
        param.data = loaded_weight.narrow(1, layer.tp_rank * n, n)


def row_rebound_keeping_dtype(layer, param, loaded_weight):
    """Rebinds to a cast copy: the dtype is right, but the parameter's own memory is gone."""
    n = param.shape[-1]
    param.data = (loaded_weight if param.dim() == 1 else loaded_weight.narrow(1, layer.tp_rank * n, n)).to(param.dtype)


def vocab_new_parameter(layer, param, loaded_weight):
    n = param.shape[0]
    layer.weight = torch.nn.Parameter(loaded_weight[layer.tp_rank * n:(layer.tp_rank + 1) * n].to(param.dtype).clone(),
                                      requires_grad=False)


def embedding_walks_ids_in_place(ids, weight_shards):
    """Right output, but the caller's ids are shifted down rank by rank (`ids -= n`)."""
    out = 0
    for w in weight_shards:
        n = w.shape[0]
        mine = (ids >= 0) & (ids < n)
        out = out + F.embedding(ids.clamp(0, n - 1), w) * mine.unsqueeze(-1)
        ids -= n
    return out


def row_bias_split_in_place(x_shards, weight_shards, bias=None):
    """Every rank adds bias / tp (right in sum), but divides the caller's bias in place."""
    if bias is not None:
        bias.div_(len(x_shards))
    return sum(F.linear(x, w, bias) for x, w in zip(x_shards, weight_shards))


def row_bias_always_added(x_shards, weight_shards, bias=None):
    return sum(F.linear(x, w) for x, w in zip(x_shards, weight_shards)) + bias


def column_bias_always_indexed(x, weight_shards, bias_shards=None):
    return torch.cat([F.linear(x, w, bias_shards[r]) for r, w in enumerate(weight_shards)], -1)


@pytest.mark.parametrize("swap,expect", [
    (dict(load_vocab=vocab_rebound), "no longer uses its own memory|after loading, the parameter is"),
    (dict(load_row=row_rebound), "no longer uses its own memory|after loading, the parameter is"),
    (dict(load_row=row_rebound_keeping_dtype), "no longer uses its own memory"),
    (dict(load_vocab=vocab_new_parameter), "replaced a parameter of the layer"),
])
def test_loaders_that_rebind_instead_of_copying_are_rejected_every_time(swap, expect):
    for _ in range(3):
        with pytest.raises(AssertionError) as err:
            ch09.check_shard_loaders(**loaders(**swap))
        text = str(err.value)
        assert text.startswith("E9.1:") and any(e in text for e in expect.split("|")), text
        assert "copy_" in text


@pytest.mark.parametrize("swap,expect", [
    (dict(vocab_embedding=embedding_walks_ids_in_place), "changed its input (argument 1)"),
    (dict(row_forward=row_bias_split_in_place), "changed its input (argument 3)"),
])
def test_forward_mutants_of_issue_22_are_rejected_every_time(swap, expect):
    for _ in range(3):
        with pytest.raises(AssertionError) as err:
            ch09.check_simulated_forward(**forward(**swap))
        assert str(err.value).startswith("E9.2:") and expect in str(err.value), str(err.value)


@pytest.mark.parametrize("swap,where", [(dict(row_forward=row_bias_always_added), "row_bias_always_added"),
                                        (dict(column_forward=column_bias_always_indexed), "<listcomp>|column_bias")])
def test_a_forward_that_needs_its_optional_bias_fails_in_the_students_code(swap, where):
    """bias=None is passed on every call: code that assumes a bias raises, and the check cell names it."""
    from nanovllm_course.common import verdict_line
    with pytest.raises(TypeError) as err:
        ch09.check_simulated_forward(**forward(**swap))
    line = verdict_line("E9.2", err.value, err.value.__traceback__)
    assert line.startswith("E9.2 failed: your code raised TypeError") and any(w in line for w in where.split("|")), line


# -- every hint of the chapter's checks has a mutant that reaches it --------------------------------------------
def qkv_half_rows(layer, param, loaded_weight, shard_id):
    """Copies only the first half of each slice's rows."""
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
    half = max(1, size // 2)
    param.data.narrow(0, offset, half).copy_(loaded_weight.narrow(0, layer.tp_rank * size, half))


def qkv_scaled(layer, param, loaded_weight, shard_id):
    """Right rows, but pre-scaled (as if folding a softmax scale into q): not a copy."""
    ch09.reference_load_qkv_shard(layer, param, loaded_weight, shard_id)
    param.data.mul_(0.5)


def gate_up_frees_the_checkpoint(layer, param, loaded_weight, shard_id):
    ch09.reference_load_gate_up_shard(layer, param, loaded_weight, shard_id)
    loaded_weight.zero_()                                  # "free" it after use: other ranks still read it


def row_rank0_columns(layer, param, loaded_weight):
    """Every rank takes the first columns (rank 0's)."""
    if param.dim() == 1:
        param.data.copy_(loaded_weight)
    else:
        param.data.copy_(loaded_weight[:, :param.shape[1]])


def row_bias_on_rank0_only(layer, param, loaded_weight):
    """The bias is loaded on rank 0 only (it is added there): the other ranks' bias is never written."""
    if param.dim() == 1:
        if layer.tp_rank == 0:
            param.data.copy_(loaded_weight)
    else:
        ch09.reference_load_row_shard(layer, param, loaded_weight)


def column_pops_shards(x, weight_shards, bias_shards=None):
    """Consumes the lists it was given (pop) while computing the right output."""
    outs = []
    while weight_shards:
        w = weight_shards.pop(0)
        b = bias_shards.pop(0) if bias_shards else None
        outs.append(F.linear(x, w, b))
    return torch.cat(outs, -1)


def column_no_bias(x, weight_shards, bias_shards=None):
    return torch.cat([F.linear(x, w) for w in weight_shards], -1)


def row_no_bias(x_shards, weight_shards, bias=None):
    return sum(F.linear(x, w) for x, w in zip(x_shards, weight_shards))


def lm_head_rank0(hidden, weight_shards):
    return F.linear(hidden, weight_shards[0])


@pytest.mark.parametrize("swap,expect", [
    (dict(load_qkv=qkv_half_rows), "some rows never written"),
    (dict(load_qkv=qkv_scaled), "values that are not one run of rows of the checkpoint"),
    (dict(load_gate_up=gate_up_frees_the_checkpoint), "changed the checkpoint tensor"),
    (dict(load_row=row_rank0_columns), "the weight holds weight columns 0.."),
    (dict(load_row=row_bias_on_rank0_only), "the bias holds nothing (never written)"),
])
def test_loader_hints_are_reached(swap, expect):
    for _ in range(3):
        with pytest.raises(AssertionError, match=re.escape(expect)):
            ch09.check_shard_loaders(**loaders(**swap))


@pytest.mark.parametrize("swap,expect", [
    (dict(column_forward=column_pops_shards), "changed the list it was given as argument 2"),
    (dict(column_forward=column_no_bias), "column_forward with tp=1: the bias is missing"),
    (dict(row_forward=row_no_bias), "row_forward with tp=1: the bias is missing"),
    (dict(lm_head=lm_head_rank0), "one rank's logits"),
])
def test_forward_hints_are_reached(swap, expect):
    for _ in range(3):
        with pytest.raises(AssertionError, match=re.escape(expect)):
            ch09.check_simulated_forward(**forward(**swap))


def test_shard_layout_figure_is_drawn_at_the_width_a_notebook_shows_and_its_labels_are_readable(tmp_path, monkeypatch):
    """Shown at full size in a notebook (<= 1000 px wide at the course's 110 dpi), every label of at least 9 pt
    (about 12 px); it was 1,870 px wide, shown at ~62 %, with 6.5 pt labels (~6 px on screen)."""
    import struct

    import matplotlib.text
    from nanovllm_course import figures_ch09
    sizes = []
    real_save = figures_ch09.save

    def spy(fig, path):
        sizes.extend(t.get_fontsize() for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip())
        return real_save(fig, path)
    monkeypatch.setattr(figures_ch09, "save", spy)
    path = figures_ch09.layout(tmp_path / "layout.png")
    width, height = struct.unpack(">II", path.read_bytes()[16:24])
    assert width <= 1000, width
    assert sizes and min(sizes) >= 9, sorted(sizes)[:5]
