"""Checks for chapter 04: the KV cache, block tables and paged attention.

- `check_slot_mapping(fn)` (E4.1): fn(block_table, start, end, block_size) -> the cache slot of every
  position in [start, end); compared with what the engine's `nanovllm_ref.engine.inputs.prepare_prefill` computes.
- `check_paged_decode(fn)` (E4.2): fn(q, k_cache, v_cache, block_tables, context_lens, scale) compared with
  `nanovllm_ref.attn.torch_backend.paged_decode` (fp32 atol 1e-5 / rtol 1e-4; bf16 atol 2e-2 / rtol 2e-2).
  One bf16 case has long contexts and large scores, where computing in bf16 instead of fp32 misses the
  tolerance (see LARGE_Q_STD).
- `check_store_kvcache(fn)` (E4.3): fn(key, value, k_cache, v_cache, slot_mapping) writes in place; the
  caches must equal the ones `nanovllm_ref.layers.attention.store_kvcache_torch` produces, bit for bit. Slot 0
  is written in every case, with padding rows (-1) before and after it (`edge_slots`); key and value come in
  different layouts; the inputs must come back unchanged.

Every check draws fresh random inputs on each call and prints `E4.n ok` and nothing else on success.
The `reference_*` functions are the reference answers, for later sections of the notebook and for tests.
"""
import random

import torch

from nanovllm_ref.attn import torch_backend
from nanovllm_course.common import call_student, check_close, check_unchanged, fail, fresh_generator, ok
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.layers.attention import store_kvcache_torch
from nanovllm_ref.engine.inputs import prepare_decode, prepare_prefill

# -- why a KV cache: a FLOP count ---------------------------------------------------------------------------

# Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B).
QWEN3_0_6B = dict(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151_936)


def forward_flops(num_new: int, num_cached: int, spec: dict = QWEN3_0_6B) -> int:
    """Multiply-add FLOPs (2 per MAC) of one forward over `num_new` tokens that follow `num_cached` tokens
    whose K/V is already known, ending in the logits of the last token. Linear layers cost 2 * params per
    token; attention costs 4 * context * heads * head_dim per token and layer (q.k and p.v); the LM head
    runs for one token. Norms, RoPE and softmax are ignored (a few percent)."""
    L, d, H, Hkv, D, I, V = (spec[k] for k in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                "intermediate", "vocab"))
    per_layer_params = d * (H + 2 * Hkv) * D + H * D * d + 3 * d * I
    linear = 2 * num_new * L * per_layer_params
    contexts = sum(range(num_cached + 1, num_cached + num_new + 1))        # token i sees i + 1 keys
    attention = 4 * L * H * D * contexts
    return linear + attention + 2 * d * V


def generation_flops(prompt_len: int, new_tokens: int, cached: bool, spec: dict = QWEN3_0_6B) -> list[int]:
    """Cumulative FLOPs after each of `new_tokens` generated tokens. Without a cache every step runs the
    whole sequence again; with one, the prompt runs once and each later step runs one token."""
    total, out = 0, []
    for k in range(new_tokens):
        if cached:
            total += forward_flops(prompt_len, 0, spec) if k == 0 else forward_flops(1, prompt_len + k - 1, spec)
        else:
            total += forward_flops(prompt_len + k, 0, spec)
        out.append(total)
    return out


reference_paged_decode = torch_backend.paged_decode
reference_store_kvcache = store_kvcache_torch

# -- E4.1 slot mapping ------------------------------------------------------------------------------------


def reference_slot_mapping(block_table, start: int, end: int, block_size: int) -> list[int]:
    """The slots the engine writes positions [start, end) to: what engine/inputs.py's prepare_prefill computes."""
    seq = Sequence(list(range(max(end, 1))), block_size)
    seq.block_table = list(block_table)
    seq.num_cached_tokens, seq.num_scheduled_tokens = start, end - start
    return prepare_prefill([seq], block_size, "cpu").metadata.slot_mapping.tolist()


def reference_decode_context(lengths: list[int], block_tables: list[list[int]], block_size: int) -> dict:
    """What the engine's prepare_decode (engine/inputs.py) gives the attention layers when sequences of these
    lengths (their last token not yet computed) decode one token: {"positions", "slot_mapping",
    "context_lens", "block_tables"} as Python lists (block tables padded with -1)."""
    seqs = []
    for n, table in zip(lengths, block_tables):
        seq = Sequence(list(range(n)), block_size)
        seq.block_table = list(table)
        seq.num_cached_tokens = n - 1
        seqs.append(seq)
    step = prepare_decode(seqs, block_size, "cpu")
    meta = step.metadata
    return {"positions": step.positions.tolist(), "slot_mapping": meta.slot_mapping.tolist(),
            "context_lens": meta.context_lens.tolist(), "block_tables": meta.block_tables.tolist()}


def _as_int_list(tag, value, what):
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point():
            fail(tag, f"{what} should be a 1-D integer tensor or a list of int, got a tensor of shape "
                      f"{tuple(value.shape)} and dtype {value.dtype}")
        return [int(x) for x in value.tolist()]
    if isinstance(value, (list, tuple, range)):
        if not all(isinstance(x, int) or (isinstance(x, torch.Tensor) and x.numel() == 1) for x in value):
            fail(tag, f"{what} should hold ints")
        return [int(x) for x in value]
    fail(tag, f"{what} should be a list of int (or a 1-D integer tensor), got {type(value).__name__}")


def _slot_hint(table, start, end, bs, got):
    """Name the mistake whose whole output equals `got` (the student's slots), if any."""
    n = len(table) * bs

    def variant(f):
        try:
            return [f(p) for p in range(start, end)]
        except IndexError:
            return None
    right = [table[p // bs] * bs + p % bs for p in range(start, end)]
    candidates = [
        (variant(lambda p: table[(p - start) // bs] * bs + (p - start) % bs),
         "use the absolute position p (start, start + 1, ...), not the index inside this chunk: the first "
         "`start` tokens are already in the cache"),
        (variant(lambda p: table[0] * bs + p if p < n else None),
         "did you wrap to the next block of the block table? Position p lives in block_table[p // "
         "block_size], at offset p % block_size"),
        (variant(lambda p: table[p // bs] + p % bs),
         "a block holds block_size slots: multiply the block id by block_size"),
        (list(range(start, end)),
         "the block table maps logical block p // block_size to a physical block id: look it up"),
        ([x + 1 for x in right], "off by one: position p sits at offset p % block_size (0-based) inside its block"),
        ([x - 1 for x in right], "off by one: position p sits at offset p % block_size (0-based) inside its block"),
    ]
    for slots, hint in candidates:
        if slots is not None and slots == got and slots != right:
            return hint
    return "slot(p) = block_table[p // block_size] * block_size + p % block_size"


def _slot_cases(rng: random.Random):
    """(block_size, num_tokens, start, end) covering full prefills, decodes, chunks and block boundaries."""
    cases = []
    for bs in (1, 4, 16, rng.choice([3, 5, 7])):
        n = rng.randint(1, 4 * bs + 3)
        cases.append((bs, n, 0, n))                              # whole prompt
        cases.append((bs, n, n - 1, n))                          # one decode token
        s = rng.randint(0, n)
        cases.append((bs, n, s, rng.randint(s, n)))              # a chunk (possibly empty)
        k = rng.randint(1, 3)
        cases.append((bs, k * bs + 1, k * bs, k * bs + 1))       # first token of a new block
        cases.append((bs, k * bs, (k - 1) * bs, k * bs))         # exactly one full block
    return cases


def check_slot_mapping(fn) -> None:
    tag = "E4.1"
    rng = random.Random(int(fresh_generator().initial_seed()))
    cases = [(4, 6, 0, 6, [7, 2])] + [(bs, n, s, e, None) for bs, n, s, e in _slot_cases(rng)]
    for k, (bs, n, start, end, table) in enumerate(cases):   # the first case is the worked example of the notebook
        num_blocks = (n + bs - 1) // bs
        if table is None:                         # distinct physical blocks, in any order
            table = rng.sample(range(3 * num_blocks + 8), num_blocks)
            if k % 2 and 0 not in table:          # block 0 is a block like any other: in every other table
                table[rng.randrange(num_blocks)] = 0
        expected = reference_slot_mapping(table, start, end, bs)
        args = f"slot_mapping({table}, {start}, {end}, {bs})"
        got = _as_int_list(tag, call_student(tag, fn, list(table), start, end, bs), args)
        if len(got) != len(expected):
            fail(tag, f"{args} returned {len(got)} slots, expected {len(expected)} (one per position in "
                      f"[start, end))", "positions start, start + 1, ..., end - 1; end is excluded")
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                p = start + i
                fail(tag, f"{args}: position {p} went to slot {g}, expected {e} (block {table[p // bs]}, "
                          f"offset {p % bs})", _slot_hint(table, start, end, bs, got))
    ok(tag)


# -- E4.2 paged decode attention --------------------------------------------------------------------------


def _use_block(gen: torch.Generator, tables: list[list[int]], block: int, protected: set) -> None:
    """Put `block` into one of `tables` (in place of a block held by one table only and not `protected`),
    unless a table already holds it: a kernel that skips block 0 (`if block > 0`) or stops one block short of
    the cache then reads wrong keys in every draw."""
    if any(block in t for t in tables):
        return
    counts = {}
    for t in tables:
        for b in t:
            counts[b] = counts.get(b, 0) + 1
    spots = [(i, j) for i, t in enumerate(tables) for j, b in enumerate(t) if counts[b] == 1 and b not in protected]
    if spots:
        i, j = spots[int(torch.randint(len(spots), (1,), generator=gen))]
        tables[i][j] = block


def edge_slots(gen: torch.Generator, n: int, num_slots: int, num_pad: int, *, last: bool = True,
               end: str | None = None) -> torch.Tensor:
    """A slot_mapping [n] int32 with `num_pad` rows of -1 ("do not write") and n - num_pad distinct real slots
    of [0, num_slots), drawn fresh but always holding the edge cases: slot 0 is written by a real row (a
    `slot > 0` test skips it), so is the last slot when `last` (an off-by-one at the end of the cache), and
    padding rows sit both before and after the row writing slot 0 (a padding row sent to slot 0, writing its
    old contents back, then lands on both sides of the real write). With `last=False` the last slot is
    never written, so a -1 used as an index (PyTorch's "last row") shows. `end`: "real" makes the last row a
    real one other than slot 0's (a grid one program short, or a run past the end of key, shows), "pad" a
    padding row; None leaves it to the draw."""
    real = n - num_pad
    if real < 1 or real > num_slots - (0 if last else 1):
        raise ValueError(f"cannot draw {real} distinct real slots out of {num_slots}")
    if (end == "real" and real < 2) or (end == "pad" and num_pad < 1):
        raise ValueError(f"end={end!r} needs {'two real rows' if end == 'real' else 'a padding row'}")
    edges = [0] + ([num_slots - 1] if last and num_slots > 1 and real > 1 else [])
    pool = torch.arange(1, max(1, num_slots - 1))            # neither slot 0 nor the last slot
    others = pool[torch.randperm(len(pool), generator=gen)[:real - len(edges)]].tolist()
    rest = others + edges[1:] + [-1] * max(0, num_pad - 2)
    rest = [rest[i] for i in torch.randperm(len(rest), generator=gen).tolist()]
    tail = []
    if end == "real":                                        # a real row, not slot 0, goes last
        i = next(i for i, x in enumerate(rest) if x > 0)
        tail = [rest.pop(i)]
    cut = sorted(torch.randint(0, len(rest) + 1, (3,), generator=gen).tolist())
    before, after = ([-1], [-1]) if num_pad >= 2 else ([], [-1] * num_pad)
    if end == "pad":                                         # the padding row after slot 0 goes last
        cut[2] = len(rest)
    rows = rest[:cut[0]] + before + rest[cut[0]:cut[1]] + [0] + rest[cut[1]:cut[2]] + after + rest[cut[2]:] + tail
    return torch.tensor(rows, dtype=torch.int32)


def make_paged_batch(gen: torch.Generator, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, context_lens: list[int], dtype=torch.float32, share_prefix: bool = False):
    """Random decode inputs over a paged cache filled with random values everywhere (so a kernel that reads
    past a sequence's context sees garbage). Block tables are padded with -1 to the longest one."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for nb in blocks_per_seq:
        tables.append(perm[used:used + nb])
        used += nb
    if share_prefix and batch > 1 and blocks_per_seq[0] > 1 and blocks_per_seq[1] > 1:
        tables[1][0] = tables[0][0]                      # two sequences share their first block
    for edge in (0, num_blocks - 1):                     # block 0 and the last block are always in use
        _use_block(gen, tables, edge, protected={0, num_blocks - 1})
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32)


def _decode_variants(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Outputs of plausible wrong decode kernels, with the hint for each."""
    B, H, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    out = {}
    width = block_tables.shape[1] * bs
    out["ignores context_lens"] = (
        torch_backend.paged_decode(q, k_cache, v_cache, block_tables, torch.full_like(context_lens, width), scale),
        "mask out keys at positions >= context_lens[b]: the rest of the last block (and the padding) holds "
        "stale values from other sequences")
    out["attends one key too few"] = (
        torch_backend.paged_decode(q, k_cache, v_cache, block_tables, (context_lens - 1).clamp(min=1), scale),
        "the context has context_lens[b] keys, positions 0 .. context_lens[b] - 1, including the new token's")
    out["scale"] = (torch_backend.paged_decode(q, k_cache, v_cache, block_tables, context_lens, 1.0),
                    "multiply the scores q.k by `scale` before the softmax")
    if Hkv != H:
        # Query head h read KV head h % Hkv instead of h // (H / Hkv).
        idx = torch.arange(H) % Hkv
        group = H // Hkv
        perm = torch.cat([torch.nonzero(idx == j).flatten() for j in range(Hkv)])
        wrong = torch_backend.paged_decode(q[:, perm], k_cache, v_cache, block_tables, context_lens, scale)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(H)
        out["GQA grouping"] = (wrong[:, inv],
                               f"with {H} query heads and {Hkv} KV heads, query head h uses KV head "
                               f"h // {group} (heads 0..{group - 1} share KV head 0), not h % {Hkv}")
    return out


# The last E4.2 case: bf16, hundreds of keys, queries drawn with standard deviation LARGE_Q_STD so the
# scores scale * q.k have about that standard deviation too (|scores| up to ~40; trained models produce logits that large).
# bf16 keeps 8 significant bits: between 16 and 32 its numbers are 0.125 apart, so a score near 30 rounded to
# bf16 is off by up to 0.0625 (half the spacing) and its softmax weight by up to e^0.0625 - 1 ~ 6.5% (above 32
# the spacing, and so the error, doubles). Scores, exponentials and sums all round: an implementation that computes scores and softmax in bf16 misses the tolerance
# by 2x to 12x on every draw, while one that computes in fp32 (and rounds only the output to bf16) stays
# within a third of it. (Measured over 1000 draws each; the test suite re-checks 200.)
LARGE_Q_STD = 12.0
LONG_CONTEXT = (300, 1000)
FP32_HINT = ("compute in fp32: upcast q, the gathered K and V with .float(), take the scores, softmax and "
             "weighted sum in fp32, and cast only the output back to q's dtype. bf16 keeps about 3 significant "
             "digits, so a bf16 score near 30 is off by up to 0.0625 and its softmax weight by up to ~6.5%")


def check_paged_decode(fn) -> None:
    tag = "E4.2"
    gen = fresh_generator()
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    configs = [  # (batch, H, Hkv, D, block_size, dtype, q_std, context lengths or None for awkward ones)
        (1, 4, 4, 8, 4, torch.float32, 1.0, None),
        (3, 4, 2, 16, 4, torch.float32, 1.0, None),
        (4, 8, 1, 16, 16, torch.float32, 1.0, None),
        (3, 6, 2, 8, rng.choice([3, 5]), torch.float32, 1.0, None),
        (2, 4, 2, 16, 1, torch.float32, 1.0, None),
        (3, 4, 2, 16, 8, torch.bfloat16, 1.0, None),
        (4, 16, 2, 64, 16, torch.bfloat16, LARGE_Q_STD, [rng.randint(*LONG_CONTEXT) for _ in range(4)]),
    ]
    for batch, H, Hkv, D, bs, dtype, q_std, lens in configs:
        if lens is None:
            # Awkward lengths: 1, exactly one block, one past a block, then random.
            lens = [1, bs, bs + 1, rng.randint(1, 5 * bs + 3)][:batch]
            lens += [rng.randint(1, 5 * bs + 3) for _ in range(batch - len(lens))]
            rng.shuffle(lens)
        q, kc, vc, bt, cl = make_paged_batch(gen, batch, H, Hkv, D, bs, lens, dtype, share_prefix=True)
        if q_std != 1.0:
            q = (q.float() * q_std).to(dtype)
        scale = D ** -0.5
        expected = torch_backend.paged_decode(q, kc, vc, bt, cl, scale)
        inputs = [t.clone() for t in (q, kc, vc, bt, cl)]
        got = call_student(tag, fn, *inputs, scale)
        for name, before, after in zip(("q", "k_cache", "v_cache", "block_tables", "context_lens"),
                                       (q, kc, vc, bt, cl), inputs):
            if not torch.equal(before, after):
                fail(tag, f"paged_decode modified its input {name}", "decode attention only reads its inputs")
        where = (f"batch {batch}, {H} query heads / {Hkv} KV heads, head_dim {D}, block_size {bs}, "
                 f"context_lens {lens}, {str(dtype).replace('torch.', '')}"
                 + (f", large scores (q drawn with std {q_std:g})" if q_std != 1.0 else ""))
        rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and got.dtype == expected.dtype:
            err = (got.float() - expected.float()).abs() > atol + rtol * expected.float().abs()
            if err.any():
                b, h = (int(i) for i in err.nonzero()[0][:2])
                hint = "softmax(scale * q . k over the first context_lens[b] keys) @ v, per query head"
                if dtype != torch.float32:
                    hint += "; " + FP32_HINT
                for _, (variant, why) in _decode_variants(q, kc, vc, bt, cl, scale).items():
                    if torch.allclose(got.float(), variant.float(), rtol=rtol, atol=atol):
                        hint = why
                        break
                table = bt[b].tolist()
                if len(table) > 8:
                    table = f"[{', '.join(map(str, table[:6]))}, ...] ({len(table)} blocks)"
                fail(tag, f"output differs from the reference for sequence {b} (context_len {lens[b]}, block "
                          f"table {table}) at query head {h} [{where}]", hint)
        check_close(tag, got, expected, rtol=rtol, atol=atol, what=f"paged_decode output [{where}]",
                    hint="output shape [num_seqs, num_heads, head_dim], q's dtype; compute in fp32")
    ok(tag)


# -- E4.3 store_kvcache -----------------------------------------------------------------------------------


def _kv_tensor(gen, n, hkv, d, dtype, layout):
    """key or value [n, Hkv, D] in a layout the engine may hand over: "contiguous" (K is a new tensor after the
    norm and RoPE), "fused" (V is a view of the fused QKV output: token stride (H + 2 Hkv) D), "padded" (rows
    cut from [n, Hkv, D + 8]: head stride D + 8)."""
    if layout == "fused":
        return torch.randn(n, 4 * hkv * d, generator=gen).to(dtype)[:, 3 * hkv * d:].view(n, hkv, d)
    if layout == "padded":
        return torch.randn(n, hkv, d + 8, generator=gen).to(dtype)[..., :d]
    return torch.randn(n, hkv, d, generator=gen).to(dtype)


def check_store_kvcache(fn) -> None:
    tag = "E4.3"
    gen = fresh_generator()
    for num_blocks, bs, Hkv, D, n, num_pad, dtype, k_layout, v_layout, last, end in [
            (6, 1, 1, 16, 2, 0, torch.float32, "contiguous", "contiguous", True, None),   # slots 0 and 5, no padding
            (4, 4, 2, 8, 6, 2, torch.float32, "contiguous", "fused", False, "real"),
            (5, 16, 2, 8, 17, 5, torch.bfloat16, "fused", "padded", True, "pad"),
            (3, 5, 4, 8, 7, 2, torch.float32, "padded", "fused", False, "real"),
            (6, 1, 1, 16, 1, 0, torch.float32, "fused", "padded", True, None)]:           # one token, slot 0
        k_cache = torch.randn(num_blocks, bs, Hkv, D, generator=gen).to(dtype)
        v_cache = torch.randn(num_blocks, bs, Hkv, D, generator=gen).to(dtype)
        key = _kv_tensor(gen, n, Hkv, D, dtype, k_layout)
        value = _kv_tensor(gen, n, Hkv, D, dtype, v_layout)
        # Distinct slots with slot 0 among them and padding rows (-1, "do not write") on both sides of it; the last
        # slot written in some cases, never in the others (so a -1 used as an index shows).
        slots = edge_slots(gen, n, num_blocks * bs, num_pad, last=last, end=end)
        exp_k, exp_v = k_cache.clone(), v_cache.clone()
        store_kvcache_torch(key, value, exp_k, exp_v, slots)
        got_k, got_v = k_cache.clone(), v_cache.clone()
        before = {"key": key.clone(), "value": value.clone(), "slot_mapping": slots.clone()}
        call_student(tag, fn, key, value, got_k, got_v, slots)
        check_unchanged(tag, before, {"key": key, "value": value, "slot_mapping": slots},
                        "the store only reads key, value and slot_mapping")
        layouts = {"contiguous": "contiguous", "fused": "a view of a fused QKV output", "padded": "a padded-head view"}
        where = (f"{num_blocks} blocks of {bs} slots, {n} tokens, slot_mapping {slots.tolist()}, key "
                 f"{layouts[k_layout]}, value {layouts[v_layout]}")
        pads = [i for i in range(n) if int(slots[i]) < 0]
        for name, got, exp, old, src, other in (("k_cache", got_k, exp_k, k_cache, key, value),
                                                ("v_cache", got_v, exp_v, v_cache, value, key)):
            if torch.equal(got, exp):
                continue
            skip0 = old.clone()
            store_kvcache_torch(src, src, skip0, skip0.clone(), torch.where(slots == 0, -1, slots))
            if torch.equal(got, skip0) and not any(i > int((slots == 0).nonzero()[0]) for i in pads):
                fail(tag, f"{name}: slot 0 (block 0, offset 0) was not written, though a token maps to it [{where}]",
                     "slot 0 is a real slot: only a negative slot means 'do not write' (keep slot >= 0, not "
                     "slot > 0)")
            if torch.equal(got, old):
                if name == "v_cache":           # k_cache is right by now: V was forgotten (or copied)
                    fail(tag, f"v_cache is unchanged [{where}]",
                         "v_cache must receive `value` at the same slots as k_cache receives `key`: "
                         "v_cache.view(-1, Hkv, D)[slots] = value (without the slot -1 rows), in place like the write "
                         "to k_cache")
                fail(tag, f"{name} is unchanged [{where}]",
                     "write into the cache tensor itself (in place), e.g. k_cache.view(-1, Hkv, D)[slots] = key; "
                     "a reshape that copies, or a new tensor, leaves the caller's cache untouched")
            flat_got, flat_exp, flat_old = (t.view(-1, Hkv, D) for t in (got, exp, old))
            minus_one = ("slot -1 means 'do not write'; indexing with -1 writes into the last slot: drop those rows "
                         "(keep = slot_mapping >= 0)")
            if not last and not torch.equal(flat_got[-1], flat_old[-1]):
                fail(tag, f"{name}: the last slot of the cache was overwritten, but no token maps to it [{where}]",
                     minus_one)
            bad = int((flat_got != flat_exp).flatten(1).any(1).nonzero()[0])
            rows = (slots == bad).nonzero().flatten().tolist()
            hint = ("token i's row goes to flat slot slot_mapping[i] of the cache viewed as "
                    "[num_blocks * block_size, Hkv, D]")
            if rows and torch.equal(flat_got[bad], other[rows[0]]):
                hint = "keys go to k_cache and values to v_cache: did you swap them?"
            elif rows and torch.equal(flat_got[bad], flat_old[bad]):
                if bad == 0 and any(i > rows[0] for i in pads):      # a padding row came after the real one
                    fail(tag, f"{name}: slot 0 kept its old contents although token {rows[0]} writes it [{where}]",
                         "a padding row (slot -1) sent to slot 0 wrote slot 0's old contents back over the real "
                         "write (of two writes to one slot, either may win): padding rows must write nothing, "
                         "drop them (keep = slot_mapping >= 0) before indexing")
                hint = ("slot 0 is a real slot (block 0, offset 0): only slot -1 means 'do not write'" if bad == 0
                        else "every row whose slot is >= 0 is written")
            fail(tag, f"{name}: slot {bad} (block {bad // bs}, offset {bad % bs}) holds the wrong values "
                      f"[{where}]", hint)
    ok(tag)


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402
from nanovllm_course import export as _export  # noqa: E402

EXERCISES = exercises(
    Exercise("E4.1", check_slot_mapping, ("slot_mapping",), (reference_slot_mapping,), parts=(
        EnginePart("slot_mapping", "prepare_prefill", "E4.1", adapter=_export.prefill_with_slots,
                   check=lambda mod: check_slot_mapping(mod.slot_mapping)),
        EnginePart("slot_mapping", "prepare_decode", "E4.1", adapter=_export.decode_with_slots,
                   check=lambda mod: check_slot_mapping(mod.slot_mapping)))),
    Exercise("E4.2", check_paged_decode, ("paged_decode",), (reference_paged_decode,), parts=(
        EnginePart("paged_decode", "attention_backend", "E4.2", adapter=_export.torch_backend_with_decode,
                   check=lambda mod: check_paged_decode(mod.paged_decode)),)),
    # optional (the chapter's text says so): the engine's store is given in the section after it
    Exercise("E4.3", check_store_kvcache, ("store_kvcache",), (reference_store_kvcache,), optional=True, parts=(
        EnginePart("store_kvcache", "store_kvcache", "E4.3", check=lambda mod: check_store_kvcache(mod.store_kvcache)),)),
)
PARTS = parts_of(EXERCISES)
