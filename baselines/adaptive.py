"""A latency-targeting heuristic: the largest budget whose predicted iteration fits a TBT target."""

from __future__ import annotations

from envs.serving.levels import BUDGET_LEVELS, adaptive_level, largest_fitting, latency_target_s
from envs.serving.request import Request
from envs.serving.scheduling import Plan, Policy, Rule, ServingView, admission_named
from envs.serving.stretches import ChunkFollower, FollowsChunks, Steady, SteadyFollower, stretch_head


class Adaptive(Policy, FollowsChunks):
    """Per iteration, the largest budget level whose plan the cost model predicts to finish
    within ``target_fraction`` x the SLO's TPOT bound, allocated by ``rule``.

    Every token gap then stays near the target, while quiet periods get big, efficient
    prefill chunks.  With ``spend_slack`` the target grows by the least TPOT slack any
    stream still meeting its SLO has banked (``B * (tokens - 1) - elapsed``, see
    :meth:`~envs.serving.scheduling.ServingView.min_tpot_slack`), capped by the stall bound:
    an iteration of that length keeps every such stream's TPOT so far within bound.  Needs the cost model, so it predicts with whatever model the
    backend was calibrated with (the simulator's, or the engine's fitted profile).
    ``admission`` is chunkgym's skip-ahead by default (see
    :class:`~envs.serving.scheduling.Admission`).
    """

    def __init__(
        self,
        target_fraction: float = 1.0,
        rule: str = "fcfs",
        spend_slack: bool = False,
        levels: tuple[int, ...] = BUDGET_LEVELS,
        admission: str = "skip",
    ) -> None:
        if target_fraction <= 0:
            raise ValueError(f"target_fraction must be > 0, got {target_fraction}")
        self.target_fraction = target_fraction
        self.rule = Rule[rule.upper()]
        self.spend_slack = spend_slack
        self.levels = tuple(sorted(levels))
        self.admission = admission_named(admission)
        self.name = "adaptive"

    def plan(self, view: ServingView) -> Plan:
        target = latency_target_s(view, self.target_fraction, self.spend_slack)
        return adaptive_level(view, self.levels, self.rule, target, self.admission)[1]

    def follow(self, view: ServingView, plan: Plan) -> ChunkFollower | None:
        """:func:`adaptive_level`'s search on the plans that give the head alone each level's tokens
        (what :func:`~envs.serving.budgets.budget_plans` plans while a level's chunk is no more than the head's rest and
        its KV room), priced alike.  With a :attr:`~envs.serving.cost_model.CostModel.monotone` cost
        model the search's answer is the largest level that fits, so the last answer is checked
        first (it fits and the next level does not; the latter is known without pricing while no
        decode has left, since a batch's contexts only grow) before the whole search runs again.  0 where the
        search would ask about a level beyond that, or picks one that runs no chunk.  Only with a
        fixed target (no ``spend_slack``)."""
        head = stretch_head(view, plan, self.rule)
        if head is None or self.spend_slack:
            return None
        return LevelChunk(
            view, head, self.levels, latency_target_s(view, self.target_fraction, spend_slack=False)
        )


class LevelChunk(SteadyFollower):
    """:meth:`Adaptive.follow`'s follower: the largest level whose head-alone plan fits ``target_s``."""

    def __init__(self, view: ServingView, head: Request, levels: tuple[int, ...], target_s: float) -> None:
        self.view, self.head, self.levels, self.target_s = view, head, levels, target_s
        self.monotone = view.latency_monotone
        self.last = -1  # the previous answer's level index (-1: none yet)
        self.above_at = -1  # the decode count when the level above it was last priced over the target

    def __call__(self) -> tuple[int, float | None]:
        view, head, levels, target = self.view, self.head, self.levels, self.target_s
        predict, bs, last = view.predict_latency, view.block_size, self.last
        n_dec, c = view.num_decode, head.computed
        context = view.decode_context if n_dec else 0
        limit = min(head.target - c, (-(-c // bs) + view.free_blocks) * bs - c)

        def price(i: int) -> float | None:  # None: a level beyond the head-alone plans
            left = levels[i] - n_dec
            if left > limit:
                return None
            return predict(n_dec, context, (left,), (c,)) if left > 0 else predict(n_dec, context, (), ())

        if last >= 0:
            fit = price(last)
            if fit is not None and fit <= target:
                # No level above, or it was priced over the target with these decodes and its
                # batch has only grown since (their contexts and the head's): over it still.
                known_over = last == len(levels) - 1 or (
                    self.above_at == n_dec and levels[last + 1] - n_dec <= limit
                )
                if known_over or ((above := price(last + 1)) is not None and above > target):
                    self.above_at = n_dec
                    return levels[last] - n_dec, fit
        found = largest_fitting(len(levels), price, target)
        if found is None:
            return 0, None
        lo, fit = found
        left = levels[lo] - n_dec
        if left > limit:
            return 0, None
        # The search priced the level above its answer over the target (if there is one).
        self.last, self.above_at = (lo, n_dec) if self.monotone else (-1, -1)
        return left, fit

    def steady(self) -> Steady | None:
        """With a monotone model, after an answer of level ``last`` with the level above known over
        the target at this decode count: the same answer while its price stays within the target and
        the level above's chunk is still a head-alone plan (so the warm start answers it)."""
        last, n_dec, levels = self.last, self.view.num_decode, self.levels
        if last < 0 or self.above_at != n_dec:
            return None
        tokens = levels[last] - n_dec
        room = tokens if last == len(levels) - 1 else levels[last + 1] - n_dec
        return Steady(tokens, self.target_s, room)
