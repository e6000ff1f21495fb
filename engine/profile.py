"""Latency probe: time :meth:`ModelRunner.execute` for given batch compositions.

Each :class:`Composition` is stated in the terms of ``envs/serving/cost_model.py``
(decoding sequences with their cached tokens; prefill chunks with their query tokens
and cached context), so the measured rows can be fitted to that cost model directly.
Block tables are synthetic and the cache holds zeros: attention cost depends on how
many tokens are read, not on their values.

Run ``python -m engine.profile --preset small --threads 2`` (``--help`` for options).
Threads are set explicitly with ``torch.set_num_threads``; the default is every CPU this
process may use, since the engine is the only compute-heavy thread during a replay.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.model import ModelConfig, build_model, preset, preset_names
from engine.runner import BatchItem, ModelRunner


@dataclass(frozen=True)
class Composition:
    """One iteration's batch: decodes with their cached tokens, prefill chunks with theirs."""

    label: str
    decode_contexts: tuple[int, ...] = ()
    prefill_tokens: tuple[int, ...] = ()
    prefill_context: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.prefill_tokens) != len(self.prefill_context):
            raise ValueError(
                f"Composition {self.label!r}: prefill_tokens and prefill_context differ in length"
            )
        if not (self.decode_contexts or self.prefill_tokens):
            raise ValueError(f"Composition {self.label!r} is empty")
        if any(q < 1 for q in self.prefill_tokens) or min((*self.decode_contexts, *self.prefill_context)) < 0:
            raise ValueError(f"Composition {self.label!r}: chunks need >= 1 token and contexts >= 0")

    def items(self, block_size: int, vocab_size: int) -> tuple[list[BatchItem], int]:
        """Batch items over disjoint, consecutive blocks, and the number of blocks they use."""
        spans = [(c, q) for q, c in zip(self.prefill_tokens, self.prefill_context, strict=True)]
        spans += [(c, 1) for c in self.decode_contexts]
        items, next_block = [], 0
        for i, (start, n) in enumerate(spans):
            blocks = -(-(start + n) // block_size)
            tokens = [(7919 * (i + 1) + 31 * p) % vocab_size for p in range(start, start + n)]
            items.append(BatchItem(i, tokens, start, range(next_block, next_block + blocks)))
            next_block += blocks
        return items, next_block


@dataclass(frozen=True)
class Measurement:
    composition: Composition
    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    def row(self) -> dict[str, object]:
        """The cost model's ``iteration_time`` arguments and the measured time."""
        c = self.composition
        return {
            "label": c.label,
            "num_decode": len(c.decode_contexts),
            "decode_context": sum(c.decode_contexts),
            "prefill_tokens": " ".join(map(str, c.prefill_tokens)),
            "prefill_context": " ".join(map(str, c.prefill_context)),
            "median_s": self.median_s,
            "min_s": min(self.seconds),
            "repeats": len(self.seconds),
        }


def default_compositions() -> list[Composition]:
    """Decode-only at batch 1/8/32 (context 512), prefill chunks 128/512/2048, one mixed batch."""
    comps = [Composition(f"decode {n} x ctx 512", decode_contexts=(512,) * n) for n in (1, 8, 32)]
    comps += [
        Composition(f"prefill {q}", prefill_tokens=(q,), prefill_context=(0,)) for q in (128, 512, 2048)
    ]
    comps.append(Composition("prefill 512 over ctx 1024", prefill_tokens=(512,), prefill_context=(1024,)))
    comps.append(
        Composition(
            "prefill 512 + 16 decodes x ctx 512",
            decode_contexts=(512,) * 16,
            prefill_tokens=(512,),
            prefill_context=(0,),
        )
    )
    return comps


def measure(
    model: ModelConfig | str,
    compositions: Sequence[Composition],
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    block_size: int = 16,
    repeats: int = 5,
    warmup: int = 2,
    settle: int = 0,
) -> list[Measurement]:
    """Time each composition ``repeats`` times after ``warmup`` runs, each on a cache sized for it.

    Repeats go round-robin over the compositions, so a burst of load from other
    processes on a shared machine slows one repeat of each rather than all of one.
    ``settle`` untimed runs of the same batch precede each timed one, so it starts from
    the caches its own kind of iteration leaves (as in a replay, where a decode mostly
    follows a decode) rather than those of the previous, different composition.
    """
    model = build_model(model, seed=seed, dtype=dtype, device=device)
    setups = []
    for comp in compositions:
        items, num_blocks = comp.items(block_size, model.config.vocab_size)
        cache = KVCache(model.config, num_blocks, block_size, model.embed.weight.dtype, device)
        setups.append((ModelRunner(model, cache), items))
    seconds: list[list[float]] = [[] for _ in setups]
    for r in range(warmup + repeats):
        for (runner, items), times in zip(setups, seconds, strict=True):
            for _ in range(settle):
                runner.execute(items)
            t0 = time.perf_counter()
            runner.execute(items)  # returns Python ints, so CUDA work has finished too
            if r >= warmup:
                times.append(time.perf_counter() - t0)
    return [Measurement(comp, times) for comp, times in zip(compositions, seconds, strict=True)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=preset_names())
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    cfg = preset(args.preset)
    rows = [
        m.row()
        for m in measure(
            args.preset,
            default_compositions(),
            dtype=dtype,
            device=args.device,
            block_size=args.block_size,
            repeats=args.repeats,
            warmup=args.warmup,
        )
    ]
    print(
        f"# {cfg.name}: {cfg.num_params / 1e6:.1f}M params, device {args.device}, "
        f"{args.threads} threads, block {args.block_size}, median of {args.repeats}"
    )
    for r in rows:
        print(f"{r['label']:<36} median {r['median_s'] * 1e3:8.2f} ms   min {r['min_s'] * 1e3:8.2f} ms")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
