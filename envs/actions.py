"""The action space shared by the env, exported policies and the engine: (budget level, rule).

Masks keep one representative per distinct plan, so masking never removes a choice:

* budget levels above the smallest one that covers every decode plus every waiting
  prompt's remaining prefill (over the rule lookahead) give the same plan as that
  level, so they are masked;
* allocation rules are masked (all but the first, FCFS) when at most one prompt
  waits, since every order is then the same;
* with no prompt waiting only (level 0, FCFS) stays: every action steps the decodes.

For algorithms that ignore masks, :meth:`ActionSpec.canonical` maps any action to the
valid one with the same plan (budget clamped to the covering level, rule to FCFS
where rules are masked).  The mapping is exact, not an approximation.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from functools import cache

import numpy as np

from envs.serving.scheduling import Admission, Plan, Rule, ServingView, plan_budget

BUDGET_LEVELS = tuple(64 << i for i in range(9))  # 64, 128, ..., 16384 tokens per iteration
NUM_LEVELS = len(BUDGET_LEVELS)


def covering_level(view: ServingView) -> int:
    """Index of the smallest budget level that fits every decode and all waiting prefill work."""
    work = view.num_decode
    for req in view.lookahead:
        work += req.target - req.computed
    return min(bisect_left(BUDGET_LEVELS, work), NUM_LEVELS - 1)


Valid = tuple[int, bool]
"""What a state allows: the highest valid budget level, and whether the rules differ."""


@dataclass(frozen=True)
class ActionSpec:
    """``MultiDiscrete([9, len(rules)])``: a budget level and an allocation rule (index into ``rules``),
    planned with ``admission``.

    The methods taking ``valid`` accept :meth:`valid` of the same state from a caller that
    already has it (the env computes it once per step, for the mask and the next plan).
    """

    rules: tuple[Rule, ...]
    admission: Admission = Admission.SKIP

    @property
    def nvec(self) -> tuple[int, int]:
        return (NUM_LEVELS, len(self.rules))

    @property
    def rule_names(self) -> tuple[str, ...]:
        return tuple(r.name.lower() for r in self.rules)

    def valid(self, view: ServingView) -> Valid:
        """The highest valid level (the covering one; 0 with no prompt waiting) and whether rules differ."""
        queued = len(view.queue)
        return (covering_level(view) if queued else 0), queued > 1

    def mask(self, view: ServingView, valid: Valid | None = None) -> np.ndarray:
        """Boolean mask over ``sum(nvec)`` entries: budget levels, then rules (a fresh array)."""
        level, rules = valid or self.valid(view)
        mask: np.ndarray = _masks(len(self.rules))[level, int(rules)].copy()
        return mask

    def canonical(
        self, view: ServingView, level: int, rule: int, valid: Valid | None = None
    ) -> tuple[int, int]:
        """The valid action with the same plan as ``(level, rule)``."""
        top, rules = valid or self.valid(view)
        return min(int(level), top), (int(rule) if rules else 0)

    def plan(self, view: ServingView, level: int, rule: int, valid: Valid | None = None) -> Plan:
        """The plan an action stands for: the shared planner at that budget and rule."""
        return self._plan_at(view, *self.canonical(view, level, rule, valid))

    def _plan_at(self, view: ServingView, level: int, rule: int) -> Plan:
        return plan_budget(view, BUDGET_LEVELS[level], self.rules[rule], admission=self.admission)

    def action_for(self, view: ServingView, plan: Plan) -> tuple[int, int]:
        """The valid action whose plan is ``plan`` (the smallest such level, then rule): how a
        heuristic's decision reads as an env action; ValueError if no action yields that plan."""
        want = _plan_key(plan)
        mask = self.mask(view)
        for rule in np.flatnonzero(mask[NUM_LEVELS:]):
            for level in np.flatnonzero(mask[:NUM_LEVELS]):
                if _plan_key(self._plan_at(view, int(level), int(rule))) == want:
                    return int(level), int(rule)
        raise ValueError(f"no action of {self.rule_names} x budget levels gives the plan {want}")


@cache
def _masks(n_rules: int) -> np.ndarray:
    """Every mask there is, indexed by :meth:`ActionSpec.valid`: ``[level, rules differ]``."""
    masks = np.zeros((NUM_LEVELS, 2, NUM_LEVELS + n_rules), dtype=bool)
    for level in range(NUM_LEVELS):
        masks[level, :, : level + 1] = True
    masks[:, 0, NUM_LEVELS] = True
    masks[:, 1, NUM_LEVELS:] = True
    return masks


def _plan_key(plan: Plan) -> tuple[bool, tuple[tuple[int, int], ...]]:
    return plan.decode, tuple((req.rid, n) for req, n in plan.chunks)


ACTIONS_V0 = ActionSpec((Rule.FCFS, Rule.SHORTEST_FIRST, Rule.LEAST_SLACK))
ACTIONS_V1 = ActionSpec((Rule.FCFS, Rule.SHORTEST_FIRST, Rule.LEAST_SLACK, Rule.SLACK_DOOMED_LAST))
ACTIONS_V2 = ActionSpec(ACTIONS_V1.rules, Admission.STOP)  # (level, 0) is Sarathi-Serve at that budget

# The v0 action space under its historical names.
NVEC = ACTIONS_V0.nvec
NUM_RULES = len(ACTIONS_V0.rules)
action_mask = ACTIONS_V0.mask
canonical_action = ACTIONS_V0.canonical
action_plan = ACTIONS_V0.plan
