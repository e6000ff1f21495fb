"""The action spaces shared by the env, exported policies and the engine.

v0-v2: (budget level, rule), :class:`ActionSpec`.  v3: (mode, allocation),
:class:`TargetActionSpec`: a mode is a budget level or a latency target that
:func:`envs.serving.levels.adaptive_level` turns into a budget, an allocation a rule and an
admission, so every Sarathi and adaptive heuristic is one constant action.

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
from functools import cache, cached_property
from typing import Any, Protocol

import numpy as np

from envs.lookahead import Lookahead
from envs.serving.levels import BUDGET_LEVELS, adaptive_level, latency_target_s
from envs.serving.scheduling import Admission, Plan, Rule, ServingView, blocks_needed, plan_budget

NUM_LEVELS = len(BUDGET_LEVELS)


def covering_level(view: ServingView, look: Lookahead | None = None) -> int:
    """Index of the smallest budget level that fits every decode and all waiting prefill work
    (summed by ``look``, the lookahead's scan of this state, when the caller has one)."""
    pending = sum(r.target - r.computed for r in view.lookahead) if look is None else look.pending
    return min(bisect_left(BUDGET_LEVELS, view.num_decode + pending), NUM_LEVELS - 1)


Valid = tuple[int, bool]
"""What a state allows: the highest valid budget level, and whether the rules differ."""


@dataclass(frozen=True)
class ActionSpec:
    """``MultiDiscrete([9, len(rules)])``: a budget level and an allocation rule (index into ``rules``),
    planned with ``admission``.

    The methods taking ``valid`` accept :meth:`valid` of the same state from a caller that
    already has it (the env computes it once per step, for the mask and the next plan), and
    :meth:`valid` accepts the lookahead's scan (:func:`envs.lookahead.scan_lookahead`) likewise.
    """

    rules: tuple[Rule, ...]
    admission: Admission = Admission.SKIP

    @property
    def nvec(self) -> tuple[int, int]:
        return (NUM_LEVELS, len(self.rules))

    @property
    def rule_names(self) -> tuple[str, ...]:
        return tuple(r.name.lower() for r in self.rules)

    def describe(self) -> dict[str, list[str] | list[int]]:
        """What an exported policy records of this action space (besides ``nvec``)."""
        return {"budget_levels": list(BUDGET_LEVELS), "allocation_rules": list(self.rule_names)}

    def valid(self, view: ServingView, look: Lookahead | None = None) -> Valid:
        """The highest valid level (the covering one; 0 with no prompt waiting) and whether rules differ."""
        queued = len(view.queue)
        return (covering_level(view, look) if queued else 0), queued > 1

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


@dataclass(frozen=True)
class LatencyTarget:
    """A v3 mode: the largest budget level whose plan the cost model predicts within ``fraction`` x
    the SLO's TPOT bound (plus, with ``spend_slack``, the least banked TPOT slack, capped by the
    stall bound): :class:`baselines.Adaptive`'s target, so the action is that heuristic's plan."""

    fraction: float
    spend_slack: bool = False

    @property
    def name(self) -> str:
        return f"target_{self.fraction:g}" + ("_slack" if self.spend_slack else "")

    def seconds(self, view: ServingView) -> float:
        return latency_target_s(view, self.fraction, self.spend_slack)


ValidV3 = tuple[int, bool, bool]
"""What a state allows in v3: the covering budget level (0 with no prompt waiting), whether the rules
differ, whether the admissions differ."""


@dataclass(frozen=True)
class TargetActionSpec:
    """``MultiDiscrete([9 + len(targets), len(rules) * len(admissions)])``: a mode (budget levels
    64..16384, then the latency ``targets``) and an allocation (``rules[a % n]`` admitted by
    ``admissions[a // n]``, n = ``len(rules)``).

    Masks keep one action per distinct plan where that is cheap to know: budget levels above the
    covering one, rules other than the first when at most one prompt waits, admissions other than
    the first when no waiting prompt can be blocked (every lookahead prompt fits the free slots and
    KV blocks at once); latency targets stay valid while a prompt waits (which plan they give needs
    the cost model), and with none waiting only ``(0, 0)`` stays.
    """

    rules: tuple[Rule, ...]
    targets: tuple[LatencyTarget, ...]
    admissions: tuple[Admission, ...] = (Admission.STOP, Admission.SKIP)

    @property
    def nvec(self) -> tuple[int, int]:
        return (NUM_LEVELS + len(self.targets), len(self.rules) * len(self.admissions))

    @property
    def admission(self) -> Admission:
        """The admission of the budget-level actions with allocation ``< len(rules)`` (Sarathi-Serve's)."""
        return self.admissions[0]

    @property
    def mode_names(self) -> tuple[str, ...]:
        return tuple(f"budget_{b}" for b in BUDGET_LEVELS) + tuple(t.name for t in self.targets)

    @property
    def rule_names(self) -> tuple[str, ...]:
        return tuple(r.name.lower() for r in self.rules)

    @property
    def allocation_names(self) -> tuple[str, ...]:
        return tuple(f"{r}+{a.value}" for a in self.admissions for r in self.rule_names)

    def describe(self) -> dict[str, list[str] | list[int]]:
        """What an exported policy records of this action space (besides ``nvec``): every mode and
        allocation by name, so the manifest says what each action index means."""
        return {
            "budget_levels": list(BUDGET_LEVELS),
            "allocation_rules": list(self.rule_names),
            "modes": list(self.mode_names),
            "allocations": list(self.allocation_names),
        }

    def valid(self, view: ServingView, look: Lookahead | None = None) -> ValidV3:
        queue = view.queue
        if not queue:
            return 0, False, False
        many = len(queue) > 1
        return covering_level(view, look), many, many and _may_block(view, look)

    def mask(self, view: ServingView, valid: ValidV3 | None = None) -> np.ndarray:
        """Boolean mask over ``sum(nvec)`` entries: modes, then allocations (a fresh array)."""
        level, rules, admissions = valid or self.valid(view)
        mask: np.ndarray = self._masks[level, 1 if view.queue else 0, int(rules), int(admissions)].copy()
        return mask

    @cached_property
    def _masks(self) -> np.ndarray:
        """Every mask there is, indexed ``[level, a prompt waits, rules differ, admissions differ]``
        (the env asks for one every step)."""
        masks = np.zeros((NUM_LEVELS, 2, 2, 2, sum(self.nvec)), dtype=bool)
        for level, queued, rules, admissions in np.ndindex(masks.shape[:4]):
            masks[level, queued, rules, admissions] = self._mask_of(
                level, bool(queued), bool(rules), bool(admissions)
            )
        return masks

    def _mask_of(self, level: int, queued: bool, rules: bool, admissions: bool) -> np.ndarray:
        """The mask of a state whose :meth:`valid` is ``(level, rules, admissions)``."""
        n_rules, n_modes = len(self.rules), self.nvec[0]
        mask = np.zeros(sum(self.nvec), dtype=bool)
        mask[: level + 1] = True
        if queued:
            mask[NUM_LEVELS:n_modes] = True
        for a in range(len(self.admissions) if admissions else 1):
            start = n_modes + a * n_rules
            mask[start : start + (n_rules if rules else 1)] = True
        return mask

    def canonical(
        self, view: ServingView, mode: int, allocation: int, valid: ValidV3 | None = None
    ) -> tuple[int, int]:
        """The valid action with the same plan as ``(mode, allocation)``."""
        level, rules, admissions = valid or self.valid(view)
        if not view.queue:
            return 0, 0
        n_rules = len(self.rules)
        rule = int(allocation) % n_rules if rules else 0
        admission = int(allocation) // n_rules if admissions else 0
        mode = int(mode)
        return (min(mode, level) if mode < NUM_LEVELS else mode), admission * n_rules + rule

    def plan(self, view: ServingView, mode: int, allocation: int, valid: ValidV3 | None = None) -> Plan:
        """The plan an action stands for: the shared planner at the mode's budget (or the latency
        target's adaptive budget), rule and admission."""
        mode, allocation = self.canonical(view, mode, allocation, valid)
        n_rules = len(self.rules)
        rule, admission = self.rules[allocation % n_rules], self.admissions[allocation // n_rules]
        if mode < NUM_LEVELS:
            return plan_budget(view, BUDGET_LEVELS[mode], rule, admission=admission)
        target = self.targets[mode - NUM_LEVELS]
        return adaptive_level(view, BUDGET_LEVELS, rule, target.seconds(view), admission)[1]

    def action_of(self, mode: str, rule: Rule, admission: Admission) -> tuple[int, int]:
        """The constant action ``(mode, allocation)`` of a mode name (:attr:`mode_names`), rule and admission;
        ValueError if this space has no such action."""
        if mode not in self.mode_names or rule not in self.rules or admission not in self.admissions:
            raise ValueError(
                f"no action ({mode}, {rule.name.lower()}, {admission.value}) in modes {self.mode_names}, "
                f"rules {self.rule_names}, admissions {[a.value for a in self.admissions]}"
            )
        return (
            self.mode_names.index(mode),
            self.admissions.index(admission) * len(self.rules) + self.rules.index(rule),
        )


def _may_block(view: ServingView, look: Lookahead | None = None) -> bool:
    """Whether a waiting prompt might fail to start in a plan (so ``stop`` and ``skip`` may differ):
    not when the free slots and KV blocks hold every lookahead prompt's whole remaining prefill
    (summed by ``look`` when the caller has it)."""
    if look is None:
        bs = view.block_size
        new = blocks = 0
        for req in view.lookahead:
            new += not req.running
            blocks += blocks_needed(bs, req, req.target - req.computed)
    else:
        new, blocks = look.new, look.blocks
    return new > view.free_slots or blocks > view.free_blocks


class ActionSpace(Protocol):
    """What the env, the exported-policy runtime and the teachers use of an action spec (both kinds);
    ``valid`` is the spec's own summary of a state, from :meth:`valid`."""

    @property
    def nvec(self) -> tuple[int, int]: ...

    @property
    def rules(self) -> tuple[Rule, ...]: ...

    @property
    def rule_names(self) -> tuple[str, ...]: ...

    @property
    def admission(self) -> Admission: ...

    def describe(self) -> dict[str, list[str] | list[int]]: ...

    def valid(self, view: ServingView, look: Lookahead | None = None) -> Any: ...

    def mask(self, view: ServingView, valid: Any = None) -> np.ndarray: ...

    def canonical(self, view: ServingView, a: int, b: int, valid: Any = None) -> tuple[int, int]: ...

    def plan(self, view: ServingView, a: int, b: int, valid: Any = None) -> Plan: ...


ACTIONS_V0 = ActionSpec((Rule.FCFS, Rule.SHORTEST_FIRST, Rule.LEAST_SLACK))
ACTIONS_V1 = ActionSpec((Rule.FCFS, Rule.SHORTEST_FIRST, Rule.LEAST_SLACK, Rule.SLACK_DOOMED_LAST))
ACTIONS_V2 = ActionSpec(ACTIONS_V1.rules, Admission.STOP)  # (level, 0) is Sarathi-Serve at that budget
TARGETS_V3 = tuple(LatencyTarget(f, slack) for slack in (False, True) for f in (0.25, 0.5, 1.0, 2.0))
ACTIONS_V3 = TargetActionSpec(ACTIONS_V1.rules, TARGETS_V3)
"""(level, 0) is sarathi_B; (target_1, shortest_first+skip) is adaptive_srpf, (target_1, fcfs+skip) adaptive."""

# The v0 action space under its historical names.
NVEC = ACTIONS_V0.nvec
NUM_RULES = len(ACTIONS_V0.rules)
action_mask = ACTIONS_V0.mask
canonical_action = ACTIONS_V0.canonical
action_plan = ACTIONS_V0.plan
