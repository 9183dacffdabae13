"""Invariants of the BlockManager, checked by tests after every engine step (chapter 05).

`check_block_manager(bm, live_seqs)` raises AssertionError with a readable message when one fails:
1. free blocks + used blocks == all blocks, and the two sets are disjoint;
2. each block's ref count == the number of live block tables holding it (0 for free blocks);
3. every hash-map entry points at a block that carries that hash and whose token ids are set.
"""
from collections import Counter


def check_block_manager(bm, live_seqs) -> None:
    n = len(bm.blocks)
    free, used = set(bm.free_block_ids), set(bm.used_block_ids)
    if free & used:
        raise AssertionError(f"blocks both free and used: {sorted(free & used)[:8]}")
    if len(free) + len(used) != n:
        raise AssertionError(f"free ({len(free)}) + used ({len(used)}) != total ({n})")
    holders = Counter(b for seq in live_seqs for b in seq.block_table)
    for block in bm.blocks:
        if block.ref_count != holders.get(block.block_id, 0):
            raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} but held by "
                                 f"{holders.get(block.block_id, 0)} live block tables")
        if (block.ref_count == 0) != (block.block_id in free):
            raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} but "
                                 f"{'in' if block.block_id in free else 'not in'} the free pool")
    for h, block_id in bm.hash_to_block_id.items():
        block = bm.blocks[block_id]
        if block.hash != h or not block.token_ids:
            raise AssertionError(f"hash map entry {h:#x} -> block {block_id}, which carries hash {block.hash:#x}")
