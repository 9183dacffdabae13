"""Property-based tests: random request streams drive the Scheduler and BlockManager under a tight block
budget, with a fake model. After every step the BlockManager invariants hold; every request finishes with
exactly its max_tokens; nothing is left allocated at the end."""
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm_ref.engine.block_manager import BlockManager, compute_block_hash
from nanovllm_ref.engine.invariants import check_block_manager
from nanovllm_ref.engine.scheduler import Scheduler
from nanovllm_ref.engine.sequence import Sequence
from nanovllm_ref.sampling_params import SamplingParams


def fake_next_token(seq) -> int:
    """A deterministic 'model': the next token depends only on the tokens so far (like greedy decoding)."""
    return compute_block_hash(seq.token_ids[-3:]) % 7


requests = st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=12),   # small alphabet:
                              st.integers(1, 8),                                        # many shared prefixes
                              st.integers(0, 3)),                                       # arrival step
                    min_size=1, max_size=10)


@settings(max_examples=120, deadline=None)
@given(reqs=requests, block_size=st.integers(1, 5), budget=st.integers(1, 16), max_seqs=st.integers(1, 4),
       spare_blocks=st.integers(0, 4), prefix=st.booleans())
def test_random_request_streams_keep_block_manager_invariants(reqs, block_size, budget, max_seqs, spare_blocks, prefix):
    longest = max(len(p) + n for p, n, _ in reqs)
    num_blocks = (longest + block_size - 1) // block_size + spare_blocks     # the largest request just fits
    cfg = SimpleNamespace(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=10_000,
                          eos=frozenset(), num_kvcache_blocks=num_blocks, kvcache_block_size=block_size,
                          enable_prefix_caching=prefix)
    sched = Scheduler(cfg)
    pending = sorted(reqs, key=lambda r: r[2])
    seqs, step = [], 0
    while pending or not sched.is_finished():
        while pending and pending[0][2] <= step:
            prompt, max_tokens, _ = pending.pop(0)
            seq = Sequence(prompt, block_size, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            seqs.append(seq)
            sched.add(seq)
        if not sched.is_finished():
            batch, is_prefill = sched.schedule()
            assert batch, "scheduler returned an empty batch while requests are pending (would hang)"
            if is_prefill:
                assert sum(s.num_scheduled_tokens for s in batch) <= budget
            assert len(batch) <= max_seqs
            for s in batch:                        # the slots this step writes lie inside the block table
                assert s.num_cached_tokens + s.num_scheduled_tokens <= len(s.block_table) * block_size
            sched.postprocess(batch, [fake_next_token(s) for s in batch])
            check_block_manager(sched.block_manager, list(sched.running) + list(sched.waiting))
        step += 1
        assert step < 10_000, "no progress"
    bm = sched.block_manager
    assert bm.num_free_blocks == num_blocks and not bm.used_block_ids
    for seq in seqs:
        assert seq.num_completion_tokens == seq.max_tokens
        # The completion is what the fake model gives when run token by token, whatever the batching was.
        replay = Sequence(seq.prompt_token_ids, block_size)
        for _ in range(seq.max_tokens):
            replay.append_token(fake_next_token(replay))
        assert seq.token_ids == replay.token_ids


def test_freed_block_keeps_its_hash_until_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Sequence([1, 2, 3, 4], 2)
    bm.allocate(a)
    a.num_cached_tokens = 4
    bm.hash_blocks(a)
    table = list(a.block_table)
    bm.deallocate(a)
    assert all(bm.blocks[i].hash != -1 and bm.blocks[i].ref_count == 0 for i in table)
    b = Sequence([1, 2, 3, 4, 5], 2)
    bm.allocate(b)                                   # revives both cached blocks from the free pool
    assert b.block_table[:2] == table
    assert b.num_cached_tokens == 4
    check_block_manager(bm, [b])


def test_unwritten_block_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = Sequence([1, 2, 3, 4, 5], 2), Sequence([1, 2, 3, 4, 5], 2)
    bm.allocate(a)                                   # allocated but no K/V written yet (no hash_blocks)
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)


def test_shared_prefix_blocks_have_ref_count_of_their_holders():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Sequence([1, 2, 3, 4, 5], 2)
    bm.allocate(a)
    a.num_cached_tokens = 5
    bm.hash_blocks(a)
    b = Sequence([1, 2, 3, 4, 9], 2)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    check_block_manager(bm, [b])


def test_hash_collision_is_caught_by_comparing_token_ids():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Sequence([1, 2, 3], 2)
    bm.allocate(a)
    a.num_cached_tokens = 2
    bm.hash_blocks(a)
    bm.blocks[a.block_table[0]].token_ids = [9, 9]     # pretend another prefix produced the same hash
    b = Sequence([1, 2, 3], 2)
    bm.allocate(b)
    assert b.num_cached_tokens == 0
