"""The paged KV cache's bookkeeping, with prefix caching (chapter 05).

The KV cache is cut into `num_blocks` blocks of `block_size` token slots. A sequence's block table lists
the blocks holding its tokens in order, so slot(token p) = block_table[p // block_size] * block_size
+ p % block_size (vLLM, PagedAttention paper §4.1-4.2).

Prefix caching (vLLM's automatic prefix caching; upstream nano-vllm `engine/block_manager.py`):
- A *full* block whose K/V has been written gets a hash chained over all tokens up to its end:
  h_i = xxh64(h_{i-1} || token_ids of block i). Equal hashes mean equal prefixes, so a new sequence whose
  first blocks hash the same reuses them instead of recomputing. Hash collisions are possible, so a hit
  must also pass two exact checks: the cached block holds the same token ids, and it was computed after
  exactly the prefix this sequence just matched. For the second, every hashed block carries a *lineage*: an
  id interned from (its parent's lineage, its token ids), so two blocks share a lineage only if their whole
  token prefixes are equal; a hit needs the cached block's parent lineage to equal the lineage of the block
  matched before it. Duplicate copies of one prefix (two requests that prefilled it in the same step) share
  a lineage, so no valid hit is lost; a hash collision after a different prefix never hits, whatever the
  hash function.
- Blocks are shared, so each has a ref count: the number of live block tables holding it. A block returns to
  the free pool only at ref count 0.
- A freed block keeps its hash and contents until the pool hands it out again (least recently freed first),
  so a prompt that comes back after its first request finished still hits.
- A request with prompt_logprobs takes no hit until its prompt's logits are computed (vLLM does the same):
  a cached block has K/V but no logits. Its own blocks are hashed as usual, so later requests hit them.
- Hashes are registered only after the step that wrote the block (`hash_blocks`), so no sequence can hit a
  block whose K/V is not in the cache yet (with chunked prefill a block can be allocated steps before it is
  written).
"""
from array import array
from collections import OrderedDict
from itertools import count

import xxhash

from nanovllm_ref.engine.sequence import Sequence


def compute_block_hash(token_ids: list[int], prefix_hash: int = -1) -> int:
    """Chained xxh64 of one full block: hash(prefix_hash bytes || token ids as int64). -1 = no prefix."""
    h = xxhash.xxh64()
    if prefix_hash != -1:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1          # -1: not a full, written block (or reset after reuse)
        self.token_ids: list[int] = []
        self.lineage = -1       # id of the exact token prefix this block's K/V was computed under (-1: none)
        self.parent_lineage = -1    # lineage of the block before it when it was hashed (-1: first block)

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []
        self.lineage = self.parent_lineage = -1


class BlockManager:
    """Allocates KV-cache blocks to sequences; shares full prefix blocks between them.

    num_blocks: blocks in the cache (>= 1). block_size: token slots per block (>= 1).
    enable_prefix_caching: if False, every sequence gets fresh blocks (no hashing, no sharing).
    hash_fn: fn(token_ids, prefix_hash=-1) -> int >= 0, the chained block hash (default: xxh64,
        `compute_block_hash`). Only speed depends on its quality: hits are verified exactly.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn=compute_block_hash):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if not callable(hash_fn):
            raise TypeError(f"hash_fn must be callable, got {type(hash_fn).__name__}")
        self.hash_fn = hash_fn
        # Exact prefix identity, independent of the hash: (parent lineage, block tokens) -> lineage id. Two
        # blocks share a lineage iff their whole token prefixes are equal, so a hit can demand that the
        # cached block was computed after *this* prefix without losing hits on duplicate copies of it.
        self._lineage_ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self._lineage_keys: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._lineage_users: dict[int, int] = {}
        self._next_lineage = count()
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Insertion order = order of freeing: the front is the least recently freed, handed out first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    # -- allocation -------------------------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        # Re-using the block destroys its old contents, so its prefix-cache entry must go too.
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        self._drop_lineage(block.lineage)
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, in order (full blocks only); none for a sequence
        that still needs its prompt's logits (prompt_logprobs): a hit would skip computing them."""
        if not self.enable_prefix_caching or getattr(seq, "needs_prompt_logprobs", False):
            return []
        hits, h, parent_lineage = [], -1, -1
        for i in range(len(seq) // self.block_size):
            tokens = seq.block(i)
            h = self.hash_fn(tokens, h)
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            # A hash collision unless the block holds these tokens and was computed after this exact prefix.
            if block.token_ids != tokens or block.parent_lineage != parent_lineage:
                break
            hits.append(block_id)
            parent_lineage = block.lineage
        # If the whole sequence is cached there is no token left to compute logits from: recompute the
        # last block (into a fresh block, never into a shared one).
        if hits and len(hits) * self.block_size == len(seq):
            hits.pop()
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """True if `seq` (not yet allocated) can get blocks for all its tokens now."""
        hits = self._match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)   # hits sitting in the free pool
        return self.num_free_blocks - revived >= seq.num_blocks - len(hits)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` a block table covering all its tokens, reusing cached prefix blocks.

        Sets seq.num_cached_tokens to the number of tokens whose K/V is already in the cache.
        Raises RuntimeError if called without room (check can_allocate first) or twice.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
        if not self.can_allocate(seq):
            raise RuntimeError("not enough free KV-cache blocks; call can_allocate first")
        hits = self._match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:             # freed earlier but still holding its K/V: revive it
                del self.free_block_ids[block_id]
                self.used_block_ids.add(block_id)
            block.ref_count += 1
        fresh = [self._take_free_block() for _ in range(seq.num_blocks - len(hits))]
        seq.block_table = hits + fresh
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child`, a sibling sample with the same prompt and no blocks yet, the full blocks of
        `parent`'s prefilled prompt, shared (ref count + 1 each), and fresh blocks for the rest of the
        prompt, which the child recomputes (at least its last token: its logits give the child's first
        token). Returns False, changing nothing, if the fresh blocks are not free. Works with prefix caching
        off too (the sharing is by ref count, not by hash). Raises RuntimeError if `child` has blocks."""
        if child.block_table:
            raise RuntimeError(f"sequence {child.seq_id} already has blocks")
        shared = min((len(child) - 1) // self.block_size, len(parent.block_table))
        fresh = child.num_blocks - shared
        if self.num_free_blocks < fresh:
            return False
        for block_id in parent.block_table[:shared]:
            self.blocks[block_id].ref_count += 1
        child.block_table = parent.block_table[:shared] + [self._take_free_block() for _ in range(fresh)]
        child.num_cached_tokens = shared * self.block_size
        child.num_hashed_blocks = min(shared, parent.num_hashed_blocks)
        return True

    def deallocate(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks reaching ref count 0 go back to the free pool, hash kept."""
        # Free the tail first so it is reused first: the shared prefix blocks stay cached longest.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0

    # -- exact prefix identity ----------------------------------------------------------------------------
    def _take_lineage(self, parent_lineage: int, tokens) -> int:
        key = (parent_lineage, tuple(tokens))
        lineage = self._lineage_ids.get(key)
        if lineage is None:
            lineage = next(self._next_lineage)
            self._lineage_ids[key], self._lineage_keys[lineage] = lineage, key
        self._lineage_users[lineage] = self._lineage_users.get(lineage, 0) + 1
        return lineage

    def _drop_lineage(self, lineage: int) -> None:
        """A block stops holding `lineage`; forget the id when no block holds it (memory stays bounded by
        the cache size). A child cached under a forgotten parent id then simply misses."""
        if lineage == -1:
            return
        self._lineage_users[lineage] -= 1
        if self._lineage_users[lineage] == 0:
            del self._lineage_users[lineage], self._lineage_ids[self._lineage_keys.pop(lineage)]

    # -- decode -----------------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """True if the next decode step of `seq` can get the block it may need."""
        return len(seq.block_table) >= seq.num_blocks or self.num_free_blocks >= 1

    def may_append(self, seq: Sequence) -> None:
        """Before a decode step: add a block if the last token starts a new one."""
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._take_free_block())

    # -- after a step -----------------------------------------------------------------------------------
    def hash_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks that this step filled and wrote, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_cached_tokens // self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            parent = self.blocks[seq.block_table[i - 1]] if i > 0 else None
            tokens = seq.block(i)
            block = self.blocks[seq.block_table[i]]
            block.hash = self.hash_fn(tokens, parent.hash if parent else -1)
            block.token_ids = list(tokens)
            self._drop_lineage(block.lineage)
            block.parent_lineage = parent.lineage if parent else -1
            block.lineage = self._take_lineage(block.parent_lineage, tokens)
            self.hash_to_block_id[block.hash] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)
