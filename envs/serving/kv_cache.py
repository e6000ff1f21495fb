"""Paged KV-cache accounting with prefix caching, for the serving core.

The simulator never touches tensors, so blocks are counted, not addressed: a request
holds some *private* blocks (its own KV) and references some *shared units*, each a
prefix block of the trace's hash granularity (Mooncake hashes 512-token blocks), made
of ``unit_blocks`` KV blocks.  A unit is published into the cache once a request has
computed it; later requests whose hash ids match reuse it.  Units nobody references
stay cached but evictable, in LRU order, and count as free.

Invariant (checked by :meth:`check`): private + units in use + units cached-free + empty
= total blocks, with free = empty + cached-free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, unit_tokens: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        if unit_tokens and unit_tokens % block_size:
            raise ValueError(
                f"prefix hash blocks of {unit_tokens} tokens are not a whole number of "
                f"{block_size}-token KV blocks"
            )
        self.total = num_blocks
        self.block_size = block_size
        self.unit_tokens = unit_tokens
        self.unit_blocks = unit_tokens // block_size if unit_tokens else 0
        self.empty = num_blocks
        # Blocks that can be handed out now (empty ones plus evictable cached units): kept up to
        # date by every change of either, as the planners and the core read it several times a step.
        self.free = num_blocks
        self.private = 0
        self._refs: dict[int, int] = {}  # unit hash id -> references (> 0: in use)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first
        self.evictions = 0

    # ---- capacity -----------------------------------------------------------------
    @property
    def used(self) -> int:
        return self.total - self.free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _make_room(self, blocks: int) -> None:
        """Evict the least recently used cached units until ``blocks`` are empty."""
        short, lru = blocks - self.empty, self._evictable
        if short > len(lru) * self.unit_blocks:
            raise RuntimeError(f"KV cache over-committed: need {blocks} blocks, {self.free} free")
        units, refs = -(-short // self.unit_blocks), self._refs
        for _ in range(units):
            del refs[lru.popitem(last=False)[0]]
        self.empty += units * self.unit_blocks  # evictable units were free already: free is unchanged
        self.evictions += units

    # ---- private blocks -------------------------------------------------------------
    def allocate(self, blocks: int) -> None:
        if blocks:
            if self.empty < blocks:
                self._make_room(blocks)
            self.empty -= blocks
            self.free -= blocks
            self.private += blocks

    def release(self, blocks: int) -> None:
        self.private -= blocks
        self.empty += blocks
        self.free += blocks

    # ---- shared prefix units --------------------------------------------------------
    def match(self, hash_ids: Sequence[int], max_units: int) -> list[int]:
        """The longest run of cached units at the start of ``hash_ids``, at most ``max_units``."""
        hits = []
        refs = self._refs
        for uid in hash_ids[:max_units]:
            if uid not in refs:
                break
            hits.append(uid)
        return hits

    def acquire(self, uids: list[int]) -> None:
        """Reference cached units (pinning them against eviction)."""
        refs, lru, pinned = self._refs, self._evictable, 0
        for uid in uids:
            n = refs[uid]
            if n == 0:
                del lru[uid]
                pinned += 1
            refs[uid] = n + 1
        self.free -= pinned * self.unit_blocks

    def publish(self, uids: Sequence[int]) -> int:
        """Turn ``unit_blocks`` of the caller's private blocks into each cached unit of ``uids``, in
        order, up to the first cached already (another request computed the same prefix meanwhile:
        the caller keeps its private copy from there on); how many it published."""
        refs = self._refs
        published = 0
        for uid in uids:
            if uid in refs:
                break
            refs[uid] = 1
            published += 1
        self.private -= published * self.unit_blocks
        return published

    def release_units(self, uids: list[int]) -> None:
        refs, lru, unpinned = self._refs, self._evictable, 0
        for uid in uids:
            n = refs[uid] - 1
            refs[uid] = n
            if n == 0:
                lru[uid] = None
                unpinned += 1
        self.free += unpinned * self.unit_blocks

    def check(self) -> None:
        in_use = sum(1 for n in self._refs.values() if n > 0)
        cached_free = len(self._evictable)
        assert in_use + cached_free == len(self._refs)
        accounted = self.private + (in_use + cached_free) * self.unit_blocks + self.empty
        assert accounted == self.total, f"KV blocks not conserved: {accounted} != {self.total}"
        assert self.empty >= 0 and self.private >= 0
        assert self.free == self.empty + cached_free * self.unit_blocks, "free blocks miscounted"
