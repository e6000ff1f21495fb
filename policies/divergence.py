"""Where a learned policy and ``adaptive_srpf`` decide differently, and what each difference costs.

Along a policy's own trajectory (test windows at one load), every decision with a prompt waiting
is compared with the plan ``adaptive_srpf`` would make in the same state: the same plan, the same
prompts in the same order with more or fewer tokens (a budget difference), or other prompts or
another order (an allocation difference).  For a v2 policy, two hybrids price the differences:
the policy's budget with ``adaptive_srpf``'s rule (shortest remaining first), and
``adaptive_srpf``'s budget with the policy's rule; their attain90 capacities beside the policy's
and the heuristic's say which decision loses the capacity.  For a v3 or v4 policy it also counts the
modes (budget levels, latency targets) the policy takes.

    PYTHONPATH=. python -m policies.divergence [policy=learned] [workload=mooncake_conv] \
        [load_scale=3.0] ["seeds=[0,1,2]"] [capacity=true]

The last stdout line is one JSON object.
"""

from __future__ import annotations

import functools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chunkgym.cli import hydra_cli
from chunkgym.config import NON_EMPTY, POSITIVE
from envs.actions import ActionSpec, TargetActionSpec
from envs.serving.capacity import measure_capacity
from envs.serving.levels import BUDGET_LEVELS, adaptive_level
from envs.serving.scheduling import Admission, Plan, Policy, Rule, ServingView, plan_budget
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.exported import ExportedPolicy
from policies.registry import make_policy

KINDS = ("same plan", "more tokens", "fewer tokens", "other allocation")
HYBRIDS = ("policy", "policy budget + srpf rule", "srpf budget + policy rule", "adaptive_srpf")


def srpf_plan(view: ServingView, admission: Admission) -> tuple[int, Plan]:
    """``adaptive_srpf``'s budget level index and plan in this state."""
    return adaptive_level(view, BUDGET_LEVELS, Rule.SHORTEST_FIRST, view.slo.tpot_s, admission)


def kind_of(plan: Plan, reference: Plan) -> str:
    """How ``plan`` differs from ``reference``: one of :data:`KINDS`."""
    ours, theirs = [(r.rid, n) for r, n in plan.chunks], [(r.rid, n) for r, n in reference.chunks]
    if ours == theirs and plan.decode == reference.decode:
        return KINDS[0]
    order, other = [r for r, _ in ours], [r for r, _ in theirs]
    if order[: len(other)] == other or other[: len(order)] == order:
        return KINDS[1] if sum(n for _, n in ours) > sum(n for _, n in theirs) else KINDS[2]
    return KINDS[3]


class Compared(Policy):
    """``policy`` (or a hybrid of it with ``adaptive_srpf``), counting how its decisions differ."""

    def __init__(self, policy: Policy, hybrid: str = HYBRIDS[0]) -> None:
        self.policy = policy
        self.hybrid = hybrid
        self.name = f"{policy.name} ({hybrid})"
        self.counts: Counter[str] = Counter()
        self.modes: Counter[str] = Counter()  # a v3/v4 policy's modes (budget levels, latency targets) taken
        self.admission = getattr(getattr(policy, "actions", None), "admission", Admission.SKIP)

    def reset(self, view: ServingView) -> None:
        self.policy.reset(view)

    def plan(self, view: ServingView) -> Plan:
        if not view.queue:
            return self.policy.plan(view)
        srpf_level, srpf = srpf_plan(view, self.admission)
        if self.hybrid == HYBRIDS[3]:
            return srpf
        if self.hybrid == HYBRIDS[0]:
            policy = self.policy
            if isinstance(policy, ExportedPolicy) and isinstance(policy.actions, TargetActionSpec):
                (mode, allocation), valid = policy.decide(view)
                self.modes[policy.actions.mode_names[mode]] += 1
                plan = policy.actions.plan(view, mode, allocation, valid)
            else:
                plan = policy.plan(view)
            self.counts[kind_of(plan, srpf)] += 1
            return plan
        policy = self.policy
        assert isinstance(policy, ExportedPolicy) and isinstance(policy.actions, ActionSpec)
        level, rule = policy.act_one(policy.features(view), policy.actions.mask(view))
        level, rule = policy.actions.canonical(view, level, rule)
        if self.hybrid == HYBRIDS[1]:
            budget, allocation = BUDGET_LEVELS[level], Rule.SHORTEST_FIRST
        else:
            budget, allocation = BUDGET_LEVELS[srpf_level], policy.actions.rules[rule]
        return plan_budget(view, budget, allocation, admission=self.admission)


@dataclass
class Options:
    policy: str = "learned"  # a registered policy name or learned:PATH
    workload: str = "mooncake_conv"
    load_scale: float = 3.0  # where the decisions are counted
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # test windows
    capacity: bool = True  # also the attain90 capacities of the policy, the hybrids and adaptive_srpf


RULES = {"seeds": NON_EMPTY, "load_scale": POSITIVE}


def _compared(name: str, hybrid: str) -> Compared:
    return Compared(make_policy(name), hybrid)


@hydra_cli(Options, "divergence_options", RULES)
def main(opts: Options) -> None:
    started = time.perf_counter()
    setup = ServingSetup.from_names()
    workload = load_workload(opts.workload)
    counts: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    attainment = []
    for seed in opts.seeds:
        compared = _compared(opts.policy, HYBRIDS[0])
        trace = workload.window("test", seed, opts.load_scale)
        attainment.append(setup.simulator(trace).run(compared).metrics["slo_attainment"])
        counts += compared.counts
        modes += compared.modes
    total = sum(counts.values())
    shares = {k: round(counts[k] / total, 4) for k in KINDS}
    print(f"{opts.policy} on {opts.workload} test x{opts.load_scale}, seeds {opts.seeds}: {total} decisions")
    for k in KINDS:
        print(f"  {k:>16}: {100 * shares[k]:5.1f}%")
    taken = {m: round(n / total, 4) for m, n in modes.most_common()}  # v3/v4 policies: the modes taken
    for m, share in taken.items():
        print(f"  mode {m:>18}: {100 * share:5.1f}%")
    out: dict[str, Any] = {
        "policy": opts.policy,
        "workload": opts.workload,
        "load_scale": opts.load_scale,
        "seeds": opts.seeds,
        "decisions": total,
        "shares": shares,
        "modes": taken,
        "slo_attainment": round(float(np.mean(attainment)), 4),
    }
    policy = make_policy(opts.policy)
    hybrids = HYBRIDS if isinstance(getattr(policy, "actions", None), ActionSpec) else HYBRIDS[::3]
    if opts.capacity:
        caps: dict[str, list[float]] = {}
        for hybrid in hybrids:
            make = functools.partial(_compared, opts.policy, hybrid)
            caps[hybrid] = [
                round(measure_capacity(setup, workload, make, seed=s).scale, 3) for s in opts.seeds
            ]
            print(f"  attain90 capacity, {hybrid:>26}: {np.mean(caps[hybrid]):.2f}  {caps[hybrid]}")
        out["capacity"] = caps
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
