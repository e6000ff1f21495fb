"""Time a fixed capacity grid with the fast-search mechanisms off and on, back to back.

Grid: fcfs, sarathi_512, sarathi_2048, adaptive_srpf x azure_conv, azure_code,
mooncake_conv; test split, seed 0, ``attain90``, default tolerance, default model and
hardware, strict SLO.  Baseline: ``early_stop=False, parallel=1`` (the reference search:
every probe runs to the end with every shortcut off, :data:`envs.serving.shortcuts.NO_SHORTCUTS`,
each budget level planned from scratch, and is judged on its summary); fast: probes decided from the SLO counters (stopped once
proven, no iteration log, no summary, every shortcut on:
:data:`envs.serving.shortcuts.PROBE_SHORTCUTS`, chunk stretches included (a long prompt's middle
chunks run without asking the policy, a segment up to the next event at a time), and all budget
levels of an iteration from one pass (:func:`envs.serving.budgets.budget_plans`, whose plans carry
their price to the clock)) and the speculative search over ``--parallel`` worker processes (default: the
cores this process may use), one pool shared by the whole grid, the slowest searches' probes first,
with the quickest searches' next probes queued behind them (one per worker).

    python bench/capacity_speed.py [--parallel N] [--rounds R]

The grid runs ``--rounds`` times each way (default 2), in the order baseline, fast, fast,
baseline, ... (ABBA), so that a machine whose speed drifts steadily during the run slows both
alike; a shared machine's speed can move by tens of percent within minutes.
The last stdout line is one JSON object: baseline_s, fast_s (each a round's mean), speedup
(wall clock, all rounds' ratio), identical (every capacity of every round bit-identical to the
reference search's), load_avg, the CPU seconds of both (baseline_cpu_s, fast_cpu_s: the work
done, robust to a loaded machine) and round_speedups (each round's ratio, as the drift leaves it).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import time
from typing import cast

import chunkgym
from chunkgym.parallel import default_jobs
from envs.serving.capacity import Capacity, CapacityQuery, measure_capacities
from envs.serving.scheduling import Policy
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.registry import make_policy

POLICIES = ("fcfs", "sarathi_512", "sarathi_2048", "adaptive_srpf")
WORKLOADS = ("azure_conv", "azure_code", "mooncake_conv")


def main() -> None:
    chunkgym.require_own_packages()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parallel", type=int, default=0, help="probes in flight (0: the cores available)")
    ap.add_argument("--rounds", type=int, default=2, help="grids timed each way, in ABBA order")
    args = ap.parse_args()
    parallel = args.parallel or default_jobs()
    if parallel < 1:
        ap.error(f"--parallel must be >= 0, got {args.parallel}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")

    setup = ServingSetup.from_names()
    workloads = {w: load_workload(w) for w in WORKLOADS}  # parsed once, outside both timings
    queries = [
        CapacityQuery(setup, workloads[w], functools.partial(make_policy, p), "attain90", "test", 0)
        for w in WORKLOADS
        for p in POLICIES
    ]
    load_before = os.getloadavg()
    timed = {
        "baseline": functools.partial(measure_capacities, queries, early_stop=False, parallel=1),
        "fast": functools.partial(measure_capacities, queries, early_stop=True, parallel=parallel),
    }  # the fast one's pool start-up counts
    found: dict[str, list[list[Capacity]]] = {"baseline": [], "fast": []}
    wall: dict[str, list[float]] = {"baseline": [], "fast": []}
    cpu: dict[str, list[float]] = {"baseline": [], "fast": []}
    for r in range(args.rounds):
        for way in ("baseline", "fast") if r % 2 == 0 else ("fast", "baseline"):
            t0, cpu0 = time.perf_counter(), _cpu_s()
            found[way].append(timed[way]())
            wall[way].append(time.perf_counter() - t0)
            cpu[way].append(_cpu_s() - cpu0)
    baseline, fast = found["baseline"][0], found["fast"][0]
    baseline_s, fast_s = (sum(wall[w]) / args.rounds for w in ("baseline", "fast"))
    baseline_cpu_s, fast_cpu_s = (sum(cpu[w]) / args.rounds for w in ("baseline", "fast"))
    identical = all(
        _same(r, g)
        for got in found["baseline"][1:] + found["fast"]
        for r, g in zip(baseline, got, strict=True)
    )

    print(f"{'workload':14s} {'policy':14s} {'scale':>10s} {'probes':>6s} {'early':>5s} {'spec':>4s}  same")
    for q, ref, got in zip(queries, baseline, fast, strict=True):
        print(
            f"{q.workload.spec.name:14s} {cast(functools.partial[Policy], q.make_policy).args[0]:14s} {got.scale:10.6f} "
            f"{len(got.probes):6d} {sum(p.decided_early for p in got.probes):5d} {got.speculative:4d}  "
            f"{_same(ref, got)}"
        )
    probes = [p for c in fast for p in c.probes]
    print(
        json.dumps(
            {
                "baseline_s": round(baseline_s, 3),
                "fast_s": round(fast_s, 3),
                "speedup": round(baseline_s / fast_s, 3),
                "identical": identical,
                "baseline_cpu_s": round(baseline_cpu_s, 3),
                "fast_cpu_s": round(fast_cpu_s, 3),
                "parallel": parallel,
                "searches": len(queries),
                "probes": len(probes),
                "decided_early": sum(p.decided_early for p in probes),
                "requests_decided_share": round(
                    sum(p.requests_decided for p in probes) / sum(p.requests for p in probes), 4
                ),
                "speculative_probes": sum(c.speculative for c in fast),
                "round_speedups": [
                    round(b / f, 3) for b, f in zip(wall["baseline"], wall["fast"], strict=True)
                ],
                "load_avg_before": [round(x, 2) for x in load_before],
                "load_avg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the pool's workers, once shut down):
    the work done, which a loaded machine does not inflate the way it does wall time."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _same(ref: Capacity, got: Capacity) -> bool:
    """Bit-identical capacity: scale, rate, bracket and the decided probe sequence."""
    return (
        ref.scale == got.scale
        and ref.rps == got.rps
        and ref.result.bracket == got.result.bracket
        and ref.result.evaluations == got.result.evaluations
    )


if __name__ == "__main__":
    main()
