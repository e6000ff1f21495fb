"""Capacity of constant actions of ``chunkgym/ChunkedPrefill-v3``: which heuristic is best where?

Every Sarathi budget and every adaptive heuristic is one constant (mode, allocation) action of
v3 (:mod:`policies.constant`), and so are the latency targets no registered baseline names
(``target_0.5``, ``target_1_slack``, ...). This searches the attain90 capacity of each named
action on each workload and seed, and prints them side by side with the best per workload: the
evidence behind the learned recipe's candidate teachers (``conf/experiment/learned.yaml``).

    python bench/constant_actions.py ["actions=[target_1__shortest_first+skip,...]"] \
        ["workloads=[...]"] [split=test] ["seeds=[0,1,2,3,4]"] [slo=strict]

The last stdout line is one JSON object: ``{workload: {action: mean capacity over the seeds}}``
plus ``split``, ``seeds``, ``slo``, ``wall_s`` and ``load_avg``.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field

import chunkgym
from chunkgym.cli import hydra_cli
from chunkgym.config import NON_EMPTY, POSITIVE
from chunkgym.config import Rule as OptionRule
from chunkgym.parallel import default_jobs
from envs.actions import ACTIONS_V3
from envs.serving.capacity import CapacityQuery, measure_capacities
from envs.serving.metrics import slo_names
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload, workload_names
from policies.constant import ConstantAction, action_named, is_action_name

TARGETS_SRPF = [f"{t.name}__shortest_first+skip" for t in ACTIONS_V3.targets]


@dataclass
class Options:
    """``python bench/constant_actions.py KEY=VALUE ...``."""

    actions: list[str] = field(default_factory=lambda: list(TARGETS_SRPF))  # MODE__ALLOCATION names
    workloads: list[str] = field(
        default_factory=lambda: [w for w in workload_names() if not w.startswith("synthetic")]
    )
    split: str = "test"
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    slo: str = "strict"
    rel_tol: float = 0.01  # the capacity search's relative bracket width (evaluate.py's default)
    parallel: int = 0  # searches at once; 0: the cores available


RULES = {
    "actions": OptionRule(
        lambda names: len(names) > 0 and all(is_action_name(n) for n in names),
        f"a non-empty list of v3 action names MODE__ALLOCATION (modes {', '.join(ACTIONS_V3.mode_names)}; "
        f"allocations {', '.join(ACTIONS_V3.allocation_names)})",
    ),
    "workloads": OptionRule(
        lambda names: len(names) > 0 and all(n in workload_names() for n in names),
        f"a non-empty list of workload names ({', '.join(workload_names())})",
    ),
    "seeds": NON_EMPTY,
    "split": OptionRule(lambda v: v in ("train", "val", "test"), "one of train, val, test"),
    "slo": OptionRule(lambda v: v in slo_names(), f"one of {', '.join(slo_names())}"),
    "rel_tol": POSITIVE,
}


def _constant(action: tuple[int, int]) -> ConstantAction:
    return ConstantAction(ACTIONS_V3, action)


@hydra_cli(Options, "constant_actions", RULES)
def main(args: Options) -> None:
    chunkgym.require_own_packages()
    workloads = {name: load_workload(name) for name in args.workloads}
    setup = ServingSetup.from_names(slo=args.slo)
    actions = {name: action_named(ACTIONS_V3, name) for name in args.actions}
    queries = [
        CapacityQuery(
            setup,
            workloads[w],
            functools.partial(_constant, a),
            "attain90",
            args.split,
            s,
            rel_tol=args.rel_tol,
        )
        for w in args.workloads
        for a in actions.values()
        for s in args.seeds
    ]
    start = time.perf_counter()
    found = iter(measure_capacities(queries, early_stop=True, parallel=args.parallel or default_jobs()))
    table = {
        w: {n: sum(next(found).scale for _ in args.seeds) / len(args.seeds) for n in actions}
        for w in args.workloads
    }
    width = max(len(n) for n in actions)
    print(f"{'action':{width}s} " + " ".join(f"{w[:14]:>14s}" for w in args.workloads))
    for n in actions:
        cells = (
            f"{table[w][n]:13.3f}{'*' if table[w][n] == max(table[w].values()) else ' '}"
            for w in args.workloads
        )
        print(f"{n:{width}s} " + " ".join(cells))
    print(
        f"(* the best per workload; mean attain90 capacity over seeds {args.seeds}, {args.split} split, {args.slo} SLO)"
    )
    out: dict[str, object] = {"capacity": table, "split": args.split, "seeds": args.seeds, "slo": args.slo}
    out |= {
        "wall_s": round(time.perf_counter() - start, 1),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
