"""Sim-to-real against vLLM: profile vLLM, fit the cost model, replay the same windows on vLLM and in the simulator.

1. profile vLLM (its own scheduler) over :func:`engine.vllm_backend.profile.grid` and fit the cost
   model (:func:`engine.vllm_backend.profile.calibrate`), writing the coefficient file into ``out``;
   with ``reference_step_s`` set, scale ``load_scale`` by this machine's speed (:func:`machine_load`),
   so a slower machine serves the windows in the regime the load was chosen for;
2. per policy, start vLLM with the chunkgym scheduler running it and replay every window of ``seeds``
   in real time (:mod:`engine.vllm_backend.replay`); the simulator serves the same windows with the
   fitted profile.  With ``calibrate_speed``, the engine times a few dozen steps
   of known batches just before and just after each window (:meth:`VllmServer.time_scale`), and the
   simulator's clock runs that window at the mean of the two (measured / predicted step time), the
   policies still planning with the profile.  Off by default: on a shared machine the two timings of
   one window can differ by up to 1.7x, and the scaled simulator was further from vLLM (docs/vllm.md);
3. compare (:func:`compare`): per-iteration latency MAPE (:func:`engine.sim_to_real.iteration_mape`:
   each vLLM step against the cost model's prediction for the batch vLLM ran, times the window's
   time scale; ``iteration_mape_profile``: against the profile alone), the relative errors
   ``|sim / vllm - 1|`` of TTFT P50, TTFT P99 and TBT P99 (each averaged over the windows first),
   plan agreement (the fraction of vLLM's steps that scheduled exactly the tokens per request the
   policy planned on vLLM's state), and Kendall's tau-b between the policies' mean goodput on vLLM
   and in the simulator, a pair less than ``tie`` apart (relative) counting as tied.

``python bench/sim_to_real_vllm.py`` is the entry point; its last stdout line is the JSON summary.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from chunkgym import REPO_ROOT, resolve_path
from chunkgym.cli import hydra_cli
from chunkgym.config import AT_LEAST_ONE, POSITIVE, Rule
from chunkgym.io import atomic_write_text
from engine.replay import Replay, check, run_spec, write
from engine.sim_to_real import _rounded
from engine.vllm_backend import llm
from engine.vllm_backend.compare import compare, table
from engine.vllm_backend.profile import calibrate, grid
from engine.vllm_backend.replay import VllmReplayConfig, VllmServer, replay
from engine.vllm_backend.speed import SPEED_PROBE, machine_load
from envs.serving.cost_model import CostModel, RooflineCostModel

DEFAULT_CONFIG = REPO_ROOT / "conf" / "replay" / "vllm" / "cpu_vllm_bench.yaml"
CONFIG_NAME = "sim_to_real_vllm"


@dataclass
class SimToRealVllmConfig(VllmReplayConfig):
    """The slice (``config=PATH``, default ``conf/replay/vllm/cpu_vllm_bench.yaml``), its windows and the profiling."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # test windows, each replayed per policy
    repeats: int = 5  # profiling repeats per composition (median)
    warmup: int = 1  # untimed repeats before them
    grid_stride: int = 1  # profile every k-th composition of the grid (smoke runs)
    tie: float = 0.05  # goodputs less than this apart (relative) tie in the rank comparison
    # seconds of speed.SPEED_PROBE on the machine load_scale was chosen on; the windows are served at
    # load_scale x reference_step_s / this machine's fitted time for it.  null: at load_scale as given
    reference_step_s: float | None = None
    # time the engine's speed before and after each window and run the simulator's clock at it
    # (off: in the measurements of docs/vllm.md it made the simulator less accurate)
    calibrate_speed: bool = False
    out: str = "outputs/sim_to_real_vllm"

    def replay_config(self, seed: int) -> VllmReplayConfig:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(VllmReplayConfig)}
        return VllmReplayConfig(**{**fields, "seed": seed})


RULES: dict[str, Rule] = {
    "repeats": AT_LEAST_ONE,
    "warmup": Rule(lambda v: v >= 0, "an integer >= 0"),
    "grid_stride": AT_LEAST_ONE,
    "tie": Rule(lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
    "seeds": Rule(lambda v: len(v) > 0, "a non-empty list of window seeds"),
    "reference_step_s": Rule(lambda v: v is None or POSITIVE.test(v), "null or seconds > 0"),
}


@dataclass(frozen=True)
class WindowSpeed:
    """The engine's time scale (measured / predicted step time) just before and just after a window;
    1.0 both without ``calibrate_speed``.  The simulator serves the window at their mean."""

    before: float
    after: float

    @property
    def mean(self) -> float:
        return (self.before + self.after) / 2


def serve_all(
    conf: SimToRealVllmConfig, log: Callable[[str], None], loads: list[float], cost: CostModel
) -> tuple[dict[tuple[str, str, int], Replay], dict[tuple[str, int], WindowSpeed]]:
    """Every policy on vLLM (one engine per policy, the windows in turn) and in the simulator, and
    each (policy, window)'s engine speed against ``cost``."""
    done: dict[tuple[str, str, int], Replay] = {}
    speeds: dict[tuple[str, int], WindowSpeed] = {}
    for policy in conf.policies:
        server = VllmServer(conf.replay_config(conf.seeds[0]), policy)
        try:
            for seed in conf.seeds:
                loads.append(os.getloadavg()[0])
                one = dataclasses.replace(conf.replay_config(seed), policies=[policy])
                before = server.time_scale(cost) if conf.calibrate_speed else 1.0
                done[(policy, "vllm", seed)] = replay(
                    dataclasses.replace(one, backends=["vllm"]), {policy: server}, log
                )
                after = server.time_scale(cost) if conf.calibrate_speed else 1.0
                speeds[(policy, seed)] = speed = WindowSpeed(before, after)
                if conf.calibrate_speed:
                    log(
                        f"{policy} window {seed}: vLLM ran {before:.3f}x / {after:.3f}x the profile's step times before / after"
                    )
                done[(policy, "sim", seed)] = replay(
                    dataclasses.replace(one, backends=["sim"]), log=log, time_scale=speed.mean
                )
        finally:
            server.close()
            del server
            gc.collect()
    return done, speeds


def run(conf: SimToRealVllmConfig, out: Path, log: Callable[[str], None] = print) -> dict:
    """The whole measurement (module docstring); the JSON-ready summary."""
    for seed in conf.seeds:  # bad names and empty windows fail before minutes of profiling
        check(conf.replay_config(seed))
    start = time.perf_counter()
    loads = [os.getloadavg()[0]]
    compositions = grid()[:: conf.grid_stride]
    log(
        f"profiling vLLM {llm.VERSION} ({conf.model}, {conf.threads} thread(s)) over {len(compositions)} compositions..."
    )
    cal = calibrate(conf, out, conf.repeats, conf.warmup, compositions, log, out / "profile.csv")
    log(
        f"fitted {cal.fit.points} compositions in {cal.seconds:.0f} s ({cal.span:.1f}x latency span): in-sample "
        f"MAPE {cal.fit.in_sample_mape:.3f}, held-out {cal.fit.heldout_mape:.3f} -> {cal.path}"
    )
    load, speed = machine_load(conf.load_scale, conf.reference_step_s, RooflineCostModel(cal.fit.params))
    fitted = dataclasses.replace(conf, cost_model=str(cal.path), load_scale=load)
    if conf.reference_step_s is not None:
        log(
            f"this machine runs {SPEED_PROBE.label!r} at {speed:.3f}x the reference's speed: load {conf.load_scale:g} -> {load:g}"
        )
    profile_cost = (
        run_spec(fitted, fitted.policies[0]).setup.build().cost_model
    )  # the file, as the replays load it
    done, speeds = serve_all(fitted, log, loads, profile_cost)
    loads.append(os.getloadavg()[0])
    merged = Replay(
        [r for d in done.values() for r in d.rows],
        pd.concat([d.iterations.assign(seed=s) for (_, _, s), d in done.items()], ignore_index=True),
        {},
    )
    write(merged, out)
    runs = {key: next(iter(d.results.values())) for key, d in done.items()}
    summary = compare(runs, conf.policies, conf.seeds, conf.tie, {key: v.mean for key, v in speeds.items()})
    first = done[(conf.policies[0], "vllm", conf.seeds[0])].rows[0].row
    summary.update(
        policies=list(conf.policies),
        windows=len(conf.seeds),
        vllm_version=llm.VERSION,
        load_avg=float(np.mean(loads)),
        load_scale=load,
        load_scale_nominal=conf.load_scale,
        machine_speed=speed,
        calibrate_speed=conf.calibrate_speed,
        time_scale_before_after={f"{p} {s}": [v.before, v.after] for (p, s), v in speeds.items()},
        tie=conf.tie,
        profile={
            "compositions": cal.fit.points,
            "in_sample_mape": cal.fit.in_sample_mape,
            "heldout_mape": cal.fit.heldout_mape,
            "latency_span": cal.span,
            "seconds": cal.seconds,
            "file": str(cal.path),
        },
        slice={
            "workload": first["workload"],
            "seeds": list(conf.seeds),
            "load_scale": load,
            "window_s": conf.window_s,
            "length_scale": conf.length_scale,
            "requests": [done[(conf.policies[0], "vllm", s)].rows[0].row["requests"] for s in conf.seeds],
        },
        machine=cal.where,
        loadavg_samples=loads,
        wall_s=time.perf_counter() - start,
        output_dir=str(out),
    )
    return summary


@hydra_cli(SimToRealVllmConfig, CONFIG_NAME, RULES, DEFAULT_CONFIG)
def main(opts: SimToRealVllmConfig) -> dict:
    """:func:`run`; the table and ``out/summary.json``, then the summary as the last stdout line."""
    out = resolve_path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        summary = run(opts, out, log=lambda s: print(s, flush=True))
    except ValueError as exc:
        raise SystemExit(f"python bench/sim_to_real_vllm.py: error: {exc}") from exc
    print(table(summary))
    atomic_write_text(out / "summary.json", json.dumps(_rounded(summary), indent=1) + "\n")
    print(json.dumps(_rounded(summary)))
    return summary
