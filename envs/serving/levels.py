"""Budget levels, and the search for the largest one whose plan fits a latency target.

:data:`BUDGET_LEVELS` are the token budgets the env's action chooses among and the ``adaptive``
heuristic (:class:`baselines.Adaptive`) searches; :func:`adaptive_level` is that search, which a v3
env action with a latency target runs too, so the heuristic is one constant action.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from envs.serving.budgets import budget_plans
from envs.serving.scheduling import Admission, Plan, Rule, ServingView

BUDGET_LEVELS = tuple(64 << i for i in range(9))  # 64 .. 16384 tokens per iteration


def latency_target_s(view: ServingView, fraction: float, spend_slack: bool) -> float:
    """The latency the next iteration may take: ``fraction`` x the SLO's TPOT bound, plus, with
    ``spend_slack``, the least TPOT slack a stream still meeting its SLO has banked, capped by the
    stall bound (:class:`baselines.Adaptive`'s target, and a v3 env action's)."""
    target = fraction * view.slo.tpot_s
    if not spend_slack:
        return target
    slack = view.min_tpot_slack()  # inf when no stream can still meet its SLO
    return min(view.slo.stall_s, target + max(0.0, slack))


def adaptive_level(
    view: ServingView,
    levels: Sequence[int],
    rule: Rule,
    target_s: float,
    admission: Admission = Admission.SKIP,
) -> tuple[int, Plan]:
    """Binary search ``levels`` (ascending) for the largest whose plan the cost model predicts
    within ``target_s``; its index and plan (the smallest level if none fits).  The plans come
    from :func:`~envs.serving.budgets.budget_plans`: one planning pass for all levels."""
    plans = budget_plans(view, levels[-1], rule, admission)
    lo = 0
    if view.queue:
        found = largest_fitting(len(levels), lambda i: plans.latency(levels[i]), target_s)
        assert found is not None, "a plan's latency is always known"
        lo = found[0]
    return lo, plans.plan(levels[lo])


def largest_fitting(
    count: int, latency: Callable[[int], float | None], target_s: float
) -> tuple[int, float | None] | None:
    """The binary search of :func:`adaptive_level` over indices ``0 .. count - 1``: the largest whose
    ``latency`` is within ``target_s`` (0 if none) and that latency (None if it was never asked), or
    None as soon as ``latency`` answers None (it cannot say)."""
    lo, hi, fit = 0, count - 1, None
    while lo < hi:  # invariant: lo fits (or is 0), indices above hi do not
        mid = (lo + hi + 1) // 2
        price = latency(mid)
        if price is None:
            return None
        if price <= target_s:
            lo, fit = mid, price
        else:
            hi = mid - 1
    return lo, fit
