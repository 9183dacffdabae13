"""Checks for chapter 05: the block manager and prefix caching.

- `check_compute_block_hash(fn)` (E5.1): fn(token_ids, prefix_hash=-1) must return exactly
  `nanovllm_ref.engine.block_manager.compute_block_hash(token_ids, prefix_hash)`.
- `check_block_manager_basics(cls)` (E5.2): a BlockManager class, run with prefix caching off, allocates,
  appends and frees exactly like the reference (block tables, num_cached_tokens, the free pool in order,
  ref counts through a shared table, RuntimeError on a refused allocate) and keeps the invariants of
  `nanovllm_ref.engine.invariants.check_block_manager` (scenarios, then random request streams).
- `check_prefix_caching(cls)` (E5.3): a subclass that adds prefix caching, run with caching on: the same
  comparisons plus block hashes, num_hashed_blocks (of every sequence, also after deallocate), the token ids
  of hashed blocks and the hit pattern, on scenarios (one per caching rule,
  including a simulated hash collision) and random request streams under a tight block budget.

Hints are chosen from what differs (which field, after which operation), not from the scenario's name.
Every check draws fresh random inputs on each call and prints `E5.n ok` and nothing else on success.
`reference_compute_block_hash` and `ReferenceBlockManager` are the reference answers.
"""
import random
from array import array
from types import SimpleNamespace

import xxhash

from nanovllm_course.common import call_student, fail, fresh_generator, ok
from nanovllm_ref.engine.block_manager import BlockManager as RefBlockManager
from nanovllm_ref.engine.block_manager import compute_block_hash as ref_hash
from nanovllm_ref.engine.invariants import check_block_manager
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.sampling_params import SamplingParams

reference_compute_block_hash = ref_hash
ReferenceBlockManager = RefBlockManager

_VOCAB = 151_936          # Qwen3's vocabulary size: token ids do not fit in 16 bits


def _rng() -> random.Random:
    return random.Random(int(fresh_generator().initial_seed()))


# -- a model-free simulation of the engine's bookkeeping (for the notebook and its figure) -----------------


def simulate(prompts: list[list[int]], block_size: int, num_blocks: int, caching: bool, max_tokens: int = 4,
             arrivals_per_step: int = 1, manager=None) -> dict:
    """Run the reference scheduler over `prompts` with no model (every sampled token is 0), adding
    `arrivals_per_step` new requests per step. Returns {"prefill_tokens": tokens the model had to compute
    in prefill steps, "cached_tokens": prompt tokens served from the prefix cache, "steps": steps taken}.
    `manager`: a BlockManager class to use instead of the reference one."""
    cfg = SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=10**6, eos=frozenset(),
                          num_kvcache_blocks=num_blocks, kvcache_block_size=block_size,
                          enable_prefix_caching=caching)
    sched = Scheduler(cfg)
    if manager is not None:
        sched.block_manager = manager(num_blocks, block_size, caching)
    queue = [Sequence(p, block_size, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
             for p in prompts]
    prefill = cached = steps = 0
    admitted = set()
    while queue or not sched.is_finished():
        for _ in range(arrivals_per_step):
            if queue:
                sched.add(queue.pop(0))
        seqs, is_prefill = sched.schedule()
        steps += 1
        if is_prefill:
            prefill += sum(s.num_scheduled_tokens for s in seqs)
            for s in seqs:
                if s.seq_id not in admitted:           # first admission: what the prefix cache served
                    admitted.add(s.seq_id)
                    cached += s.num_cached_tokens
        sched.postprocess(seqs, [0] * len(seqs))
    return {"prefill_tokens": prefill, "cached_tokens": cached, "steps": steps}


# -- E5.1 the chained block hash ---------------------------------------------------------------------------


def _hash_variants(tokens, prefix):
    """Plausible wrong hashes, with the hint for each."""
    def xx(*parts):
        h = xxhash.xxh64()
        for part in parts:
            h.update(part)
        return h.intdigest()
    pre = prefix.to_bytes(8, "little") if prefix != -1 else b""
    out = [
        (ref_hash(tokens, -1), "the hash must chain: feed prefix_hash (8 bytes, little-endian) to xxh64 before "
                               "the tokens, so equal blocks after different prefixes hash differently"),
        (xx(pre, array("i", tokens).tobytes()), "write each token id as 8 little-endian bytes: "
                                                "array('q', token_ids).tobytes() (int64), not 'i' (int32)"),
        (xx(array("q", tokens).tobytes(), pre), "feed the prefix hash first, then the token ids"),
    ]
    if prefix != -1:
        out.append((xx(prefix.to_bytes(8, "big"), array("q", tokens).tobytes()),
                    "encode prefix_hash little-endian: prefix_hash.to_bytes(8, 'little')"))
    if prefix == 0:
        out.insert(0, (ref_hash(tokens, -1), "0 is a valid hash: only -1 means 'no prefix' (test `!= -1`, not "
                                             "truthiness)"))
    return out


def check_compute_block_hash(fn) -> None:
    tag = "E5.1"
    rng = _rng()
    cases = []
    for n in (1, 4, 16, 17, 256):
        tokens = [rng.randrange(_VOCAB) for _ in range(n)]
        for prefix in (-1, rng.randrange(1, 2**64), 2**64 - 1, 0):
            cases.append((tokens, prefix))
    cases.append(([0], -1))
    for tokens, prefix in cases:
        expected = ref_hash(tokens, prefix)
        got = call_student(tag, fn, list(tokens), prefix)
        shown = f"compute_block_hash(<{len(tokens)} token ids>, prefix_hash={prefix})"
        if isinstance(got, bool) or not isinstance(got, int):
            fail(tag, f"{shown} returned a {type(got).__name__}, expected a Python int",
                 "xxhash.xxh64().intdigest() gives the hash as an int in [0, 2**64)")
        if got != expected:
            hint = "h = xxhash.xxh64(); h.update(prefix_hash.to_bytes(8, 'little')) unless prefix_hash == -1; " \
                   "h.update(array('q', token_ids).tobytes()); return h.intdigest()"
            for variant, why in _hash_variants(tokens, prefix):
                if got == variant:
                    hint = why
                    break
            fail(tag, f"{shown} = {got:#x}, expected {expected:#x}", hint)
    tokens = [rng.randrange(_VOCAB) for _ in range(8)]
    if call_student(tag, fn, tokens) != ref_hash(tokens):
        fail(tag, "compute_block_hash(token_ids) without a prefix differs from compute_block_hash(token_ids, -1)",
             "prefix_hash defaults to -1 (no previous block)")
    ok(tag)


# -- E5.2 / E5.3 the BlockManager class: lockstep comparison with the reference ---------------------------


class _Lockstep:
    """Runs the same operations on the reference BlockManager and the student's, on twin sequences, and
    compares everything observable after each one."""

    def __init__(self, tag, cls, scenario, num_blocks, block_size, caching, hint):
        self.tag, self.scenario, self.hint = tag, scenario, hint
        self.ops = []
        self.ref = RefBlockManager(num_blocks, block_size, caching)
        self.stu = self._call(cls, num_blocks, block_size, caching, op=f"BlockManager({num_blocks}, "
                                                                         f"{block_size}, {caching})")
        self.bs = block_size
        self.pairs = {}            # label -> (ref seq, student seq)
        self.live = set()          # labels with blocks

    def _where(self):
        return f"scenario '{self.scenario}', after: {'; '.join(self.ops[-6:]) or 'nothing'}"

    def _call(self, fn, *args, op):
        try:
            return fn(*args)
        except NotImplementedError as exc:
            fail(self.tag, f"not implemented yet ({exc}) [in {op}]",
                 "fill in the BlockManager methods above, run the cell, then this check")
        except AssertionError:
            raise
        except Exception as exc:
            fail(self.tag, f"{op} raised {type(exc).__name__}: {exc} [{self._where()}]", self.hint)

    def _both(self, name, label, *extra):
        op = f"{name}({label}{''.join(', ' + str(e) for e in extra)})"
        r, s = self.pairs[label]
        want = getattr(self.ref, name)(r, *extra)
        got = self._call(getattr(self.stu, name), s, *extra, op=op)
        self.ops.append(op)
        return want, got

    def fail(self, message, hint=None):
        fail(self.tag, f"{message} [{self._where()}]", hint or self.hint)

    def compare(self, default_hint=None):
        last = _op_name(self.ops[-1]) if self.ops else ""
        pairs = [(label, r, s, label in self.live) for label, (r, s) in sorted(self.pairs.items())]
        found = _seq_diff(self.ref, self.stu, pairs, {last}) or _tokens_diff(self.stu)
        if found:
            self.fail(found[0], found[1] or default_hint)
        try:
            check_block_manager(self.stu, [self.pairs[lb][1] for lb in self.live])
        except AssertionError as exc:
            hint = None
            if "ref_count" in str(exc) and last == "deallocate":
                hint = ("deallocate decrements the ref count of every block in the table; a block goes back to "
                        "the free pool only when its count reaches 0")
            elif "ref_count" in str(exc) and last == "allocate":
                hint = ("allocate adds one reference to every block it puts in the table: +1 for a shared hit, "
                        "1 for a fresh block")
            self.fail(f"invariant broken: {exc}", hint)
        except Exception as exc:
            self.fail(f"check_block_manager could not read the manager ({type(exc).__name__}: {exc})",
                      "keep the attributes blocks, free_block_ids, used_block_ids and hash_to_block_id")
        found = (_pool_diff(self.ref, self.stu, {last}) or _hash_diff(self.ref, self.stu, {last})
                 or _seq_diff(self.ref, self.stu, pairs, {last}, hashed=True))
        if found:
            self.fail(found[0], found[1] or default_hint)

    # operations ---------------------------------------------------------------------------------------
    def new(self, label, tokens):
        self.pairs[label] = (Sequence(tokens, self.bs), Sequence(tokens, self.bs))

    def allocate(self, label):
        want, got = self._both("can_allocate", label)
        if bool(got) != want:
            self.fail(f"can_allocate({label}) returned {got}, expected {want}")
        if want:
            self._both("allocate", label)
            self.live.add(label)
        self.compare()
        return want

    def write(self, label, n=None):
        """The model ran: n more tokens (default: all) now have K/V in the cache."""
        r, s = self.pairs[label]
        n = len(r) - r.num_cached_tokens if n is None else n
        r.num_cached_tokens += n
        s.num_cached_tokens += n
        self.ops.append(f"<{label}: {n} tokens written>")
        self._both("hash_blocks", label)
        self.compare()

    def append(self, label, token):
        """One decode step: sample `token`, then (if room) reserve its slot."""
        for seq in self.pairs[label]:
            seq.append_token(token)
        self.ops.append(f"<{label}: append token>")
        want, got = self._both("can_append", label)
        if bool(got) != want:
            self.fail(f"can_append({label}) returned {got}, expected {want}")
        if want:
            self._both("may_append", label)
        self.compare()
        return want

    def free(self, label):
        self._both("deallocate", label)
        self.live.discard(label)
        self.compare()

    def share(self, src, dst):
        """`dst` (a new sequence with src's tokens) holds src's blocks too, as a forked request would: one
        more reference on each block, set on both managers. Then ref counts above 1 exist without caching."""
        self.new(dst, list(self.pairs[src][0].token_ids))
        for mgr, i in ((self.ref, 0), (self.stu, 1)):
            a, b = self.pairs[src][i], self.pairs[dst][i]
            b.block_table = list(a.block_table)
            b.num_cached_tokens, b.num_hashed_blocks = a.num_cached_tokens, a.num_hashed_blocks
            for block_id in b.block_table:
                mgr.blocks[block_id].ref_count += 1
        self.live.add(dst)
        self.ops.append(f"<{dst} shares {src}'s blocks>")
        self.compare()

    def refuse(self, label, why):
        """allocate(label) must raise RuntimeError (`why` says why) and change nothing."""
        r, s = self.pairs[label]
        op = f"allocate({label})"
        try:
            self.ref.allocate(r)
        except RuntimeError:
            pass
        else:                                          # pragma: no cover - the scenarios are built to refuse
            raise RuntimeError(f"reference allocate({label}) did not refuse")
        try:
            self.stu.allocate(s)
        except NotImplementedError as exc:      # a subclass of RuntimeError: a stub is not a refusal
            fail(self.tag, f"not implemented yet ({exc}) [in {op}]",
                 "fill in the BlockManager methods above, run the cell, then this check")
        except RuntimeError:
            self.ops.append(op + " -> RuntimeError")
        except Exception as exc:
            self.ops.append(op)
            self.fail(f"{op} raised {type(exc).__name__}: {exc}, expected RuntimeError ({why})", _REFUSE_HINT)
        else:
            self.ops.append(op)
            self.fail(f"{op} returned without raising, but {why}", _REFUSE_HINT)
        self.compare(default_hint=_REFUSE_HINT)

    def collide(self, holder, newcomer):
        """Make block 0 of `holder` look as if its hash were that of `newcomer`'s block 0 (different tokens):
        a 64-bit hash collision, which the token comparison on every hit must catch."""
        for mgr, i in ((self.ref, 0), (self.stu, 1)):
            held, new = self.pairs[holder][i], self.pairs[newcomer][i]
            h = ref_hash(new.block(0), -1)
            block = mgr.blocks[held.block_table[0]]
            if mgr.hash_to_block_id.get(block.hash) == block.block_id:
                del mgr.hash_to_block_id[block.hash]
            block.hash = h
            mgr.hash_to_block_id[h] = block.block_id
        self.ops.append(f"<{holder}'s block 0 now has the hash of {newcomer}'s block 0: a collision>")


_REFUSE_HINT = ("allocate raises RuntimeError, and changes nothing, when the sequence already has blocks or when "
                "can_allocate(seq) is False: the scheduler relies on it never handing out blocks it does not have")


def _op_name(op: str) -> str:
    return "refused allocate" if op.endswith("-> RuntimeError") else op.lstrip("<").split("(")[0]


def _covered_blocks(seq, block_size):
    return len(seq) // block_size


def _seq_diff(ref_mgr, stu_mgr, pairs, ops, hashed=False):
    """First difference in a sequence's block_table or num_cached_tokens (or, with `hashed`, in the
    num_hashed_blocks of a sequence holding blocks), as (message, hint); the hint is chosen from the field that
    differs and the operations that just ran (`ops`: a set of method names).
    pairs: (label, ref seq, student seq, holds blocks)."""
    bs = ref_mgr.block_size
    for label, r, s, live in pairs:
        if hashed:
            # Every sequence, with blocks or not: a freed one must have been reset too.
            if getattr(s, "num_hashed_blocks", None) != r.num_hashed_blocks:
                msg = f"sequence {label}: num_hashed_blocks {s.num_hashed_blocks}, expected {r.num_hashed_blocks}"
                hint = None
                if not live and not r.block_table and "deallocate" in ops:
                    hint = ("deallocate resets the sequence completely: block_table = [], num_cached_tokens = 0 and "
                            "num_hashed_blocks = 0 (its blocks, and so their hashes, are no longer its own)")
                elif "hash_blocks" in ops:
                    hint = ("hash_blocks advances seq.num_hashed_blocks to num_cached_tokens // block_size, so that "
                            "its next call starts after the blocks already hashed")
                elif "allocate" in ops:
                    hint = ("allocate sets num_hashed_blocks to the number of prefix-hit blocks (they carry hashes "
                            "already)")
                return msg, hint
            continue
        table = list(s.block_table)
        if table != r.block_table:
            msg = f"sequence {label}: block_table {table}, expected {r.block_table}"
            hint = None
            if not r.block_table and table and "deallocate" in ops:
                hint = "deallocate empties the sequence's table (seq.block_table = [])"
            elif len(table) != len(r.block_table) and ops & {"allocate", "may_append"}:
                hint = (f"a sequence's table covers all its tokens: ceil(len(seq) / block_size) = {r.num_blocks} "
                        f"blocks for {len(r)} tokens")
            else:
                for i, b in enumerate(table[:_covered_blocks(s, bs)]):
                    if i < len(r.block_table) and r.block_table[i] == b:
                        continue
                    tokens = getattr(stu_mgr.blocks[b], "token_ids", None) if 0 <= b < len(stu_mgr.blocks) else None
                    if tokens and list(tokens) != list(s.block(i)):
                        hint = (f"block {b} holds other token ids than block {i} of the sequence: on a hash hit, "
                                "compare the block's token_ids with the sequence's before reusing it (two "
                                "different prefixes can share a 64-bit hash)")
                        break
            return msg, hint
        if s.num_cached_tokens != r.num_cached_tokens:
            msg = f"sequence {label}: num_cached_tokens {s.num_cached_tokens}, expected {r.num_cached_tokens}"
            hint = None
            if not r.block_table and "deallocate" in ops:
                hint = ("deallocate resets the sequence: block_table = [] and num_cached_tokens = 0 (a preempted "
                        "sequence is recomputed from its first token)")
            elif "allocate" in ops:
                hint = "allocate sets num_cached_tokens = number of prefix-hit blocks * block_size (0 without hits)"
            return msg, hint
    return None


def _tokens_diff(stu_mgr):
    """A block registered in the hash map must keep its token ids (every hit compares them)."""
    try:
        entries = list(stu_mgr.hash_to_block_id.items())
        blocks = stu_mgr.blocks
    except AttributeError:
        return None                           # check_block_manager reports the missing attribute
    for h, block_id in entries:
        if 0 <= block_id < len(blocks) and blocks[block_id].hash == h and not getattr(blocks[block_id], "token_ids", None):
            return (f"block {block_id} is in the hash map (hash {_hex(h)}) but holds no token ids",
                    "hash_blocks stores each block's token ids with its hash (block.token_ids = seq.block(i)): a "
                    "hit compares them with the new sequence's block, since 64-bit hashes can collide")
    return None


def _pool_diff(ref_mgr, stu_mgr, ops):
    """The free pool: the same blocks, in the same order (least recently freed first)."""
    mine, want = list(stu_mgr.free_block_ids), list(ref_mgr.free_block_ids)
    if sorted(mine) != sorted(want):
        return f"free blocks {sorted(mine)}, expected {sorted(want)}", None
    if mine != want:
        if "deallocate" in ops:
            hint = ("deallocate returns a sequence's blocks to the back of the free pool from its last block to its "
                    "first: the tail, least likely to be shared, is handed out again first")
        else:
            hint = ("the free pool is kept in the order blocks were freed: take from its front (least recently "
                    "freed), append freed blocks at its back")
        return f"free pool in the order {mine}, expected {want}", hint
    return None


def _hash_diff(ref_mgr, stu_mgr, ops):
    for ref_block, block in zip(ref_mgr.blocks, stu_mgr.blocks):
        if block.hash == ref_block.hash:
            continue
        hint = None
        if ref_block.hash != -1 and block.hash == ref_hash(ref_block.token_ids, -1):
            hint = ("chain the hashes: block i's hash covers blocks 0..i, so pass the previous block's hash "
                    "as prefix_hash (-1 for block 0)")
        elif ref_block.hash != -1 and block.hash == -1 and "deallocate" in ops:
            hint = ("a freed block keeps its hash and token ids (and its hash_to_block_id entry) until the "
                    "free pool hands it out again")
        elif ref_block.hash != -1 and block.hash == -1 and "hash_blocks" in ops:
            hint = ("hash_blocks registers every full block below num_cached_tokens // block_size that has "
                    "no hash yet: block.hash, block.token_ids and hash_to_block_id")
        elif ref_block.hash == -1 and ops & {"allocate", "may_append"}:
            hint = ("a block handed out by allocate / may_append has no K/V yet: it must carry no hash "
                    "(reset an old one, drop its hash_to_block_id entry, register nothing before "
                    "hash_blocks)")
        return f"block {block.block_id} carries hash {_hex(block.hash)}, expected {_hex(ref_block.hash)}", hint
    return None


def _hex(h):
    return "-1 (none)" if h == -1 else f"{h:#x}"


def _tokens(rng, n):
    return [rng.randrange(_VOCAB) for _ in range(n)]


def _scenarios_basic(tag, cls, rng, caching):
    """Allocation, append and free; all with prefix caching switched off unless `caching`."""
    bs = rng.choice([2, 4, 5])
    t = _Lockstep(tag, cls, "allocate and free", 6, bs, caching,
                  "allocate gives a sequence ceil(len / block_size) blocks taken from the front of the free "
                  "pool; deallocate returns them (last block first) to the back of the pool")
    t.new("A", _tokens(rng, 2 * bs + 1))
    t.allocate("A")
    t.new("B", _tokens(rng, bs))
    t.allocate("B")
    t.refuse("B", "B already has its blocks (and 2 blocks are free)")
    t.free("A")
    t.new("C", _tokens(rng, 1))
    t.allocate("C")
    t.free("B")
    t.free("C")

    t = _Lockstep(tag, cls, "shared blocks", 4, bs, caching,
                  "a block held by several tables has one reference per table: deallocate decrements the ref "
                  "count of each of its blocks and frees a block only when its count reaches 0")
    t.new("A", _tokens(rng, bs + 1))
    t.allocate("A")
    t.write("A")
    t.share("A", "B")
    t.free("A")
    t.new("C", _tokens(rng, 2 * bs))                       # takes the 2 free blocks, never B's
    t.allocate("C")
    t.free("B")
    t.free("C")

    t = _Lockstep(tag, cls, "not enough blocks", 3, bs, caching,
                  "can_allocate is True only if the free pool has a block for every block of the sequence")
    t.new("A", _tokens(rng, 2 * bs))
    t.allocate("A")
    t.new("B", _tokens(rng, bs + 1))
    t.allocate("B")                                    # needs 2, only 1 free: refused
    t.refuse("B", "can_allocate(B) is False: B needs 2 blocks and only 1 is free")
    t.new("C", _tokens(rng, bs))
    t.allocate("C")
    t.free("A")
    t.allocate("B")

    t = _Lockstep(tag, cls, "decode appends", 3, bs, caching,
                  "a decode step needs a new block only when the new last token starts one, i.e. when "
                  "len(seq) > len(block_table) * block_size; can_append is False only then and with no free "
                  "block")
    t.new("A", _tokens(rng, bs - 1))
    t.allocate("A")
    t.write("A")
    for _ in range(2 * bs + 2):
        if not t.append("A", rng.randrange(_VOCAB)):
            break
        t.write("A", 1)
    t.free("A")

    t = _Lockstep(tag, cls, "block_size 1", 4, 1, caching,
                  "with block_size 1 every token is its own block")
    t.new("A", _tokens(rng, 3))
    t.allocate("A")
    t.write("A")
    t.append("A", 7)
    t.write("A", 1)
    t.append("A", 8)
    t.free("A")


def _scenarios_caching(tag, cls, rng):
    bs = rng.choice([2, 4, 5])
    shared = _tokens(rng, 2 * bs)

    t = _Lockstep(tag, cls, "prefix hit", 8, bs, True,
                  "after hash_blocks(A), a new sequence whose first full blocks hold the same tokens reuses "
                  "A's blocks: num_cached_tokens = hit blocks * block_size, and their ref counts go up")
    t.new("A", shared + _tokens(rng, 1))
    t.allocate("A")
    t.write("A")
    t.new("B", shared + _tokens(rng, bs + 1))
    t.allocate("B")
    t.new("C", _tokens(rng, 1) + shared)                  # same blocks, shifted: no hit
    t.allocate("C")
    t.free("A")
    t.free("B")
    t.free("C")

    t = _Lockstep(tag, cls, "equal block after a different prefix", 8, bs, True,
                  "chain the hashes: block i's hash covers blocks 0..i, so pass the previous block's hash as "
                  "prefix_hash (-1 for block 0)")
    x, y = _tokens(rng, bs), _tokens(rng, bs)
    t.new("A", x + y + [1])
    t.allocate("A")
    t.write("A")
    t.new("B", _tokens(rng, bs) + y + [1])
    t.allocate("B")
    t.write("B")
    t.new("C", x + y + [2])
    t.allocate("C")

    t = _Lockstep(tag, cls, "hash collision", 6, bs, True,
                  "a hash hit counts only if the block's token_ids equal the sequence's block: hashes can collide")
    t.new("A", _tokens(rng, bs + 1))
    t.allocate("A")
    t.write("A")
    t.new("B", _tokens(rng, bs + 1))
    t.collide("A", "B")                                    # A's block 0 now carries the hash of B's block 0
    t.allocate("B")                                        # same hash, other tokens: no hit
    t.free("A")
    t.free("B")

    t = _Lockstep(tag, cls, "no hit on a block not yet written", 8, bs, True,
                  "hashes are registered only in hash_blocks, for blocks whose tokens all have K/V "
                  "(i < num_cached_tokens // block_size): allocate must not register them")
    t.new("A", shared + _tokens(rng, 1))
    t.allocate("A")
    t.new("B", shared + _tokens(rng, 2))
    t.allocate("B")
    t.write("A", bs)                                       # first block written: now it may hit
    t.new("C", shared + _tokens(rng, 3))
    t.allocate("C")

    t = _Lockstep(tag, cls, "a freed block keeps its hash", 6, bs, True,
                  "deallocate puts a block with ref count 0 back in the free pool but keeps its hash, its "
                  "token ids and its hash_to_block_id entry, so the same prompt coming back still hits; "
                  "allocate takes such a hit back out of the free pool")
    t.new("A", shared + _tokens(rng, 1))
    t.allocate("A")
    t.write("A")
    t.free("A")
    t.new("B", list(t.pairs["A"][0].token_ids))
    t.allocate("B")

    t = _Lockstep(tag, cls, "ref counts", 5, bs, True,
                  "a shared block has one reference per block table holding it; deallocate decrements it and "
                  "frees the block only at 0")
    t.new("A", shared + _tokens(rng, 1))
    t.allocate("A")
    t.write("A")
    t.new("B", shared + _tokens(rng, 1))
    t.allocate("B")
    t.free("A")
    t.new("C", _tokens(rng, 2 * bs))                      # takes the free blocks, must not take B's
    t.allocate("C")
    t.free("B")
    t.free("C")

    t = _Lockstep(tag, cls, "whole prompt cached", 6, bs, True,
                  "if every block of the new sequence hits, drop the last hit: its last token must be "
                  "computed again to get logits (into a fresh block)")
    t.new("A", list(shared))
    t.allocate("A")
    t.write("A")
    t.new("B", list(shared))
    t.allocate("B")

    t = _Lockstep(tag, cls, "re-using a freed block drops its old hash", 3, bs, True,
                  "when the free pool hands out a block that still carries a hash, remove its hash_to_block_id "
                  "entry and reset the block (hash -1, no token ids): its K/V is about to be overwritten")
    t.new("A", shared + _tokens(rng, 1))
    t.allocate("A")
    t.write("A")
    t.free("A")
    t.new("B", _tokens(rng, 3 * bs))                       # takes all three blocks, evicting A's
    t.allocate("B")
    t.write("B", bs)
    t.free("B")
    t.new("C", shared + _tokens(rng, 1))
    t.allocate("C")

    t = _Lockstep(tag, cls, "can_allocate counts hits in the free pool", 3, bs, True,
                  "a hit whose block sits in the free pool (ref count 0) uses up a free block too: "
                  "needed = fresh blocks + such revived hits")
    t.new("A", shared + _tokens(rng, 1))
    t.allocate("A")
    t.write("A")
    t.free("A")
    t.new("B", shared + _tokens(rng, bs + 1))            # 2 revived hits + 2 fresh > 3 free
    t.allocate("B")
    t.new("C", shared[:bs] + _tokens(rng, 1))
    t.allocate("C")

    t = _Lockstep(tag, cls, "decode fills a block, then it is hashed", 6, bs, True,
                  "hash_blocks also registers blocks filled by decode steps (every full block below "
                  "num_cached_tokens that has no hash yet)")
    t.new("A", _tokens(rng, bs - 1))
    t.allocate("A")
    t.write("A")
    for _ in range(bs + 1):
        t.append("A", rng.randrange(_VOCAB))
        t.write("A", 1)
    t.new("B", list(t.pairs["A"][0].token_ids) + [3])
    t.allocate("B")


def _random_stream(tag, cls, rng, caching):
    """Drive two schedulers (reference BlockManager, student's) with the same random request stream."""
    bs = rng.choice([1, 2, 3, 4])
    num_blocks = rng.randint(5, 10)
    budget = rng.choice([2 * bs, 7, 16])
    capacity = num_blocks * bs
    cfg = SimpleNamespace(max_num_seqs=rng.randint(2, 5), max_num_batched_tokens=budget, max_model_len=10**6,
                          eos=frozenset(), num_kvcache_blocks=num_blocks, kvcache_block_size=bs,
                          enable_prefix_caching=caching)
    ref, stu = Scheduler(cfg), Scheduler(cfg)
    what = (f"random request stream ({num_blocks} blocks of {bs}, prefix caching "
            f"{'on' if caching else 'off'}, step budget {budget} tokens)")
    try:
        stu.block_manager = cls(num_blocks, bs, caching)
    except NotImplementedError as exc:
        fail(tag, f"not implemented yet ({exc})", "fill in the BlockManager methods above")
    families = [_tokens(rng, rng.randint(0, 3 * bs)) for _ in range(3)]
    prompts = []
    for _ in range(rng.randint(10, 16)):
        if prompts and rng.random() < 0.25:
            prompt = list(rng.choice(prompts))                              # the same prompt again
        else:
            prompt = rng.choice(families) + _tokens(rng, rng.randint(1, 2 * bs + 1))
        prompt = prompt[:capacity - 1]
        prompts.append(prompt)
    pairs, log = [], []
    step = preemptions = 0
    while (len(pairs) < len(prompts) or not ref.is_finished()) and step < 3000:
        step += 1
        if len(pairs) < len(prompts) and (ref.is_finished() or rng.random() < 0.4):
            prompt = prompts[len(pairs)]
            sp = SamplingParams(temperature=1.0, max_tokens=rng.randint(1, max(1, min(6, capacity - len(prompt)))),
                                ignore_eos=True)
            pair = (Sequence(prompt, bs, sp), Sequence(prompt, bs, sp))
            pairs.append(pair)
            ref.add(pair[0])
            stu.add(pair[1])
            log.append(f"add request {len(pairs) - 1} ({len(prompt)} tokens)")
        index = {id(p[0]): i for i, p in enumerate(pairs)}
        index.update({id(p[1]): i for i, p in enumerate(pairs)})
        r_seqs, r_pre = ref.schedule()
        try:
            s_seqs, s_pre = stu.schedule()
        except NotImplementedError as exc:
            fail(tag, f"not implemented yet ({exc})", "fill in the BlockManager methods above")
        except Exception as exc:
            fail(tag, f"{type(exc).__name__}: {exc} during step {step} of a {what}",
                 "the scenarios passed but the stream did not: look at how preemption (deallocate of a running "
                 "sequence) and chunked prefill (hash_blocks after each chunk) use the manager")
        r_ids, s_ids = [index[id(s)] for s in r_seqs], [index[id(s)] for s in s_seqs]
        kind = "prefill" if r_pre else "decode"
        log.append(f"{kind} {r_ids}")
        if r_ids != s_ids or r_pre != s_pre:
            fail(tag, f"step {step} of a {what}: the scheduler ran requests {s_ids} "
                      f"({'prefill' if s_pre else 'decode'}), expected {r_ids} ({kind}); recent steps: "
                      f"{'; '.join(log[-6:])}",
                 "can_allocate / can_append answered differently from the reference")
        preempted = ref.num_preemptions > preemptions
        preemptions = ref.num_preemptions
        ops = {"allocate", "may_append"} | ({"deallocate"} if preempted else set())
        _stream_compare(tag, ref, stu, pairs, ops, f"step {step} of a {what}" + (" (with a preemption)" if
                                                                                    preempted else ""), log)
        tokens = [rng.randrange(_VOCAB) for _ in r_seqs]
        ref.postprocess(r_seqs, tokens)
        try:
            stu.postprocess(s_seqs, tokens)
        except Exception as exc:
            fail(tag, f"{type(exc).__name__}: {exc} after step {step} of a {what}",
                 "hash_blocks and deallocate run after each step")
        _stream_compare(tag, ref, stu, pairs, {"hash_blocks", "deallocate"},
                        f"the end of step {step} of a {what} (hash_blocks, and deallocate of finished requests)", log)
        try:
            check_block_manager(stu.block_manager, list(stu.running) + list(stu.waiting))
        except AssertionError as exc:
            fail(tag, f"invariant broken after step {step} of a {what}: {exc}; recent steps: "
                      f"{'; '.join(log[-6:])}",
                 "ref counts, the free pool and the hash map must stay consistent after every operation")
    for i, (r, s) in enumerate(pairs):
        if s.token_ids != r.token_ids:
            fail(tag, f"request {i} of a {what} ended with different tokens than on the reference")
    if len(stu.block_manager.free_block_ids) != num_blocks:
        fail(tag, f"after every request of a {what} finished, not all blocks are free", "blocks leaked")


def _stream_compare(tag, ref, stu, pairs, ops, when, log):
    """After a scheduler phase: every request's fields, the free pool (in order) and the block hashes."""
    live = {id(s) for s in list(ref.running) + list(ref.waiting) if s.block_table}
    labelled = [(f"request {i}", r, s, id(r) in live) for i, (r, s) in enumerate(pairs)]
    found = (_seq_diff(ref.block_manager, stu.block_manager, labelled, ops)
             or _tokens_diff(stu.block_manager)
             or _pool_diff(ref.block_manager, stu.block_manager, ops)
             or _hash_diff(ref.block_manager, stu.block_manager, ops)
             or _seq_diff(ref.block_manager, stu.block_manager, labelled, ops, hashed=True))
    if found:
        message, hint = found
        fail(tag, f"{message}, at {when}; recent steps: {'; '.join(log[-6:])}",
             hint or "the scenarios above passed: compare the order the free pool hands out blocks (least "
                     "recently freed first) and when hashes are registered")


def check_block_manager_basics(cls) -> None:
    tag = "E5.2"
    rng = _rng()
    _scenarios_basic(tag, cls, rng, caching=False)
    for _ in range(6):
        _random_stream(tag, cls, rng, caching=False)
    ok(tag)


def check_prefix_caching(cls) -> None:
    tag = "E5.3"
    rng = _rng()
    _scenarios_basic(tag, cls, rng, caching=True)
    _scenarios_caching(tag, cls, rng)
    for _ in range(4):
        _random_stream(tag, cls, rng, caching=True)
    ok(tag)


# --- the chapter's exercises (read by grade, export, engine_check, the capstone and the tests) -----------------
from nanovllm_course.common import EnginePart, Exercise, exercises, parts_of  # noqa: E402

# two exercises fill one field: the later (prefix caching) wins where both are done
EXERCISES = exercises(
    Exercise("E5.1", check_compute_block_hash, ("compute_block_hash",), (reference_compute_block_hash,)),
    Exercise("E5.2", check_block_manager_basics, ("BlockManager",), (ReferenceBlockManager,), parts=(
        EnginePart("BlockManager", "block_manager", "E5.2", check=lambda mod: check_block_manager_basics(mod.BlockManager)),)),
    Exercise("E5.3", check_prefix_caching, ("CachingBlockManager",), (ReferenceBlockManager,), parts=(
        EnginePart("CachingBlockManager", "block_manager", "E5.3",
                   check=lambda mod: check_prefix_caching(mod.CachingBlockManager)),)),
)
PARTS = parts_of(EXERCISES)
