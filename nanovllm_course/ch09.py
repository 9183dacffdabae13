"""Checks for chapter 09: tensor parallelism (column-, row- and vocab-parallel layers).

- `check_shard_loaders(load_qkv_shard, load_gate_up_shard, load_row_shard, load_vocab_shard)` (E9.1): for
  tp in {2, 4} and every rank, the reference layers of `nanovllm_ref.layers` are built inside
  `tensor_parallel(rank, tp)` (QKVParallelLinear with grouped-query heads, MergedColumnParallelLinear,
  RowParallelLinear with a bias, VocabParallelEmbedding), each parameter is filled with NaN, and the
  student's loader copies fresh random checkpoint tensors into it (in another dtype than the parameter's, on
  every rank: bf16 into fp32 and fp32 into bf16). The result must equal, **exactly** (bit for bit), what the
  reference `weight_loader` writes, in the parameter's own memory and dtype (no `param.data = ...`), with the
  checkpoint tensor unchanged. Signatures:
    load_qkv_shard(layer, param, loaded_weight, shard_id "q" | "k" | "v") -> None   (= Parts.qkv_weight_loader)
    load_gate_up_shard(layer, param, loaded_weight, shard_id 0 | 1) -> None       (= Parts.gate_up_weight_loader)
    load_row_shard(layer, param, loaded_weight) -> None        (weight [out, in/tp] or bias [out])
    load_vocab_shard(layer, param, loaded_weight) -> None      (rows [V/tp, hidden] of a [V, hidden] table)
- `check_simulated_forward(column_forward, row_forward, vocab_embedding, lm_head)` (E9.2): the forward of
  each parallel layer simulated in one process from a list of per-rank shards (tp = 1, 2, 3, 4), against
  the unsharded layer (F.linear / F.embedding on the whole weight), fp32, atol = rtol = 1e-5; column and row
  forward with a bias and with None for every tp; every input (tensors and the lists of shards) unchanged:
    column_forward(x [T, in], weight_shards [tp x [out/tp, in]], bias_shards [tp x [out/tp]] or None) -> [T, out]
    row_forward(x_shards [tp x [T, in/tp]], weight_shards [tp x [out, in/tp]], bias [out] or None) -> [T, out]
    vocab_embedding(ids [T] int64, weight_shards [tp x [V/tp, hidden]]) -> [T, hidden]
    lm_head(hidden [T, hidden], weight_shards [tp x [V/tp, hidden]]) -> logits [T, V]

Failure messages say what differs: which rank, which block (q / k / v, gate / up, a vocabulary range) and
which checkpoint rows it holds instead of the expected ones; for the forward, a bias added tp times or
never, partials concatenated instead of summed, unmasked lookups, a token of one rank's vocabulary range
that got zeros or another row, ranks' logits in the wrong place.

Every check draws fresh random inputs and prints `E9.n ok` and nothing else on success. The
`reference_*` functions are the reference answers (the loaders are the engine's own).
"""
import contextlib
import io
import warnings

import torch
import torch.nn.functional as F

from nanovllm_course.common import call_student, check_close, fail, fresh_generator, ok, randint
from nanovllm_ref.layers.embed_head import VocabParallelEmbedding
from nanovllm_ref.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                        load_gate_up_shard, load_qkv_shard)
from nanovllm_ref.utils.parallel import tensor_parallel

ATOL = RTOL = 1e-5

# -- reference answers -----------------------------------------------------------------------------------------
reference_load_qkv_shard = load_qkv_shard
reference_load_gate_up_shard = load_gate_up_shard


def reference_load_row_shard(layer, param, loaded_weight) -> None:
    """RowParallelLinear.weight_loader: the weight's columns of this rank; the whole bias on every rank."""
    RowParallelLinear.weight_loader(layer, param, loaded_weight)


def reference_load_vocab_shard(layer, param, loaded_weight) -> None:
    """VocabParallelEmbedding.weight_loader: rows [rank * V/tp, (rank + 1) * V/tp) of the table."""
    VocabParallelEmbedding.weight_loader(layer, param, loaded_weight)


def reference_column_forward(x, weight_shards, bias_shards=None):
    biases = bias_shards if bias_shards is not None else [None] * len(weight_shards)
    return torch.cat([F.linear(x, w, b) for w, b in zip(weight_shards, biases)], dim=-1)   # the gather


def reference_row_forward(x_shards, weight_shards, bias=None):
    partials = [F.linear(x, w, bias if rank == 0 else None)
                for rank, (x, w) in enumerate(zip(x_shards, weight_shards))]
    return torch.stack(partials).sum(0)          # the all-reduce


def reference_vocab_embedding(ids, weight_shards):
    out = 0
    for rank, w in enumerate(weight_shards):
        local = ids - rank * w.shape[0]
        mine = (local >= 0) & (local < w.shape[0])
        out = out + F.embedding(local.clamp(0, w.shape[0] - 1), w) * mine.unsqueeze(-1).to(w.dtype)
    return out                                   # the all-reduce


def reference_lm_head(hidden, weight_shards):
    return torch.cat([F.linear(hidden, w) for w in weight_shards], dim=-1)     # the gather on rank 0


# -- helpers -----------------------------------------------------------------------------------------------------
def build(cls, rank: int, tp: int, *args, dtype=torch.float32, **kwargs):
    """A reference layer built for `rank` of `tp` (what each worker builds), its parameters in `dtype` and
    filled with NaN."""
    with tensor_parallel(rank, tp):
        layer = cls(*args, **kwargs).to(dtype)
    for p in layer.parameters():
        p.data.fill_(float("nan"))
    return layer


def _dtypes(rank: int):
    """(parameter dtype, checkpoint dtype) for a rank: they differ on every rank, both ways round (a bf16 model
    loading an fp32 checkpoint, an fp32 model loading a bf16 one), so a loader must copy (and cast), not rebind."""
    return (torch.bfloat16, torch.float32) if rank % 2 else (torch.float32, torch.bfloat16)


def _locate(block: torch.Tensor, sources: dict) -> str:
    """Describe what `block` ([n, ...] rows) holds: 'nothing', '<name> rows a..b', or 'other values'."""
    if torch.isnan(block).all():
        return "nothing (never written)"
    n = block.shape[0]
    for name, src in sources.items():
        src = src.to(block.dtype)
        for start in range(0, src.shape[0] - n + 1):
            if torch.equal(src[start:start + n], block):
                return f"{name} rows {start}..{start + n - 1}"
    if torch.isnan(block).any():
        return "some rows never written"
    return "values that are not one run of rows of the checkpoint"


_REBIND_HINT = ("copy into the parameter's own memory: param.data.narrow(...).copy_(loaded_weight.narrow(...)); "
                "copy_ also casts to the parameter's dtype. `param.data = <a slice of loaded_weight>` swaps the "
                "parameter for a view of the checkpoint: it keeps the checkpoint's dtype, ties the parameter to the "
                "checkpoint's memory, and anything holding the old storage never sees the weights")


def _run_loader(tag, fn, args, what, hint):
    layer, param, loaded = args[0], args[1], args[2]
    held = {n: p for n, p in layer.named_parameters()}
    before = (param.dtype, tuple(param.shape), param.data_ptr())
    source = loaded.clone()
    try:
        call_student(tag, fn, *args)
    except AssertionError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        fail(tag, f"{what}: your loader raised {type(exc).__name__}: {first}", hint)
    if {n: p for n, p in layer.named_parameters()}.keys() != held.keys() or \
            any(p is not held[n] for n, p in layer.named_parameters()):
        fail(tag, f"{what}: your loader replaced a parameter of the layer with a new one", _REBIND_HINT)
    if (param.dtype, tuple(param.shape)) != before[:2]:
        fail(tag, f"{what}: after loading, the parameter is {tuple(param.shape)} {param.dtype}, it was {before[1]} "
                  f"{before[0]} (the checkpoint tensor is {tuple(loaded.shape)} {loaded.dtype})", _REBIND_HINT)
    if param.data_ptr() != before[2]:
        fail(tag, f"{what}: after loading, the parameter no longer uses its own memory (its data was rebound, "
                  "e.g. to a view of the checkpoint tensor)", _REBIND_HINT)
    if not torch.equal(loaded, source):
        fail(tag, f"{what}: your loader changed the checkpoint tensor it was given",
             "a loader only reads loaded_weight (other ranks read the same tensor)")


def _compare_blocks(tag, got, want, blocks, sources, where, hint):
    """blocks: [(name, start, size)] along dim 0 of the fused parameter (together they cover all of it)."""
    if torch.equal(got, want):
        return
    # A block never written says most about the mistake (its rows went somewhere else): report it first.
    blocks = sorted(blocks, key=lambda b: not bool(torch.isnan(got[b[1]:b[1] + b[2]]).all()))
    for name, start, size in blocks:
        g, w = got[start:start + size], want[start:start + size]
        if not torch.equal(g, w):
            fail(tag, f"{where}: the {name} rows {start}..{start + size - 1} of the parameter hold "
                      f"{_locate(g, sources)}, expected {_locate(w, sources)}", hint)


# -- E9.1 ------------------------------------------------------------------------------------------------------
def _dt(dtype) -> str:
    return str(dtype).replace("torch.", "")


QKV_HINT = ("each rank keeps its own heads: q rows [rank * H/tp * d, ...) of q_proj and k/v rows "
            "[rank * Hkv/tp * d, ...) of k_proj / v_proj (fewer KV heads than q heads: their slice has its own "
            "size), stored q first, then k, then v")
GATE_UP_HINT = ("gate and up are two checkpoint tensors sliced separately: rank r takes rows [r * I/tp, (r+1) * "
                "I/tp) of gate_proj into the first half of its parameter and the same rows of up_proj into the "
                "second half (layer.output_sizes, layer.tp_rank, layer.tp_size)")
ROW_HINT = ("a row-parallel weight is split along its input features (dim 1): columns [rank * in/tp, (rank+1) "
            "* in/tp); the bias [out] is not split: every rank loads all of it (only rank 0 adds it)")
VOCAB_HINT = ("rank r holds rows [r * V/tp, (r + 1) * V/tp) of the [V, hidden] table, where V/tp is the "
              "parameter's row count (param.shape[0])")


def _check_qkv(tag, fn, g, tp, rank):
    d, hidden = 4, randint(g, 6, 12)
    kv = tp * randint(g, 1, 2)
    heads = kv * randint(g, 2, 3)             # grouped-query: more q heads than kv heads
    bias = rank in (0, tp - 1)                # with a q/k/v bias on some ranks, without on others
    pdt, cdt = _dtypes(rank)
    ref = build(QKVParallelLinear, rank, tp, hidden, d, heads, kv, bias=bias, dtype=pdt)
    mine = build(QKVParallelLinear, rank, tp, hidden, d, heads, kv, bias=bias, dtype=pdt)
    ckpt = {s: torch.randn((h * d, hidden), generator=g).to(cdt) for s, h in (("q", heads), ("k", kv), ("v", kv))}
    cbias = {s: torch.randn(t.shape[0], generator=g).to(cdt) for s, t in ckpt.items()}
    q, k = mine.num_heads * d, mine.num_kv_heads * d
    blocks = [("q", 0, q), ("k", q, k), ("v", q + k, k)]
    where = (f"rank {rank} of tp={tp} ({heads} q heads, {kv} kv heads, head_dim {d}; {_dt(pdt)} parameters, "
             f"{_dt(cdt)} checkpoint)")
    for name, source in [("weight", ckpt)] + ([("bias", cbias)] if bias else []):
        p_ref, p_mine = getattr(ref, name), getattr(mine, name)
        for s in ("q", "k", "v"):
            load_qkv_shard(ref, p_ref, source[s], s)
            rows = f"{source[s].shape[0]} rows = {heads if s == 'q' else kv} heads x {d}"
            _run_loader(tag, fn, (mine, p_mine, source[s].clone(), s),
                        f"{where}, loading {s}_proj.{name} ({rows})", QKV_HINT)
        _compare_blocks(tag, p_mine.data, p_ref.data, blocks, {f"{s}_proj.{name}": t for s, t in source.items()},
                        f"{where}, {name}", QKV_HINT)


def _check_gate_up(tag, fn, g, tp, rank):
    hidden, inter = randint(g, 5, 10), tp * randint(g, 2, 5)
    pdt, cdt = _dtypes(rank)
    ref = build(MergedColumnParallelLinear, rank, tp, hidden, [inter, inter], dtype=pdt)
    mine = build(MergedColumnParallelLinear, rank, tp, hidden, [inter, inter], dtype=pdt)
    ckpt = [torch.randn((inter, hidden), generator=g).to(cdt) for _ in range(2)]
    n = inter // tp
    where = f"rank {rank} of tp={tp} (intermediate {inter}; {_dt(pdt)} parameters, {_dt(cdt)} checkpoint)"
    for s in (0, 1):
        load_gate_up_shard(ref, ref.weight, ckpt[s], s)
        _run_loader(tag, fn, (mine, mine.weight, ckpt[s].clone(), s),
                    f"{where}, loading {('gate', 'up')[s]}_proj", GATE_UP_HINT)
    _compare_blocks(tag, mine.weight.data, ref.weight.data, [("gate", 0, n), ("up", n, n)],
                    {"gate_proj": ckpt[0], "up_proj": ckpt[1]}, where, GATE_UP_HINT)


def _check_row(tag, fn, g, tp, rank):
    inp, out = tp * randint(g, 2, 5), randint(g, 3, 8)
    pdt, cdt = _dtypes(rank)
    ref = build(RowParallelLinear, rank, tp, inp, out, bias=True, dtype=pdt)
    mine = build(RowParallelLinear, rank, tp, inp, out, bias=True, dtype=pdt)
    w, b = torch.randn((out, inp), generator=g).to(cdt), torch.randn(out, generator=g).to(cdt)
    where = f"rank {rank} of tp={tp} (in {inp}, out {out}; {_dt(pdt)} parameters, {_dt(cdt)} checkpoint)"
    reference_load_row_shard(ref, ref.weight, w)
    reference_load_row_shard(ref, ref.bias, b)
    _run_loader(tag, fn, (mine, mine.weight, w.clone()), f"{where}, loading the weight", ROW_HINT)
    _run_loader(tag, fn, (mine, mine.bias, b.clone()), f"{where}, loading the bias", ROW_HINT)
    if not torch.equal(mine.weight.data, ref.weight.data):
        got = _locate(mine.weight.data.T.contiguous(), {"weight columns": w.T.contiguous().to(pdt)})
        n = inp // tp
        fail(tag, f"{where}: the weight holds {got.replace(' rows', '')}, expected weight columns "
                  f"{rank * n}..{(rank + 1) * n - 1}", ROW_HINT)
    if not torch.equal(mine.bias.data, ref.bias.data):
        what = "nothing (never written)" if torch.isnan(mine.bias.data).all() else \
            "partly nothing (some entries never written)" if torch.isnan(mine.bias.data).any() else "other values"
        fail(tag, f"{where}: the bias holds {what}, expected the whole checkpoint bias (it is not split)", ROW_HINT)


def _check_vocab(tag, fn, g, tp, rank):
    vocab = tp * randint(g, 3, 8)
    hidden = _distinct(g, vocab // tp, 2, 6)
    pdt, cdt = _dtypes(rank)
    ref = build(VocabParallelEmbedding, rank, tp, vocab, hidden, dtype=pdt)
    mine = build(VocabParallelEmbedding, rank, tp, vocab, hidden, dtype=pdt)
    table = torch.randn((vocab, hidden), generator=g).to(cdt)
    reference_load_vocab_shard(ref, ref.weight, table)
    where = f"rank {rank} of tp={tp} (vocab {vocab}, hidden {hidden}; {_dt(pdt)} parameters, {_dt(cdt)} checkpoint)"
    _run_loader(tag, fn, (mine, mine.weight, table.clone()), f"{where}, loading the embedding", VOCAB_HINT)
    n = vocab // tp
    _compare_blocks(tag, mine.weight.data, ref.weight.data,
                    [(f"vocabulary (ids {rank * n}..{(rank + 1) * n - 1})", 0, n)], {"table": table}, where, VOCAB_HINT)


def check_shard_loaders(load_qkv, load_gate_up, load_row, load_vocab) -> None:
    tag = "E9.1"
    g = fresh_generator()
    for check_one, fn in ((_check_qkv, load_qkv), (_check_gate_up, load_gate_up), (_check_row, load_row),
                          (_check_vocab, load_vocab)):
        for tp in (2, 4):
            for rank in range(tp):
                check_one(tag, fn, g, tp, rank)
    ok(tag)


# -- E9.2 ------------------------------------------------------------------------------------------------------
def _close(tag, actual, expected, what, hint):
    check_close(tag, actual, expected, rtol=RTOL, atol=ATOL, what=what, hint=hint)


def _near(a, b):
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=RTOL, atol=ATOL))


def _call(tag, fn, name, *args):
    """fn(*args) on the caller's tensors (lists of shards too), which must come back unchanged."""
    flat = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            flat[f"argument {i + 1}"] = a
        elif isinstance(a, list):
            flat.update({f"argument {i + 1}[{r}]": t for r, t in enumerate(a)})
    before = {k: v.clone() for k, v in flat.items()}
    lists = [list(a) if isinstance(a, list) else None for a in args]
    got = call_student(tag, fn, *args)
    for i, (a, saved) in enumerate(zip(args, lists)):
        if saved is not None and (len(a) != len(saved) or any(x is not y for x, y in zip(a, saved))):
            fail(tag, f"{name} changed the list it was given as argument {i + 1} (the ranks' shards)",
                 "read the lists; build new tensors and lists for your results")
    for k, v in flat.items():
        if not torch.equal(v, before[k]):
            fail(tag, f"{name} changed its input ({k}) in place; each rank still needs it",
                 "work on new tensors (ids - start, x @ w.T + b), not with -=, +=, .sub_() or .div_() on the "
                 "inputs")
    return got


def _check_column(tag, fn, g, tp, with_bias):
    T, inp, out = randint(g, 1, 7), randint(g, 4, 12), tp * randint(g, 2, 6)
    x, w = torch.randn((T, inp), generator=g), torch.randn((out, inp), generator=g) / inp ** 0.5
    b = torch.randn(out, generator=g) if with_bias else None
    got = _call(tag, fn, "column_forward", x, list(w.chunk(tp)), None if b is None else list(b.chunk(tp)))
    want = F.linear(x, w, b)
    hint = "each rank computes x @ W_r.T (+ b_r) for its out/tp features; concatenate the ranks' outputs along the last dim"
    if tp > 1 and isinstance(got, torch.Tensor) and got.shape == (T, out // tp):
        fail(tag, f"column_forward with tp={tp}: output has shape {tuple(got.shape)}, one rank's slice; expected "
                  f"{(T, out)}", hint)
    if b is not None and _near(got, F.linear(x, w)):
        fail(tag, f"column_forward with tp={tp}: the bias is missing", "rank r adds its own slice b_r of the bias")
    _close(tag, got, want, f"column_forward output (tp={tp}, {T} tokens{', with' if with_bias else ', no'} bias)",
           hint)


def _check_row_forward(tag, fn, g, tp, with_bias):
    T, inp, out = randint(g, 1, 7), tp * randint(g, 2, 6), randint(g, 3, 10)
    x, w = torch.randn((T, inp), generator=g), torch.randn((out, inp), generator=g) / inp ** 0.5
    b = torch.randn(out, generator=g) if with_bias else None
    got = _call(tag, fn, "row_forward", list(x.chunk(tp, dim=-1)), list(w.chunk(tp, dim=-1)), b)
    want = F.linear(x, w, b)
    hint = ("each rank's x_r @ W_r.T is a partial sum over its input features; the all-reduce adds the ranks' "
            "partials, and the bias must be added once (on rank 0), not on every rank")
    if b is not None and tp > 1 and _near(got, want + (tp - 1) * b):
        fail(tag, f"row_forward with tp={tp}: the bias was added {tp} times (on every rank)", hint)
    if b is not None and _near(got, F.linear(x, w)):
        fail(tag, f"row_forward with tp={tp}: the bias is missing", hint)
    if tp > 1 and isinstance(got, torch.Tensor) and got.shape == (T, out * tp):
        fail(tag, f"row_forward with tp={tp}: output has shape {tuple(got.shape)}: the partials were concatenated, "
                  f"not summed; expected {(T, out)}", hint)
    _close(tag, got, want, f"row_forward output (tp={tp}, {T} tokens{', with' if with_bias else ', no'} bias)",
           hint if with_bias else "with bias=None there is nothing to add: the sum of the partials")


def _distinct(g, n, low, high):
    """A random int in [low, high] other than n: two sizes that coincide would hide one taken for the other."""
    x = randint(g, low, high - 1)
    return x + 1 if x >= n else x


def _check_embedding(tag, fn, g, tp):
    n = randint(g, 3, 9)
    hidden = _distinct(g, n, 2, 6)
    vocab = n * tp
    table = torch.randn((vocab, hidden), generator=g)
    ids = torch.cat([torch.arange(vocab), torch.randint(0, vocab, (randint(g, 1, 12),), generator=g)])
    ids = ids[torch.randperm(len(ids), generator=g)]
    got = _call(tag, fn, "vocab_embedding", ids, list(table.chunk(tp)))
    want = F.embedding(ids, table)
    hint = ("rank r owns ids [r * V/tp, (r + 1) * V/tp) with V/tp = its shard's rows: it looks up ids - start for "
            "the ids it owns, writes zeros for the others, and the sum over ranks (the all-reduce) fills in the rest")
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        _close(tag, got, want, f"vocab_embedding output (tp={tp})", hint)
    unmasked = sum(F.embedding((ids - r * n).clamp(0, n - 1), w) for r, w in enumerate(table.chunk(tp)))
    if tp > 1 and _near(got, unmasked):
        fail(tag, f"vocab_embedding with tp={tp}: every rank added a row for every token: the ids a rank does not "
                  "own were clamped into its range but not masked to zero", hint)
    row_ok = (got - want).abs().le(ATOL + RTOL * want.abs()).all(-1)
    bad = [i for i in range(len(ids)) if not bool(row_ok[i])]
    if bad:
        ranks = sorted({int(ids[i]) // n for i in bad})
        i = bad[0]
        what = ("zeros: no rank looked it up" if float(got[i].abs().max()) <= ATOL else
                "a vector that is not its row: a rank looked up a row it does not own, or two ranks added theirs")
        fail(tag, f"vocab_embedding with tp={tp}, {n} rows per rank (rank r owns ids r*{n}..r*{n}+{n - 1}): token "
                  f"id {int(ids[i])} (rank {int(ids[i]) // n}'s) got {what}; wrong tokens belong to rank"
                  f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}", hint)
    _close(tag, got, want, f"vocab_embedding output (tp={tp})", hint)


def _check_lm_head(tag, fn, g, tp):
    n, T = randint(g, 3, 9), randint(g, 1, 5)
    hidden = _distinct(g, n, 2, 8)
    vocab = n * tp
    w, h = torch.randn((vocab, hidden), generator=g), torch.randn((T, hidden), generator=g)
    got = _call(tag, fn, "lm_head", h, list(w.chunk(tp)))
    want = F.linear(h, w)
    hint = "each rank computes logits for its V/tp ids; rank 0 gathers them in rank order along the last dim"
    if tp > 1 and isinstance(got, torch.Tensor) and got.shape == (T, n):
        fail(tag, f"lm_head with tp={tp}: output has shape {tuple(got.shape)}, one rank's logits; expected {(T, vocab)}", hint)
    if isinstance(got, torch.Tensor) and got.shape == want.shape:
        for r in range(tp):
            if not _near(got[:, r * n:(r + 1) * n], want[:, r * n:(r + 1) * n]):
                fail(tag, f"lm_head with tp={tp}: the logits of ids {r * n}..{(r + 1) * n - 1} (rank {r}'s) differ", hint)
    _close(tag, got, want, f"lm_head logits (tp={tp})", hint)


def check_simulated_forward(column_forward, row_forward, vocab_embedding, lm_head) -> None:
    tag = "E9.2"
    g = fresh_generator()
    for tp in (1, 2, 3, 4):            # the optional bias both ways, every time
        for with_bias in (True, False):
            _check_column(tag, column_forward, g, tp, with_bias)
    for tp in (1, 2, 3, 4):
        for with_bias in (True, False):
            _check_row_forward(tag, row_forward, g, tp, with_bias)
    for check_one, fn in ((_check_embedding, vocab_embedding), (_check_lm_head, lm_head)):
        for tp in (1, 2, 3, 4):
            check_one(tag, fn, g, tp)
    ok(tag)


# -- demos ---------------------------------------------------------------------------------------------------
def sharded_mlp_error(tp: int = 2, seed: int = 0) -> float:
    """Qwen3's MLP (gate_up column-parallel, SiLU-and-mul per rank, down row-parallel), with its weights
    sharded by the reference loaders for `tp` ranks and the ranks simulated in one process; returns the max
    abs difference from the unsharded MLP (fp32)."""
    from nanovllm_ref.layers.activation import silu_and_mul
    g = torch.Generator().manual_seed(seed)
    hidden, inter, T = 16, 8 * tp, 5
    gate, up = (torch.randn((inter, hidden), generator=g) / 4 for _ in range(2))
    down = torch.randn((hidden, inter), generator=g) / 3
    x = torch.randn((T, hidden), generator=g)
    full = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    partials = []
    for rank in range(tp):
        gu = build(MergedColumnParallelLinear, rank, tp, hidden, [inter, inter])
        dn = build(RowParallelLinear, rank, tp, inter, hidden)
        load_gate_up_shard(gu, gu.weight, gate, 0)
        load_gate_up_shard(gu, gu.weight, up, 1)
        reference_load_row_shard(dn, dn.weight, down)
        partials.append(F.linear(silu_and_mul(F.linear(x, gu.weight)), dn.weight))   # no communication until here
    return (torch.stack(partials).sum(0) - full).abs().max().item()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 41))]


def tp2_equals_tp1(max_tokens: int = 6) -> tuple[list, list]:
    """The reference engine on the tiny Qwen3 with tensor_parallel_size=2 (rank 1 a spawned process, gloo on
    CPU) and with 1, greedy. Returns (tp2 ids, tp1 ids). Lives here, in an importable module, because the
    spawned worker must be able to import what it runs."""
    from nanovllm_course.common import tiny_model_dir
    from nanovllm_ref import LLM, SamplingParams
    path = tiny_model_dir("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        with LLM(path, tensor_parallel_size=2, kvcache_block_size=4, max_model_len=64, device="cpu") as llm:
            tp2 = [o["token_ids"] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        llm1 = LLM(path, kvcache_block_size=4, max_model_len=64, device="cpu")
        try:
            tp1 = [o["token_ids"] for o in llm1.generate(PROMPTS, sp, use_tqdm=False)]
        finally:
            llm1.exit()
    return tp2, tp1


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402

# the rank-aware loaders have the Parts signature; the capstone checks them with the reference row and vocab
# loaders (only these two are engine parts)
EXERCISES = exercises(
    Exercise("E9.1", check_shard_loaders, ("load_qkv_shard", "load_gate_up_shard", "load_row_shard", "load_vocab_shard"),
             (reference_load_qkv_shard, reference_load_gate_up_shard, reference_load_row_shard,
              reference_load_vocab_shard), parts=(
        EnginePart("load_qkv_shard", "qkv_weight_loader", "E9.1",
                   check=lambda mod: check_shard_loaders(mod.load_qkv_shard, mod.load_gate_up_shard,
                                                         reference_load_row_shard, reference_load_vocab_shard)),
        EnginePart("load_gate_up_shard", "gate_up_weight_loader", "E9.1",
                   check=lambda mod: check_shard_loaders(mod.load_qkv_shard, mod.load_gate_up_shard,
                                                         reference_load_row_shard, reference_load_vocab_shard)))),
    Exercise("E9.2", check_simulated_forward, ("column_forward", "row_forward", "vocab_embedding", "lm_head"),
             (reference_column_forward, reference_row_forward, reference_vocab_embedding, reference_lm_head)),
)
PARTS = parts_of(EXERCISES)
