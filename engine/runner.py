"""The boundary the scheduler calls: execute one iteration of a mixed batch.

A scheduler decides *what* runs (which sequences, how many tokens each, which blocks
they own); :class:`ModelRunner` only computes it: one forward pass over the flattened
tokens of every :class:`BatchItem`, K/V written into the paged cache, and the greedy
next token of each item that asks for one.  It holds no per-sequence state, so the
same runner serves any scheduling policy, preemption included (a preempted sequence
simply comes back later as items that recompute its tokens).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention import PagedAttention, Span
from engine.kv_cache import KVCache
from engine.model import LlamaModel


@dataclass(frozen=True)
class BatchItem:
    """The work of one sequence in one iteration.

    Attributes:
        seq_id: the scheduler's name for the sequence (used only in error messages).
        token_ids: the tokens computed now; one for a decode, a chunk for a prefill.
        start: position of ``token_ids[0]``, i.e. how many tokens of the sequence are
            already in the cache (prefix-cache hits plus earlier chunks).
        block_table: the sequence's cache blocks, covering at least positions
            ``[0, start + len(token_ids))``.
        sample: return the greedy next token; set it when ``token_ids`` ends at the
            sequence's last known token (a decode or a prompt's final chunk).
    """

    seq_id: Hashable
    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    sample: bool = True


class ModelRunner:
    """Runs iterations of ``model`` over ``cache``; stateless between calls."""

    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        if cache.k.dtype != model.embed.weight.dtype or cache.k.device != model.embed.weight.device:
            raise ValueError(
                f"ModelRunner: cache is {cache.k.dtype} on {cache.k.device}, model is "
                f"{model.embed.weight.dtype} on {model.embed.weight.device}"
            )
        self.model = model
        self.cache = cache
        self.device = model.embed.weight.device

    @torch.inference_mode()
    def execute(self, items: Sequence[BatchItem]) -> list[int | None]:
        """Run one iteration; the greedy next token of each sampling item, ``None`` for the others.

        Greedy means argmax of the logits, ties broken by the lowest token id.
        """
        hidden, rows = self._forward(items)
        picked = [i for i, item in enumerate(items) if item.sample]
        tokens: list[int | None] = [None] * len(items)
        if picked:
            last = torch.tensor([rows[i].stop - 1 for i in picked], device=self.device)
            best = self.model.greedy(hidden[last])
            for i, token in zip(picked, best, strict=True):
                tokens[i] = token
        return tokens

    @torch.inference_mode()
    def logits(self, items: Sequence[BatchItem]) -> list[Tensor]:
        """Run one iteration and return the logits ``[len(token_ids), vocab]`` of every item's tokens."""
        hidden, rows = self._forward(items)
        return [self.model.logits(hidden[r]) for r in rows]

    def _forward(self, items: Sequence[BatchItem]) -> tuple[Tensor, list[slice]]:
        """Hidden states of the flat batch (chunks first, then single tokens) and each item's rows."""
        self._validate(items)
        # Chunks first, then single tokens by context, so decode buckets are contiguous.
        order = sorted(range(len(items)), key=lambda i: (len(items[i].token_ids) == 1, items[i].start))
        rows: list[slice] = [slice(0)] * len(items)
        token_ids: list[int] = []
        positions: list[int] = []
        spans: list[Span] = []
        for i in order:
            item = items[i]
            n = len(item.token_ids)
            rows[i] = slice(len(token_ids), len(token_ids) + n)
            token_ids.extend(item.token_ids)
            positions.extend(range(item.start, item.start + n))
            spans.append(Span(item.start, n, item.block_table))
        tokens = torch.tensor(token_ids, dtype=torch.long)
        vocab = self.model.config.vocab_size
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            bad = next(items[i].seq_id for i in order if not all(0 <= t < vocab for t in items[i].token_ids))
            raise ValueError(f"ModelRunner: sequence {bad!r} has a token id outside [0, {vocab})")
        attention = PagedAttention(self.cache, spans, self.device)
        hidden = self.model(tokens.to(self.device), torch.tensor(positions).to(self.device), attention)
        return hidden, rows

    def _validate(self, items: Sequence[BatchItem]) -> None:
        if not items:
            raise ValueError("ModelRunner: empty batch")
        seen: set[Hashable] = set()
        bs, blocks, max_context = self.cache.block_size, self.cache.num_blocks, self.model.config.max_context
        for item in items:
            end = item.start + len(item.token_ids)
            where = f"ModelRunner: sequence {item.seq_id!r}"
            if item.seq_id in seen:
                raise ValueError(f"{where} appears twice in one batch")
            seen.add(item.seq_id)
            if not item.token_ids or item.start < 0:
                raise ValueError(f"{where}: needs at least one token and start >= 0, got start {item.start}")
            if end > max_context:
                raise ValueError(f"{where}: position {end - 1} exceeds max_context {max_context}")
            used = item.block_table[: -(-end // bs)]
            if len(used) * bs < end:
                raise ValueError(
                    f"{where}: {len(item.block_table)} blocks of {bs} cannot hold positions up to {end - 1}"
                )
            if min(used) < 0 or max(used) >= blocks:
                raise ValueError(f"{where}: block table {list(used)} has ids outside [0, {blocks})")
