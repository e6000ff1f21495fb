"""Paged KV accounting: allocation, prefix units, LRU eviction, conservation."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.serving.kv_cache import BlockManager


def test_allocate_release_conserves_blocks():
    kv = BlockManager(10, 16)
    kv.allocate(7)
    assert kv.free == 3 and kv.used == 7
    kv.release(7)
    kv.check()
    assert kv.free == 10


def test_over_commit_raises():
    kv = BlockManager(4, 16)
    with pytest.raises(RuntimeError, match="over-committed"):
        kv.allocate(5)


def test_unit_size_must_be_whole_blocks():
    with pytest.raises(ValueError, match="whole number"):
        BlockManager(10, 16, unit_tokens=40)


def test_publish_match_acquire_and_lru_eviction():
    kv = BlockManager(12, 16, unit_tokens=64)  # a unit = 4 blocks
    kv.allocate(8)  # request 1 computes two units
    assert kv.publish([7, 8]) == 2
    assert kv.publish([7]) == 0  # already cached: the caller keeps its copy
    assert kv.private == 0 and kv.used == 8
    assert kv.match([7, 8, 9], max_units=3) == [7, 8]
    assert kv.match([8, 7], max_units=2) == [8, 7]
    assert kv.match([7, 8], max_units=1) == [7]
    kv.release_units([7, 8])  # request 1 finishes: both cached, evictable, counted free
    assert kv.free == 12 and kv.used == 0
    kv.acquire([8])  # a new request pins unit 8
    kv.allocate(8)  # needs every free block but unit 8's: evicts unit 7 (LRU), not 8
    assert kv.match([7], 1) == [] and kv.match([8], 1) == [8] and kv.evictions == 1
    kv.check()


def test_publish_stops_at_the_first_unit_cached_already():
    kv = BlockManager(12, 16, unit_tokens=64)
    kv.allocate(12)
    assert kv.publish([7]) == 1
    assert kv.publish([9, 7, 10]) == 1  # 7 is cached: the caller keeps its copies of 7 and 10
    assert kv.private == 4 and kv.match([9], 1) == [9] and kv.match([10], 1) == []
    kv.check()


def test_a_shortage_eviction_cannot_cover_evicts_nothing():
    kv = BlockManager(12, 16, unit_tokens=64)
    kv.allocate(8)
    kv.publish([7, 8])
    kv.release_units([7, 8])
    kv.acquire([8])  # 4 empty blocks and unit 7's 4 evictable ones: 8 free
    with pytest.raises(RuntimeError, match="need 12 blocks, 8 free"):
        kv.allocate(12)
    assert kv.match([7], 1) == [7] and kv.evictions == 0 and kv.free == 8
    kv.check()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "release", "publish", "acquire", "drop"]), st.integers(0, 9)),
        max_size=60,
    )
)
def test_blocks_conserved_under_random_operations(ops):
    kv = BlockManager(40, 16, unit_tokens=32)
    held_units: list[int] = []
    for op, x in ops:
        if op == "alloc" and x <= kv.free:
            kv.allocate(x)
        elif op == "release" and x <= kv.private:
            kv.release(x)
        elif op == "publish" and kv.private >= kv.unit_blocks and kv.publish([x]) == 1:
            held_units.append(x)
        elif op == "acquire":
            hits = kv.match([x], 1)
            kv.acquire(hits)
            held_units.extend(hits)
        elif op == "drop" and held_units:
            kv.release_units([held_units.pop()])
        kv.check()
        assert kv.used + kv.free == kv.total
