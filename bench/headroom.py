"""Headroom: how much can choosing the budget and rule per iteration gain over fixed budgets?

For each workload (val split, so the test split stays unseen), the capacity (>= 90% of
requests within SLO, default model and hardware) of:

* ``sarathi``: the best fixed Sarathi budget (FCFS allocation), swept 128..8192;
* ``constant``: the best constant action (budget x allocation rule) of the env;
* ``oracle``: the hindsight oracle of :mod:`policies.oracle` (rollout policy
  improvement over the best constant action, re-simulating every action each period);
  ``oracle_foresight=false`` makes it causal (its rollouts see only the requests that have
  arrived), which measures how much of the oracle's gain needs the future arrivals.

The ratio oracle / sarathi is the ceiling a learned policy can aim for.

    python bench/headroom.py ["workloads=[azure_conv,...]"] ["seeds=[0]"] [oracle=false] [backend=ray]

Every capacity search is one job (:mod:`chunkgym.backends`: ``backend=ray`` runs them on the
cluster at ``$RAY_ADDRESS``, docs/cluster.md); the oracle's searches start once the fixed
actions' are known. Each search is sequential and deterministic, so the table does not depend
on the backend or ``n_jobs``.

The last stdout line is one JSON object.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import chunkgym
from baselines import Sarathi
from chunkgym.backends import BACKENDS, session
from chunkgym.cli import hydra_cli
from chunkgym.config import NON_EMPTY, NON_NEGATIVE, POSITIVE
from chunkgym.config import Rule as OptionRule
from chunkgym.parallel import parallel_map
from envs.serving.capacity import measure_capacity
from envs.serving.early import Attain90Stop
from envs.serving.metrics import attain90, capacity_search
from envs.serving.scheduling import RULE_NAMES, Rule
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload, workload_names
from leaderboard.runs import cached_workload
from policies.oracle import DEFAULT_BUDGETS, DEFAULT_RULES, oracle_run

SARATHI_BUDGETS = (128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class FixedSearch:
    """The capacity of one fixed action (budget, allocation rule) on one val window: one job."""

    workload: str
    seed: int
    budget: int
    rule: Rule
    rel_tol: float

    @property
    def label(self) -> str:
        return f"budget {self.budget} {RULE_NAMES[self.rule]} on {self.workload}, seed {self.seed}"


def fixed_capacity(job: FixedSearch) -> float:
    """The ``attain90`` capacity search of :mod:`envs.serving.capacity`, probes decided early."""
    setup, workload = ServingSetup.from_names(), cached_workload(job.workload)  # jobs run in workers
    policy = functools.partial(Sarathi, job.budget, RULE_NAMES[job.rule])
    return measure_capacity(setup, workload, policy, "attain90", "val", job.seed, rel_tol=job.rel_tol).scale


@dataclass(frozen=True)
class OracleSearch:
    """The hindsight oracle's capacity on one val window, from the best constant action: one job."""

    workload: str
    seed: int
    base: tuple[int, Rule]
    start: float
    period_s: float
    horizon_s: float
    rel_tol: float
    early_stop: bool  # end a probe once its attain90 outcome is proven (same answer)
    foresight: bool  # the rollouts see the future arrivals (false: only those that have arrived)

    @property
    def label(self) -> str:
        return f"oracle on {self.workload}, seed {self.seed}"


def oracle_capacity(job: OracleSearch) -> tuple[float, float]:
    """(capacity, wall seconds of the search); its probes are sequential, each one oracle run."""
    setup, workload = ServingSetup.from_names(), cached_workload(job.workload)  # jobs run in workers
    start = time.perf_counter()

    def passes(scale: float) -> bool:
        trace = workload.window("val", job.seed, scale)
        sim = setup.simulator(trace)
        proof = Attain90Stop.for_requests(len(trace))
        stop = proof.watching(sim.core) if job.early_stop else None
        result, _ = oracle_run(
            sim, job.base, DEFAULT_BUDGETS, DEFAULT_RULES, job.period_s, job.horizon_s, stop, job.foresight
        )
        if result.stopped:
            return proof.passed(sim.core)
        return attain90(result.metrics)

    scale = capacity_search(passes, start=job.start, rel_tol=job.rel_tol).scale
    return scale, time.perf_counter() - start


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
    backend: str = "local"  # local processes, or ray: the cluster at $RAY_ADDRESS (unset: a local one)
    n_jobs: int = 0  # searches at once; 0: every core (backend=ray: all of them)
    progress: bool = False  # progress bars on stderr
    oracle_early_stop: bool = True  # end an oracle probe once its attain90 outcome is proven
    oracle_foresight: bool = True  # false: a causal oracle, its rollouts blind to future arrivals


RULES = {"seeds": NON_EMPTY, "workloads": NON_EMPTY, "period_s": POSITIVE, "horizon_s": POSITIVE}
RULES["rel_tol"] = POSITIVE
RULES["n_jobs"] = NON_NEGATIVE
RULES["backend"] = OptionRule(lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}")


def fixed_jobs(args: Options) -> list[FixedSearch]:
    """Every (workload, seed, budget, rule) searched: Sarathi's budgets with FCFS, the env's with every rule."""
    return [
        FixedSearch(name, seed, budget, rule, args.rel_tol)
        for name in args.workloads
        for seed in args.seeds
        for budget in SARATHI_BUDGETS
        for rule in (Rule.FCFS, Rule.SHORTEST_FIRST, Rule.SLACK_DOOMED_LAST)
        if rule == Rule.FCFS or budget in DEFAULT_BUDGETS
    ]


@hydra_cli(Options, "headroom", RULES)
def main(args: Options) -> None:
    chunkgym.require_own_packages()
    for name in args.workloads:
        load_workload(name)  # an unknown name fails before any search
    jobs = fixed_jobs(args)
    with session(args.backend, args.n_jobs):
        found = parallel_map(fixed_capacity, jobs, args.n_jobs, "fixed", args.progress, args.backend)
        caps: dict[tuple[str, int], dict[tuple[int, Rule], float]] = {}
        for fixed, scale in zip(jobs, found, strict=True):
            caps.setdefault((fixed.workload, fixed.seed), {})[fixed.budget, fixed.rule] = scale
        entries: dict[tuple[str, int], dict[str, Any]] = {}
        bases: dict[tuple[str, int], tuple[int, Rule]] = {}
        for key, by_action in caps.items():
            sarathi = max((c, b) for (b, r), c in by_action.items() if r == Rule.FCFS)
            constant = max((c, b, int(r)) for (b, r), c in by_action.items())
            bases[key] = (constant[1], Rule(constant[2]))
            entries[key] = {
                "sarathi": sarathi[0],
                "sarathi_budget": sarathi[1],
                "constant": constant[0],
                "constant_action": [constant[1], RULE_NAMES[constant[2]]],
            }
        if args.oracle:
            oracles = [
                OracleSearch(
                    w,
                    s,
                    bases[w, s],
                    e["constant"],
                    args.period_s,
                    args.horizon_s,
                    args.rel_tol,
                    args.oracle_early_stop,
                    args.oracle_foresight,
                )
                for (w, s), e in entries.items()
            ]
            searched = parallel_map(
                oracle_capacity, oracles, args.n_jobs, "oracle", args.progress, args.backend
            )
            for job, (scale, wall_s) in zip(oracles, searched, strict=True):
                entries[job.workload, job.seed].update(
                    oracle=scale, oracle_wall_s=wall_s, oracle_foresight=job.foresight
                )
    report = {}
    for name in args.workloads:
        row = {seed: entries[name, seed] for seed in args.seeds}
        for seed, entry in row.items():
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
