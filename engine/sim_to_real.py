"""Sim-to-real: profile the engine on this machine, fit the cost model, replay one slice in both, compare.

1. profile the replay's model on its device and threads over :func:`engine.calibrate.default_grid`;
2. fit the cost model to it (:func:`engine.calibrate.fit`) and write the coefficient file into the
   output folder (``conf/cost`` is left alone);
3. per policy, replay the same slice (:mod:`engine.replay`) on the engine in real time and in the
   simulator with the fitted profile;
4. compare: the per-iteration latency MAPE (each engine iteration's measured latency against the
   cost model's prediction for that very batch) and the relative errors ``|sim / engine - 1|`` of
   TTFT P50, TTFT P99 and TBT P99.  The headline numbers pool the iterations of all policies and
   take the worst policy's relative errors.

Entry points: ``python bench/sim_to_real.py`` (CPU, ``conf/engine/cpu_replay.yaml``) and
``python bench/engine_gpu.py`` (one GPU, ``conf/engine/gpu_replay.yaml``); both print one JSON
object as their last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from chunkgym import resolve_path
from chunkgym.io import atomic_write_text
from engine.calibrate import calibrate
from engine.replay import ReplayConfig, check, load_config, replay
from engine.replay import write as write_replay
from envs.serving.simulator import SimResult

DEFAULT_POLICIES = ("sarathi_512", "fcfs")
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
    per = {}
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


def main(argv: Sequence[str] | None = None, default_config: str | None = None, description: str = "") -> dict:
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="profiling repeats per composition (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--out", default="outputs/sim_to_real", help="profile, results and iterations go here"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="replay config: config=PATH and KEY=VALUE (e.g. 'policies=[sarathi_512,fcfs]' seed=1)",
    )
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if default_config and not any(o.startswith("config=") for o in overrides):
        overrides.insert(0, f"config={default_config}")
    if not any(o.startswith("policies=") for o in overrides):
        overrides.append(f"policies=[{','.join(DEFAULT_POLICIES)}]")
    try:
        conf = load_config(overrides)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    out = resolve_path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = run(conf, out, args.repeats, args.warmup, log=lambda s: print(s, flush=True))
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
