"""The action space shared by the env, exported policies and the engine: (budget level, rule).

Masks keep one representative per distinct plan, so masking never removes a choice:

* budget levels above the smallest one that covers every decode plus every waiting
  prompt's remaining prefill (over the rule lookahead) give the same plan as that
  level, so they are masked;
* allocation rules are masked (all but FCFS) when at most one prompt waits, since
  every order is then the same;
* with no prompt waiting only (level 0, FCFS) stays: every action steps the decodes.

For algorithms that ignore masks, :func:`canonical_action` maps any action to the
valid one with the same plan (budget clamped to the covering level, rule to FCFS
where rules are masked).  The mapping is exact, not an approximation.
"""

from __future__ import annotations

import numpy as np

from envs.serving.scheduling import RULE_NAMES, Plan, Rule, View, plan_budget

BUDGET_LEVELS = tuple(64 << i for i in range(9))  # 64, 128, ..., 16384 tokens per iteration
NUM_LEVELS = len(BUDGET_LEVELS)
NUM_RULES = len(RULE_NAMES)
NVEC = (NUM_LEVELS, NUM_RULES)


def covering_level(view: View) -> int:
    """Index of the smallest budget level that fits every decode and all waiting prefill work."""
    work = view.num_decode
    for req in view.lookahead:
        work += req.target - req.computed
    for i, level in enumerate(BUDGET_LEVELS):
        if level >= work:
            return i
    return NUM_LEVELS - 1


def action_mask(view: View) -> np.ndarray:
    """Boolean mask over ``sum(NVEC)`` entries: budget levels, then rules."""
    mask = np.zeros(NUM_LEVELS + NUM_RULES, dtype=bool)
    queued = len(view.queue)
    top = covering_level(view) if queued else 0
    mask[: top + 1] = True
    if queued > 1:
        mask[NUM_LEVELS:] = True
    else:
        mask[NUM_LEVELS] = True
    return mask


def canonical_action(view: View, level: int, rule: int) -> tuple[int, int]:
    """The valid action with the same plan as ``(level, rule)``."""
    queued = len(view.queue)
    if not queued:
        return 0, 0
    level = min(int(level), covering_level(view))
    return level, (int(rule) if queued > 1 else 0)


def action_plan(view: View, level: int, rule: int) -> Plan:
    """The plan an action stands for: the shared planner at that budget and rule."""
    level, rule = canonical_action(view, level, rule)
    return plan_budget(view, BUDGET_LEVELS[level], Rule(rule))
