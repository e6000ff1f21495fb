"""Fleet simulation speed: 8 replicas at 8x the Azure conv trace's rate against one replica at 1x.

    python bench/fleet_speed.py [replicas=8] [policy=sarathi_512]

Replays all 19,366 requests of AzureLLMInferenceTrace_conv (Vidur's set-up: Llama-2-7B on one H100
per server, as ``bench/sim_speed.py``) once on one server at the recorded rate and once at
``replicas`` x that rate on ``replicas`` servers, behind ``round_robin`` and behind
``prefix_affinity``.  Each server then serves about the single server's load, so a fleet that costs
no more per simulated iteration than one server runs as many iterations per second:
``fleet_over_single`` is the lower of the two routers' ratios of iterations per second (summed over
replicas) to the single server's (target >= 0.8).  Each rate is the best of ``repeats`` runs in CPU
seconds of this process (steadier than wall time beside other jobs); timings of one run compare.
The last stdout line is one JSON object with the load average over the run (``load_avg``).
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from baselines.routers import make_router
from chunkgym.cli import hydra_cli
from chunkgym.config import AT_LEAST_ONE
from envs.serving.loop import SimResult
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from envs.serving.workloads.trace import Trace
from policies.registry import make_policy

ROUTERS = ("round_robin", "prefix_affinity")


def azure_conv_at(load: float) -> Trace:
    """All of AzureLLMInferenceTrace_conv at ``load`` x its recorded rate (the workload's rate_scale undone)."""
    workload = load_workload("azure_conv")
    return workload.split("all", 0, load / workload.spec.rate_scale)


def _timed(run: Callable[[], SimResult]) -> tuple[float, SimResult]:
    """CPU seconds of this process (steadier than wall time on a shared machine) and the result."""
    start = time.process_time()
    result = run()
    return time.process_time() - start, result


@dataclass
class Options:
    replicas: int = 8
    policy: str = "sarathi_512"
    repeats: int = 3  # each run's best of this many


@hydra_cli(Options, "fleet_speed", {"replicas": AT_LEAST_ONE, "repeats": AT_LEAST_ONE})
def main(args: Options) -> None:
    load_start = os.getloadavg()[0]
    setup = ServingSetup.from_names("llama2_7b", "h100_80gb", 1, "strict", "calibrated")  # Vidur's set-up
    single_trace, fleet_trace = azure_conv_at(1.0), azure_conv_at(float(args.replicas))
    single_wall, single = min(
        (
            _timed(lambda: setup.simulator(single_trace).run(make_policy(args.policy)))
            for _ in range(args.repeats)
        ),
        key=lambda timed: timed[0],
    )
    single_rate = single.metrics["iterations"] / single_wall
    out: dict[str, object] = {
        "replicas": args.replicas,
        "policy": args.policy,
        "requests": len(fleet_trace),
        "single_iterations": int(single.metrics["iterations"]),
        "single_wall_s": round(single_wall, 3),
        "single_iterations_per_s": round(single_rate),
    }
    rates = []
    fleet_wall = 0.0
    for name in ROUTERS:
        fleet = setup.fleet(
            fleet_trace, args.replicas, functools.partial(make_policy, args.policy), make_router(name)
        )
        wall = time.perf_counter()
        result = fleet.run()
        seconds = time.perf_counter() - wall
        fleet_wall += seconds
        rate = result.metrics["iterations"] / seconds
        rates.append(rate)
        out[f"{name}_iterations"] = int(result.metrics["iterations"])
        out[f"{name}_wall_s"] = round(seconds, 3)
        out[f"{name}_iterations_per_s"] = round(rate)
        out[f"{name}_over_single"] = round(rate / single_rate, 3)
        out[f"{name}_goodput_rps"] = round(result.metrics["goodput_rps"], 3)
    out["fleet_iterations_per_s"] = round(min(rates))  # the slower router's
    out["fleet_over_single"] = round(min(rates) / single_rate, 3)
    out["fleet_wall_s"] = round(fleet_wall, 3)
    out["load_avg"] = round((load_start + os.getloadavg()[0]) / 2, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
