"""Sarathi-Serve: stall-free batching under a fixed token budget."""

from __future__ import annotations

from envs.serving.scheduling import Plan, Policy, Rule, ServingView, admission_named, plan_budget
from envs.serving.stretches import BudgetChunk, ChunkFollower, FollowsChunks, stretch_head


class Sarathi(Policy, FollowsChunks):
    """Every decode, then ongoing partial prefills, then new prompts, within ``budget`` tokens.

    Decodes count against the budget, so an iteration's work (and a streaming user's
    token gap) is bounded by the budget.  ``admission="stop"`` (the default) is Sarathi-Serve's
    and vLLM V1's: new prompts in order until the first whose whole prompt does not fit in
    KV; ``"skip"`` lets later prompts pass it (see :class:`~envs.serving.scheduling.Admission`).
    ``rule`` other than FCFS gives the variants a learned policy can also pick.
    """

    def __init__(self, budget: int = 512, rule: str = "fcfs", admission: str = "stop") -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1 token, got {budget}")
        self.budget = budget
        self.rule = Rule[rule.upper()]
        self.admission = admission_named(admission)
        self.name = f"sarathi_{budget}"

    def plan(self, view: ServingView) -> Plan:
        return plan_budget(view, self.budget, self.rule, admission=self.admission)

    def follow(self, view: ServingView, plan: Plan) -> ChunkFollower | None:
        """The head takes the budget left after the decodes (it is first in the order, and the
        chunk, shorter than its rest, fits: the conditions of :meth:`FollowsChunks.follow`)."""
        if stretch_head(view, plan, self.rule) is None:
            return None
        return BudgetChunk(view, self.budget)
