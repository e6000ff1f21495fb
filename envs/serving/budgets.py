"""Every budget of one iteration from a single planning pass: a policy choosing among budget levels
(``adaptive``, the learned policy's latency targets) asks for up to five per iteration.

:func:`budget_plans` gives :func:`~envs.serving.scheduling.plan_budget`'s plans and
:func:`~envs.serving.scheduling.plan_latency`'s prices at every budget up to one, from one pass
(:class:`BudgetPrefixes`); on the reference path (:data:`~envs.serving.shortcuts.NO_SHORTCUTS`) from
scratch, budget by budget (:class:`EachBudget`).  A speed path, not the interface: like it, this
module imports no implementation, so policies call it; tests/test_budget_plans.py checks the two
agree bit for bit.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

from envs.serving.request import Request
from envs.serving.scheduling import (
    Admission,
    Plan,
    Rule,
    ServingView,
    plan_budget,
    plan_latency,
    rule_order,
)


class BudgetPlans(Protocol):
    """:func:`plan_budget` (all decodes, skip or stop admission) and :func:`plan_latency` at any
    budget up to the one it was made for, in one state: what a policy choosing among budget levels
    (``adaptive``) asks for several budgets per iteration."""

    def latency(self, budget: int) -> float: ...

    def plan(self, budget: int) -> Plan: ...


class EachBudget:
    """Plans every budget asked from scratch: the plain planner, the reference for :class:`BudgetPrefixes`."""

    def __init__(self, view: ServingView, rule: Rule, admission: Admission) -> None:
        self.view, self.rule, self.admission = view, rule, admission

    def latency(self, budget: int) -> float:
        return plan_latency(self.view, self.plan(budget))

    def plan(self, budget: int) -> Plan:
        return plan_budget(self.view, budget, self.rule, admission=self.admission)


class BudgetPrefixes:
    """Every budget up to ``max_budget`` from one planning pass, priced without building plans.

    :func:`plan_budget` reads the budget only as the tokens ``left`` after the decodes: a chunk is
    cut short by it exactly when the chunks before it and its own would exceed it, and the loop
    ends there.  So the plan at a smaller budget is the largest plan's chunks up to the first whose
    running total reaches its ``left``, that one cut to the rest: the same chunks in the same order,
    and, priced with the same arguments, the same latencies.  The pass is :func:`plan_budget`'s
    loop with the admission arithmetic inlined (tests/test_budget_plans.py checks the two agree).
    """

    def __init__(self, view: ServingView, max_budget: int, rule: Rule, admission: Admission) -> None:
        n_dec = view.num_decode
        self._max_budget = max_budget
        self._n_dec = n_dec
        self._predict = view.predict_latency
        self._context = view.decode_context if n_dec else 0  # plan_latency's decode arguments
        self._reqs: list[Request] = []
        self._sizes: list[int] = []  # each chunk's tokens at max_budget
        self._computed: list[int] = []  # each chunk's request's tokens in KV
        self._ends: list[int] = []  # prefill tokens up to and including each chunk
        self._prices: dict[tuple[int, int], float] = {}
        left = max_budget - n_dec
        if left <= 0 or not view.queue:
            return
        order = rule_order(view, rule)
        stop = admission is Admission.STOP
        self._pass(view, order, left, stop)
        if stop and not self._reqs and not n_dec and not view.num_prefilling:
            self._pass(view, order, left, False)  # plan_budget's fallback to skip-ahead

    def _pass(self, view: ServingView, order: Sequence[Request], left: int, stop: bool) -> None:
        reqs, sizes, computed, ends = self._reqs, self._sizes, self._computed, self._ends
        bs, free, slots = view.block_size, view.free_blocks, view.free_slots
        admitting, total = True, 0
        for req in order:
            running = req.running
            if not (running or admitting):
                continue
            c = req.computed
            held = -(-c // bs)
            room = (held + free) * bs - c  # the most tokens whose KV fits in the free blocks
            rem = req.target - c
            if not (rem > 0 and room > 0 if running else slots > 0 and rem <= room):  # may_prefill
                if stop and not running:
                    admitting = False
                continue
            n = min(rem, left, room)
            reqs.append(req)
            sizes.append(n)
            computed.append(c)
            total += n
            ends.append(total)
            left -= n
            free -= -(-(c + n) // bs) - held
            if not running:
                slots -= 1
            if left <= 0:
                break

    def _cut(self, budget: int) -> tuple[int, int]:
        """The chunks kept whole at ``budget`` and the tokens of the one cut after them (0: none)."""
        if budget > self._max_budget:
            raise ValueError(f"budget {budget} exceeds the {self._max_budget} these plans were made for")
        left = budget - self._n_dec
        if left <= 0:
            return 0, 0
        ends = self._ends
        j = bisect_left(ends, left)  # the first chunk whose running total reaches left
        if j == len(ends):
            return j, 0
        return j, left - (ends[j - 1] if j else 0)

    def latency(self, budget: int) -> float:
        cut = self._cut(budget)
        price = self._prices.get(cut)
        if price is None:
            j, part = cut
            if part:
                sizes = self._sizes[:j]
                sizes.append(part)
                price = self._predict(self._n_dec, self._context, sizes, self._computed[: j + 1])
            else:
                price = self._predict(self._n_dec, self._context, self._sizes[:j], self._computed[:j])
            self._prices[cut] = price
        return price

    def plan(self, budget: int) -> Plan:
        """The plan at ``budget``, with its price if :meth:`latency` computed it (``Plan.latency``)."""
        j, part = self._cut(budget)
        chunks = list(zip(self._reqs[:j], self._sizes[:j], strict=True))
        if part:
            chunks.append((self._reqs[j], part))
        return Plan(self._n_dec > 0, chunks, self._prices.get((j, part)))


_ONE_PASS: ContextVar[bool] = ContextVar("one_pass_budgets", default=True)


def planning_one_pass() -> bool:
    """The planning mode now (see :func:`one_pass_planning`)."""
    return _ONE_PASS.get()


@contextmanager
def one_pass_planning(one_pass: bool) -> Iterator[None]:
    """Within it, :func:`budget_plans` plans all budgets from one pass (``one_pass``, as outside it) or each
    from scratch (:class:`EachBudget`).  The loop enters it for every run from its one switch,
    :attr:`~envs.serving.shortcuts.Shortcuts.one_pass_budgets` (off on the reference path); tests
    that call a planner outside a run enter it themselves."""
    token = _ONE_PASS.set(one_pass)
    try:
        yield
    finally:
        _ONE_PASS.reset(token)


def budget_plans(view: ServingView, max_budget: int, rule: Rule, admission: Admission) -> BudgetPlans:
    """Plans and prices at any budget up to ``max_budget`` in ``view``'s current state: from one
    pass (:class:`BudgetPrefixes`), or each from scratch (see :func:`one_pass_planning`)."""
    if _ONE_PASS.get():
        return BudgetPrefixes(view, max_budget, rule, admission)
    return EachBudget(view, rule, admission)
