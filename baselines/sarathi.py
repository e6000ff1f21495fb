"""Sarathi-Serve: stall-free batching under a fixed token budget."""

from __future__ import annotations

from envs.serving.scheduling import Plan, Policy, Rule, ServingView, plan_budget


class Sarathi(Policy):
    """Every decode, then ongoing partial prefills, then new prompts, within ``budget`` tokens.

    Decodes count against the budget, so an iteration's work (and a streaming user's
    token gap) is bounded by the budget.  ``rule`` other than FCFS gives the variants a
    learned policy can also pick.
    """

    def __init__(self, budget: int = 512, rule: str = "fcfs") -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1 token, got {budget}")
        self.budget = budget
        self.rule = Rule[rule.upper()]
        self.name = f"sarathi_{budget}"

    def plan(self, view: ServingView) -> Plan:
        return plan_budget(view, self.budget, self.rule)
