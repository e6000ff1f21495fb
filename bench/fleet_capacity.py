"""Each router's fleet capacity and prefix hit rate: 8 replicas on a prefix-heavy workload.

    python bench/fleet_capacity.py [workload=mooncake_conv] [replicas=8] [seeds=[0,1,2]] [report=reports/fleet/NAME]

Per router of conf/router/ and seed: the fleet's attain90 capacity (load scale and req/s, the
search of ``evaluate.py``) with ``policy`` on every server, and the fleet-wide prefix hit rate on
the same traffic for every router: the test window at round robin's capacity for that seed (so the
hit rates compare like for like).  Writes ``report``.json and .md when ``report`` is set; the last
stdout line is one JSON object with the means over seeds and the load average.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from baselines.routers import make_router, router_names
from chunkgym.cli import hydra_cli
from chunkgym.config import AT_LEAST_ONE
from chunkgym.io import atomic_write_text
from envs.serving.capacity import CapacityQuery, measure_capacities
from envs.serving.fleet import FleetSpec
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.registry import make_policy


@dataclass
class Options:
    workload: str = "mooncake_conv"
    replicas: int = 8
    policy: str = "sarathi_512"
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    model: str = "llama3_8b"
    hardware: str = "h100_80gb"
    parallel: int = 2
    report: str = ""  # a path without suffix: writes .json and .md there


@hydra_cli(Options, "fleet_capacity", {"replicas": AT_LEAST_ONE, "parallel": AT_LEAST_ONE})
def main(args: Options) -> None:
    load_start, wall = os.getloadavg()[0], time.perf_counter()
    setup = ServingSetup.from_names(args.model, args.hardware, 1, "strict", "calibrated")
    workload = load_workload(args.workload)
    routers = router_names()
    policy = functools.partial(make_policy, args.policy)
    queries = [
        CapacityQuery(
            setup,
            workload,
            policy,
            seed=seed,
            fleet=FleetSpec(replicas=args.replicas, router=name),
            make_router=functools.partial(make_router, name),
        )
        for name in routers
        for seed in args.seeds
    ]
    found = iter(measure_capacities(queries, parallel=args.parallel))
    rows = {name: [next(found) for _ in args.seeds] for name in routers}
    hits: dict[str, list[float]] = {name: [] for name in routers}
    for i, seed in enumerate(args.seeds):
        trace = workload.window("test", seed, rows["round_robin"][i].scale)
        for name in routers:
            fleet = setup.fleet(trace, args.replicas, policy, make_router(name), seed)
            hits[name].append(fleet.run().metrics["prefix_hit_rate"])
    table = {
        name: {
            "capacity_scale": [c.scale for c in rows[name]],
            "capacity_rps": [round(c.rps, 4) for c in rows[name]],
            "prefix_hit_rate": [round(h, 4) for h in hits[name]],
            "capacity_rps_mean": round(float(np.mean([c.rps for c in rows[name]])), 4),
            "prefix_hit_rate_mean": round(float(np.mean(hits[name])), 4),
        }
        for name in routers
    }
    out = {
        "workload": args.workload,
        "replicas": args.replicas,
        "policy": args.policy,
        "seeds": args.seeds,
        "routers": table,
        "wall_s": round(time.perf_counter() - wall, 1),
        "load_avg": round((load_start + os.getloadavg()[0]) / 2, 2),
    }
    if args.report:
        path = Path(args.report)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path.with_suffix(".json"), json.dumps(out, indent=1) + "\n")
        atomic_write_text(path.with_suffix(".md"), markdown(out))
    print(json.dumps(out))


def markdown(out: dict) -> str:
    """The table of a report: one row per router, best capacity first."""
    lines = [
        f"# Routers on {out['workload']}, {out['replicas']} replicas of {out['policy']}",
        "",
        f"`python bench/fleet_capacity.py workload={out['workload']} replicas={out['replicas']} "
        f"policy={out['policy']}` (seeds {out['seeds']}; {out['wall_s']} s, load average {out['load_avg']}).",
        "Capacity: attain90 (90% of requests within the strict SLO), the fleet's req/s; prefix hit rate:",
        "fleet-wide share of prompt tokens served from a prefix cache, on round robin's capacity traffic.",
        "",
        "| router | capacity req/s (mean) | per seed | prefix hit rate (mean) | per seed |",
        "|---|---|---|---|---|",
    ]
    ranked = sorted(out["routers"].items(), key=lambda kv: -kv[1]["capacity_rps_mean"])
    for name, row in ranked:
        lines.append(
            f"| {name} | {row['capacity_rps_mean']:.2f} | {', '.join(f'{v:.2f}' for v in row['capacity_rps'])} "
            f"| {row['prefix_hit_rate_mean']:.3f} | {', '.join(f'{v:.3f}' for v in row['prefix_hit_rate'])} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
