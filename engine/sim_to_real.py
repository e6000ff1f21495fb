"""Sim-to-real: profile the engine on this machine, fit the cost model, replay one slice in both, compare.

1. profile the replay's model on its device and threads over :func:`calibration.iterations.default_grid`;
2. fit the cost model to it (:func:`calibration.iterations.fit`) and write the coefficient file into the
   output folder (``conf/cost`` is left alone);
3. per policy, replay the same slice (:mod:`engine.replay`) on the engine in real time and in the
   simulator with the fitted profile;
4. compare: the per-iteration latency MAPE (each engine iteration's measured latency against the
   cost model's prediction for that very batch) and the relative errors ``|sim / engine - 1|`` of
   TTFT P50, TTFT P99 and TBT P99.  The headline numbers pool the iterations of all policies and
   take the worst policy's relative errors.

Entry points: ``python bench/sim_to_real.py`` (CPU, ``conf/replay/cpu_replay.yaml``) and
``python bench/engine_gpu.py`` (one GPU, ``conf/replay/gpu_replay.yaml``); both print one JSON
object as their last line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chunkgym import resolve_path
from chunkgym.cli import hydra_cli, load_options
from chunkgym.config import AT_LEAST_ONE, Rule
from chunkgym.io import atomic_write_text
from engine.calibrate import calibrate
from engine.replay import DEFAULT_CONFIG, ReplayConfig, check, replay
from engine.replay import write as write_replay
from envs.serving.loop import SimResult

DEFAULT_POLICIES = ("sarathi_512", "fcfs")
PRESET = (f"policies=[{','.join(DEFAULT_POLICIES)}]",)
"""Applied over the replay file, under the command line's overrides."""
CONFIG_NAME = "sim_to_real"


@dataclass
class SimToRealConfig(ReplayConfig):
    """The replay slice (``config=PATH``, default ``conf/replay/cpu_replay.yaml``) and the profiling."""

    repeats: int = 5  # profiling repeats per composition (median)
    warmup: int = 1  # untimed repeats before them
    out: str = "outputs/sim_to_real"  # profile, results and iterations go here

    def replay_config(self) -> ReplayConfig:
        return ReplayConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ReplayConfig)})


RULES: dict[str, Rule] = {"repeats": AT_LEAST_ONE, "warmup": Rule(lambda v: v >= 0, "an integer >= 0")}


def options(argv: Sequence[str], default_config: Path = DEFAULT_CONFIG) -> SimToRealConfig:
    """What ``python bench/sim_to_real.py ARGV`` runs (``bench/engine_gpu.py``: another default file)."""
    return load_options(SimToRealConfig, [*PRESET, *argv], default_config, RULES, CONFIG_NAME)


COMPARED = ("ttft_p50_s", "ttft_p99_s", "tbt_p99_s")


def iteration_mape(iterations: dict[str, np.ndarray]) -> float:
    """Mean of ``|predicted / measured - 1|`` over an engine run's iterations."""
    return float(np.mean(np.abs(iterations["predicted"] / iterations["latency"] - 1.0)))


def relative_errors(engine: SimResult, sim: SimResult) -> dict[str, float]:
    """``|sim / engine - 1|`` of each compared metric, keyed ``<metric>_rel_err`` without the unit."""
    return {
        f"{name.removesuffix('_s')}_rel_err": abs(sim.metrics[name] / engine.metrics[name] - 1.0)
        for name in COMPARED
    }


def compare(runs: dict[tuple[str, str], SimResult], policies: Sequence[str]) -> dict:
    """Per-policy and headline errors of the simulator against the engine."""
    per: dict[str, dict[str, Any]] = {}
    for policy in policies:
        engine, sim = runs[(policy, "engine")], runs[(policy, "sim")]
        per[policy] = {
            "iteration_mape": iteration_mape(engine.iterations),
            **relative_errors(engine, sim),
            "iterations": len(engine.iterations["latency"]),
            "engine": {name: engine.metrics[name] for name in COMPARED},
            "sim": {name: sim.metrics[name] for name in COMPARED},
        }
    pooled = {
        k: np.concatenate([runs[(p, "engine")].iterations[k] for p in policies])
        for k in ("predicted", "latency")
    }
    headline = {"iteration_mape": iteration_mape(pooled)}
    for key in relative_errors(runs[(policies[0], "engine")], runs[(policies[0], "sim")]):
        headline[key] = max(per[p][key] for p in policies)
    return {**headline, "policies": per}


def run(
    conf: ReplayConfig,
    out: Path,
    repeats: int = 5,
    warmup: int = 1,
    log: Callable[[str], None] = print,
) -> dict:
    """The whole measurement (see the module docstring); returns the JSON-ready summary."""
    check(conf)  # a bad name fails before minutes of profiling
    start = time.perf_counter()
    load_start = os.getloadavg()
    log(f"profiling {conf.model} on {conf.device} with {conf.threads} thread(s)...")
    cal = calibrate(conf, out, repeats, warmup)
    fitted, path = cal.fit, cal.path
    log(
        f"fitted {fitted.points} compositions in {cal.seconds:.0f} s: "
        f"in-sample MAPE {fitted.in_sample_mape:.3f}, "
        f"held-out {fitted.heldout_mape:.3f}; scheduler {cal.overhead_s * 1e3:.3f} ms per iteration -> {path}"
    )
    conf = dataclasses.replace(conf, cost_model=str(path), backends=["engine", "sim"])
    done = replay(conf, log=log)
    write_replay(done, out)
    summary = compare(done.results, conf.policies)
    first = done.rows[0].row
    summary.update(
        profile={
            "compositions": fitted.points,
            "in_sample_mape": fitted.in_sample_mape,
            "heldout_mape": fitted.heldout_mape,
            "scheduler_overhead_s": cal.overhead_s,
            "seconds": cal.seconds,
            "file": str(path),
        },
        slice={
            "workload": first["workload"],
            "seed": conf.seed,
            "load_scale": conf.load_scale,
            "window_s": conf.window_s,
            "length_scale": conf.length_scale,
            "requests": first["requests"],
            "span_s": first["span_s"],
        },
        machine=cal.where,
        loadavg_start=list(load_start),
        loadavg_end=list(os.getloadavg()),
        wall_s=time.perf_counter() - start,
        output_dir=str(out),
    )
    return summary


@hydra_cli(SimToRealConfig, CONFIG_NAME, RULES, DEFAULT_CONFIG, PRESET)
def main(opts: SimToRealConfig) -> dict:
    """The measurement of :func:`run`; the summary goes to ``out/summary.json`` and, last, to stdout."""
    out = resolve_path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = run(opts.replay_config(), out, opts.repeats, opts.warmup, log=lambda s: print(s, flush=True))
    atomic_write_text(out / "summary.json", json.dumps(_rounded(summary), indent=1) + "\n")
    print(json.dumps(_rounded(summary)))
    return summary


def _rounded(value):
    """4 significant digits, NaN as null (strict JSON)."""
    if isinstance(value, float):
        return None if math.isnan(value) else float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rounded(v) for v in value]
    return value
