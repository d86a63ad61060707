"""The paged KV pool's bookkeeping: allocation, slot mapping, freeing, and the invariant checker."""
import random

import pytest

from refengine.engine.block_manager import BlockManager, BlockTable, block_hashes


def test_allocate_grows_table_to_cover_tokens_and_free_returns_everything():
    manager = BlockManager(num_blocks=10, block_size=4)
    table = BlockTable("a")
    manager.allocate(table, 5)
    assert len(table) == 2 and manager.num_used_blocks == 2
    manager.allocate(table, 8)  # still fits in two blocks
    assert len(table) == 2
    manager.allocate(table, 9)
    assert len(table) == 3 and manager.num_free_blocks == 7
    manager.check_invariants()
    manager.free(table)
    assert len(table) == 0 and manager.num_free_blocks == 10
    manager.check_invariants([table])


def test_slot_mapping_follows_the_block_table():
    manager = BlockManager(num_blocks=6, block_size=4)
    other, table = BlockTable("other"), BlockTable("t")
    manager.allocate(other, 4)  # takes a block so `table` does not start at block 0
    manager.allocate(table, 10)
    expected = [block * 4 + offset for block in table.block_ids for offset in range(4)][:10]  # block by block
    assert manager.slot_mapping(table, 0, 10) == expected
    assert manager.slot_mapping(table, 3, 7) == expected[3:7]
    assert not set(expected) & set(manager.slot_mapping(other, 0, 4))


def test_pool_exhaustion_is_refused_not_overcommitted():
    manager = BlockManager(num_blocks=3, block_size=2)
    a, b = BlockTable("a"), BlockTable("b")
    manager.allocate(a, 4)
    assert manager.can_allocate(b, 2) and not manager.can_allocate(b, 3)
    with pytest.raises(RuntimeError, match="b"):
        manager.allocate(b, 3)
    assert len(b) == 0
    manager.check_invariants()


@pytest.mark.parametrize("corrupt, message", [
    (lambda m, t: m.free_block_ids.__setitem__(t.block_ids[0], None), "both free and used"),
    (lambda m, t: m.cached.__setitem__(b"stale", t.block_ids[0]), "disagree"),
    (lambda m, t: m.free_block_ids.popitem(last=False), "free .* \\+ used"),
    (lambda m, t: t.block_ids.append(t.block_ids[0]), "refcount"),
])
def test_check_invariants_catches_corruption(corrupt, message):
    manager = BlockManager(num_blocks=5, block_size=2)
    table = BlockTable("t")
    manager.allocate(table, 3)
    manager.check_invariants()
    corrupt(manager, table)
    with pytest.raises(AssertionError, match=message):
        manager.check_invariants()


def test_check_invariants_catches_a_finished_table_holding_blocks():
    manager = BlockManager(num_blocks=4, block_size=2)
    table = BlockTable("done")
    manager.allocate(table, 2)
    with pytest.raises(AssertionError, match="done"):
        manager.check_invariants([table])


def test_random_allocate_free_sequences_keep_the_accounting_exact():
    rng = random.Random(0)
    manager = BlockManager(num_blocks=16, block_size=3)
    live: dict[str, tuple[BlockTable, int]] = {}
    for n in range(2000):
        if live and rng.random() < 0.3:
            owner = rng.choice(sorted(live))
            manager.free(live.pop(owner)[0])
        else:
            owner = rng.choice(sorted(live)) if live and rng.random() < 0.6 else f"s{n}"
            table, tokens = live.get(owner, (BlockTable(owner), 0))
            tokens += rng.randint(1, 7)
            if manager.can_allocate(table, tokens):
                manager.allocate(table, tokens)
                live[owner] = (table, tokens)
        manager.check_invariants()
        slots = [manager.slot_mapping(t, 0, k) for t, k in live.values()]
        all_slots = [slot for table_slots in slots for slot in table_slots]
        assert len(set(all_slots)) == len(all_slots), "two live tokens share a cache slot"
        assert manager.num_used_blocks == sum(manager.blocks_for(k) for _, k in live.values())


# --- prefix caching ---------------------------------------------------------------------------------
def test_block_hashes_chain_through_the_parent():
    """Equal hashes mean equal tokens from position 0 on: a block's tokens after another prefix hash
    differently, and a hash computed in pieces (parent given) is the one computed at once."""
    a = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(a) == 2 and a == block_hashes([1, 2, 3, 4], 2)
    assert block_hashes([9, 9, 3, 4], 2)[1] != a[1]  # same block, another parent
    assert block_hashes([3, 4], 2, parent=a[0]) == a[1:]
    assert block_hashes([1], 2) == []


def test_a_cached_prefix_is_shared_counted_and_evicted_least_recently_freed_first():
    manager = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a = BlockTable("a")
    manager.allocate(a, 4)
    hashes = block_hashes([1, 2, 3, 4], 2)
    manager.register(a, hashes)
    b = BlockTable("b")
    hit = manager.cached_prefix(hashes + block_hashes([1, 2, 3, 4, 5, 6], 2)[2:])
    assert hit == a.block_ids  # the third block was never registered
    assert manager.num_free_after_hit(hit) == 2  # shared, not taken from the free list
    manager.take_cached(b, hit)
    assert [manager.ref_counts[x] for x in hit] == [2, 2]
    manager.check_invariants()
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 4 and manager.cached_prefix(hashes) == hit  # freed, still cached
    assert manager.num_free_after_hit(hit) == 2  # a hit on free blocks takes them off the free list
    c = BlockTable("c")
    manager.allocate(c, 6)  # the never-used blocks first, then the least recently freed: the prefix's tail
    assert c.block_ids == [2, 3, hit[1]]
    assert manager.cached_prefix(hashes) == hit[:1]  # the evicted block is not found through its old hash
    manager.check_invariants()


def test_without_caching_nothing_is_found_or_registered():
    manager = BlockManager(num_blocks=4, block_size=2)
    a = BlockTable("a")
    manager.allocate(a, 4)
    hashes = block_hashes([1, 2, 3, 4], 2)
    manager.register(a, hashes)
    assert manager.cached == {} and manager.cached_prefix(hashes) == []


def test_a_hash_already_registered_keeps_its_block():
    manager = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a, b = BlockTable("a"), BlockTable("b")
    manager.allocate(a, 2)
    manager.allocate(b, 2)
    [h] = block_hashes([1, 2], 2)
    manager.register(a, [h])
    manager.register(b, [h])
    assert manager.cached == {h: a.block_ids[0]} and manager.hash_of == {a.block_ids[0]: h}
    manager.check_invariants()
