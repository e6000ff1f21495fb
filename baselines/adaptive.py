"""A latency-targeting heuristic: the largest budget whose predicted iteration fits a TBT target."""

from __future__ import annotations

from envs.serving.scheduling import Plan, Policy, Rule, View, plan_budget, plan_latency

BUDGET_LEVELS = tuple(64 << i for i in range(9))  # 64 .. 16384, the env's action levels


class Adaptive(Policy):
    """Per iteration, binary-search the budget levels for the largest whose plan the cost
    model predicts to finish within ``target_fraction`` x the SLO's TPOT bound.

    Every token gap then stays near the target, while quiet periods get big, efficient
    prefill chunks.  Needs the cost model, so it predicts with whatever model the
    backend was calibrated with (the simulator's, or the engine's fitted profile).
    """

    def __init__(self, target_fraction: float = 1.0, levels: tuple[int, ...] = BUDGET_LEVELS) -> None:
        if target_fraction <= 0:
            raise ValueError(f"target_fraction must be > 0, got {target_fraction}")
        self.target_fraction = target_fraction
        self.levels = tuple(sorted(levels))
        self.name = "adaptive"
        self._target = 0.0

    def reset(self, core) -> None:
        self._target = self.target_fraction * core.slo.tpot_s

    def plan(self, view: View) -> Plan:
        lo, hi = 0, len(self.levels) - 1
        best = plan_budget(view, self.levels[0], Rule.FCFS)
        if not view.queue:
            return best
        while lo < hi:  # invariant: levels[lo] fits (or is the smallest), levels[hi + 1:] do not
            mid = (lo + hi + 1) // 2
            plan = plan_budget(view, self.levels[mid], Rule.FCFS)
            if plan_latency(view, plan) <= self._target:
                lo, best = mid, plan
            else:
                hi = mid - 1
        return best
