"""A hindsight oracle: per time window, the best (budget, rule) by re-simulating every option.

It is not a policy a server could run (it sees the future arrivals and simulates
ahead); it bounds what switching among the env's actions can gain.  Every
``period_s`` seconds of simulated time it forks the simulator once per candidate
action, runs each fork with that action for one period and then with a *base* action
(the best constant one, say) until ``horizon_s`` seconds from now, scores each fork by
requests known to meet their SLO minus those known to miss them, and commits the best
candidate for the period.  This is rollout-based policy improvement (Bertsekas): with
horizons long enough to settle the queue it never does worse than the base action,
which the greedy "constant action over the horizon" variant can (it is myopic).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from baselines import Sarathi
from envs.actions import BUDGET_LEVELS
from envs.serving.loop import SimResult
from envs.serving.scheduling import Rule
from envs.serving.simulator import Simulator

DEFAULT_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
DEFAULT_RULES = (Rule.FCFS, Rule.SHORTEST_FIRST, Rule.SLACK_DOOMED_LAST)

Action = tuple[int, Rule]


def run_until(sim: Simulator, action: Action, until: float, stop: Callable[[], bool] | None = None) -> bool:
    """Serve with a constant action until the clock passes ``until`` (or ``stop()`` holds);
    False once the trace is done."""
    budget, rule = action
    return sim.run_until(Sarathi(budget, rule.name), stop=stop, until_s=until)


def oracle_run(
    sim: Simulator,
    base: Action,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    rules: Sequence[Rule] = DEFAULT_RULES,
    period_s: float = 2.0,
    horizon_s: float = 30.0,
    stop: Callable[[], bool] | None = None,
) -> tuple[SimResult, list[tuple[float, int, int]]]:
    """Run ``sim`` to the end under the oracle; also returns its choices (time, budget, rule).

    ``stop``: end the run as soon as it holds (checked between iterations of the committed
    run, as :meth:`ServingLoop.run_until` does), e.g. a capacity probe's
    :class:`~envs.serving.early.Attain90Stop` once the probe's outcome is proven; the result
    is then partial (``stopped`` True).  Every choice up to there is the same as without it.
    """
    for b in (*budgets, base[0]):
        if b not in BUDGET_LEVELS:
            raise ValueError(f"budget {b} is not an action level; levels: {BUDGET_LEVELS}")
    # The base action is the incumbent: another candidate must score strictly better.
    candidates = [base] + [(b, r) for b in budgets for r in rules if (b, r) != base]
    choices: list[tuple[float, int, int]] = []
    stopped = False
    while sim.advance_to_work():
        if stop is not None and stop():
            stopped = True
            break
        start = sim.core.now
        best, best_score = base, None
        for action in candidates:  # the base action first: ties keep it
            twin = sim.fork(keep_log=False)
            if run_until(twin, action, start + period_s):
                run_until(twin, base, start + horizon_s)
            score = twin.core.n_good - twin.core.n_bad
            if best_score is None or score > best_score:
                best, best_score = action, score
        choices.append((start, best[0], int(best[1])))
        run_until(sim, best, start + period_s, stop)
    result = sim.result()
    result.stopped = stopped
    return result, choices
