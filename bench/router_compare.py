"""The learned router against every router baseline: 8 servers on test windows of each workload.

    python bench/router_compare.py [router=learned_router] [policy=sarathi_512] [seeds=[0,1,2]]

Each workload of ``workloads`` is served at its load of ``loads`` (the workload's own 1x, one
server's: a fleet of 8 carries about 8x) on the test windows ``seeds``, by ``replicas`` servers each
scheduling with ``policy``, behind ``router`` (``learned_router``: the shipped one, or
``learned_router:PATH``) and behind each baseline of :data:`baselines.routers.ROUTERS`.  Per workload and
router: the mean over windows of goodput, SLO attainment, prefix hit rate and load imbalance.  A
workload is marked ``held_out`` when the learned router never trained on it (its manifest's
``workloads``); the test windows of the others are held out too (it trained on train splits).  Writes
``out`` (``.json`` and ``.md``); the last stdout line is the JSON.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from baselines.routers import ROUTERS
from chunkgym import REPO_ROOT
from chunkgym.cli import hydra_cli
from chunkgym.config import AT_LEAST_ONE
from chunkgym.io import atomic_write_text
from chunkgym.received import load_json
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.registry import make_policy
from policies.router_export import SPEC_FILE, make_any_router, router_dir

METRICS = ("goodput_rps", "slo_attainment", "prefix_hit_rate", "load_imbalance")


@dataclass
class Options:
    router: str = "learned_router"
    policy: str = "sarathi_512"
    replicas: int = 8
    workloads: list[str] = field(default_factory=lambda: ["mooncake_conv", "azure_conv", "servegen_r1"])
    loads: list[float] = field(default_factory=lambda: [20.0, 20.0, 16.0])  # one per workload
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    out: str = "reports/fleet/router_compare"


def markdown(out: dict[str, object], rows: list[dict[str, object]]) -> str:
    lines = [
        f"# Routers on {out['replicas']} servers ({out['policy']} each), test windows {out['seeds']}",
        "",
        "Written by `python bench/router_compare.py`; means over the windows. *held out*: the learned router "
        "never trained on the workload (every row is on test windows, which it never saw).",
        "",
        "| workload | load | router | goodput (req/s) | SLO attainment | prefix hit rate | load imbalance |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        held = " (held out)" if r["held_out"] else ""
        lines.append(
            f"| {r['workload']}{held} | {r['load_scale']} | {r['router']} | {r['goodput_rps']:.3f} | "
            f"{r['slo_attainment']:.3f} | {r['prefix_hit_rate']:.3f} | {r['load_imbalance']:.3f} |"
        )
    return "\n".join(lines) + "\n"


@hydra_cli(Options, "router_compare", {"replicas": AT_LEAST_ONE})
def main(args: Options) -> None:
    if len(args.loads) != len(args.workloads):
        raise SystemExit(
            f"router_compare.py: error: loads={args.loads}: one load per workload of {args.workloads}"
        )
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    directory = router_dir(args.router)
    if directory is None:
        raise SystemExit(
            f"router_compare.py: error: router={args.router!r}: learned_router or learned_router:PATH"
        )
    trained_on = load_json(directory / SPEC_FILE, directory).get("workloads", [])
    setup = ServingSetup.from_names()
    make = functools.partial(make_policy, args.policy)
    rows: list[dict[str, object]] = []
    for name, load in zip(args.workloads, args.loads, strict=True):
        workload = load_workload(name)
        traces = [workload.window("test", seed, load) for seed in args.seeds]
        for router in [args.router, *ROUTERS]:
            runs = [
                setup.fleet(t, args.replicas, make, make_any_router(router)).run().metrics for t in traces
            ]
            row: dict[str, object] = {"workload": name, "load_scale": load, "router": router}
            row.update({m: round(float(np.mean([r[m] for r in runs])), 4) for m in METRICS})
            row["held_out"] = name not in trained_on
            rows.append(row)
    best: dict[str, object] = {}
    for name in args.workloads:
        baselines = [r for r in rows if r["workload"] == name and r["router"] in ROUTERS]
        top = max(baselines, key=lambda r: float(r["goodput_rps"]))  # type: ignore[arg-type]
        mine = next(r for r in rows if r["workload"] == name and r["router"] == args.router)
        best[name] = {
            "best_baseline": top["router"],
            "best_baseline_goodput_rps": top["goodput_rps"],
            "learned_goodput_rps": mine["goodput_rps"],
            "learned_over_best": round(float(mine["goodput_rps"]) / float(top["goodput_rps"]), 4),  # type: ignore[arg-type]
            "held_out": mine["held_out"],
        }
    out: dict[str, object] = {
        "router": args.router,
        "policy": args.policy,
        "replicas": args.replicas,
        "seeds": args.seeds,
        "trained_on": trained_on,
        "learned_vs_best": best,
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 2),
        "load_avg": round((load_start + os.getloadavg()[0]) / 2, 2),
    }
    target = Path(args.out) if Path(args.out).is_absolute() else REPO_ROOT / args.out
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target.with_suffix(".json"), json.dumps(out, indent=2) + "\n")
    atomic_write_text(target.with_suffix(".md"), markdown(out, rows))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
