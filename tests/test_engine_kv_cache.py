"""Block allocator and prefix cache of engine/kv_cache.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import KVCache, PagedKVPool, block_hashes
from engine.model import preset

BS = 4


def _prefill(bm: PagedKVPool, seq_id: str, tokens: list[int]) -> int:
    """Add a sequence and compute its whole prompt; returns the cached tokens."""
    cached = bm.add(seq_id, tokens)
    assert bm.reserve(seq_id, len(tokens))
    bm.mark_computed(seq_id, len(tokens))
    return cached


def test_block_hashes_chain_parents_and_skip_partial_block():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1], "same tokens after a different prefix must hash differently"
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS) == a


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    bm = PagedKVPool(16, BS)
    prompt = list(range(10))
    assert _prefill(bm, "a", prompt) == 0
    assert bm.add("b", prompt[:8] + [99, 98]) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    # A prompt that is exactly two cached blocks still computes its last token.
    assert bm.add("c", prompt[:8]) == 4
    assert bm.num_cached_tokens(prompt[:9]) == 8
    bm.check_consistency()


def test_freed_cached_blocks_are_reused_then_evicted_lru_tail_first():
    bm = PagedKVPool(4, BS)
    _prefill(bm, "a", list(range(12)) + [0])  # 3 full blocks + 1 partial = all 4 blocks
    table = bm.block_table("a")
    bm.free("a")
    assert bm.num_free_blocks == 4
    assert bm.add("a2", list(range(12)) + [5]) == 12  # a recompute after preemption hits all 3
    bm.free("a2")
    # Taking one block now evicts the prompt's last full block first, keeping its head.
    bm.add("b", [7])
    assert bm.reserve("b", 4) and bm.reserve("b", 5)
    assert bm.block_table("b") == [table[3], table[2]]
    assert bm.num_cached_tokens(list(range(12)) + [0]) == 8
    bm.check_consistency()


def test_reserve_without_room_changes_nothing():
    bm = PagedKVPool(3, BS)
    bm.add("a", [1, 2, 3])
    assert bm.reserve("a", 8)
    assert not bm.reserve("a", 13)
    assert bm.block_table("a") == [0, 1] and bm.num_free_blocks == 1
    assert bm.blocks_needed("a", 13) == 2


def test_disabled_prefix_caching_never_hits():
    bm = PagedKVPool(8, BS, enable_prefix_caching=False)
    _prefill(bm, "a", list(range(9)))
    assert bm.add("b", list(range(9))) == 0
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda bm: bm.add("a", [1]), "already registered"),
        (lambda bm: bm.add("z", []), "no tokens"),
        (lambda bm: bm.free("nope"), "unknown sequence 'nope'"),
        (lambda bm: bm.mark_computed("a", 9), "cannot have 9 computed"),
    ],
)
def test_bad_calls_name_the_sequence(call, match):
    bm = PagedKVPool(4, BS)
    bm.add("a", [1, 2, 3])
    with pytest.raises(ValueError, match=match):
        call(bm)


def test_kv_cache_shape_and_size():
    cfg = preset("tiny")
    cache = KVCache(cfg, num_blocks=5, block_size=BS, dtype=torch.float64)
    assert cache.k.shape == (cfg.num_layers, 5, BS, cfg.num_kv_heads, cfg.head_dim)
    assert KVCache.bytes_per_block(cfg, BS, torch.float64) == 2 * cache.k[:, 0].numel() * 8
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(cfg, 0, BS, torch.float32)


_BASE = list(range(100, 116))  # prompts share prefixes of this, so prefix hits are common
_op = st.tuples(
    st.sampled_from(["add", "add", "step", "step", "step", "free"]),
    st.integers(0, 5),  # sequence slot
    st.integers(0, 16),  # length of the shared prefix of the prompt
    st.lists(st.integers(0, 2), min_size=1, max_size=6),  # the prompt's own tail
    st.integers(1, 16),  # tokens computed by a step
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 16), ops=st.lists(_op, max_size=80))
def test_random_workload_conserves_blocks_and_hits_only_matching_content(num_blocks, ops):
    """Blocks in use + free = total after every operation, and every prefix hit holds the right tokens.

    Sequences are added (re-adding one is a preemption: it returns with all its tokens),
    stepped through their tokens (a step that reaches the end appends a generated token)
    and freed.  ``content`` stands in for the KV tensors: what the runner wrote where.
    """
    bm = PagedKVPool(num_blocks, BS)
    content: dict[int, list[int | None]] = {b: [None] * BS for b in range(num_blocks)}
    known: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    for op, slot, shared, tail, n in ops:
        sid = f"s{slot}"
        prompt = _BASE[:shared] + tail
        if op == "add":
            if sid in known:  # preempted: it comes back with all its tokens, to recompute
                bm.free(sid)
                prompt = known.pop(sid)
            cached = bm.add(sid, prompt)
            table = bm.block_table(sid)
            assert cached < len(prompt) and cached == BS * len(table)
            assert [content[table[p // BS]][p % BS] for p in range(cached)] == prompt[:cached]
            known[sid], computed[sid] = list(prompt), cached
        elif op == "step" and sid in known:
            start = computed[sid]
            end = min(start + n, len(known[sid]))
            if bm.reserve(sid, end):
                table = bm.block_table(sid)
                for p in range(start, end):
                    content[table[p // BS]][p % BS] = known[sid][p]
                bm.mark_computed(sid, end)
                computed[sid] = end
                if end == len(known[sid]):
                    bm.append_token(sid, (start + n) % 3)
                    known[sid].append((start + n) % 3)
        elif op == "free" and sid in known:
            bm.free(sid)
            del known[sid], computed[sid]
        bm.check_consistency()
        assert bm.num_used_blocks + bm.num_free_blocks == num_blocks
        assert bm.num_used_blocks == len({b for s in known for b in bm.block_table(s)})
