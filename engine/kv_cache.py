"""Paged KV cache: the tensors that hold K/V, and the block allocator with prefix caching.

:class:`KVCache` owns the device memory: K and V of shape
``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``; token ``p`` of a
sequence lives in block ``table[p // block_size]`` at offset ``p % block_size``.

:class:`PagedKVPool` decides which blocks a sequence uses; it is plain Python (no
torch) and never touches the tensors.  A block is *in use* while some sequence's block
table holds it (reference count > 0) and *free* otherwise; a free block that holds a
full, hashed block of computed tokens stays in the prefix cache until it is evicted
(least recently freed first) to serve a new allocation.  Invariant, checked by
:meth:`PagedKVPool.check_consistency`: in use + free = total.

A full block's hash chains the hash of the block before it with its token ids, so a
hash names a whole prefix.  Hashes are Python's 64-bit tuple hash, which is stable
across processes for ints; two different prefixes colliding has probability ~2^-64.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from engine.model import ModelConfig


class KVCache:
    """K/V storage for every layer, in fixed-size blocks."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"KVCache: need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass
class _Seq:
    tokens: list[int]
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of table[: len(hashes)], all computed and full


class PagedKVPool:
    """Block allocator with reference counts, per-sequence block tables and a prefix cache.

    Life of a sequence: :meth:`add` (attaches cached prefix blocks), then per iteration
    :meth:`reserve` blocks for the tokens about to be computed, :meth:`mark_computed`
    after the forward pass (publishes full blocks to the prefix cache) and
    :meth:`append_token` for each generated token; :meth:`free` on finish or preemption.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"PagedKVPool: need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached; oldest first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._seqs: dict[Hashable, _Seq] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (including cached ones that may be evicted)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._get(seq_id).table

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens known for the sequence (prompt plus appended)."""
        return len(self._get(seq_id).tokens)

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` that :meth:`add` would take from the prefix cache.

        At most ``len(token_ids) - 1`` rounded down to whole blocks: the last token is
        always computed, so its logits exist and no shared block is ever written.
        """
        return self.block_size * len(self._match(token_ids))

    def add(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Register a sequence with its known tokens; returns how many leading tokens are cached.

        Cached blocks are attached to its table (a free cached block leaves the free pool);
        the caller computes the tokens from that position on.
        """
        if seq_id in self._seqs:
            raise ValueError(f"PagedKVPool.add: sequence {seq_id!r} is already registered")
        if not token_ids:
            raise ValueError(f"PagedKVPool.add: sequence {seq_id!r} has no tokens")
        matched = self._match(token_ids)
        for block in matched:
            self._take(block)
        hashes = [cast(int, self._hash[b]) for b in matched]  # matched blocks are cached, so hashed
        self._seqs[seq_id] = _Seq(list(token_ids), [b for b in matched], hashes)
        return self.block_size * len(matched)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """New blocks :meth:`reserve` would take to cover positions ``[0, num_tokens)``."""
        return max(0, -(-num_tokens // self.block_size) - len(self._get(seq_id).table))

    def reserve(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Grow the table to cover positions ``[0, num_tokens)``; False (and no change) if blocks run out."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.num_free_blocks:
            return False
        table = self._seqs[seq_id].table
        for _ in range(need):
            table.append(self._allocate())
        return True

    def append_token(self, seq_id: Hashable, token_id: int) -> None:
        """Record a generated token (so its block can be hashed once full and computed)."""
        self._get(seq_id).tokens.append(token_id)

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Positions ``[0, num_tokens)`` now hold K/V: publish their full blocks to the prefix cache."""
        seq = self._get(seq_id)
        if num_tokens > min(len(seq.tokens), len(seq.table) * self.block_size):
            raise ValueError(
                f"PagedKVPool.mark_computed: sequence {seq_id!r} has {len(seq.tokens)} tokens and "
                f"{len(seq.table)} blocks, cannot have {num_tokens} computed"
            )
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        while (len(seq.hashes) + 1) * bs <= num_tokens:
            i = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else None
            h = hash((parent, tuple(seq.tokens[i * bs : (i + 1) * bs])))
            seq.hashes.append(h)
            block = seq.table[i]
            # An identical block computed by another sequence keeps the cache entry.
            if h not in self._cached and self._hash[block] is None:
                self._cached[h] = block
                self._hash[block] = h

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence (finished or preempted); its unshared blocks become free.

        Blocks are released last-first, so the tail of a prompt (least likely to be shared)
        is evicted before its head.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"PagedKVPool.free: unknown sequence {seq_id!r}")
        for block in reversed(seq.table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def check_consistency(self) -> None:
        """Raise AssertionError unless reference counts, free pools and the hash index agree."""
        refs = [0] * self.num_blocks
        for seq in self._seqs.values():
            for block in seq.table:
                refs[block] += 1
        assert refs == self._ref, "reference counts differ from block-table occurrences"
        free = set(self._free)
        assert len(free) == len(self._free) and not free & set(self._evictable), "a block is free twice"
        assert free | set(self._evictable) == {b for b in range(self.num_blocks) if refs[b] == 0}
        assert self.num_used_blocks + self.num_free_blocks == self.num_blocks
        assert all(self._hash[b] is None for b in free), "an uncached free block still has a hash"
        assert all(self._hash[b] == h for h, b in self._cached.items()), "hash index is stale"
        assert sum(h is not None for h in self._hash) == len(self._cached)

    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"PagedKVPool: unknown sequence {seq_id!r}") from None

    def _match(self, token_ids: Sequence[int]) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        usable = token_ids[: (len(token_ids) - 1) // self.block_size * self.block_size]
        matched = []
        for h in block_hashes(usable, self.block_size):
            block = self._cached.get(h)
            if block is None:
                break
            matched.append(block)
        return matched

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[cast(int, self._hash[block])]  # an evictable block is cached, so hashed
            self._hash[block] = None
        self._ref[block] = 1
        return block
