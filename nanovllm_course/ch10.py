"""Checks for chapter 10: CUDA graphs (capture, replay, static buffers, bucket padding) and capture safety.

- `check_graph_batch_sizes(fn)` (E10.1): `fn(max_num_seqs) -> list[int]` must equal the engine's
  `graph_batch_sizes` **exactly** for many values of max_num_seqs (1, small, multiples of 16 and their
  neighbours, 512 and fresh random ones); the message says which sizes are missing or extra and, where it is
  the cause, which batch pads with more than 15 idle rows or finds no graph at all.
- `check_fill_static_inputs(fn)` (E10.2): `fn(buffers, input_ids, positions, meta)` on buffers full of the
  previous step's values ("stale"), for fresh random batches (B = 1 .. max, block tables narrower than the
  buffer); every buffer must equal the reference's result **exactly**, stay the same tensor object (the graph
  reads fixed addresses), and the inputs must be unchanged.
- `check_capture_safe_store(fn)` (E10.3): `fn(key, value, k_cache, v_cache, slot_mapping)`, the Parts
  `store_kvcache` signature. (1) A dispatch spy (`TorchDispatchMode`) records every ATen op it runs and fails
  on the ones that make the host wait for the device or give data-dependent shapes: `aten._local_scalar_dense`
  (`.item()`, `.tolist()`, `int(t)`, `if t:`, and `x[t]` with a 0-d tensor t), `aten.nonzero`, `aten.masked_select`, indexing or index_put
  with a boolean mask, `aten.unique*`. (2) The caches must equal the reference store's **bit for bit** on
  fp32 and bf16 cases with slots -1 (padding) anywhere and slot 0 written by a real row between padding rows,
  a real row writing slot 0 followed by padding rows, no padding, only padding, and key and value in
  different layouts (one contiguous, the other a view of the fused QKV output, each way round).
- `check_graph_replay(fn)` (E10.4): `fn(run_step, batch_size, cuda) -> (graph, output)` captures one decode step
  of the tiny Qwen3 (`run_step(bs)` runs the model on the first bs rows of static buffers); replaying it with
  the buffers refilled for a smaller batch (the rest padding) must give the eager logits (fp32: atol = rtol =
  1e-5; bf16: 2e-2) and leave every cache slot outside the batch's own slots bit for bit untouched. On CUDA
  `cuda` is `torch.cuda` (fp32 and bf16); on the CPU it is `CPUGraphs`, a stand-in whose graph records the
  ATen ops of the captured call and replays them on the same tensors (fp32, the engine with the capture-safe
  reference store), and whose capture fails, as CUDA's does, on an op that reads values on the host. On both,
  `run_step` notes whether each call is eager or captured (`is_current_stream_capturing`): an eager warm-up at
  the captured batch size must come before the first captured call (`_check_warm_up`).

- `check_qk_norm_rope_store(fn)` (E10.5): `fn(qkv, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache,
  v_cache, slot_mapping, num_heads, num_kv_heads, head_dim) -> q`, what the fused decode kernel
  (kernels/qk_norm_rope_store.py) computes, in plain PyTorch: compared with `reference_qk_norm_rope_store` (the
  general route's reference ops in order) on fresh random fp32 and bf16 cases (GQA, one KV head with
  head_dim 24, no q/k norm; a strided qkv; a padding row with slot -1): q and k_cache within atol = rtol =
  1e-5 (bf16: 1.6e-2), v_cache bit for bit, other slots and the inputs unchanged; an answer that equals the
  reference with one known mistake (no norm, a norm over the whole row, norm after RoPE, k normalised with
  q's weight, interleaved RoPE pairs, k stored before RoPE, a rotated v, v from the wrong columns, slot -1
  used as an index) gets that mistake's hint.

Every check prints `E10.n ok` and nothing else on success. `reference_*` are the answers; the notebook's later
sections use them, never the student's functions.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanovllm_course.common import call_student, check_close, check_unchanged, fail, fresh_generator, ok, randint
from nanovllm_ref.attn.torch_backend import store_kvcache as reference_masked_store
from nanovllm_ref.engine.cuda_graph import fill_static_inputs as reference_fill_static_inputs
from nanovllm_ref.engine.cuda_graph import graph_batch_sizes as reference_graph_batch_sizes
from nanovllm_ref.utils.context import AttentionMetadata

__all__ = ["reference_graph_batch_sizes", "reference_fill_static_inputs", "reference_store_kvcache",
           "reference_capture_decode_graph", "CPUGraphs", "CPUGraph", "CaptureError", "check_graph_batch_sizes", "check_fill_static_inputs",
           "check_capture_safe_store", "check_graph_replay", "SyncSpy", "padding_table", "make_buffers",
           "reference_qk_norm_rope_store", "check_qk_norm_rope_store"]


# -- E10.1 ------------------------------------------------------------------------------------------------------
def padding_table(sizes: list[int], max_num_seqs: int) -> dict[int, int | None]:
    """batch -> idle rows when it replays the smallest captured size >= batch (None: no graph fits)."""
    table = {}
    for b in range(1, max_num_seqs + 1):
        fit = [s for s in sizes if s >= b]
        table[b] = min(fit) - b if fit else None
    return table


def check_graph_batch_sizes(fn) -> None:
    tag = "E10.1"
    g = fresh_generator()
    cases = [1, 2, 3, 5, 8, 9, 15, 16, 17, 31, 32, 33, 48, 100, 255, 256, 257, 512]
    cases += [randint(g, 2, 600) for _ in range(6)]
    for m in cases:
        got = call_student(tag, fn, m)
        want = reference_graph_batch_sizes(m)
        if not isinstance(got, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in got):
            fail(tag, f"graph_batch_sizes({m}) should return a list of ints, got {type(got).__name__}",
                 "return a plain Python list such as [1, 2, 4, 8, 16, ...]")
        got = list(got)
        if got == want:
            continue
        if got != sorted(set(got)):
            fail(tag, f"graph_batch_sizes({m}) is not sorted ascending without repeats",
                 "the engine replays the first (smallest) size that fits, so keep the list sorted; sorted(set(...))")
        too_big = [s for s in got if s > m or s < 1]
        if too_big:
            fail(tag, f"graph_batch_sizes({m}) captures size {too_big[0]}, outside 1..max_num_seqs={m}",
                 "a batch never has more than max_num_seqs sequences: a bigger graph only costs capture time "
                 "and memory")
        pad = padding_table(got, m)
        no_graph = [b for b, p in pad.items() if p is None]
        if no_graph:
            fail(tag, f"graph_batch_sizes({m}): a batch of {no_graph[0]} sequences finds no captured graph "
                      f"(largest size {max(got, default=0)})",
                 "always capture max_num_seqs itself, even when it is not a multiple of 16")
        worst = max(pad, key=lambda b: pad[b])
        if pad[worst] > 15:
            fail(tag, f"graph_batch_sizes({m}): a batch of {worst} pads to {worst + pad[worst]}, "
                      f"{pad[worst]} idle rows (more than 15)",
                 "past 8, capture every multiple of 16 (16, 32, 48, ...), not only powers of two")
        missing = [s for s in want if s not in got]
        extra = [s for s in got if s not in want]
        fail(tag, f"graph_batch_sizes({m}) = {got[:12]}{' ...' if len(got) > 12 else ''}: missing {missing[:8]}, "
                  f"extra {extra[:8]} compared with the engine's buckets",
             "1, 2, 4, 8 for small batches (a batch of 1 should not run 16 rows), then every multiple of 16 below "
             "max_num_seqs, then max_num_seqs")
    ok(tag)


# -- E10.2 ------------------------------------------------------------------------------------------------------
def make_buffers(max_bs: int, max_blocks: int, hidden: int = 8, *, g=None) -> dict:
    """Static buffers like CUDAGraphRunner's, on the CPU, full of a previous step's values (stale)."""
    g = g if g is not None else fresh_generator()
    return dict(
        input_ids=torch.randint(0, 1000, (max_bs,), generator=g),
        positions=torch.randint(0, 500, (max_bs,), generator=g),
        slot_mapping=torch.randint(0, 4 * max_blocks, (max_bs,), generator=g).to(torch.int32),
        context_lens=torch.randint(1, 64, (max_bs,), generator=g).to(torch.int32),
        block_tables=torch.randint(0, 4 * max_blocks, (max_bs, max_blocks), generator=g).to(torch.int32),
        outputs=torch.randn(max_bs, hidden, generator=g))


def _decode_step(g, batch: int, width: int, block_size: int = 4):
    """Random decode inputs of one step: ids, positions, metadata with distinct real slots and tables."""
    ids = torch.randint(0, 1000, (batch,), generator=g)
    ctx = torch.randint(1, width * block_size + 1, (batch,), generator=g).to(torch.int32)
    ctx[torch.randint(0, batch, (1,), generator=g)] = width * block_size      # someone uses the full width
    perm = torch.randperm(batch * width + 8, generator=g)[:batch * width].view(batch, width).to(torch.int32)
    tables = perm.clone()
    used = (ctx.long() + block_size - 1) // block_size
    for b in range(batch):
        tables[b, used[b]:] = -1
    positions = ctx.long() - 1
    slots = (tables[torch.arange(batch), positions // block_size].long() * block_size + positions % block_size)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=slots.to(torch.int32), context_lens=ctx,
                             block_tables=tables)
    return ids, positions, meta


_FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables", "outputs")


def check_fill_static_inputs(fn) -> None:
    tag = "E10.2"
    g = fresh_generator()
    shapes = [(8, 6, 1, 3), (8, 6, 8, 6), (16, 5, 5, 2), (32, 9, randint(g, 2, 31), randint(g, 1, 8))]
    for max_bs, max_blocks, batch, width in shapes:
        buffers = make_buffers(max_bs, max_blocks, g=g)
        ids, positions, meta = _decode_step(g, batch, width)
        expected = {k: v.clone() for k, v in buffers.items()}
        reference_fill_static_inputs(expected, ids, positions, meta)
        objects = {k: v for k, v in buffers.items()}
        pointers = {k: v.data_ptr() for k, v in buffers.items()}
        before = dict(input_ids=ids.clone(), positions=positions.clone(), slot_mapping=meta.slot_mapping.clone(),
                      context_lens=meta.context_lens.clone(), block_tables=meta.block_tables.clone())
        call_student(tag, fn, buffers, ids, positions, meta)
        check_unchanged(tag, before, dict(input_ids=ids, positions=positions, slot_mapping=meta.slot_mapping,
                                          context_lens=meta.context_lens, block_tables=meta.block_tables))
        case = f"(batch {batch}, buffers for {max_bs} rows, block table {width} of {max_blocks} columns)"
        for k in _FIELDS:
            if buffers.get(k) is not objects[k] or buffers[k].data_ptr() != pointers[k]:
                fail(tag, f"buffers['{k}'] was replaced by a new tensor {case}; the captured graph keeps reading "
                          "the old one's memory",
                     "write into the buffers in place: buffers['x'][:B] = ..., .fill_(), .zero_(), .copy_()")
        _compare_buffers(tag, buffers, expected, batch, width, case)
    ok(tag)


def _compare_buffers(tag, got, want, batch, width, case):
    rows = lambda t: t[:batch]          # noqa: E731
    for k in ("input_ids", "positions", "slot_mapping", "context_lens"):
        if not torch.equal(rows(got[k]), rows(want[k])):
            fail(tag, f"buffers['{k}'][:{batch}] does not hold this step's {k} {case}",
                 "copy the step's values into the first B rows")
    if not torch.equal(got["block_tables"][:batch, :width], want["block_tables"][:batch, :width]):
        fail(tag, f"buffers['block_tables'][:{batch}, :{width}] does not hold this step's block tables {case}",
             "copy meta.block_tables into the top-left B x width corner")
    pad_slots = got["slot_mapping"][batch:]
    if not torch.equal(pad_slots, want["slot_mapping"][batch:]):
        if pad_slots.numel() and (pad_slots == 0).all():
            fail(tag, f"padding rows of slot_mapping are 0, not -1 {case}: each would write its K/V into slot 0 "
                      "(block 0, offset 0), which belongs to a real sequence",
                 "slot -1 means 'store nothing'; fill the padding rows with -1")
        fail(tag, f"padding rows {batch}.. of slot_mapping should be -1 but keep other values {case} (the "
                  "previous step's slots): replaying would overwrite those cache slots",
             "fill the padding rows with -1 every step, not only the first B rows")
    if not torch.equal(got["context_lens"][batch:], want["context_lens"][batch:]):
        fail(tag, f"padding rows {batch}.. of context_lens should be 0 {case}; stale lengths make the padding "
                  "rows attend over blocks they do not own", "zero the padding rows' context lengths")
    bt, wbt = got["block_tables"], want["block_tables"]
    if not torch.equal(bt[batch:], wbt[batch:]):
        fail(tag, f"padding rows {batch}.. of block_tables should be all -1 {case}",
             "fill the whole block-table buffer with -1 before copying this step's tables in")
    if not torch.equal(bt[:batch, width:], wbt[:batch, width:]):
        fail(tag, f"block_tables columns {width}.. of the real rows should be -1 {case}, but hold an earlier "
                  "step's block ids (stale columns)",
             "this step's tables can be narrower than the buffer: clear the columns past their width too")
    if not torch.equal(got["outputs"], want["outputs"]):
        fail(tag, f"buffers['outputs'] changed {case}; filling the inputs should not touch the graph's output",
             "only the five input buffers are yours to fill")


# -- E10.3 ------------------------------------------------------------------------------------------------------
_SYNC_OPS = {
    "_local_scalar_dense": "reads a tensor's value on the host (.item(), .tolist(), int(t), `if t:`)",
    "item": "reads a tensor's value on the host (.item())",
    "is_nonzero": "reads a tensor's value on the host (`if t:`, bool(t))",
    "equal": "compares tensors on the host (torch.equal returns a Python bool)",
    "nonzero": "computes nonzero(), whose output size depends on the data (a boolean mask `x[mask]` does this)",
    "nonzero_static": None,
    "masked_select": "calls masked_select, whose output size depends on the data",
    "unique_consecutive": "calls unique, whose output size depends on the data",
    "_unique2": "calls unique, whose output size depends on the data",
    "_unique": "calls unique, whose output size depends on the data",
}


class SyncSpy(TorchDispatchMode):
    """Records every ATen op run inside it; `problems` lists those a CUDA graph cannot capture (host reads
    and data-dependent shapes), with why."""

    def __init__(self):
        super().__init__()
        self.ops, self.problems = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops.append(name)
        why = capture_problem(func, args, kwargs)
        if why:
            self.problems.append((name, why))
        return func(*args, **kwargs)


def capture_problem(func, args, kwargs) -> str | None:
    """Why a CUDA graph cannot capture this ATen op (a host read or a data-dependent shape), or None."""
    name = func.overloadpacket.__name__
    if _SYNC_OPS.get(name):
        return _SYNC_OPS[name]
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices or ()):
            return "indexes with a boolean mask, whose result size depends on the data"
    return None


def reference_store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Capture-safe store: every row writes somewhere, nothing is filtered. A padding row (slot -1) repeats the
    write of the step's first real row (same slot, same values), so duplicate writes agree; when the step has
    no real row, padding rows write cache slot 0's own contents back. No .item(), no boolean mask."""
    if key.shape[0] == 0:
        return
    slots = slot_mapping.long()
    real = slots >= 0
    first = real.long().argmax().view(1)                 # first real row (0 when there is none)
    first_real = real.index_select(0, first)             # [1] bool
    anchor = torch.where(first_real, slots.index_select(0, first), 0)
    target = torch.where(real, slots, anchor)
    for src, cache in ((key, k_cache), (value, v_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        fill = torch.where(first_real[:, None, None], src.index_select(0, first), flat[:1])
        rows = torch.where(real[:, None, None], src, fill)
        flat.index_copy_(0, target, rows)


def _store_cases(g):
    """(name, key, value, k_cache, v_cache, slot_mapping) cases: padding anywhere with slot 0 written by a real
    row between padding rows, a real write to slot 0 followed by padding rows, only padding, no padding, key and
    value in different layouts (as in the engine: K a new tensor, V a view of the fused QKV output), fp32 and bf16."""
    from nanovllm_course.ch04 import edge_slots
    cases = []
    for name, n, blocks, bs, hkv, d, dtype, pattern in [
            ("mixed, fp32, key contiguous, value a view of a fused QKV output", 9, 6, 4, 2, 8, torch.float32, "random"),
            ("slot 0 written by a real row, then padding rows", 6, 4, 4, 1, 4, torch.float32, "slot0"),
            ("only padding rows", 5, 3, 4, 2, 4, torch.float32, "none"),
            ("no padding, bf16", 7, 5, 5, 2, 16, torch.bfloat16, "all"),
            ("padding first, bf16, key a view of a fused QKV output, value contiguous", 11, 8, 16, 2, 8,
             torch.bfloat16, "first")]:
        k_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
        v_cache = torch.randn(blocks, bs, hkv, d, generator=g).to(dtype)
        fused = torch.randn(n, 3, hkv, d, generator=g).to(dtype)
        key, value = fused[:, 1], fused[:, 2]
        if "key a view" not in name:
            key = key.contiguous()
        if "value a view" not in name:
            value = value.contiguous()
        slots = torch.randperm(blocks * bs, generator=g)[:n].to(torch.int32)
        if pattern == "random":                  # slot 0 and the last slot real, padding rows on both sides of 0
            slots = edge_slots(g, n, blocks * bs, max(2, n // 3), end="real")
        elif pattern == "first":
            slots = torch.cat([torch.tensor([-1], dtype=torch.int32), edge_slots(g, n - 1, blocks * bs, n // 3,
                                                                                end="pad")])
        elif pattern == "slot0":
            slots[0] = 0
            slots[1:][slots[1:] == 0] = 1
            slots[n // 2:] = -1
        elif pattern == "none":
            slots[:] = -1
        cases.append((name, key, value, k_cache, v_cache, slots))
    return cases


def _store_sync_failure(tag, op, why, ops, case):
    """E10.3's verdict on a store that makes the host wait. Indexing with a 0-d tensor (`slots[first]`, where
    `first = mask.argmax()`) is the trap that hides best: PyTorch turns `x[t]` into `x[t.item()]`, a host read
    (aten._local_scalar_dense) followed by a select, without an `.item()` in sight."""
    k = ops.index(op) if op in ops else -1
    follows = ops[k + 1] if 0 <= k < len(ops) - 1 else None
    if op == "_local_scalar_dense" and follows in ("select", "slice"):
        fail(tag, f"your store indexes a tensor with a 0-d tensor (x[t] where t is, e.g., the result of argmax()): "
                  f"PyTorch reads t's value on the host to pick the row (aten._local_scalar_dense, then aten.{follows}), "
                  f"so the host waits for the GPU and a CUDA graph cannot capture it (case: {case})",
             "index with a 1-element index tensor instead, which stays on the device: x.index_select(0, t.view(1)) "
             "(or torch.gather)")
    fail(tag, f"your store runs aten.{op}: it {why}, so the host waits for the GPU and a CUDA graph "
              f"cannot capture it (case: {case})",
         "keep every row and compute where each padding row goes with tensor ops (torch.where, index_select with a "
         "1-element index tensor); never read a value on the host (.item(), .tolist(), int(t), `if t:`, or x[t] "
         "with a 0-d tensor t) and never filter rows with a boolean mask")


def check_capture_safe_store(fn) -> None:
    tag = "E10.3"
    g = fresh_generator()
    for name, key, value, k_cache, v_cache, slots in _store_cases(g):
        want_k, want_v = k_cache.clone(), v_cache.clone()
        reference_masked_store(key, value, want_k, want_v, slots)
        before = dict(key=key.clone(), value=value.clone(), slot_mapping=slots.clone())
        old_k = k_cache.clone()
        spy = SyncSpy()
        with spy:
            call_student(tag, fn, key, value, k_cache, v_cache, slots)
        if spy.problems:
            op, why = spy.problems[0]
            _store_sync_failure(tag, op, why, spy.ops, name)
        check_unchanged(tag, before, dict(key=key, value=value, slot_mapping=slots))
        for what, got, want in (("k_cache", k_cache, want_k), ("v_cache", v_cache, want_v)):
            if torch.equal(got, want):
                continue
            flat_g, flat_w = got.view(-1, *got.shape[2:]), want.view(-1, *want.shape[2:])
            bad = [s for s in range(flat_g.shape[0]) if not torch.equal(flat_g[s], flat_w[s])]
            s = bad[0]
            bs = got.shape[1]
            written = set(slots[slots >= 0].tolist())
            if s not in written:
                where = "the last slot of the cache" if s == flat_g.shape[0] - 1 else f"slot {s}"
                fail(tag, f"{what}: {where} (block {s // bs}, offset {s % bs}) changed although no real row "
                          f"writes it (case: {name}); a padding row (slot -1) wrote there",
                     "a -1 index means 'the last row' in PyTorch and clamping sends it to slot 0: padding rows "
                     "must leave every slot as it was")
            src = key if what == "k_cache" else value
            pad_rows = [src[i] for i in range(src.shape[0]) if int(slots[i]) < 0]
            if any(torch.equal(flat_g[s], r) for r in pad_rows) and not torch.equal(flat_g[s], flat_w[s]):
                fail(tag, f"{what}: slot {s} (block {s // bs}, offset {s % bs}) holds the K/V of a padding row "
                          f"(slot -1) instead of the real row written there (case: {name}); a padding row wrote there",
                     "a -1 index means 'the last row' in PyTorch and clamping sends it to slot 0: padding rows "
                     "must leave every slot as it was")
            if s == 0 and torch.equal(flat_g[0], old_k.view(-1, *old_k.shape[2:])[0] if what == "k_cache" else flat_g[0]):
                fail(tag, f"{what}: slot 0 kept its old contents although a real row writes it (case: {name}); a "
                          "padding row wrote the old value back over the real row's write",
                     "when two rows of one index_copy_ hit the same slot, either may win: padding rows must write "
                     "exactly what a real row writes there, or go to a slot no real row uses")
            fail(tag, f"{what}: slot {s} (block {s // bs}, offset {s % bs}) does not hold the row written to it "
                      f"(case: {name})",
                 "slot s is row s of cache.view(-1, num_kv_heads, head_dim); write key[i] to row slot_mapping[i]")
    ok(tag)


# -- a CUDA-graph stand-in for the CPU (E10.4's check without a GPU) ---------------------------------------------
class CaptureError(RuntimeError):
    """What capture on the stand-in raises for an op a real CUDA graph cannot capture."""


class CPUGraph:
    """A stand-in for torch.cuda.CUDAGraph on the CPU: capture records every ATen op with its arguments (the
    tensors themselves, so their memory is fixed), replay runs the recorded ops again and writes each result
    into the tensor that the op produced at capture. Like a real graph it knows nothing of Python: branches
    and shapes are those of the capture, and new tensors passed later are invisible to it."""

    def __init__(self):
        self.ops = []

    def replay(self):
        from torch.utils._pytree import tree_flatten
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for dst, src in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst is not src:
                    if dst.shape != src.shape:
                        raise CaptureError(f"aten.{func.overloadpacket.__name__} gave a different shape at replay")
                    if dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: CPUGraph):
        super().__init__()
        self.graph = graph

    def __enter__(self):
        CPUGraphs._capturing += 1
        return super().__enter__()

    def __exit__(self, *exc):
        CPUGraphs._capturing -= 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        why = capture_problem(func, args, kwargs)
        if why:
            raise CaptureError(f"operation not permitted when stream is capturing: aten.{name} {why}")
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


class CPUGraphs:
    """The three names of torch.cuda that capture uses (CUDAGraph, graph, synchronize), for the CPU; and
    `is_current_stream_capturing()`, as torch.cuda has it: True inside `with graph(...)`, so a step function can
    tell a captured call from an eager one (E10.4's check uses it to see the warm-up)."""
    CUDAGraph = CPUGraph
    _capturing = 0

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return CPUGraphs._capturing > 0

    @staticmethod
    def graph(g: CPUGraph):
        if not isinstance(g, CPUGraph):
            raise TypeError("graph() needs the CUDAGraph() of this same namespace")
        return _Recorder(g)

    @staticmethod
    def synchronize():
        return None


def graph_ops_recorded(graph) -> bool:
    """False only for a CPU stand-in graph that recorded no op (a real CUDA graph cannot be inspected)."""
    return not isinstance(graph, CPUGraph) or bool(graph.ops)


# -- E10.4 (CUDA) ------------------------------------------------------------------------------------------------
def reference_capture_decode_graph(run_step, batch_size: int, cuda=torch.cuda):
    """Warm up once eagerly, then capture one call of run_step(batch_size) into a graph. `cuda` is torch.cuda
    (or the CPU stand-in CPUGraphs). Returns (graph, output): replaying the graph rewrites `output` in place."""
    run_step(batch_size)
    cuda.synchronize()
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        output = run_step(batch_size)
    cuda.synchronize()
    return graph, output


def _check_warm_up(tag: str, calls: list) -> None:
    """E10.4's order of operations: an eager run_step(bs) before the first captured run_step(bs). On CUDA the
    first run of a step does what a capture cannot record (Triton and torch.compile compile, cuBLAS creates its
    handle and workspace, the allocator grows its pool); kernels are picked and compiled per shape, so the
    warm-up must use the batch size that is captured. The CPU stand-in cannot fail on any of that, so the check
    looks at the calls themselves, on both."""
    first = next((i for i, (kind, _) in enumerate(calls) if kind == "captured"), None)
    if first is None:
        return                                  # nothing captured: "the graph recorded nothing" says so
    before, captured = [bs for kind, bs in calls[:first] if kind == "eager"], calls[first][1]
    if not before:
        fail(tag, "run_step was captured without an eager warm-up call before it",
             "call run_step(batch_size) once eagerly, then cuda.synchronize(), before `with cuda.graph(graph):`: on "
             "CUDA the first run of a step compiles Triton kernels and creates cuBLAS workspaces, which a capture "
             "cannot record (the capture fails or the graph replays garbage)")
    if captured not in before:
        fail(tag, f"the warm-up ran run_step({before[0]}), but the captured call is run_step({captured})",
             "warm up with the batch size you capture: kernels are chosen and compiled per shape, so a warm-up at "
             "another size leaves the captured size's first run (and its compilation) inside the capture")


def check_graph_replay(fn, dtypes=None, device: str | None = None) -> None:
    """E10.4: capture the tiny Qwen3's decode step with fn(run_step, batch_size, cuda), replay it for a smaller
    batch (padding rows), compare the logits with the eager step's and the cache outside the batch's slots with
    its state before. On CUDA (the default when there is one) `cuda` is torch.cuda and both fp32 and bf16 run;
    on the CPU it is the stand-in CPUGraphs (fp32, with the capture-safe reference store in the engine)."""
    import warnings

    from nanovllm_course.common import tiny_model_dir
    from nanovllm_ref import LLM
    from nanovllm_ref.engine.inputs import prepare_decode
    from nanovllm_ref.engine.sequence import Sequence
    from nanovllm_ref.utils.context import attention_metadata

    tag = "E10.4"
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        fail(tag, "needs a CUDA GPU", "run this on a machine with CUDA, or look at the committed figure")
    dtypes = dtypes or ((torch.float32, torch.bfloat16) if on_cuda else (torch.float32,))
    graphs = torch.cuda if on_cuda else CPUGraphs
    from nanovllm_ref import Parts
    parts = Parts() if on_cuda else Parts(store_kvcache=reference_store_kvcache)
    g = fresh_generator()
    for dtype in dtypes:
        atol = 1e-5 if dtype == torch.float32 else 2e-2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(tiny_model_dir("qwen3"), device=device, dtype=str(dtype).split(".")[-1], enforce_eager=True,
                      kvcache_block_size=4, max_model_len=64, num_kvcache_blocks=64, parts=parts,
                      # the torch back-end reads no metadata on the host (the CPU one does), so it captures
                      attention_backend="auto" if on_cuda else "torch")
        try:
            runner = llm.model_runner
            model, dev = runner.model, runner.device
            graph_bs, batch = 8, randint(g, 1, 7)
            seqs = [Sequence(torch.randint(3, 400, (randint(g, 3, 20),), generator=g).tolist(), 4)
                    for _ in range(batch)]
            for seq in seqs:                       # prefill: writes the prompts' K/V, gives each a first token
                llm.scheduler.block_manager.allocate(seq)
                seq.num_scheduled_tokens = len(seq) - seq.num_cached_tokens
            first = runner.run(seqs, True)
            for seq, tok in zip(seqs, first):
                seq.num_cached_tokens = len(seq)
                seq.append_token(tok)
                llm.scheduler.block_manager.may_append(seq)
            step = prepare_decode(seqs, 4, dev)
            caches = [(layer.k_cache, layer.v_cache) for layer in runner._attention_layers()]
            before = [(k.clone(), v.clone()) for k, v in caches]
            with torch.inference_mode(), attention_metadata(step.metadata):
                eager = model.compute_logits(model(step.input_ids, step.positions)).float()
            for (k, v), (k0, v0) in zip(caches, before):          # undo the eager step's writes
                k.copy_(k0)
                v.copy_(v0)
            max_blocks = 16
            buf = dict(input_ids=torch.zeros(graph_bs, dtype=torch.int64, device=dev),
                       positions=torch.zeros(graph_bs, dtype=torch.int64, device=dev),
                       slot_mapping=torch.full((graph_bs,), -1, dtype=torch.int32, device=dev),
                       context_lens=torch.zeros(graph_bs, dtype=torch.int32, device=dev),
                       block_tables=torch.full((graph_bs, max_blocks), -1, dtype=torch.int32, device=dev))

            calls = []           # ("eager" or "captured", batch size) of every run_step call, in order

            def run_step(bs):
                calls.append(("captured" if graphs.is_current_stream_capturing() else "eager", bs))
                meta = AttentionMetadata(is_prefill=False, slot_mapping=buf["slot_mapping"][:bs],
                                         context_lens=buf["context_lens"][:bs], block_tables=buf["block_tables"][:bs])
                with attention_metadata(meta):
                    return model(buf["input_ids"][:bs], buf["positions"][:bs])

            with torch.inference_mode():
                graph, out = call_student(tag, fn, run_step, graph_bs, graphs)
                _check_warm_up(tag, calls)
                if not isinstance(graph, graphs.CUDAGraph) or not isinstance(out, torch.Tensor):
                    fail(tag, "capture should return (the graph, the output tensor of the captured call)",
                         "graph = cuda.CUDAGraph(); with cuda.graph(graph): output = run_step(batch_size)")
                if out.shape[0] != graph_bs:
                    fail(tag, f"the captured output has {out.shape[0]} rows; capture run_step(batch_size) for "
                              f"batch_size={graph_bs}", "the graph's shapes are those of the captured call")
                if not graph_ops_recorded(graph):
                    fail(tag, "the graph recorded nothing: run_step must run inside `with cuda.graph(graph):`",
                         "the warm-up runs eagerly before; the captured call goes inside the with block")
                for (k, v), (k0, v0) in zip(caches, before):      # the capture's own warm-up wrote padding rows' junk
                    k.copy_(k0)
                    v.copy_(v0)
                reference_fill_static_inputs(buf, step.input_ids, step.positions, step.metadata)
                graph.replay()
                if on_cuda:
                    torch.cuda.synchronize()
                replayed = model.compute_logits(out[:batch]).float()
            real = set(step.metadata.slot_mapping.tolist())
            for (k, v), (k0, v0) in zip(caches, before):
                for now, then in ((k, k0), (v, v0)):
                    # compare bits (an unwritten cache slot may hold NaN, and NaN != NaN)
                    fn_ = now.view(-1, *now.shape[2:]).view(torch.uint8).flatten(1)
                    fo = then.view(-1, *then.shape[2:]).view(torch.uint8).flatten(1)
                    changed = (fn_ != fo).any(1).nonzero().flatten().tolist()
                    stray = [s for s in changed if s not in real]
                    if stray:
                        fail(tag, f"replay changed cache slot {stray[0]}, which no real row of the batch writes "
                                  f"({dtype}): a padding row stored its K/V",
                             "capture run_step(batch_size) itself: it reads the static slot_mapping, whose padding "
                             "rows are -1 at every replay")
            err = (replayed - eager).abs().max().item()
            if not torch.allclose(replayed, eager, atol=atol, rtol=atol):
                fail(tag, f"replayed logits differ from the eager step by {err:.3g} ({dtype}, batch {batch} in a "
                          f"graph of {graph_bs}; tolerance {atol})",
                     "return the very tensor the captured call returned (replay rewrites it; a copy stays stale), "
                     "and warm up once before capturing")
        finally:
            llm.exit()
    ok(tag)


# -- E10.5: what the fused q/k-norm + RoPE + KV-store kernel computes -------------------------------------------
def reference_qk_norm_rope_store(qkv, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache, v_cache,
                                 slot_mapping, num_heads, num_kv_heads, head_dim):
    """E10.5's answer: the general route's ops one after the other (models/qwen3.DecoderAttention): split the
    fused QKV output, per-head RMSNorm of q and k (reference rms_norm; skipped when q_weight is None), RoPE
    (reference apply_rope), store k and v at slot_mapping (-1: nothing). Returns q [T, H, d].
    kernels/qk_norm_rope_store.py computes the same in one Triton kernel."""
    return _qk_variant(qkv, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping,
                       num_heads, num_kv_heads, head_dim)


def _rope_interleaved(positions, x, cos, sin):
    """RoPE on pairs (2i, 2i+1), the GPT-J layout (a known mistake here: the model uses rotate-half)."""
    c, s_ = cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((even * c - odd * s_, odd * c + even * s_), dim=-1).flatten(-2)
    return out.to(x.dtype)


def _qk_variant(qkv, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping,
                h, hkv, d, mistake=None):
    """The reference (mistake None), or the reference with one known mistake, to name what a student got wrong."""
    from nanovllm_ref.attn.torch_backend import store_kvcache as torch_store
    from nanovllm_ref.layers.layernorm import rms_norm
    from nanovllm_ref.layers.rotary_embedding import apply_rope, apply_rotary
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    if mistake == "sin_sign":                         # rotating the other way: x * cos + rotate_half(x) * -sin
        sin = -sin
    if mistake == "token_index":                      # cos/sin rows of 0..T-1, not of each token's position
        positions = torch.arange(qkv.shape[0], device=qkv.device)
    if mistake == "no_eps":                           # also what a hard-coded 1e-6 gives, within tolerance
        eps = 0.0
    if mistake == "eps_outside_root":
        def rms_norm(x, w, eps):                      # noqa: F811 (the mistake: eps added after the root)
            xf = x.float()
            return w * (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    if mistake == "v_columns":                       # v read right after q, i.e. from k's columns
        v = qkv[:, h * d:(h + hkv) * d]
    q, k, v = q.reshape(-1, h, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    if q_weight is not None and mistake != "no_norm":
        if mistake == "norm_whole_row":
            q = rms_norm(q.flatten(1), q_weight.repeat(h), eps).view(-1, h, d)
            k = rms_norm(k.flatten(1), k_weight.repeat(hkv), eps).view(-1, hkv, d)
        elif mistake != "norm_after_rope":
            q = rms_norm(q, q_weight, eps)
            k = rms_norm(k, q_weight if mistake == "k_with_q_weight" else k_weight, eps)
    k_plain = k
    if mistake == "interleaved":
        q, k = _rope_interleaved(positions, q, cos, sin), _rope_interleaved(positions, k, cos, sin)
    else:
        q, k = apply_rope(positions, q, k, cos, sin)
    if mistake == "norm_after_rope" and q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    stored_k = k_plain if mistake == "k_before_rope" else k
    if mistake == "v_rotated":
        v = apply_rotary(v, cos[positions], sin[positions])
    slots = slot_mapping
    if mistake == "padding_wraps":                   # slot -1 used as an index: the cache's last slot
        slots = torch.where(slot_mapping < 0, k_cache.shape[0] * k_cache.shape[1] - 1, slot_mapping)
    torch_store(stored_k.contiguous(), v.contiguous(), k_cache, v_cache, slots.to(slot_mapping.dtype))
    return q


_QK_MISTAKES = {
    "no_norm": "Qwen3 RMS-normalises every head of q and k (q_weight, k_weight) BEFORE RoPE; only a model "
               "without q/k norm (q_weight None) skips it",
    "norm_whole_row": "RMSNorm here is per head: the mean of squares runs over one head's head_dim channels, "
                      "not over the whole row of all heads",
    "norm_after_rope": "normalise first, then rotate: RoPE comes after the q/k RMSNorm (the weight would "
                       "otherwise scale rotated channels)",
    "k_with_q_weight": "k is normalised with k_weight, q with q_weight",
    "interleaved": "RoPE pairs channel i with channel i + d/2 (rotate half, GPT-NeoX layout), not 2i with 2i+1",
    "k_before_rope": "the cache must hold k AFTER norm and RoPE: attention reads keys from the cache and never "
                     "rotates them again",
    "v_rotated": "v is stored as it is: no norm, no RoPE",
    "v_columns": "qkv's columns are [q: H*d | k: Hkv*d | v: Hkv*d]; v starts at column (H + Hkv) * d",
    "padding_wraps": "slot -1 is a padding row that stores nothing; used as an index it would hit the cache's "
                     "last slot",
    "no_eps": "RMSNorm adds the eps it is given under the root, x * rsqrt(mean(x**2) + eps): it is the "
              "model's rms_norm_eps, so neither leave it out nor use a constant of your own (this case's eps is "
              "large, so it shows)",
    "eps_outside_root": "eps goes inside the root: x * rsqrt(mean(x**2) + eps), not x / (sqrt(mean(x**2)) + eps)",
    "sin_sign": "rotate by +theta: x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]",
    "token_index": "index cos_sin_cache by each token's position (positions[t]), not by its row t in the batch",
}


def _qk_cases(g):
    """(name, dtype, T, H, Hkv, d, qk_norm, eps): fresh random cases of the shapes the kernel serves. T >= 2, so
    every case has a padding row; the second case's eps is large (0.05-0.5) so that where it goes shows."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        t = randint(g, 2, 7)
        big_eps = float(torch.empty(1).uniform_(0.05, 0.5, generator=g))
        cases += [("Qwen3-like GQA", dtype, t, 4, 2, 16, True, 1e-6),
                  ("one KV head, head_dim 24 (half 12), a large eps", dtype, randint(g, 2, 5), 3, 1, 24, True, big_eps),
                  ("no q/k norm (Llama-like)", dtype, t, 2, 2, 8, False, 1e-6)]
    return cases


def check_qk_norm_rope_store(fn) -> None:
    """E10.5: fn(qkv, positions, cos_sin_cache, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping,
    num_heads, num_kv_heads, head_dim) -> q must match `reference_qk_norm_rope_store`: q and k_cache within
    fp32 atol = rtol = 1e-5 (bf16: 1.6e-2), v_cache bit for bit, every slot the mapping does not name unchanged,
    qkv unchanged."""
    from nanovllm_ref.layers.rotary_embedding import RotaryEmbedding
    tag = "E10.5"
    g = fresh_generator()
    block_size, num_blocks, max_pos = 4, 4, 64
    for name, dtype, t, h, hkv, d, qk_norm, eps in _qk_cases(g):
        rope = RotaryEmbedding(d, max_pos, 10000.0)
        width = (h + 2 * hkv) * d
        qkv = torch.randn(t, width + 8, generator=g).to(dtype)[:, :width]      # a strided view, as in the model
        perm = torch.randperm(num_blocks * block_size, generator=g)[:t].to(torch.int32)
        perm[randint(g, 0, t - 1)] = -1                                         # a padding row
        positions = torch.randint(0, max_pos, (t,), generator=g)
        positions[0] = max_pos - 1                                              # never the row index
        weights = ((torch.randn(d, generator=g) * 0.5 + 1).to(dtype), (torch.randn(d, generator=g) * 0.5 + 1).to(dtype)) \
            if qk_norm else (None, None)
        k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
        v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
        args = (positions, rope.cos_sin_cache, *weights, eps)
        tail = (perm, h, hkv, d)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        want = reference_qk_norm_rope_store(qkv, *args, ref_k, ref_v, *tail)
        before = {"qkv": qkv.clone(), "positions": positions.clone(), "slot_mapping": perm.clone()}
        got_k, got_v = k_cache.clone(), v_cache.clone()
        got = call_student(tag, fn, qkv, *args, got_k, got_v, *tail)
        check_unchanged(tag, before, {"qkv": qkv, "positions": positions, "slot_mapping": perm})
        case = f"({name}, {dtype}, T={t}, H={h}, Hkv={hkv}, d={d}, eps={eps:.3g}, slots {perm.tolist()})"
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2
        diagnosis = None
        outputs = (got, got_k, got_v)
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
                and _close(got, want, tol) and _close(got_k, ref_k, tol) and torch.equal(got_v, ref_v)):
            diagnosis = _diagnose_qk(outputs, qkv, args, k_cache, v_cache, tail, tol, qk_norm)
        if diagnosis:
            fail(tag, f"{diagnosis[0]} {case}", _QK_MISTAKES[diagnosis[1]])
        hint_q = "q: split qkv into q | k | v columns, reshape to [T, H, d], normalise each head, then RoPE"
        check_close(tag, got, want, rtol=tol, atol=tol, what=f"the returned q {case}", hint=hint_q)
        untouched = _slots_changed(got_k, k_cache, perm) + _slots_changed(got_v, v_cache, perm)
        if untouched:
            fail(tag, f"cache slot {untouched[0]} changed, but no real row of the step writes it {case}",
                 "write only the slots slot_mapping names; a row with slot -1 stores nothing")
        check_close(tag, got_k, ref_k, rtol=tol, atol=tol, what=f"k_cache {case}",
                    hint="store k after its RMSNorm and RoPE, at slot_mapping[t] (block = slot // block_size)")
        if not torch.equal(got_v, ref_v):
            fail(tag, f"v_cache differs from the reference {case}",
                 "v is copied bit for bit into the same slots as k: v = qkv[:, (H + Hkv) * d:]")
    ok(tag)


def _close(a, b, tol) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


def _slots_changed(now, then, slots) -> list[int]:
    flat_now, flat_then = now.flatten(0, 1).flatten(1), then.flatten(0, 1).flatten(1)
    changed = (flat_now != flat_then).any(1).nonzero().flatten().tolist()
    real = set(slots[slots >= 0].tolist())
    return [s for s in changed if s not in real]


def _diagnose_qk(outputs, qkv, args, k_cache, v_cache, tail, tol, qk_norm):
    """(what differed, mistake) when the student's outputs equal the reference with one known mistake."""
    got, got_k, got_v = outputs
    for mistake in _QK_MISTAKES:
        if not qk_norm and mistake in ("no_norm", "norm_whole_row", "norm_after_rope", "k_with_q_weight",
                                       "no_eps", "eps_outside_root"):
            continue
        mk, mv = k_cache.clone(), v_cache.clone()
        mq = _qk_variant(qkv, *args, mk, mv, *tail, mistake=mistake)
        if _close(got, mq, tol) and _close(got_k, mk, tol) and torch.equal(got_v, mv):
            what = {"no_norm": "q and k_cache come out without the q/k RMSNorm",
                    "norm_whole_row": "q and k_cache are normalised over the whole row, not per head",
                    "norm_after_rope": "q and k_cache are normalised after RoPE",
                    "k_with_q_weight": "k_cache holds k normalised with q_weight",
                    "interleaved": "q and k_cache are rotated in (2i, 2i+1) pairs",
                    "k_before_rope": "k_cache holds k before RoPE", "v_rotated": "v_cache holds a rotated v",
                    "v_columns": "v_cache holds the k columns",
                    "padding_wraps": "the padding row wrote the last cache slot",
                    "no_eps": "q and k_cache are normalised without the eps given (or with a tiny one)",
                    "eps_outside_root": "q and k_cache are normalised with eps added after the square root",
                    "sin_sign": "q and k_cache are rotated by -theta",
                    "token_index": "q and k_cache are rotated by each token's row in the batch, not its position"
                    }[mistake]
            return what, mistake
    return None


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402

EXERCISES = exercises(
    Exercise("E10.1", check_graph_batch_sizes, ("graph_batch_sizes",), (reference_graph_batch_sizes,), parts=(
        EnginePart("graph_batch_sizes", "graph_batch_sizes", "E10.1",
                   check=lambda mod: check_graph_batch_sizes(mod.graph_batch_sizes)),)),
    Exercise("E10.2", check_fill_static_inputs, ("fill_static_inputs",), (reference_fill_static_inputs,)),
    Exercise("E10.3", check_capture_safe_store, ("store_kvcache",), (reference_store_kvcache,), parts=(
        EnginePart("store_kvcache", "store_kvcache", "E10.3", check=lambda mod: check_capture_safe_store(mod.store_kvcache)),)),
    Exercise("E10.4", check_graph_replay, ("capture_decode_graph",), (reference_capture_decode_graph,)),
    Exercise("E10.5", check_qk_norm_rope_store, ("qk_norm_rope_store",), (reference_qk_norm_rope_store,)),
)
PARTS = parts_of(EXERCISES)
