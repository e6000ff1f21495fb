"""Our engine as a profiling source: time :meth:`engine.runner.ModelRunner.execute` on batch compositions.

:func:`measure` times any :class:`~calibration.iterations.Composition` list (as :func:`batch_items`)
on a fresh cache per composition; :func:`profile` times the calibration grid and returns the samples
:func:`calibration.iterations.fit` takes (``python -m engine.calibrate`` runs both).  Run as a
command, it prints a latency probe of a few batches::

    python -m engine.profile preset=small threads=2 repeats=20 csv=out.csv

Threads are set explicitly with ``torch.set_num_threads``; the probe's default is every CPU this
process may use, since the engine is the only compute-heavy thread during a replay.
"""

from __future__ import annotations

import csv
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from calibration.iterations import Composition, Measurement, Sample, default_grid
from chunkgym import resolve_path
from chunkgym.cli import hydra_cli
from engine.kv_cache import KVCache
from engine.model import ModelConfig, build_model, preset, preset_names
from engine.runner import BatchItem, ModelRunner


def default_compositions() -> list[Composition]:
    """The probe's batches: decode-only at 1/8/32 (context 512), prefill chunks 128/512/2048, one mixed."""
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


def batch_items(comp: Composition, block_size: int, vocab_size: int) -> tuple[list[BatchItem], int]:
    """Our engine's batch items for ``comp`` over disjoint, consecutive blocks, and the number of blocks they use.

    Block tables are synthetic and the cache may hold zeros: attention cost depends on how
    many tokens are read, not on their values.
    """
    spans = [(c, q) for q, c in zip(comp.prefill_tokens, comp.prefill_context, strict=True)]
    spans += [(c, 1) for c in comp.decode_contexts]
    items, next_block = [], 0
    for i, (start, n) in enumerate(spans):
        blocks = -(-(start + n) // block_size)
        tokens = [(7919 * (i + 1) + 31 * p) % vocab_size for p in range(start, start + n)]
        items.append(BatchItem(i, tokens, start, range(next_block, next_block + blocks)))
        next_block += blocks
    return items, next_block


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
    net = build_model(model, seed=seed, dtype=dtype, device=device)
    setups = []
    for comp in compositions:
        items, num_blocks = batch_items(comp, block_size, net.config.vocab_size)
        cache = KVCache(net.config, num_blocks, block_size, net.embed.weight.dtype, device)
        setups.append((ModelRunner(net, cache), items))
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


def profile(
    model: str,
    threads: int,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    block_size: int = 16,
    grid: Sequence[Composition] | None = None,
    settle: int = 1,
) -> list[Sample]:
    """Time the grid on ``model`` (a preset or ``conf/model`` name) with ``threads`` torch threads.

    ``dtype`` names a torch dtype; ``None`` is the engine's default (float32 on CPU, bfloat16 on CUDA).
    Each timed run follows ``settle`` untimed runs of the same batch (:func:`measure`).
    """
    torch.set_num_threads(threads)
    measured = measure(
        model,
        grid or default_grid(),
        seed=seed,
        dtype=getattr(torch, dtype) if dtype else None,
        device=device,
        block_size=block_size,
        repeats=repeats,
        warmup=warmup,
        settle=settle,
    )
    return [Sample.of(m) for m in measured]


def machine(device: str, threads: int) -> str:
    """Where a profile was measured, for the coefficient file's ``source`` (CPU: with the load average)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    load = os.getloadavg()[0]
    return (
        f"{_cpu_name()} ({os.cpu_count()} CPUs, {threads} torch threads, 1-min load average {load:.1f}), "
        f"torch {torch.__version__}"
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class ProbeOptions:
    """``python -m engine.profile``: the latency probe's options."""

    preset: str = "small"  # an engine preset (engine/model.py)
    threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    device: str = "cpu"
    dtype: str | None = None  # float32, float64, bfloat16 or float16; null: the engine's default
    block_size: int = 16
    repeats: int = 5
    warmup: int = 2
    csv: str | None = None  # also write the rows to this CSV file


DTYPES = ("float32", "float64", "bfloat16", "float16")


def probe(opts: ProbeOptions) -> list[dict[str, object]]:
    """Time :func:`default_compositions`, print one line per batch, optionally write the rows as CSV."""
    if opts.preset not in preset_names():
        raise SystemExit(f"preset: {opts.preset!r} is not one of {', '.join(preset_names())}")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise SystemExit(f"dtype: {opts.dtype!r} is not one of {', '.join(DTYPES)}")
    torch.set_num_threads(opts.threads)
    cfg = preset(opts.preset)
    measured = measure(
        opts.preset,
        default_compositions(),
        dtype=getattr(torch, opts.dtype) if opts.dtype else None,
        device=opts.device,
        block_size=opts.block_size,
        repeats=opts.repeats,
        warmup=opts.warmup,
    )
    rows = [m.row() for m in measured]
    print(
        f"# {cfg.name}: {cfg.num_params / 1e6:.1f}M params, device {opts.device}, "
        f"{opts.threads} threads, block {opts.block_size}, median of {opts.repeats}"
    )
    for r in rows:
        print(f"{r['label']:<36} median {r['median_s'] * 1e3:8.2f} ms   min {r['min_s'] * 1e3:8.2f} ms")
    if opts.csv:
        with resolve_path(opts.csv).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


main = hydra_cli(ProbeOptions, name="engine_profile")(probe)

if __name__ == "__main__":
    main()
