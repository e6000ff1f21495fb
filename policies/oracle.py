"""A hindsight oracle: per time window, the best (budget, rule) by re-simulating every option.

It is not a policy a server could run (it sees the future arrivals and simulates
ahead); it bounds what switching among the env's actions can gain.  With
``foresight=False`` its rollouts see only the requests that have arrived: a causal,
model-predictive controller that a server holding the cost model could run, which
measures how much of that gain needs the future arrivals.  Every
``period_s`` seconds of simulated time it forks the simulator once per candidate
action, runs each fork with that action for one period and then with a *base* action
(the best constant one, say) until ``horizon_s`` seconds from now, scores each fork by
requests known to meet their SLO minus those known to miss them, and commits the best
candidate for the period.  This is rollout-based policy improvement (Bertsekas): with
horizons long enough to settle the queue it never does worse than the base action,
which the greedy "constant action over the horizon" variant can (it is myopic).

Forks share the finished history (:meth:`Simulator.fork`), rollouts record no iteration
log, and a candidate whose period planned exactly as an earlier one's (the same budgets
often cut the same chunks) takes that one's score: the simulator is deterministic, so its
rollout would end in the same state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from baselines import Sarathi
from envs.serving.levels import BUDGET_LEVELS
from envs.serving.loop import SimResult, UnrecordedLog
from envs.serving.scheduling import Plan, Policy, Rule, ServingView
from envs.serving.simulator import Simulator

DEFAULT_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
DEFAULT_RULES = (Rule.FCFS, Rule.SHORTEST_FIRST, Rule.SLACK_DOOMED_LAST)

Action = tuple[int, Rule]


PlanKey = tuple[bool, tuple[tuple[int, int], ...]]  # decode?, (request id, tokens) per chunk


class _Recorded(Policy):
    """``policy``, recording its plans: two candidates whose periods planned alike leave the
    simulator (deterministic) in the same state, so the second one's rollout is not run."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.plans: list[PlanKey] = []

    def plan(self, view: ServingView) -> Plan:
        plan = self.policy.plan(view)
        self.plans.append((plan.decode, tuple((r.rid, n) for r, n in plan.chunks)))
        return plan


def best_for_period(
    sim: Simulator,
    candidates: Sequence[Callable[[], Policy]],
    period_s: float,
    horizon_s: float,
    margin: float = 0.0,
    foresight: bool = True,
) -> int:
    """The index of the candidate whose ``period_s`` of serving from ``sim``'s state, followed by
    ``candidates[0]`` (the incumbent) until ``horizon_s`` from now, scores best (requests known to
    meet their SLO minus those known to miss); the incumbent unless the best beats its score by more
    than ``margin`` x the requests its rollout decided (ties keep the earlier one).  ``sim`` itself
    is not advanced (each rollout runs on a fork); ``foresight=False``: the rollouts serve only the
    requests that have arrived."""
    start, decided = sim.core.now, sim.core.n_good + sim.core.n_bad
    best, best_score, bar = 0, 0, 0.0
    scores: dict[tuple[bool, tuple[PlanKey, ...]], int] = {}  # by the period's plans
    for i, make in enumerate(candidates):
        twin = sim.fork(keep_log=False, foresight=foresight)
        twin.log = UnrecordedLog()  # a rollout is scored on the SLO counters alone
        period = _Recorded(make())
        key = twin.run_until(period, until_s=start + period_s), tuple(period.plans)
        if key not in scores:  # else an earlier candidate planned alike: the same state, score
            if key[0]:
                twin.run_until(candidates[0](), until_s=start + horizon_s)
            scores[key] = twin.core.n_good - twin.core.n_bad
        score = scores[key]
        if i == 0:
            best_score = score
            bar = score + margin * (twin.core.n_good + twin.core.n_bad - decided)
        elif score > best_score and score > bar:
            best, best_score = i, score
    return best


def oracle_run(
    sim: Simulator,
    base: Action,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    rules: Sequence[Rule] = DEFAULT_RULES,
    period_s: float = 2.0,
    horizon_s: float = 30.0,
    stop: Callable[[], bool] | None = None,
    foresight: bool = True,
) -> tuple[SimResult, list[tuple[float, int, int]]]:
    """Run ``sim`` to the end under the oracle; also returns its choices (time, budget, rule).

    ``stop``: end the run as soon as it holds (checked between iterations of the committed
    run, as :meth:`ServingLoop.run_until` does), e.g. a capacity probe's
    :class:`~envs.serving.early.Attain90Stop` once the probe's outcome is proven; the result
    is then partial (``stopped`` True).  Every choice up to there is the same as without it.
    ``foresight=False``: each choice sees only the requests that have arrived (see the module).
    """
    for b in (*budgets, base[0]):
        if b not in BUDGET_LEVELS:
            raise ValueError(f"budget {b} is not an action level; levels: {BUDGET_LEVELS}")
    # The base action is the incumbent: another candidate must score strictly better.
    candidates = [base] + [(b, r) for b in budgets for r in rules if (b, r) != base]
    policies = [functools.partial(Sarathi, b, r.name) for b, r in candidates]
    choices: list[tuple[float, int, int]] = []
    stopped = False
    while sim.advance_to_work():
        if stop is not None and stop():
            stopped = True
            break
        start = sim.core.now
        best = best_for_period(sim, policies, period_s, horizon_s, foresight=foresight)
        budget, rule = candidates[best]
        choices.append((start, budget, int(rule)))
        sim.run_until(Sarathi(budget, rule.name), stop=stop, until_s=start + period_s)
    result = sim.result()
    result.stopped = stopped
    return result, choices
