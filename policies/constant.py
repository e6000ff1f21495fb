"""Heuristics as constant actions of ``chunkgym/ChunkedPrefill-v3`` (and of v4, which shares its actions).

v3's modes include :class:`baselines.Adaptive`'s latency targets and its allocations include
the admission, so each Sarathi budget and each adaptive heuristic is one action taken at
every step.  This is what lets training start from the best heuristic: its label is one
action, the same in every state (after masking), which a network reproduces exactly, where
cloning a heuristic's per-state budget in v2 did not carry over to the policy's own states.
"""

from __future__ import annotations

from baselines import Adaptive, Sarathi
from envs.actions import ACTIONS_V3, LatencyTarget, TargetActionSpec
from envs.serving.levels import BUDGET_LEVELS
from envs.serving.scheduling import Plan, Policy, ServingView

Action = tuple[int, int]


def constant_action(actions: TargetActionSpec, policy: Policy) -> Action:
    """The v3 action whose plan is ``policy``'s in every state; ValueError for a heuristic that has none."""
    if isinstance(policy, Sarathi) and policy.budget in BUDGET_LEVELS:
        return actions.action_of(f"budget_{policy.budget}", policy.rule, policy.admission)
    if isinstance(policy, Adaptive) and policy.levels == BUDGET_LEVELS:
        target = LatencyTarget(policy.target_fraction, policy.spend_slack)
        return actions.action_of(target.name, policy.rule, policy.admission)
    raise ValueError(
        f"policy {policy.name!r} ({type(policy).__name__}) is no constant action of the v3 action space "
        f"(Sarathi at a budget of {list(BUDGET_LEVELS)}, or Adaptive with targets "
        f"{[t.name for t in actions.targets]})"
    )


def action_named(actions: TargetActionSpec, name: str) -> Action:
    """The action :class:`ConstantAction` names ``name`` (``MODE__ALLOCATION``, e.g.
    ``target_1_slack__shortest_first+skip``); ValueError listing the valid modes and allocations."""
    action = _parse(actions, name)
    if action is None:
        raise ValueError(
            f"{name!r} is no action name MODE__ALLOCATION of the v3 action space (modes "
            f"{', '.join(actions.mode_names)}; allocations {', '.join(actions.allocation_names)})"
        )
    return action


def is_action_name(name: object) -> bool:
    """Whether ``name`` names a constant action of ``chunkgym/ChunkedPrefill-v3`` (see :func:`action_named`)."""
    return isinstance(name, str) and _parse(ACTIONS_V3, name) is not None


def _parse(actions: TargetActionSpec, name: str) -> Action | None:
    mode, sep, allocation = name.partition("__")
    if not sep or mode not in actions.mode_names or allocation not in actions.allocation_names:
        return None
    return actions.mode_names.index(mode), actions.allocation_names.index(allocation)


class ConstantAction(Policy):
    """The action ``(mode, allocation)`` of ``actions`` at every iteration (a heuristic, stated as v3)."""

    def __init__(self, actions: TargetActionSpec, action: Action) -> None:
        mode, allocation = action
        if not (0 <= mode < actions.nvec[0] and 0 <= allocation < actions.nvec[1]):
            raise ValueError(f"action {action} is outside nvec {actions.nvec}")
        self.actions = actions
        self.action = action
        self.name = f"{actions.mode_names[mode]}__{actions.allocation_names[allocation]}"

    def plan(self, view: ServingView) -> Plan:
        return self.actions.plan(view, *self.action)
