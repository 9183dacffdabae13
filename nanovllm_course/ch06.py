"""Checks for chapter 06: Triton kernels.

- `check_store_kvcache(fn)` (E6.1): fn(key, value, k_cache, v_cache, slot_mapping) writes in place, with
  the semantics of `nanovllm_ref.attn.torch_backend.store_kvcache`: the caches must equal the reference's
  bit for bit (a copy has no rounding). Hkv = 3, head_dim = 40 (neither a power of two), a third of the
  slots -1, block sizes 1, 5 and 16, fp32 and bf16. Key and value always have different layouts (a fused-QKV
  view, a padded-head view, contiguous: in the engine K is new out of RoPE and V a view of the projection);
  slot 0 and the last slot are always written, with padding rows before and after the token writing slot 0
  (`ch04.edge_slots`). The caches sit between guard rows: writing slot -1 lands there.
- `check_online_softmax(fn)` (E6.2): fn(scores [R, T] fp32 with -inf for masked keys, values [T, D] fp32,
  tile) -> [R, D] fp32, compared with `torch.softmax(scores, -1) @ values` at rtol = atol = 1e-5, for tiles
  of 1, 3 and 64; rows whose maximum rises from tile to tile, rows far below 0 (near -1000: exp(s) underflows),
  rows in the hundreds (150 to 400 above 0: exp(s) overflows fp32), rows whose first (or a middle) tile is fully
  masked. A wrong answer gets the hint of the planted mistake (`_SOFTMAX_MISTAKES`) that gives it in every case.
- `check_paged_decode(fn)` (E6.3): fn(q, k_cache, v_cache, block_tables, context_lens, scale) compared with
  `nanovllm_ref.attn.torch_backend.paged_decode`: fp32 rtol = atol = 1e-4 and a relative error norm
  ||got - ref|| / ||ref|| <= 1e-5; one bf16 case at 2e-2 and 8e-3. Contexts 1, B and B + 1 (B = block size),
  block sizes 1, 4, 16 and 17, GQA groups 1 to 8, block tables padded with -1, two sequences sharing a block,
  block 0 and the last block in use, q a strided view in one batch; and, in every call, one fp32 and one bf16
  batch whose sequences' scores sit in the hundreds, alternately above and below 0 (`_large_scores`: a kernel
  without the running max gives NaN there), compared at 1e-3 and 1e-4 in fp32 (a score of 300 carries a
  rounding error of ~1e-4).
- `check_split_decode(fn)` (E6.4, optional): the same cases, with fn(q, ..., scale, num_splits) for 1, 2, 3
  and 5 splits (more splits than tiles: empty splits must merge to nothing), plus two longer sequences with
  one tile more than there are splits, and the two batches with scores in the hundreds (3 splits, each with
  keys: a merge with exp(lse_s) instead of exp(lse_s - max lse) overflows); the hint names the matching wrong
  merge (`reference_split_variant`).

Under the Triton interpreter (CPU), every kernel launched inside a check runs with a memory watch
(`watch_memory`): a load or store of an enabled lane outside every tensor passed to the kernel stops the
kernel and the check names the tensor it missed (inputs sit in storages with slack after them, so a run past
a tensor's end is seen whatever the allocator did); every store is recorded per program (a padding row that
stores anything, even a slot's old contents, is named); masked-off lanes of a load without `other=` read
NaN, as a GPU's read garbage; and one more case per kernel passes slots or block ids whose offsets start past
2**31 elements, through a tensor pointer shifted down by as much (no 8 GiB allocation): int64 offsets land on
the real tensor, int32 ones wrap and are caught. On a GPU none of this runs (a wrapped address would crash
the process), so the checks there rely on the values and the guard rows alone.

Every check draws fresh random inputs on each call and prints `E6.n ok` and nothing else on success.
"""
import contextlib
import math
import os
import warnings

import torch

from nanovllm_course.common import CheckFailed, call_student, check_close, fail, fresh_generator, ok
from nanovllm_ref.attn import torch_backend

reference_store_kvcache = torch_backend.store_kvcache
reference_torch_paged_decode = torch_backend.paged_decode


def interpreting() -> bool:
    """True when Triton kernels defined now run in the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device() -> str:
    """Where the checks put their tensors: the GPU when kernels are compiled for it, else the CPU."""
    return "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def reference_triton_store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The engine's Triton store kernel (nanovllm_ref/kernels/store_kvcache.py)."""
    from nanovllm_ref.kernels.store_kvcache import store_kvcache
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def reference_triton_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=None):
    """The engine's split-KV Triton decode (nanovllm_ref/kernels/attention.py)."""
    from nanovllm_ref.kernels.attention import paged_decode
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits)


# -- a memory watch for interpreted kernels ---------------------------------------------------------------

class OutOfBounds(Exception):
    """Raised inside an interpreted kernel by the memory watch, before the access happens."""


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that a strided tensor view can address."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


INT32_LIMIT = 2 ** 31      # offsets at or past this many elements need int64 arithmetic


def isolated(gen: torch.Generator, t: torch.Tensor, slack: int | None = None) -> torch.Tensor:
    """A copy of `t` (same shape, strides and values) at the start of a storage of random values with `slack`
    more elements after its last one (default: as many as it spans, at least 1024), so an access that runs past
    its end lands in memory no other tensor of the launch owns, and the memory watch sees it every time (not only
    when the allocator happened to put nothing of the kernel's right behind it)."""
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) + 1 if t.numel() else 0
    size = span + (slack if slack is not None else max(1024, span))
    if t.is_floating_point():
        buf = torch.randn(size, generator=gen).to(t.dtype).to(t.device)
    else:
        buf = torch.randint(-2 ** 20, 2 ** 20, (size,), generator=gen).to(t.dtype).to(t.device)
    out = buf.as_strided(t.shape, t.stride(), 0)
    out.copy_(t)
    return out


class MemoryWatch:
    """What an interpreted kernel did to memory: the first out-of-bounds access, stored as `violation` (kind,
    tensor name, where, count) with `access` (enabled lanes, tile lanes) of that load or store, and, for the
    tensors named in `record`, every element offset each program stored to (`stored`), so a store that writes
    back the values already there is seen too.

    `shifts` {name: elements} hands that tensor to the kernel as a pointer `elements` lower, so a check can
    pass indices that large (slots or block ids past 2**31 elements) without allocating the memory: with int64
    offsets the kernel lands on the real, small tensor; with int32 offsets they wrap and land far outside it.
    Loads of the region just below a shifted tensor (indices the big tensor would have, below the shift) are
    moved onto the tensor, so a masked-off lane that read block 0 there still reads memory."""

    def __init__(self, named: dict, shifts: dict | None = None, record=()):
        self.named = {name: _extent(t) for name, t in named.items()}
        self.storages = {name: (t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() +
                                t.untyped_storage().nbytes()) for name, t in named.items() if t.numel()}
        self.shifts = {named[n].data_ptr(): e * named[n].element_size() for n, e in (shifts or {}).items() if e}
        self.below = [(self.named[n][0] - e * named[n].element_size(), self.named[n][0])
                      for n, e in (shifts or {}).items() if e]
        self.record = {name: (self.named[name][0], named[name].element_size()) for name in record}
        self.stores = {name: {} for name in record}     # name -> program index -> [element offsets]
        self.ranges: list[tuple[int, int]] = []
        self.violation = None
        self.access = None
        self.launched = False       # a Triton kernel ran inside the watch
        self.arguments: dict[str, tuple[int, int]] = {}    # other tensors of a launch, by kernel parameter name
        self.all_stores: list = []                          # the byte address of every stored lane

    def check(self, kind: str, ptrs, mask, program=None):
        """Stop the kernel (OutOfBounds) at an enabled lane outside every tensor it was launched with. Returns
        None, or the lanes' addresses with those of the region below a shifted tensor moved onto it."""
        import numpy as np
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        on = (np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape) if mask is not None
              else np.ones(addr.shape, dtype=bool))
        if not on.any() or not self.ranges:
            return None
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        lanes = addr.astype(np.int64)
        inside = np.zeros(lanes.shape, dtype=bool)
        for lo, hi in self.ranges:
            inside |= (lanes >= lo) & (lanes + size <= hi)
        moved = None
        if kind == "read" and self.below:
            for lo, hi in self.below:
                low = on & ~inside & (lanes >= lo) & (lanes + size <= hi)
                if low.any():
                    moved = np.where(low, np.uint64(hi), addr if moved is None else moved)
                    inside |= low
        bad = on & ~inside
        if bad.any():
            first = int(lanes[bad][0])
            # Name the tensor the access was meant for: the one its other lanes hit, else the nearest to the
            # first bad address (a wild address, e.g. from garbage read by a masked-off lane, is near nothing).
            tensors = list(self.named.items()) + list(self.arguments.items())
            good = lanes[on & inside]
            hit = [(n, r) for n, r in tensors if good.size and ((good >= r[0]) & (good < r[1])).any()]
            # or the one whose storage holds the bad address (the check's inputs have slack after them)
            hit = hit or [(n, self.named[n]) for n, (lo, hi) in self.storages.items() if lo <= first < hi]
            best = None
            for name, (lo, hi) in hit or tensors:
                dist = lo - first if first < lo else max(0, first + size - hi)
                if best is None or dist < best[0]:
                    best = (dist, name, "before the start of" if first < lo else "past the end of")
            _, name, where = best if best else (0, "a tensor", "outside")
            self.violation = (kind, name, where, int(bad.sum()))
            self.access = (int(on.sum()), int(on.size))
            raise OutOfBounds(f"{kind} {where} {name}")
        if kind == "wrote":
            self.all_stores.append(lanes[on])
            for name, (lo, elem) in self.record.items():
                hit = on & (lanes >= lo) & (lanes < self.named[name][1])
                if hit.any():
                    self.stores[name].setdefault(program, []).append((lanes[hit] - lo) // elem)
        return moved

    def wrote_into(self, t: torch.Tensor) -> bool:
        """True if a kernel inside the watch stored into `t`'s memory (interpreter only)."""
        lo, hi = _extent(t)
        return any(((a >= lo) & (a < hi)).any() for a in self.all_stores)

    def stored(self, name: str) -> dict:
        """{program index (x, y, z): set of element offsets into tensor `name` (one of `record`) it stored to}."""
        import numpy as np
        return {p: set(np.concatenate(parts).tolist()) for p, parts in self.stores[name].items()}


def _poison(ti, ptrs):
    """`other` for a masked load that gave none: NaN (integers: -2**30, far outside any index), as a GPU's
    masked-off lanes return whatever sits in memory rather than the zeros the interpreter would give."""
    import numpy as np
    elem = ptrs.get_element_ty()
    np_dtype = ti._get_np_dtype(elem)
    shape = np.shape(ptrs.data)
    if str(elem) == "bf16":                                   # the interpreter keeps bf16 as uint16 bits
        return ti.TensorHandle(np.full(shape, 0x7FC0, dtype=np.uint16), elem)
    if np.issubdtype(np_dtype, np.floating):
        return ti.TensorHandle(np.full(shape, np.nan, dtype=np_dtype), elem)
    if np.issubdtype(np_dtype, np.signedinteger):
        return ti.TensorHandle(np.full(shape, max(np.iinfo(np_dtype).min // 2, -2 ** 30), dtype=np_dtype), elem)
    return None


@contextlib.contextmanager
def watch_memory(named: dict, *, shifts: dict | None = None, record=()):
    """Inside the block, interpreted kernels may only touch the tensors they were launched with; `named`
    maps names to the check's tensors, to say which one an access missed. Masked-off lanes of loads without
    `other` read NaN. `shifts` and `record`: see MemoryWatch. No-op on a GPU."""
    watch = MemoryWatch(named, shifts, record)
    if not interpreting():
        yield watch
        return
    from triton.runtime import interpreter as ti
    builder, executor = ti.interpreter_builder, ti.GridExecutor
    real_init, real_load, real_store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store
    real_cvt = ti._implicit_cvt

    def init(self, args_dev, kwargs):
        args_hst, kwargs_hst = real_init(self, args_dev, kwargs)
        watch.launched = True
        watch.ranges = [_extent(a) for a in list(args_hst) + list(kwargs_hst.values()) if isinstance(a, torch.Tensor)]
        known = set(watch.named.values())
        for arg_name, a in list(zip(getattr(self, "arg_names", []), args_hst)) + list(kwargs_hst.items()):
            if isinstance(a, torch.Tensor) and _extent(a) not in known:
                watch.arguments[f"the tensor passed as {arg_name}"] = _extent(a)
        return args_hst, kwargs_hst

    def cvt(arg):
        out = real_cvt(arg)
        if isinstance(arg, torch.Tensor) and watch.shifts.get(arg.data_ptr()):
            import numpy as np
            h = out.handle
            out = type(out)(ti.TensorHandle(h.data - np.uint64(watch.shifts[arg.data_ptr()]), h.dtype), out.type)
        return out

    def load(ptrs, mask, other, *args):
        moved = watch.check("read", ptrs, mask)
        if moved is not None:
            ptrs = ti.TensorHandle(moved, ptrs.dtype)
        if other is None and mask is not None and not bool(mask.data.all()):
            other = _poison(ti, ptrs)
        return real_load(ptrs, mask, other, *args)

    def store(ptrs, value, mask, *args):
        watch.check("wrote", ptrs, mask, program=getattr(builder, "grid_idx", None))
        return real_store(ptrs, value, mask, *args)

    executor._init_args_hst, builder.create_masked_load, builder.create_masked_store = init, load, store
    ti._implicit_cvt = cvt
    import numpy as np
    try:
        # NaN read from masked-off lanes makes numpy warn inside the interpreter; the check reports the result
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            yield watch
    finally:
        executor._init_args_hst = real_init
        ti._implicit_cvt = real_cvt
        del builder.create_masked_load, builder.create_masked_store


def shifts_supported() -> bool:
    """True when this Triton's interpreter lets a check hand a kernel a shifted pointer (MemoryWatch.shifts)."""
    if not interpreting():
        return False
    from triton.runtime import interpreter as ti
    return callable(getattr(ti, "_implicit_cvt", None)) and callable(getattr(ti, "_get_np_dtype", None))


def _run_kernel(tag, fn, args, watch: MemoryWatch, oob_hint, oob_message=None) -> object:
    """Call the student's launcher; turn a memory-watch stop or any other crash into a teaching failure.
    `oob_hint(kind, name, where, watch)` chooses the hint of an out-of-bounds access; `oob_message(kind,
    count)`, if given, its message."""
    try:
        return call_student(tag, fn, *args)
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - a student's kernel can fail in many ways (an assert too)
        if watch.violation:
            kind, name, where, count = watch.violation
            fail(tag, oob_message(kind, count) if oob_message else f"your kernel {kind} {count} element(s) {where} "
                                                                   f"`{name}`", oob_hint(kind, name, where, watch))
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        fail(tag, f"your launcher or kernel raised {type(exc).__name__}: {first}",
             "run it on a tiny case in a cell of its own to see the full traceback")


# == E6.1 the KV-store kernel ===============================================================================

STORE_CASES = [  # (block_size, num_blocks, num_tokens, dtype, key layout, value layout, last row)
    (5, 6, 12, torch.float32, "fused", "padded_heads", "real"),    # neither contiguous, each its own strides
    (1, 20, 9, torch.float32, "contiguous", "fused", "pad"),      # the engine's: K new out of RoPE, V a view
    (16, 3, 13, torch.bfloat16, "padded_heads", "fused", "real"),
    (5, 4, 7, torch.float32, "fused", "contiguous", None),
]
# Slots pushed past 2**31 elements of the cache (through MemoryWatch.shifts, under the interpreter only).
STORE_BIG_CASE = (4, 5, 6, torch.float32, "contiguous", "fused", "real")
STORE_HKV, STORE_D, STORE_H = 3, 40, 6
GUARD_ROWS = 2
_LAYOUT_NAMES = {"fused": "a view of a fused QKV output", "padded_heads": "rows with a padded head stride",
                 "contiguous": "contiguous"}


def _store_tensor(gen, n, layout, part, dtype, device):
    """key or value (`part`) [n, Hkv, D] in one of the layouts the engine may hand over."""
    hkv, d = STORE_HKV, STORE_D
    if layout == "fused":        # a view of one [n, (H + 2 Hkv) D] projection output: token stride (H+2Hkv) D
        qkv = torch.randn(n, (STORE_H + 2 * hkv) * d, generator=gen).to(dtype).to(device)
        _, k, v = qkv.split([STORE_H * d, hkv * d, hkv * d], dim=-1)
        return (k if part == "key" else v).view(n, hkv, d)
    if layout == "padded_heads":  # rows of [n, Hkv, D + 8] cut to D: head stride D + 8
        return torch.randn(n, hkv, d + 8, generator=gen).to(dtype).to(device)[..., :d]
    return torch.randn(n, hkv, d, generator=gen).to(dtype).to(device)


def _store_keys(gen, n, layout, dtype, device):
    """key, value [n, Hkv, D], both in `layout` (for demos; the check gives them different layouts)."""
    return (_store_tensor(gen, n, layout, "key", dtype, device),
            _store_tensor(gen, n, layout, "value", dtype, device))


def _guarded_cache(gen, num_blocks, bs, dtype, device):
    """(buffer, cache): a contiguous [num_blocks, bs, Hkv, D] cache with GUARD_ROWS slot rows of random
    values on each side inside `buffer`, so a write to slot -1 (or one slot past the end) is caught."""
    row = STORE_HKV * STORE_D
    buf = torch.randn((num_blocks * bs + 2 * GUARD_ROWS) * row, generator=gen).to(dtype).to(device)
    cache = buf[GUARD_ROWS * row:(GUARD_ROWS + num_blocks * bs) * row].view(num_blocks, bs, STORE_HKV, STORE_D)
    return buf, cache


def _as_contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    """What a kernel that assumes a contiguous [n, Hkv, D] tensor reads from the view `t`."""
    n, h, d = t.shape
    return _read_with_strides(t, (h * d, d, 1))


def _read_with_strides(t: torch.Tensor, stride) -> torch.Tensor | None:
    """What a kernel reads from `t`'s memory with another tensor's strides (None where that leaves it)."""
    try:
        return torch.as_strided(t, t.shape, stride)
    except RuntimeError:
        return None


def _store_oob_hint(kind, name, where, watch=None):
    if kind == "wrote" and name in ("k_cache", "v_cache") and where.startswith("before"):
        return ("a slot of -1 means 'do not write' (the padding rows of a CUDA-graph batch): the program of "
                "such a token must store nothing; slot * row_size with slot = -1 points just before the cache")
    if name in ("key", "value"):
        lanes = watch.access[0] if watch is not None and watch.access else None
        if lanes == STORE_HKV * STORE_D:        # the mask was right: the addresses were not
            return (f"{name} is a strided view with its own strides: key and value can have different layouts "
                    f"(in the engine K is a new tensor, V a view of the fused QKV output), so address {name} "
                    f"with {'stride_kt, stride_kh' if name == 'key' else 'stride_vt, stride_vh'}, not the other "
                    "tensor's strides nor Hkv * D")
        return ("mask the tile: BLOCK_H and BLOCK_D are powers of two >= Hkv and D, so lanes with h >= Hkv or "
                "d >= D must be masked in the load (and the store)")
    return "mask every load and store with (h < Hkv) & (d < D), and skip tokens whose slot is -1"


_INT64_HINT = ("offsets past 2**31 elements overflow int32: cast the slot (and the token index) to int64 before "
               "multiplying, slot = tl.load(slot_ptr + token).to(tl.int64); a large cache has such slots")
_PAD_HINT = ("a token with slot -1 must store nothing at all (not even the old contents of the slot it was sent "
             "to): on a GPU its store races with the real token writing that slot; wrap the body in "
             "`if slot >= 0:` or fold slot >= 0 into the store mask")


def _describe_layout(name, t, layout):
    return f"{name} {_LAYOUT_NAMES[layout]} (strides {tuple(t.stride())})"


def _store_case(tag, fn, gen, device, bs, num_blocks, n, dtype, k_layout, v_layout, end, big=False):
    # slack for any mix-up of the layouts' strides: a read with another tensor's strides stays in this storage
    slack = 2 * n * (STORE_H + 2 * STORE_HKV) * (STORE_D + 8)
    key = isolated(gen, _store_tensor(gen, n, k_layout, "key", dtype, device), slack)
    value = isolated(gen, _store_tensor(gen, n, v_layout, "value", dtype, device), slack)
    k_buf, k_cache = _guarded_cache(gen, num_blocks, bs, dtype, device)
    v_buf, v_cache = _guarded_cache(gen, num_blocks, bs, dtype, device)
    from nanovllm_course.ch04 import edge_slots
    # slot 0 and the last slot written, -1 rows on both sides of slot 0, the last row real or padding
    slots = edge_slots(gen, n, num_blocks * bs, max(2, n // 3), end=end).to(device)
    row = STORE_HKV * STORE_D
    first = -(-INT32_LIMIT // row) if big else 0           # slot `first` starts 2**31 elements into the cache
    given = torch.where(slots >= 0, slots + first, slots)
    k_old, v_old = k_buf.clone(), v_buf.clone()
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    reference_store_kvcache(key, value, exp_k, exp_v, slots)
    key_in, value_in, slots_in = key.clone(), value.clone(), given.clone()
    where = (f"block_size {bs}, {n} tokens, Hkv {STORE_HKV}, head_dim {STORE_D}, {str(dtype).replace('torch.', '')}, "
             f"{_describe_layout('key', key, k_layout)}, {_describe_layout('value', value, v_layout)}"
             + (f", slots from {first} on: offsets past 2**31 elements" if big else ""))
    hint = (lambda *a: _INT64_HINT) if big else _store_oob_hint
    with watch_memory({"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": given},
                      shifts={"k_cache": first * row, "v_cache": first * row}, record=("k_cache", "v_cache")) as watch:
        _run_kernel(tag, fn, (key, value, k_cache, v_cache, given), watch, hint,
                    (lambda kind, count: f"with slots from {first} on (offsets past 2**31 elements) your kernel "
                                         f"{kind} {count} element(s) outside every tensor it was given, far from "
                                         f"the cache: its offsets wrapped around [{where}]") if big else None)
    launched = watch.launched
    if not (torch.equal(key, key_in) and torch.equal(value, value_in) and torch.equal(given, slots_in)):
        fail(tag, f"your store changed key, value or slot_mapping [{where}]", "the store only reads them")
    mapped = set(slots[slots >= 0].tolist())
    for name, buf, old, got, exp, src, other in (("k_cache", k_buf, k_old, k_cache, exp_k, key, value),
                                                 ("v_cache", v_buf, v_old, v_cache, exp_v, value, key)):
        if not torch.equal(buf[:GUARD_ROWS * row], old[:GUARD_ROWS * row]):
            fail(tag, f"your store wrote just before {name} (where slot -1 points) [{where}]",
                 _INT64_HINT if big else _store_oob_hint("wrote", name, "before the start of"))
        if not torch.equal(buf[-GUARD_ROWS * row:], old[-GUARD_ROWS * row:]):
            fail(tag, f"your store wrote past the end of {name} [{where}]",
                 _INT64_HINT if big else _store_oob_hint("wrote", name, "past"))
        flat_got, flat_exp = got.view(-1, STORE_HKV, STORE_D), exp.view(-1, STORE_HKV, STORE_D)
        flat_old = old[GUARD_ROWS * row:-GUARD_ROWS * row].view_as(flat_got)
        spill_hint = ("mask the tile with (h < Hkv) & (d < D): BLOCK_H and BLOCK_D are powers of two, and lanes "
                      "past head_dim (or past the last head) spill into the next slot's row")
        for program, elems in sorted(watch.stored(name).items()):     # under the interpreter: every store
            t = program[0]                                     # one program per token
            own = int(slots[t]) if t < n else -1
            extra = sorted({e // row for e in elems} - ({own} if own >= 0 else set()))
            if not extra:
                continue
            s = extra[0]
            whole = all(s * row + e in elems for e in range(row))
            if own < 0:
                fail(tag, f"{name}: token {t} has slot -1, but your kernel stored into slot {s} for it [{where}]",
                     _INT64_HINT if big else _PAD_HINT)
            fail(tag, f"{name}: token {t} (slot {own + first}) also stored {'a whole row' if whole else 'lanes'} into "
                      f"slot {s + first} [{where}]", _INT64_HINT if big else spill_hint if not whole else
                 "token i's row goes to row slot_mapping[i] of the cache viewed as [num_slots, Hkv, D], element "
                 "slot * Hkv * D + h * D + d")
        if torch.equal(got, exp):
            continue
        changed = (flat_got != flat_old).flatten(1).any(1)
        stray = [s for s in changed.nonzero().flatten().tolist() if s not in mapped]
        if stray:                                              # what a GPU run sees of a store to a wrong slot
            fail(tag, f"{name}: slot {stray[0] + first} changed although no token maps to it [{where}]",
                 _INT64_HINT if big else "a token stores only into its own slot, and a token with slot -1 nowhere")
        bad = int((flat_got != flat_exp).flatten(1).any(1).nonzero()[0])
        i = (slots == bad).nonzero().flatten().tolist()[0]
        if big:
            fail(tag, f"{name}: slot {bad + first} holds the wrong values (token {i}) [{where}]", _INT64_HINT)
        if torch.equal(flat_got[bad], flat_old[bad]):
            if bad == 0:
                fail(tag, f"{name}: slot 0 (block 0, offset 0) was not written, though token {i} maps to it "
                          f"[{where}]", "slot 0 is a real slot: only a negative slot means 'do not write' "
                                        "(test slot >= 0, not slot > 0)")
            fail(tag, f"{name}: slot {bad} (token {i}) was not written [{where}]",
                 "every token whose slot is >= 0 stores its whole [Hkv, D] row")
        if torch.equal(flat_got[bad], other[i]):
            fail(tag, f"{name}: slot {bad} holds token {i}'s {'value' if name == 'k_cache' else 'key'} "
                      f"[{where}]", "keys go to k_cache and values to v_cache: did you swap them?")
        other_strides = _read_with_strides(src, other.stride())
        packed = (STORE_HKV * STORE_D, STORE_D, 1)
        if other.stride() not in (src.stride(), packed) and other_strides is not None \
                and torch.equal(flat_got[bad], other_strides[i]):
            own = "key" if name == "k_cache" else "value"
            fail(tag, f"{name}: slot {bad} holds the wrong numbers for token {i}: {own} was read with "
                      f"{'value' if own == 'key' else 'key'}'s strides [{where}]",
                 f"key and value are separate views with their own strides (here {tuple(key.stride())} and "
                 f"{tuple(value.stride())}): address {own} with "
                 f"{'stride_kt, stride_kh' if own == 'key' else 'stride_vt, stride_vh'}")
        contiguous = _as_contiguous_rows(src)
        if not src.is_contiguous() and contiguous is not None and torch.equal(flat_got[bad], contiguous[i]):
            fail(tag, f"{name}: slot {bad} holds the wrong numbers for token {i} [{where}]",
                 f"{'key' if name == 'k_cache' else 'value'} is a strided view: token t, head h starts at "
                 "ptr + t * stride(0) + h * stride(1), not t * Hkv * D + h * D; pass the strides to the kernel "
                 "and use them")
        if torch.equal(flat_got[bad][0], flat_exp[bad][0]):
            fail(tag, f"{name}: slot {bad}: head 0 is right, a later head is wrong [{where}]",
                 "head h of a token starts h * stride(1) elements after head 0 in key (or value), and h * D "
                 "elements after it in the cache row")
        fail(tag, f"{name}: slot {bad} (block {bad // bs}, offset {bad % bs}) holds the wrong values "
                  f"(token {i}) [{where}]",
             "token i's [Hkv, D] row goes to k_cache viewed as [num_blocks * block_size, Hkv, D], row "
             "slot_mapping[i], i.e. element slot * Hkv * D + h * D + d")
    return launched


def check_store_kvcache(fn) -> None:
    tag = "E6.1"
    gen = fresh_generator()
    device = kernel_device()
    launched = [_store_case(tag, fn, gen, device, *case) for case in STORE_CASES]
    if shifts_supported() and all(launched):       # slots past 2**31 elements: for Triton kernels, interpreted
        _store_case(tag, fn, gen, device, *STORE_BIG_CASE, big=True)
    ok(tag)


# == E6.2 online softmax ====================================================================================

def reference_online_softmax(scores, values, tile: int, *, rescale_acc=True, rescale_sum=True,
                             max_init=float("-inf"), guard_empty=True, subtract_max=True, alpha_inverted=False,
                             stale_max=False, exp2=False, normalise=True, full_tiles_only=False,
                             dtype=torch.float32):
    """softmax(scores, -1) @ values, walking the keys `tile` at a time with a running max m, running sum l
    and rescaled accumulator acc. The keyword arguments plant the classic mistakes, for the checks' hints:
    rescale_acc / rescale_sum False (a raised max not applied to acc / l), max_init 0.0 (m starts at 0),
    guard_empty False (exp(-inf - -inf) = NaN while a row's tiles so far are masked), subtract_max False
    (p = exp(s): overflows once a score passes ~88), alpha_inverted (exp(m_new - m_old)), stale_max
    (p = exp(s - m_old), the max before this tile), exp2 (2**x for e**x), normalise False (acc, not acc / l),
    full_tiles_only (a partial last tile left out), dtype (the arithmetic in fp16 or bf16)."""
    rows, num_keys = scores.shape
    m = torch.full((rows,), max_init, dtype=dtype)
    l = torch.zeros(rows, dtype=dtype)
    acc = torch.zeros(rows, values.shape[1], dtype=dtype)
    exp = torch.exp2 if exp2 else torch.exp
    stop = num_keys - num_keys % tile if full_tiles_only else num_keys
    for start in range(0, stop, tile):
        s = scores[:, start:start + tile].to(dtype)
        v = values[start:start + tile].to(dtype)
        if not subtract_max:
            p = exp(s)
            l, acc = l + p.sum(dim=1), acc + p @ v
            continue
        m_new = torch.maximum(m, s.max(dim=1).values)
        # A row whose tiles so far are all masked has m_new = -inf: exp(-inf - -inf) would be NaN.
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new) if guard_empty else m_new
        alpha = exp(m_use - m) if alpha_inverted else exp(m - m_use)     # inverted: inf at the first tile
        m_p = torch.where(torch.isinf(m), m_use, m) if stale_max else m_use
        p = exp(s - m_p[:, None])
        l = (l * alpha if rescale_sum else l) + p.sum(dim=1)
        acc = (acc * alpha[:, None] if rescale_acc else acc) + p @ v
        m = m_new
    return (acc / l[:, None] if normalise else acc).float()


def tile_average_softmax(scores, values, tile: int):
    """A planted mistake (for the hints): each tile's own softmax @ values, then the mean over the tiles."""
    outs = []
    for start in range(0, scores.shape[1], tile):
        s = scores[:, start:start + tile].float()
        outs.append(torch.nan_to_num(torch.softmax(s, dim=-1)) @ values[start:start + tile].float())
    return sum(outs) / len(outs)


SOFTMAX_ROWS = ("random scores", "scores whose maximum rises from tile to tile", "scores all near -1000",
                "random scores", "scores in the hundreds")
BIG_SCORE = 150.0       # row 4's scores sit 150 to 400 above 0: exp(s) overflows fp32 past s ~ 88.7


def _softmax_cases(gen):
    """(name, scores [R, T], values [T, D], tile) with every row having at least one visible key: random scores
    (row 0, a fully masked middle tile where it has one), a max that rises tile after tile (1), scores near -1000
    (2: exp(s) underflows), the first two tiles fully masked (3), scores in the hundreds (4: exp(s) overflows)."""
    cases = []
    for tile in (1, 3, 64):
        for num_keys in (1, 7, 50) if tile != 64 else (50, 64, 70):
            rows, d = len(SOFTMAX_ROWS), 6            # d != rows: a transposed answer has the wrong shape
            s = torch.randn(rows, num_keys, generator=gen) * 3
            s[1] += torch.linspace(0, 12, num_keys)              # the max rises tile after tile
            s[2] -= 1000.0                                        # far below 0: exp(s) underflows
            s[4] = s[4] * 30 + BIG_SCORE + 250 * torch.rand(1, generator=gen)   # far above 0: exp(s) overflows
            if num_keys > 2 * tile:
                s[3, :2 * tile] = float("-inf")                   # the first two tiles fully masked
            if num_keys > 3 * tile + 1:
                s[0, tile:2 * tile] = float("-inf")               # a fully masked middle tile
            v = torch.randn(num_keys, d, generator=gen)
            cases.append((f"tile {tile}, {num_keys} keys", s, v, tile))
    return cases


_NO_MAX_HINT = ("subtract the running max before exp: p = exp(s - m). exp(s) itself overflows fp32 once a score "
                "passes ~88 (inf / inf = NaN: a kernel's scores are that large once q and k are) and underflows to 0 "
                "near -1000 (0 / 0)")
_SOFTMAX_MISTAKES = [     # (reference_online_softmax flags, or a function, hint); the first that explains every case
    (dict(subtract_max=False), _NO_MAX_HINT),
    (dict(rescale_acc=False, rescale_sum=False), "when a tile raises the running max from m to m', multiply the "
     "running sum l and the accumulator acc by alpha = exp(m - m') before adding the new tile; compute alpha with "
     "the OLD m (after m = m' it is exp(0) = 1)"),
    (dict(rescale_acc=False), "the accumulator must be rescaled too: acc = acc * exp(m - m') + p @ v"),
    (dict(rescale_sum=False), "the running sum must be rescaled too: l = l * exp(m - m') + sum(p)"),
    (dict(alpha_inverted=True), "the rescale factor is exp(m_old - m_new), at most 1 (the old terms shrink against "
     "the new max); you used exp(m_new - m_old)"),
    (dict(stale_max=True), "p = exp(s - m_new), with the running max that includes this tile: l and acc, once "
     "rescaled by exp(m_old - m_new), are relative to m_new, so the tile's terms must be too"),
    (dict(max_init=0.0), "start the running max at -inf, not 0: with m = 0, exp(s - m) underflows to 0 for scores "
     "near -1000, l stays 0 and acc / l is 0 / 0"),
    (dict(guard_empty=False), "while every key so far is masked the running max is still -inf, and "
     "exp(-inf - (-inf)) is NaN: subtract 0 instead of the max for such rows (their p and alpha are then exactly 0)"),
    (dict(exp2=True), "torch.exp2(x) is 2**x: use torch.exp (or multiply the scores by log2(e) before exp2)"),
    (dict(normalise=False), "return acc / l: acc alone is the sum of exp(s - m) * v, not yet divided by the sum of "
     "the weights"),
    (dict(full_tiles_only=True), "the last tile may be partial (num_keys not a multiple of tile): loop over "
     "range(0, num_keys, tile); the slice scores[:, start:start + tile] stops at the end by itself"),
    (tile_average_softmax, "each tile's softmax was averaged over the tiles: a tile's result must be weighted by its "
     "share of the whole row's exp-sum, which is what the running max m and the running sum l keep"),
]


def _softmax_mistake(results) -> str | None:
    """The hint of the planted mistake that gives the student's output in every case of this call."""
    for planted, hint in _SOFTMAX_MISTAKES:
        try:
            if all(torch.allclose(got, planted(scores, values, tile) if callable(planted) else
                                  reference_online_softmax(scores, values, tile, **planted),
                                  rtol=1e-5, atol=1e-5, equal_nan=True)
                   for _, scores, values, tile, got in results):
                return hint
        except RuntimeError:
            continue
    # right to 1-3 digits where the scores are of order 1, not to 1e-5: the precision of fp16 (11 bits) or bf16
    # (8 bits); where they are near -1000 or in the hundreds, rounding the scores themselves moves the weights
    rows = [0, 3]         # random scores of order 3: bf16 rounds them by up to 0.03, and the weights by as much
    if all(torch.allclose(got[rows], (torch.softmax(scores, dim=-1) @ values)[rows], rtol=0.1, atol=0.1)
           for _, scores, values, tile, got in results):
        return ("your output is right to 1-3 digits only, the precision of fp16 or bf16 arithmetic: keep the scores, "
                "m, l and acc in fp32 (the engine's kernel does the same with bf16 inputs)")
    return None


def check_online_softmax(fn) -> None:
    tag = "E6.2"
    gen = fresh_generator()
    results, first_bad = [], None
    for where, scores, values, tile in _softmax_cases(gen):
        expected = torch.softmax(scores, dim=-1) @ values
        before = (scores.clone(), values.clone())
        got = call_student(tag, fn, scores, values, tile)
        if not (torch.equal(scores, before[0]) and torch.equal(values, before[1])):
            fail(tag, f"online_softmax changed its inputs [{where}]", "it only reads scores and values")
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != torch.float32:
            check_close(tag, got, expected, rtol=1e-5, atol=1e-5, what=f"output [{where}]",
                        hint="return softmax(scores) @ values: [rows, D], fp32")
        results.append((where, scores, values, tile, got))
        bad = ~torch.isclose(got, expected, rtol=1e-5, atol=1e-5)
        if bad.any() and first_bad is None:
            first_bad = (where, scores, got, expected, int(bad.nonzero()[0][0]))
    if first_bad is None:
        ok(tag)
        return
    where, scores, got, expected, row = first_bad
    kind = SOFTMAX_ROWS[row]
    if row == 0 and torch.isinf(scores[0]).any():
        kind += " with a fully masked middle tile"
    if row == 3 and torch.isinf(scores[3]).any():
        kind += ", first two tiles fully masked"
    what = f"row {row} ({kind}) [{where}]"
    hint = _softmax_mistake(results)
    if torch.isnan(got[row]).any() or torch.isinf(got[row]).any():
        if hint is None:
            hint = (_NO_MAX_HINT if row in (2, 4) else "while every key so far is masked the running max is still "
                    "-inf, and exp(-inf - (-inf)) is NaN: subtract 0 instead of the max for such rows (their p and "
                    "alpha are then exactly 0)")
        fail(tag, f"{'NaN' if torch.isnan(got[row]).any() else 'inf'} in {what}", hint)
    fail(tag, f"output differs from softmax(scores) @ values in {what}: got {got[row, 0].item():.6g}, expected "
              f"{expected[row, 0].item():.6g} (first column; tolerance rtol = atol = 1e-5)",
         hint or "keep, per row, m (max so far), l (sum of exp(s - m)) and acc (sum of exp(s - m) * v); fold each "
                 "tile in, rescaling l and acc by exp(m_old - m_new); return acc / l")


# == E6.3 paged decode ======================================================================================

def make_paged_batch(gen, num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype=torch.float32,
                     share_block=True, device="cpu"):
    """Chapter 04's decode inputs (`ch04.make_paged_batch`: a paged cache full of random values, scattered
    blocks, tables padded with -1; the first two sequences share their first block when both fill one),
    moved to `device`. Callers put the longest sequence last, so its table has no padding and reading a table
    past a context runs off the end of the tensor."""
    from nanovllm_course.ch04 import make_paged_batch as paged_batch
    tensors = paged_batch(gen, len(context_lens), num_heads, num_kv_heads, head_dim, block_size, context_lens,
                          dtype, share_prefix=share_block)
    return [t.to(device) for t in tensors]


def _decode_cases(gen):
    """(block_size, group, num_kv_heads, head_dim, dtype, context_lens): contexts 1, B, B + 1 in every case."""
    extra = lambda bs, hi: int(torch.randint(bs + 2, hi + 1, (1,), generator=gen))  # noqa: E731
    return [
        (1, 1, 2, 16, torch.float32, [1, 1, 2, extra(1, 15)]),   # last tile runs past the table
        (4, 2, 2, 24, torch.float32, [1, 4, 5, extra(4, 21)]),
        (16, 8, 1, 16, torch.float32, [1, 16, 17, extra(16, 40)]),
        (17, 3, 2, 32, torch.float32, [1, 17, 18, extra(17, 40)]),
        (4, 4, 2, 16, torch.bfloat16, [1, 4, 5, extra(4, 30)]),
    ]


def _tiled_variant(q, k_cache, v_cache, block_tables, context_lens, scale, block_n, **flags):
    """A one-pass tiled decode in PyTorch with planted mistakes: flags of reference_online_softmax plus
    zero_score_padding (keys past the context in the last tile count with score 0 and value 0)."""
    pad = flags.pop("zero_score_padding", False)
    B, H, D = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = H // hkv
    out = torch.empty(B, H, D)
    for b in range(B):
        n = int(context_lens[b])
        pos = torch.arange(n)
        rows = block_tables[b].long()[pos // bs].cpu() * bs + pos % bs
        k = k_cache.reshape(-1, hkv, D).cpu().float()[rows]
        v = v_cache.reshape(-1, hkv, D).cpu().float()[rows]
        total = -(-n // block_n) * block_n if pad else n
        for h in range(H):
            s = (k[:, h // group] @ q[b, h].cpu().float()) * scale
            vv = v[:, h // group]
            if total > n:
                s = torch.cat([s, torch.zeros(total - n)])
                vv = torch.cat([vv, torch.zeros(total - n, D)])
            out[b, h] = reference_online_softmax(s[None], vv, block_n, **flags)[0]
    return out.to(q.dtype)


def _decode_hint(got, q, kc, vc, bt, cl, scale, rtol, atol):
    """The hint of the planted mistake whose output equals `got`, else a generic one."""
    H, hkv = q.shape[1], kc.shape[2]
    g = got.float().cpu()

    def same(x):
        return torch.allclose(g, x.float().cpu(), rtol=rtol, atol=atol)
    if same(torch_backend.paged_decode(q, vc, kc, bt, cl, scale)):
        return "keys come from k_cache and values from v_cache: did you swap them?"
    if same(torch_backend.paged_decode(q, kc, vc, bt, cl, 1.0)):
        return "multiply the scores q . k by `scale` before the softmax (scale = head_dim ** -0.5)"
    packed = _read_with_strides(q, (q.shape[1] * q.shape[2], q.shape[2], 1))
    if not q.is_contiguous() and packed is not None and same(torch_backend.paged_decode(packed, kc, vc, bt, cl, scale)):
        return (f"q is a strided view (strides {tuple(q.stride())}): address it with stride_qb and stride_qh, not as "
                "a contiguous [B, H, D] tensor (and not with the output's strides)")
    if same(torch_backend.paged_decode(q, kc, vc, bt, cl, scale * math.log2(math.e))) or same(
            torch_backend.paged_decode(q, kc, vc, bt, cl, scale / math.log2(math.e))):
        return "tl.exp2(x) is 2**x: either use tl.exp, or multiply the scores by log2(e) before exp2"
    if hkv != H:
        idx = torch.arange(H, device=q.device) % hkv
        perm = torch.cat([torch.nonzero(idx == j).flatten() for j in range(hkv)])
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(H, device=q.device)
        if same(torch_backend.paged_decode(q[:, perm], kc, vc, bt, cl, scale)[:, inv]):
            return (f"program (seq, kv_head) owns query heads kv_head * {H // hkv} ... kv_head * {H // hkv} + "
                    f"{H // hkv - 1}: query head h uses KV head h // (H / Hkv), not h % Hkv")
    for block_n in (16, 32, 64):
        for flags, why in (
                (dict(zero_score_padding=True), "keys past context_len in the last tile must not count: set their "
                 "scores to -inf with tl.where (a masked load gives k = 0, a score of 0, which still gets the weight "
                 "exp(0 - m) in the sum)"),
                (dict(rescale_acc=False, rescale_sum=False), "when a tile raises the running max from m to m', "
                 "rescale l and acc by exp(m - m') (see E6.2)"),
                (dict(rescale_acc=False), "rescale the accumulator too: acc = acc * alpha[:, None] + p @ v"),
                (dict(rescale_sum=False), "rescale the running sum too: l = l * alpha + sum(p)")):
            if same(_tiled_variant(q, kc, vc, bt, cl, scale, block_n, **flags)):
                return why
    return ("softmax(scale * q . k) @ v over the first context_lens[b] keys of sequence b, found through its "
            "block table: key t is row block_tables[b, t // block_size] * block_size + t % block_size")


def _decode_oob_hint(kind, name, where, watch=None):
    if name == "block_tables":
        return ("positions past context_len have no block (their table entry is -1 padding, or past the end of "
                "the row): load block_tables[b, pos // block_size] with mask=pos < context_len")
    if name in ("k_cache", "v_cache"):
        return ("mask the K/V loads with (pos < context_len) & (d < head_dim): masked-off positions have no "
                "valid block, so their addresses point anywhere")
    if name == "q":
        return "mask the query load with (g < GROUP) & (d < head_dim): BLOCK_G and BLOCK_D are padded"
    if kind == "wrote":
        return ("store only the real lanes: rows g < GROUP (the query heads of this KV head) and d < HEAD_DIM; "
                "BLOCK_G and BLOCK_D are padded to powers of two >= 16")
    return "mask every load and store: padded lanes (BLOCK_G > GROUP, BLOCK_D > head_dim) must not touch memory"


_DECODE_INT64_HINT = ("block ids times the cache's block stride pass 2**31 elements in a large cache: compute "
                      "the row offsets in int64 (block = tl.load(...).to(tl.int64) before multiplying by stride_cb)")


def _decode_tolerance(dtype, large=False) -> tuple[float, float]:
    """(rtol = atol, bound on the relative error norm) of E6.3 / E6.4: fp32 1e-4 and 1e-5; bf16 2e-2 and 8e-3. With
    scores in the hundreds (`large`) fp32 is looser, 1e-3 and 1e-4: a score of 300 carries an absolute rounding
    error of ~1e-4 (fp32 keeps 7 digits), which exp turns into a relative error of the weights that size."""
    if dtype != torch.float32:
        return 2e-2, 8e-3
    return (1e-3, 1e-4) if large else (1e-4, 1e-5)


def _compare_decode(tag, got, expected, where, dtype, hint_fn, nan_hint=None, large=False):
    rtol, rel_bound = _decode_tolerance(dtype, large)
    atol = rtol
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
        check_close(tag, got, expected, rtol=rtol, atol=atol, what=f"output [{where}]",
                    hint="return a new [num_seqs, num_heads, head_dim] tensor in q's dtype")
    g, e = got.float().cpu(), expected.float().cpu()
    if torch.isnan(g).any():
        b, h = (int(i) for i in torch.isnan(g).nonzero()[0][:2])
        fail(tag, f"NaN in sequence {b}, query head {h} [{where}]", nan_hint() if nan_hint else
             "a padded query row (g >= GROUP) or a tile with no valid key makes 0 / 0 or -inf - -inf; and a masked "
             "load without other= reads garbage (NaN here) that 0 * NaN carries into tl.dot: give the K and V "
             "loads other=0.0")
    bad = (g - e).abs() > atol + rtol * e.abs()
    rel = ((g - e).norm() / e.norm().clamp_min(1e-12)).item()
    if bad.any() or rel > rel_bound:
        b, h = (int(i) for i in (bad.nonzero()[0][:2] if bad.any() else ((g - e).abs().flatten(1).amax(1).argmax(), 0)))
        fail(tag, f"output differs from the reference for sequence {b}, query head {h} (relative error norm "
                  f"{rel:.1e}; tolerance rtol = atol = {rtol:g}, norm <= {rel_bound:g}) [{where}]", hint_fn())


# Block ids pushed past 2**31 elements of the cache (MemoryWatch.shifts; Triton kernels, interpreted).
_DECODE_BIG_CASE = (4, 2, 2, 16, torch.float32)


def _large_scores(gen, q, kc, offsets):
    """Move the scores of sequence b to about offsets[b] (hundreds, either sign), their spread about 10: every key
    of KV head j gets c * u_j (u_j a random unit vector), and each query head of it its own part along u_j
    replaced by offsets[b] / (scale * c) * u_j, so q . k * scale = offsets[b] + the usual random part. In place."""
    B, H, D = q.shape
    hkv = kc.shape[2]
    scale = D ** -0.5
    u = torch.randn(hkv, D, generator=gen).to(q.device)
    u = (u / u.norm(dim=-1, keepdim=True)).repeat_interleave(H // hkv, 0)          # [H, D]: each query head's u
    c = (max(abs(o) for o in offsets) / scale) ** 0.5                              # keys are shared: one c
    qf = q.float()
    for b, offset in enumerate(offsets):
        along = (qf[b] * u).sum(-1, keepdim=True)
        qf[b] = qf[b] - along * u + offset / (scale * c) * u
    kc.copy_((kc.float() + c * u[::H // hkv]).to(kc.dtype))
    q.copy_(qf.to(q.dtype))


def _decode_inputs(gen, case, device, *, q_view=False, big=False, offsets=None):
    """One decode batch: (q, k_cache, v_cache, block tables given to the kernel, context_lens, the real block
    tables, the block id offset). `q_view`: q is a strided view (as a query sliced from a wider tensor);
    `big`: the tables hold block ids pushed by an offset whose rows start past 2**31 elements; `offsets`: the
    scores of sequence b sit near offsets[b] (`_large_scores`)."""
    bs, group, hkv, d, dtype, lens = case
    H = group * hkv
    q, kc, vc, bt, cl = make_paged_batch(gen, H, hkv, d, bs, lens, dtype, device=device)
    if offsets is not None:
        _large_scores(gen, q, kc, offsets)
    if q_view:
        wide = torch.randn(q.shape[0], 2 * H * d, generator=gen).to(dtype).to(device)
        wide[:, :H * d] = q.flatten(1)
        q = wide[:, :H * d].view(q.shape)
    first = -(-INT32_LIMIT // kc.stride(0)) if big else 0
    given = torch.where(bt >= 0, bt + first, bt)
    q, kc, vc, given, cl = (isolated(gen, t) for t in (q, kc, vc, given, cl))
    return q, kc, vc, given, cl, bt, first


def _decode_where(case, first, q, extra="", offsets=None):
    bs, group, hkv, d, dtype, lens = case
    return (f"{extra}block_size {bs}, {group * hkv} query heads / {hkv} KV heads, head_dim {d}, context_lens {lens}, "
            f"{str(dtype).replace('torch.', '')}" + ("" if q.is_contiguous() else f", q a strided view (strides "
                                                      f"{tuple(q.stride())})")
            + (f", scores in the hundreds (each sequence's near {offsets})" if offsets else "")
            + (f", block ids from {first} on (rows past 2**31 elements)" if first else ""))


def _run_decode(tag, fn, args, named, first, where, shift_elems):
    msg = ((lambda kind, count: f"with block ids from {first} on (rows past 2**31 elements) your kernel {kind} "
                                f"{count} element(s) outside every tensor it was given: its offsets wrapped "
                                f"around [{where}]") if first else None)
    with watch_memory(named, shifts={"k_cache": shift_elems, "v_cache": shift_elems}) as watch:
        got = _run_kernel(tag, fn, args, watch, (lambda *a: _DECODE_INT64_HINT) if first else _decode_oob_hint, msg)
    return got, watch


def _large_cases(gen):
    """E6.3 / E6.4's cases with scores in the hundreds: (case, offsets), the offsets of the sequences' scores
    alternating in sign (far above 0: exp(s) overflows fp32; far below 0: exp(s) underflows to 0)."""
    def offsets(n, first_sign):
        mags = (150 + 250 * torch.rand(n, generator=gen)).tolist()
        return [round(m) * (first_sign if i % 2 == 0 else -first_sign) for i, m in enumerate(mags)]
    extra = lambda bs, hi: int(torch.randint(bs + 2, hi + 1, (1,), generator=gen))  # noqa: E731
    return [((4, 2, 2, 24, torch.float32, [1, 5, 17, extra(4, 40)]), offsets(4, 1)),
            ((16, 4, 2, 16, torch.bfloat16, [1, 16, 17, extra(16, 40)]), offsets(4, -1))]


def _large_hint(got, offsets, split=False) -> str:
    """The hint for NaN or inf with scores in the hundreds: which sign of offset broke says which mistake."""
    bad = [b for b in range(got.shape[0]) if not torch.isfinite(got[b].float()).all()]
    merge = (" Merge the splits with exp(lse_s - M), M = max_s lse_s: exp(lse_s) alone overflows the same way."
             if split else "")
    if bad and all(offsets[b] < 0 for b in bad):
        return ("with scores far below 0 (about " + f"{offsets[bad[0]]}" + ") every exp(s - m) underflowed to 0, so "
                "l = 0 and acc / l = 0 / 0: start the running max m at -inf, not 0, so that the first tile sets it "
                "to its own max" + merge)
    return ("with scores in the hundreds exp(s) overflows fp32 (it is inf past s ~ 88.7; inf / inf = NaN) and far "
            "below 0 it underflows to 0 (0 / 0): subtract the running max before exp, p = exp(s - m_new), and "
            "rescale l and acc by exp(m_old - m_new) when the max rises (E6.2)" + merge)


def _decode_runs(gen, cases):
    """(case, q_view, is_big, offsets) for E6.3: the usual cases, q a strided view in the second, the cases with
    scores in the hundreds, and the one with block ids past 2**31 elements last."""
    extra = int(torch.randint(6, 22, (1,), generator=gen))
    return ([(c, i == 1, False, None) for i, c in enumerate(cases)]
            + [(c, False, False, o) for c, o in _large_cases(gen)]
            + [((*_DECODE_BIG_CASE, [1, 4, 5, extra]), False, True, None)])


def check_paged_decode(fn) -> None:
    tag = "E6.3"
    gen = fresh_generator()
    device = kernel_device()
    launched = True
    for case, q_view, is_big, offsets in _decode_runs(gen, _decode_cases(gen)):
        if is_big and not (launched and shifts_supported()):
            continue
        q, kc, vc, bt, cl, real_bt, first = _decode_inputs(gen, case, device, q_view=q_view, big=is_big,
                                                           offsets=offsets)
        scale = case[3] ** -0.5
        expected = torch_backend.paged_decode(q, kc, vc, real_bt, cl, scale)
        saved = [t.clone() for t in (q, kc, vc, bt, cl)]
        where = _decode_where(case, first, q, offsets=offsets)
        got, watch = _run_decode(tag, fn, (q, kc, vc, bt, cl, scale),
                                 {"q": q, "k_cache": kc, "v_cache": vc, "block_tables": bt, "context_lens": cl},
                                 first, where, first * kc.stride(0))
        launched = launched and watch.launched
        for name, before, after in zip(("q", "k_cache", "v_cache", "block_tables", "context_lens"),
                                       saved, (q, kc, vc, bt, cl)):
            if not torch.equal(before, after):
                fail(tag, f"paged_decode changed its input {name} [{where}]", "decode attention only reads")
        dtype = case[4]
        rtol = atol = _decode_tolerance(dtype, offsets is not None)[0]
        _compare_decode(tag, got, expected, where, dtype,
                        (lambda: _DECODE_INT64_HINT) if first else
                        lambda: _decode_hint(got, q, kc, vc, real_bt, cl, scale, rtol, atol),
                        nan_hint=(lambda: _large_hint(got, offsets)) if offsets is not None else None,
                        large=offsets is not None)
    ok(tag)


# == E6.4 split-KV decode ===================================================================================

SPLITS = (1, 2, 3, 5)


def reference_split_variant(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, block_n=16, *,
                            merge="lse", empty="skip", tiles="ceil", splits_merged=None):
    """Split-KV decode in PyTorch, split s owning tiles [s * c, (s + 1) * c) of block_n keys, with planted
    mistakes for the checks' hints: merge "lse" (right), "mean" (a plain average of the splits that have
    keys), "unnormalised" (sum of exp(lse_s - M) * o_s, not divided by the sum of the weights); empty "skip"
    (right: weight 0), "nan" (o = acc / l with l = 0, lse = -inf), "weight" (lse = 0: an empty split weighs
    in with o = 0); tiles "ceil" (right: c = cdiv(T, S)) or "floor" (c = T // S: the last tiles dropped);
    splits_merged: how many splits the merge reads (None: all of them; num_splits - 1: the last one lost);
    merge "no_max" (weights exp(lse_s) / sum exp(lse_s), M not subtracted: overflows for scores in the hundreds)."""
    B, H, D = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = H // hkv
    out = torch.empty(B, H, D)
    for b in range(B):
        n = int(context_lens[b])
        pos = torch.arange(n)
        rows = block_tables[b].long().cpu()[pos // bs] * bs + pos % bs
        k = k_cache.reshape(-1, hkv, D).cpu().float()[rows].repeat_interleave(group, 1)      # [n, H, D]
        v = v_cache.reshape(-1, hkv, D).cpu().float()[rows].repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[b].cpu().float(), k) * scale                   # [H, n]
        num_tiles = -(-n // block_n)
        per = (-(-num_tiles // num_splits) if tiles == "ceil" else num_tiles // num_splits) * block_n
        parts, lses = [], []
        for split in range(num_splits if splits_merged is None else max(1, splits_merged)):
            lo, hi = split * per, min((split + 1) * per, n)
            if lo < hi:
                p = torch.softmax(scores[:, lo:hi], dim=-1)
                parts.append(torch.einsum("ht,thd->hd", p, v[lo:hi]))
                lses.append(torch.logsumexp(scores[:, lo:hi], dim=-1))
            elif empty != "skip":
                parts.append(torch.full((H, D), float("nan")) if empty == "nan" else torch.zeros(H, D))
                lses.append(torch.full((H,), float("-inf")) if empty == "nan" else torch.zeros(H))
        if not parts:
            out[b] = float("nan")
            continue
        o, lse = torch.stack(parts), torch.stack(lses)                                        # [S, H, D], [S, H]
        if merge == "mean":
            out[b] = o.mean(0)
            continue
        w = torch.exp(lse) if merge == "no_max" else torch.exp(lse - lse.max(0).values)
        total = (w[..., None] * o).sum(0)
        out[b] = total if merge == "unnormalised" else total / w.sum(0)[..., None]
    return out.to(q.dtype)


_SPLIT_VARIANTS = [
    (dict(empty="nan"), "a split with no key (a short sequence, more splits than tiles) has l = 0: acc / l is "
                        "0 / 0 = NaN; store o = 0 and lse = -inf for it (weight 0 in the merge)"),
    (dict(empty="weight"), "a split with no key must weigh nothing in the merge: its lse is -inf (not 0 or m), "
                           "so exp(lse - M) = 0"),
    (dict(merge="mean"), "merge with the log-sum-exp of each split, not a plain average: out = sum_s exp(lse_s - M) "
                         "* o_s / sum_s exp(lse_s - M), M = max_s lse_s, where o_s is split s's normalised output"),
    (dict(merge="unnormalised"), "divide the merged sum by the sum of the weights, sum_s exp(lse_s - M): each o_s "
                                 "is normalised within its split, the weights are not"),
    (dict(tiles="floor"), "split s owns tiles [s * c, (s + 1) * c) with c = cdiv(num_tiles, num_splits), rounded "
                          "UP: with c = num_tiles // num_splits the last tiles belong to no split"),
    ("drop_last", "the merge must read every split, s = 0 .. num_splits - 1 (BLOCK_S >= num_splits, masked with "
                  "s < num_splits): the last split's keys are missing from your output"),
]


def _split_hint(got, args, num_splits, watch, rtol, atol):
    """The hint of the planted split-KV mistake whose output equals `got`, else a generic one."""
    g = got.float().cpu()
    if watch.launched and interpreting() and not watch.wrote_into(got):
        return ("no kernel stored into the tensor your launcher returned: the merge kernel writes out[b, h, :] "
                "for every (sequence, query head)")
    for block_n in (16, 32, 64):
        for flags, why in _SPLIT_VARIANTS:
            if flags == "drop_last":
                if num_splits == 1:
                    continue
                flags = dict(splits_merged=num_splits - 1)
            wrong = reference_split_variant(*args, num_splits, block_n, **flags).float()
            if torch.allclose(g, wrong, rtol=rtol, atol=atol, equal_nan=True):
                return why
    if torch.isnan(g).any():
        return _SPLIT_VARIANTS[0][1]
    return ("merge with the log-sum-exp of each split: out = sum_s exp(lse_s - M) * o_s / sum_s exp(lse_s - M), "
            "M = max_s lse_s, where o_s is split s's normalised output")


def check_split_decode(fn) -> None:
    """fn(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits) -> [B, H, D]."""
    tag = "E6.4"
    gen = fresh_generator()
    device = kernel_device()
    cases = []
    for i, case in enumerate(_decode_cases(gen)[1:4]):
        for num_splits in (1, SPLITS[i + 1] if i < 2 else SPLITS[3]):
            # Two longer sequences with num_splits + 1 tiles of 16 and of 64 keys: splits that must share the
            # tiles unevenly (a rounding-down split size drops the last tile there).
            r = int(torch.randint(1, 16, (1,), generator=gen))
            lens = case[5] + [16 * max(num_splits, 2) + r, 64 * max(num_splits, 2) + r]
            cases.append(((*case[:5], lens), num_splits, i == 0, False, None))
    for case, offsets in _large_cases(gen):          # scores in the hundreds, every split with keys in the long ones
        r = int(torch.randint(1, 16, (1,), generator=gen))
        lens = case[5][:2] + [48 + r, 192 + r]
        cases.append(((*case[:5], lens), 3, False, False, offsets))
    extra = int(torch.randint(6, 22, (1,), generator=gen))
    cases.append(((*_DECODE_BIG_CASE, [1, 4, 5, extra]), 3, False, True, None))
    launched = True
    for case, num_splits, q_view, is_big, offsets in cases:
        if is_big and not (launched and shifts_supported()):
            continue
        q, kc, vc, bt, cl, real_bt, first = _decode_inputs(gen, case, device, q_view=q_view, big=is_big,
                                                           offsets=offsets)
        scale = case[3] ** -0.5
        expected = torch_backend.paged_decode(q, kc, vc, real_bt, cl, scale)
        where = _decode_where(case, first, q, f"{num_splits} split(s), ", offsets=offsets)
        got, watch = _run_decode(tag, fn, (q, kc, vc, bt, cl, scale, num_splits),
                                 {"q": q, "k_cache": kc, "v_cache": vc, "block_tables": bt, "context_lens": cl},
                                 first, where, first * kc.stride(0))
        launched = launched and watch.launched
        dtype = case[4]
        rtol = atol = _decode_tolerance(dtype, offsets is not None)[0]
        args = (q, kc, vc, real_bt, cl, scale)
        hint = (lambda: _DECODE_INT64_HINT) if first else \
            (lambda: _split_hint(got, args, num_splits, watch, rtol, atol))
        _compare_decode(tag, got, expected, where, dtype, hint, large=offsets is not None,
                        nan_hint=(lambda: _large_hint(got, offsets, split=True)) if offsets is not None else hint)
    ok(tag)


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402
from nanovllm_course import export as _export  # noqa: E402

# the references are the engine's PyTorch functions (fast on a CPU); reference_triton_* are its kernels
EXERCISES = exercises(
    Exercise("E6.1", check_store_kvcache, ("store_kvcache",), (reference_store_kvcache,), parts=(
        EnginePart("store_kvcache", "store_kvcache", "E6.1", triton=True,
                   check=lambda mod: check_store_kvcache(mod.store_kvcache)),)),
    Exercise("E6.2", check_online_softmax, ("online_softmax",), (reference_online_softmax,)),
    Exercise("E6.3", check_paged_decode, ("paged_decode",), (reference_torch_paged_decode,), parts=(
        EnginePart("paged_decode", "attention_backend", "E6.3", adapter=_export.torch_backend_with_decode, triton=True,
                   check=lambda mod: check_paged_decode(mod.paged_decode)),)),
    Exercise("E6.4", check_split_decode, ("paged_decode_split",), (reference_triton_paged_decode,), optional=True),
)
PARTS = parts_of(EXERCISES)
