"""Replay a trace slice on the real engine in real time, and the same slice in the simulator.

    python -m engine.replay                                    # conf/replay/cpu_replay.yaml as is
    python -m engine.replay "policies=[sarathi_512,learned:PATH]" workload=azure_code seed=1 output_dir=DIR
    python -m engine.replay config=conf/replay/my.yaml "backends=[engine,sim]"

Options are :class:`ReplayConfig` fields, read from ``config`` (default ``conf/replay/cpu_replay.yaml``,
which documents the CPU settings) and overridden by ``KEY=VALUE`` arguments.  Per policy and backend
one results row with exactly the columns of ``evaluate.py`` (built by
:func:`leaderboard.runs.result_row`), ``backend`` ``engine`` or ``sim``, so a real row and a
simulated one sit side by side.  Writes under ``output_dir``: ``results.csv``, ``results.json``,
``buckets.csv``, and ``iterations.csv`` (every iteration of every run: start, latency, batch, and for
engine runs the cost model's prediction for the same batch).  ``python evaluate.py results=DIR/results.csv``
renders the leaderboard from them.

The trace: the workload's ``split`` window for ``seed`` at ``load_scale`` (as ``evaluate.py`` cuts
it), then every prompt and output length divided by ``length_scale`` (rounded, at least 1 token)
so a small model on a CPU serves it in minutes; the rows name it ``<workload>/len<length_scale>``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd
import torch

from calibration.iterations import Composition
from chunkgym import REPO_ROOT, resolve_path
from chunkgym.cli import hydra_cli, load_options
from chunkgym.io import atomic_path, atomic_write_text
from chunkgym.progress import Progress
from chunkgym.provenance import config_hash
from engine.model import LlamaModel, build_model
from engine.profile import batch_items
from engine.runner import ModelRunner
from engine.serve import IDLE_MODES, Engine, EngineResult, WallClock
from envs.serving.core import ServingConfig
from envs.serving.loop import SimResult
from envs.serving.metrics import load_slo
from envs.serving.setup import serving_config
from envs.serving.specs import load_hardware, load_model
from envs.serving.workloads.trace import Trace
from leaderboard.runs import RowResult, RunSpec, SetupKey, result_row
from leaderboard.tables import write_csv, write_json
from policies.registry import make_policy

DEFAULT_CONFIG = REPO_ROOT / "conf" / "replay" / "cpu_replay.yaml"
CONFIG_NAME = "engine_replay"
BACKENDS = ("engine", "sim")
WARMUP = (
    Composition("warm-up prefill", prefill_tokens=(256,), prefill_context=(0,)),
    Composition("warm-up mixed", decode_contexts=(64,) * 8, prefill_tokens=(64,), prefill_context=(128,)),
)
"""Batches run before a replay so one-time allocations and kernel selection stay out of its timings."""
OVERHEAD_SPAN_S = 10.0
"""Seconds of real-time replay that measure the scheduler's own work per iteration."""


@dataclass
class ReplayConfig:
    """One replay: which slice, which policies, which engine (see ``conf/replay/cpu_replay.yaml``)."""

    policies: list[str] = field(default_factory=lambda: ["sarathi_512"])
    backends: list[str] = field(default_factory=lambda: ["engine"])
    workload: str = "azure_conv"
    seed: int = 0  # the test window
    load_scale: float = 1.0
    window_s: float | None = None  # trace seconds; null: the workload's own
    length_scale: float = 1.0  # prompt and output lengths divided by this
    model: str = "engine_small"  # conf/model name: the engine's shapes and the simulator's
    hardware: str = "cpu"  # conf/hardware name of the device the engine runs on
    slo: str = "strict"
    cost_model: str = "calibrated"  # calibrated (conf/cost), roofline, or a coefficient file path
    # num_blocks sizes the engine's KV cache (the default fills memory).
    serving: ServingConfig = field(default_factory=ServingConfig)
    threads: int = 1  # torch threads
    idle: str = "sleep"  # an idle engine sleeps or spins (holds its core) until the next arrival
    device: str = "cpu"
    dtype: str | None = None  # null: float32 on CPU, bfloat16 on CUDA
    weights_seed: int = 0
    prompt_seed: int = 0
    output_dir: str = "outputs/engine/replay"
    BACKENDS: ClassVar[tuple[str, ...]] = BACKENDS  # what ``backends`` may name (vLLM's replay: vllm, sim)

    def __post_init__(self) -> None:
        bad = [b for b in self.backends if b not in self.BACKENDS]
        if bad or not self.backends:
            raise ValueError(
                f"backends must be a non-empty list of {', '.join(self.BACKENDS)}, got {self.backends}"
            )
        if not (self.length_scale >= 1.0):
            raise ValueError(
                f"length_scale must be >= 1 (lengths are divided by it), got {self.length_scale}"
            )
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.idle not in IDLE_MODES:
            raise ValueError(f"idle must be one of {', '.join(IDLE_MODES)}, got {self.idle!r}")
        serving_config(self.serving)  # values out of range fail here, before any run


def load_config(argv: Sequence[str] = ()) -> ReplayConfig:
    """What ``python -m engine.replay ARGV`` reads: ``config=PATH`` (default :data:`DEFAULT_CONFIG`)
    under ``KEY=VALUE`` overrides; a bad one raises ValueError naming it."""
    return load_options(ReplayConfig, argv, DEFAULT_CONFIG, name=CONFIG_NAME)


# ---- the slice -----------------------------------------------------------------------------
def workload_label(conf: ReplayConfig) -> str:
    return conf.workload if conf.length_scale == 1.0 else f"{conf.workload}/len{conf.length_scale:g}"


def run_spec(conf: ReplayConfig, policy: str) -> RunSpec:
    setup = SetupKey.create(conf.model, conf.hardware, 1, load_slo(conf.slo), conf.cost_model, conf.serving)
    return RunSpec(policy, conf.workload, conf.load_scale, conf.seed, setup, conf.window_s)


def replay_trace(conf: ReplayConfig) -> Trace:
    """The slice both backends serve: the workload window, lengths divided by ``length_scale``."""
    return run_spec(conf, conf.policies[0]).trace().scale_lengths(conf.length_scale)


# ---- the engine ----------------------------------------------------------------------------
def build(conf: ReplayConfig) -> LlamaModel:
    """The engine's model with seeded weights."""
    dtype = getattr(torch, conf.dtype) if conf.dtype else None
    return build_model(conf.model, seed=conf.weights_seed, dtype=dtype, device=conf.device)


def warm_up(runner: ModelRunner) -> None:
    """Run :data:`WARMUP` a few times on the runner's own cache (every slot is rewritten before use)."""
    for comp in WARMUP:
        items, blocks = batch_items(comp, runner.cache.block_size, runner.model.config.vocab_size)
        if blocks <= runner.cache.num_blocks:
            for _ in range(3):
                runner.execute(items)


class ProgressClock(WallClock):
    """The engine's wall clock, saying how far into the trace the replay is every few seconds
    (a replay runs in real time, minutes on a CPU)."""

    def __init__(self, idle: str, progress: Progress) -> None:
        super().__init__(idle)
        self.progress = progress

    def now(self) -> float:
        t = super().now()
        self.progress.update(int(t), "s of the trace served in real time")
        return t


def run_engine(conf: ReplayConfig, policy: str, trace: Trace, model: LlamaModel, log=print) -> EngineResult:
    """Serve ``trace`` with ``policy`` on ``model`` in real time, on ``conf.threads`` torch threads."""
    torch.set_num_threads(conf.threads)
    setup = run_spec(conf, policy).setup.build()
    progress = Progress(f"{policy} [engine]", round(trace.span_s), say=log)
    engine = Engine(trace, setup, model, seed=conf.prompt_seed, clock=ProgressClock(conf.idle, progress))
    warm_up(engine.runner)
    # What the process holds now (the model, earlier runs' results) is left out of every collection
    # while the engine serves, so an iteration pays for collecting only what serving allocates.
    gc.collect()
    gc.freeze()
    try:
        return engine.run(make_policy(policy))
    finally:
        gc.unfreeze()


def scheduler_overhead(conf: ReplayConfig, model: LlamaModel, span_s: float = OVERHEAD_SPAN_S) -> float:
    """Seconds per iteration the engine spends outside the forward pass: policy, core, batch building.

    The profile times forward passes alone.  This is the median of latency minus forward-pass time
    over a real-time replay of the first ``span_s`` seconds of another window (seed + 1, so the
    measured slice stays unseen) with the first policy; 0 if nothing arrives in that time.
    """
    other = dataclasses.replace(conf, seed=conf.seed + 1)
    trace = head(replay_trace(other), span_s)
    if not len(trace):
        return 0.0
    it = run_engine(other, conf.policies[0], trace, model).result.iterations
    return float(np.median(it["latency"] - it["execute"]))


def head(trace: Trace, span_s: float) -> Trace:
    """The requests of ``trace`` arriving in its first ``span_s`` seconds (arrivals are sorted), with
    their prefix hashes and tenant labels."""
    count = int(np.searchsorted(trace.arrival_s, span_s, side="left"))
    return dataclasses.replace(trace.slice(0, count), span_s=min(span_s, trace.span_s))


def run_sim(conf: ReplayConfig, policy: str, trace: Trace, time_scale: float = 1.0) -> SimResult:
    """``policy`` on ``trace`` in the simulator (``time_scale``: see :class:`~envs.serving.simulator.CostModelClock`)."""
    return run_spec(conf, policy).setup.build().simulator(trace, time_scale).run(make_policy(policy))


def row(conf: ReplayConfig, policy: str, trace: Trace, result: SimResult, backend: str) -> RowResult:
    """evaluate.py's columns for ``result``; the workload names the length scale, and the config hash
    also covers the engine's settings."""
    spec = run_spec(conf, policy)
    out = result_row(spec, trace, result, backend)
    label = workload_label(conf)
    engine = {
        k: getattr(conf, k)
        for k in ("length_scale", "threads", "idle", "device", "dtype", "weights_seed", "prompt_seed")
    }
    out.row["workload"] = label
    out.row["config_hash"] = config_hash(
        {"run": out.row["config_hash"], "backend": backend, "engine": engine}
    )
    for bucket in out.buckets:
        bucket["workload"] = label
    return out


def iteration_frame(policy: str, backend: str, iterations: dict[str, np.ndarray]) -> pd.DataFrame:
    frame = pd.DataFrame(iterations)
    frame.insert(0, "backend", backend)
    frame.insert(0, "policy", policy)
    return frame


@dataclass
class Replay:
    """Every run of a replay: rows, per-iteration frames, and the raw results by (policy, backend)."""

    rows: list[RowResult]
    iterations: pd.DataFrame
    results: dict[tuple[str, str], SimResult]


def check(conf: ReplayConfig) -> Trace:
    """Resolve every name (policies, workload, model, hardware, SLO) up front; the slice to replay,
    which must hold requests (an empty one would report NaN for every metric)."""
    for name in conf.policies:
        make_policy(name)
    load_model(conf.model)
    load_hardware(conf.hardware)
    trace = replay_trace(conf)
    if not len(trace):
        raise ValueError(
            f"workload {conf.workload!r}'s test window for seed {conf.seed} (window_s={conf.window_s}, "
            f"load {conf.load_scale:g}) holds no requests; pick another seed, a longer window_s or a higher load_scale"
        )
    return trace


def replay(conf: ReplayConfig, model: LlamaModel | None = None, log=print) -> Replay:
    """Run every policy on every backend over the same slice (engine runs in real time)."""
    trace = check(conf)
    rows, frames, results = [], [], {}
    for policy in conf.policies:
        for backend in conf.backends:
            start = time.perf_counter()
            log(f"{policy} [{backend}]: serving {len(trace)} requests over {trace.span_s:.0f} s of trace")
            if backend == "engine":
                model = model or build(conf)
                result = run_engine(conf, policy, trace, model, log).result
            else:
                result = run_sim(conf, policy, trace)
            results[(policy, backend)] = result
            rows.append(row(conf, policy, trace, result, backend))
            frames.append(iteration_frame(policy, backend, result.iterations))
            m = result.metrics
            log(
                f"{policy} [{backend}] {m['finished']}/{m['requests']} finished in "
                f"{time.perf_counter() - start:.1f} s: TTFT p50 {m['ttft_p50_s']:.3f} s, "
                f"p99 {m['ttft_p99_s']:.3f} s, "
                f"TBT p99 {m['tbt_p99_s']:.4f} s, attainment {m['slo_attainment']:.3f}"
            )
    return Replay(rows, pd.concat(frames, ignore_index=True), results)


def write(out: Replay, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, write_rows, rows in (  # atomic: a killed replay never leaves a truncated results file
        ("results.csv", write_csv, [r.row for r in out.rows]),
        ("results.json", write_json, [r.row for r in out.rows]),
        ("buckets.csv", write_csv, [b for r in out.rows for b in r.buckets]),
    ):
        with atomic_path(directory / name) as tmp:
            write_rows(rows, tmp)
    with atomic_path(directory / "iterations.csv") as tmp:
        out.iterations.to_csv(tmp, index=False)


@hydra_cli(ReplayConfig, CONFIG_NAME, default_file=DEFAULT_CONFIG)
def main(conf: ReplayConfig) -> Path:
    directory = resolve_path(conf.output_dir)
    print(
        f"replaying {workload_label(conf)} seed {conf.seed} at load {conf.load_scale:g} -> {directory}",
        flush=True,
    )
    return replay_and_write(conf, replay, directory, "python -m engine.replay")


def replay_and_write(conf: ReplayConfig, serve: Callable[..., Replay], directory: Path, tool: str) -> Path:
    """Run ``serve(conf, log=print)`` and write its rows and the config to ``directory``; a bad name
    or an empty window (a ValueError before anything ran) exits with one line naming ``tool``."""
    try:
        out = serve(conf, log=lambda line: print(line, flush=True))
    except ValueError as exc:
        raise SystemExit(f"{tool}: error: {exc}") from exc
    write(out, directory)
    atomic_write_text(directory / "config.json", json.dumps(dataclasses.asdict(conf), indent=1) + "\n")
    print(f"wrote {len(out.rows)} rows to {directory / 'results.csv'}")
    return directory


if __name__ == "__main__":
    main()
