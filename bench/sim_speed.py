"""Simulation speed: the full Azure conv trace through Sarathi-512, and the env's step rate.

    python bench/sim_speed.py [env_steps=50000]

Replays all 19,366 requests of AzureLLMInferenceTrace_conv at their recorded times
(Llama-2-7B on one H100), then steps `chunkgym/ChunkedPrefill-v0`, `-v1`, `-v3` and `-v4` with
random valid actions.  Vidur, the reference simulator, spends ~40 s in its simulation loop on this
trace and scheduler (~8.2k iterations/s, so ~328k iterations); the ratios are printed
beside ours.  The replay runs twice: with the calibrated cost model (the default, the
JSON's main fields, with its TTFT and TBT medians as ``ttft_p50_s`` and ``tbt_p50_s``) and
with the uncalibrated roofline v0.  The env's step rate is timed for v0 (one step per iteration),
v1 (one step per decision, forced iterations run in between), v3 (v1's steps, latency-target
actions) and v4 (the default env: v3 plus the traffic's lengths) on the same workload, load and
seed, back to back, with the engine iterations each simulated per second and v1's rate over v0's
(``env_v1_over_v0``: the target is >= 1; on a shared machine only ratios of one run compare).  The last stdout line is one JSON object,
with the load average over the run (``load_avg``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import cast

import gymnasium as gym
import numpy as np

import chunkgym
import envs
from chunkgym.cli import hydra_cli
from chunkgym.config import AT_LEAST_ONE
from envs.chunked_prefill import ChunkedPrefillEnv
from envs.serving.setup import ServingSetup
from envs.serving.simulator import Simulator
from envs.serving.workload import load_workload
from envs.serving.workloads.trace import Trace
from policies.registry import make_policy

ENV_IDS = {"v0": envs.ENV_ID_V0, "v1": envs.ENV_ID_V1, "v3": envs.ENV_ID_V3, "v4": envs.ENV_ID_V4}
VIDUR_LOOP_S = 40.0
VIDUR_ITERATIONS_PER_S = 8.2e3
VIDUR_TTFT_P50_S = 40.4e-3
VIDUR_TBT_P50_S = 9.0e-3
"""Vidur's medians on the same trace and setup, from Vidur run on it (docs/benchmarks.md): the
targets are 0.8x-2.5x of its TTFT P50 and 0.8x-2.0x of its TBT P50."""


def native_trace(load: float = 1.0) -> Trace:
    """All of AzureLLMInferenceTrace_conv at ``load`` x its recorded arrival rate (19,366 requests)."""
    workload = load_workload("azure_conv")
    # The workload's rate_scale sets its moderate load; undo it to replay the recorded times.
    return workload.split("all", 0, load / workload.spec.rate_scale)


def vidur_setup(cost_model: str) -> ServingSetup:
    """Vidur's configuration: Llama-2-7B on one H100, TP1 (batch cap 256, 7,609 KV blocks of 16 tokens)."""
    return ServingSetup.from_names("llama2_7b", "h100_80gb", 1, "strict", cost_model)


def env_rates(env_id: str, steps: int, cost_model: str) -> tuple[float, float]:
    """Steps and engine iterations simulated per second of ``env_id`` on azure_conv at load 1,
    seed 0, with random valid actions."""
    env = gym.make(env_id, cost_model=cost_model, workload="azure_conv", load_scale=1.0)
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    inner = cast(ChunkedPrefillEnv, env.unwrapped)
    mask_of, split = inner.action_masks, inner.actions.nvec[0]
    picks = rng.random((steps, 2))
    iterations = -len(cast(Simulator, inner.sim).log)  # those before the first step are not timed
    start = time.perf_counter()
    for i in range(steps):
        m = mask_of()
        modes, allocations = np.flatnonzero(m[:split]), np.flatnonzero(m[split:])
        action = (modes[int(picks[i, 0] * len(modes))], allocations[int(picks[i, 1] * len(allocations))])
        if env.step(action)[3]:
            iterations += len(cast(Simulator, inner.sim).log)
            env.reset()
    wall = time.perf_counter() - start
    iterations += len(cast(Simulator, inner.sim).log)
    return steps / wall, iterations / wall


@dataclass
class Options:
    """``python bench/sim_speed.py KEY=VALUE ...``."""

    env_steps: int = 50_000  # random valid actions timed in the env


@hydra_cli(Options, "sim_speed", {"env_steps": AT_LEAST_ONE})
def main(args: Options) -> None:
    chunkgym.require_own_packages()
    load_start = os.getloadavg()[0]

    trace = native_trace()
    runs = {}
    latency = {}
    for cost_model in ("calibrated", "roofline"):
        sim = vidur_setup(cost_model).simulator(trace)
        print(f"{cost_model}: simulating {len(trace)} requests ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        result = sim.run(make_policy("sarathi_512"))
        wall = time.perf_counter() - start
        iterations = int(result.metrics["iterations"])
        runs[cost_model] = (iterations, wall)
        latency[cost_model] = (result.metrics["ttft_p50_s"], result.metrics["tbt_p50_s"])
        print(
            f"{cost_model:10s}: {len(trace)} requests, {iterations} iterations in {wall:.2f} s "
            f"({iterations / wall:,.0f} it/s); Vidur: {VIDUR_LOOP_S:.0f} s, {VIDUR_ITERATIONS_PER_S:,.0f} it/s "
            f"-> {VIDUR_LOOP_S / wall:.1f}x faster loop; goodput {result.metrics['goodput_rps']:.2f} req/s, "
            f"{result.metrics['rejected']} rejected (prompt+output > 4,096); TTFT P50 "
            f"{result.metrics['ttft_p50_s'] * 1e3:.1f} ms (Vidur {VIDUR_TTFT_P50_S * 1e3:.1f}), TBT P50 "
            f"{result.metrics['tbt_p50_s'] * 1e3:.2f} ms (Vidur {VIDUR_TBT_P50_S * 1e3:.1f})"
        )
    print(
        f"env: {args.env_steps:,} random valid steps of v0, v1, v3, then v4 ...", file=sys.stderr, flush=True
    )
    rates = {v: env_rates(env_id, args.env_steps, "calibrated") for v, env_id in ENV_IDS.items()}
    (steps, its), (steps_v1, its_v1) = rates["v0"], rates["v1"]
    (steps_v3, its_v3), (steps_v4, its_v4) = rates["v3"], rates["v4"]
    print(f"env v0: {steps:,.0f} steps/s with random valid actions (target 20,000), {its:,.0f} iterations/s")
    print(
        f"env v1: {steps_v1:,.0f} decision steps/s with random valid actions ({steps_v1 / steps:.2f}x v0's; "
        f"target 1x), {its_v1:,.0f} iterations/s"
    )
    print(f"env v3: {steps_v3:,.0f} decision steps/s with random valid actions, {its_v3:,.0f} iterations/s")
    print(f"env v4: {steps_v4:,.0f} decision steps/s with random valid actions, {its_v4:,.0f} iterations/s")
    iterations, wall = runs["calibrated"]
    rf_iterations, rf_wall = runs["roofline"]
    print(
        json.dumps(
            {
                "iterations": iterations,
                "wall_s": wall,
                "iterations_per_s": iterations / wall,
                "requests": len(trace),
                "env_steps_per_s": steps,
                "env_v1_steps_per_s": steps_v1,
                "env_v3_steps_per_s": steps_v3,
                "env_v4_steps_per_s": steps_v4,
                "env_v1_over_v0": steps_v1 / steps,
                "env_iterations_per_s": its,
                "env_v1_iterations_per_s": its_v1,
                "env_v3_iterations_per_s": its_v3,
                "env_v4_iterations_per_s": its_v4,
                "vidur_loop_speedup": VIDUR_LOOP_S / wall,
                "roofline_iterations": rf_iterations,
                "roofline_wall_s": rf_wall,
                "roofline_iterations_per_s": rf_iterations / rf_wall,
                "ttft_p50_s": latency["calibrated"][0],
                "tbt_p50_s": latency["calibrated"][1],
                "load_avg": (load_start + os.getloadavg()[0]) / 2,
            }
        )
    )


if __name__ == "__main__":
    main()
