"""Attention over a paged KV cache for one mixed batch (prefill chunks and decodes).

Tokens arrive flattened: first every multi-token chunk, then all single-token spans
(decodes, or prefill chunks of one token, which are the same computation).  Each
layer first writes the new tokens' K/V into their cache slots, then

* each chunk attends causally to its sequence's cached prefix plus its own earlier
  tokens: one ``scaled_dot_product_attention`` per chunk (a chunk with nothing cached
  uses its fresh K/V and ``is_causal``, without touching the cache);
* single-token spans attend in groups: a run of consecutive spans whose contexts need
  the same power-of-two bucket of blocks (1, 2, 3-4, 5-8, ...) gathers its blocks into
  one padded ``[n, kv_heads, max_blocks * block_size, head_dim]`` tensor, masked past
  each context, for one ``scaled_dot_product_attention``.  Padding is thereby under 2x,
  so decode attention reads O(cached tokens), as the simulator's cost model assumes;
  the runner sorts decodes by context so each bucket is one run.  The query heads of a
  KV head are laid out as that KV head's query rows, so grouped-query attention needs
  no K/V copies per query head.

The metadata (slots, block indices, masks) is built once per iteration and shared by
all layers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kv_cache import KVCache


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, start + length)`` of one sequence, whose blocks are ``block_table``."""

    start: int
    length: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class _Chunk:
    offset: int  # first row in the flat batch
    length: int
    blocks: Tensor | None  # blocks covering the context; None when nothing is cached
    mask: Tensor | None  # [length, context] True where a query may attend a key


@dataclass(frozen=True)
class _DecodeGroup:
    offset: int  # first row in the flat batch
    blocks: Tensor  # [n, width] block ids, padded with block 0
    mask: Tensor  # [n, 1, 1, width * block_size] True where the key is in the context


class PagedAttention:
    """The :class:`engine.model.AttentionBackend` of one iteration.

    ``spans`` are in flat-batch order: all spans of length > 1 first, then those of
    length 1.  Slots written by different spans must be distinct (the block manager
    guarantees it: only full, computed blocks are shared).
    """

    def __init__(self, cache: KVCache, spans: Sequence[Span], device: torch.device) -> None:
        self.cache = cache
        bs = cache.block_size
        slots: list[Tensor] = []
        self.chunks: list[_Chunk] = []
        offset = 0
        single: list[Span] = []
        for span in spans:
            if span.length == 1:
                single.append(span)
                continue
            if single:
                raise ValueError("PagedAttention: spans of length 1 must come after all longer spans")
            end = span.start + span.length
            blocks = torch.tensor(span.block_table[: -(-end // bs)], dtype=torch.long)
            slots.append(_slots(blocks, bs)[span.start : end])
            if span.start == 0:
                self.chunks.append(_Chunk(offset, span.length, None, None))
            else:
                queries = torch.arange(span.start, end)
                mask = torch.arange(end)[None, :] <= queries[:, None]
                self.chunks.append(_Chunk(offset, span.length, blocks.to(device), mask.to(device)))
            offset += span.length
        self.decodes: list[_DecodeGroup] = []
        for _, run in itertools.groupby(single, key=lambda s: (s.start // bs).bit_length()):
            group = list(run)
            table = [list(s.block_table[: s.start // bs + 1]) for s in group]
            width = max(len(t) for t in table)
            positions = torch.tensor([s.start for s in group])
            slots.append(torch.tensor([t[-1] * bs + s.start % bs for s, t in zip(group, table, strict=True)]))
            mask = torch.arange(width * bs)[None, :] <= positions[:, None]
            blocks = torch.tensor([t + [0] * (width - len(t)) for t in table])
            self.decodes.append(_DecodeGroup(offset, blocks.to(device), mask[:, None, None, :].to(device)))
            offset += len(group)
        self.slots = torch.cat(slots).to(device)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, self.slots, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, self.slots, v)
        out = torch.empty_like(q)
        for c in self.chunks:
            rows = slice(c.offset, c.offset + c.length)
            if c.blocks is None:
                keys, values = k[rows], v[rows]
            else:
                assert c.mask is not None, "a chunk has both blocks and a mask, or neither"
                context = c.mask.shape[1]
                keys = k_cache[c.blocks].flatten(0, 1)[:context]
                values = v_cache[c.blocks].flatten(0, 1)[:context]
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=c.mask,
                is_causal=c.mask is None,
                enable_gqa=True,
            )
            out[rows] = o.squeeze(0).transpose(0, 1)
        for g in self.decodes:
            n = g.blocks.shape[0]
            rows = slice(g.offset, g.offset + n)
            # [n, heads, d] -> [n, kv_heads, group, d]: a KV head's query heads act as its query rows.
            queries = q[rows].view(n, kv_heads, -1, head_dim)
            keys = k_cache[g.blocks].flatten(1, 2).transpose(1, 2)
            values = v_cache[g.blocks].flatten(1, 2).transpose(1, 2)
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.mask)
            out[rows] = o.reshape(n, -1, head_dim)
        return out


def _slots(blocks: Tensor, block_size: int) -> Tensor:
    """Flat cache slots of every position covered by ``blocks``, in order."""
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
