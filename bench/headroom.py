"""Headroom: how much can choosing the budget and rule per iteration gain over fixed budgets?

For each workload (val split, so the test split stays unseen), the capacity (>= 90% of
requests within SLO, default model and hardware) of:

* ``sarathi``: the best fixed Sarathi budget (FCFS allocation), swept 128..8192;
* ``constant``: the best constant action (budget x allocation rule) of the env;
* ``oracle``: the hindsight oracle of :mod:`policies.oracle` (rollout policy
  improvement over the best constant action, re-simulating every action each period).

The ratio oracle / sarathi is the ceiling a learned policy can aim for.

    python bench/headroom.py ["workloads=[azure_conv,...]"] ["seeds=[0]"] [oracle=false]

The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import chunkgym
from chunkgym.cli import hydra_cli
from chunkgym.config import NON_EMPTY, POSITIVE
from chunkgym.progress import Progress
from envs.serving.early import Attain90Stop
from envs.serving.metrics import capacity_search
from envs.serving.scheduling import RULE_NAMES, Rule
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload, workload_names
from policies.oracle import DEFAULT_BUDGETS, DEFAULT_RULES, oracle_run

SARATHI_BUDGETS = (128, 256, 512, 1024, 2048, 4096, 8192)


def attainment(setup, workload, seed, scale, budget, rule) -> float:
    from baselines import Sarathi

    trace = workload.window("val", seed, scale)
    return setup.simulator(trace).run(Sarathi(budget, RULE_NAMES[rule])).metrics["slo_attainment"]


@dataclass
class Options:
    """``python bench/headroom.py KEY=VALUE ...``."""

    workloads: list[str] = field(
        default_factory=lambda: [w for w in workload_names() if not w.startswith("synthetic")]
    )
    seeds: list[int] = field(default_factory=lambda: [0])  # val windows
    oracle: bool = True  # also search the hindsight oracle's capacity (slow)
    period_s: float = 4.0  # the oracle's decision period
    horizon_s: float = 24.0  # the oracle's rollout horizon
    rel_tol: float = 0.02  # the capacity search's relative bracket width
    oracle_early_stop: bool = True  # end an oracle probe once its attain90 outcome is proven


RULES = {"seeds": NON_EMPTY, "workloads": NON_EMPTY, "period_s": POSITIVE, "horizon_s": POSITIVE}
RULES["rel_tol"] = POSITIVE


@hydra_cli(Options, "headroom", RULES)
def main(args: Options) -> None:
    chunkgym.require_own_packages()
    setup = ServingSetup.from_names()
    report = {}
    for name in args.workloads:
        workload = load_workload(name)
        row = {}
        for seed in args.seeds:
            caps: dict[tuple[int, Rule], float] = {}
            rules = (Rule.FCFS, Rule.SHORTEST_FIRST, Rule.SLACK_DOOMED_LAST)
            total = sum(1 for b in SARATHI_BUDGETS for r in rules if r == Rule.FCFS or b in DEFAULT_BUDGETS)
            progress = Progress(f"headroom {name} seed {seed}", total)
            for budget in SARATHI_BUDGETS:
                for rule in rules:
                    if rule != Rule.FCFS and budget not in DEFAULT_BUDGETS:
                        continue
                    progress.update(len(caps), "capacity searches")
                    res = capacity_search(
                        lambda s, w=workload, k=seed, b=budget, r=rule: (  # type: ignore[misc]  # mypy cannot type a lambda with defaults
                            attainment(setup, w, k, s, b, r) >= 0.9
                        ),
                        rel_tol=args.rel_tol,
                    )
                    caps[(budget, rule)] = res.scale
            sarathi = max((c, b) for (b, r), c in caps.items() if r == Rule.FCFS)
            constant = max((c, b, int(r)) for (b, r), c in caps.items())
            entry = {
                "sarathi": sarathi[0],
                "sarathi_budget": sarathi[1],
                "constant": constant[0],
                "constant_action": [constant[1], RULE_NAMES[constant[2]]],
            }
            progress.finish(len(caps), "capacity searches")
            if args.oracle:
                print(f"headroom {name} seed {seed}: oracle capacity search", file=sys.stderr, flush=True)
                base = (constant[1], Rule(constant[2]))
                start = time.perf_counter()

                def oracle_passes(scale: float, workload=workload, seed=seed, base=base) -> bool:
                    trace = workload.window("val", seed, scale)
                    sim = setup.simulator(trace)
                    proof = Attain90Stop.for_requests(len(trace))
                    stop = (lambda: proof(sim.core)) if args.oracle_early_stop else None
                    result, _ = oracle_run(
                        sim, base, DEFAULT_BUDGETS, DEFAULT_RULES, args.period_s, args.horizon_s, stop
                    )
                    if result.stopped:
                        return proof.passed(sim.core)
                    return result.metrics["slo_attainment"] >= 0.9

                res = capacity_search(oracle_passes, start=constant[0], rel_tol=args.rel_tol)
                entry["oracle"] = res.scale
                entry["oracle_wall_s"] = time.perf_counter() - start
            row[seed] = entry
            print(f"{name:18s} seed {seed}: " + json.dumps(entry), flush=True)
        keys = ("sarathi", "constant", "oracle")
        summary = {
            k: float(np.mean([row[s][k] for s in args.seeds])) for k in keys if k in row[args.seeds[0]]
        }
        summary["constant_over_sarathi"] = summary["constant"] / summary["sarathi"]
        if "oracle" in summary:
            summary["oracle_over_sarathi"] = summary["oracle"] / summary["sarathi"]
        report[name] = {"per_seed": row, **summary}
        print(
            f"{name:18s} capacity (load scale): " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()),
            flush=True,
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
