"""Fairness and SLO-class baselines over the shared planner: VTC, weighted VTC and EDF.

Each is the shared planner (:func:`~envs.serving.scheduling.plan_budget`: every decode, then prefill
chunks within a token budget, ``admission`` as Sarathi's) with an order of the waiting prompts of its
own (``order=``).  vLLM's ``--scheduling-policy priority`` is not here: it is a knob of
:class:`~baselines.vllm_v1.VllmV1` (``scheduling_policy="priority"``), which orders the waiting prompts
with :func:`urgent_order` too.  docs/baselines.md ("Fairness baselines") has the rules and sources.

The waiting prompts these policies pick from are the whole queue, not only the first
``ServingConfig.lookahead`` queued (the view's ``lookahead``, which under a flood holds nothing but
the flood's oldest prompts): a fair or deadline-first scheduler that sees only the head of an
arrival-ordered queue is FCFS with extra steps.  They hand the planner as many prompts as the
lookahead holds (its length), so a plan never considers more prompts than the rules' plans do.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from envs.serving.request import Request, Status
from envs.serving.scheduling import Admission, Plan, Policy, Rule, ServingView, admission_named, plan_budget

W_IN = 1.0
"""VTC's charge per prompt token (the paper's ``w_p``; ``envs.serving.tenancy.W_IN``, which measures it)."""
W_OUT = 2.0
"""VTC's charge per output token (``w_q``; ``envs.serving.tenancy.W_OUT``)."""


def urgent_order(view: ServingView, key: Callable[[Request], Any]) -> list[Request]:
    """The queue in the order a policy with a sort key serves it: prompts mid-prefill first, in queue
    order (they hold a batch slot and KV, as vLLM's running list comes before its waiting queue),
    then the waiting prompts by ``key``, the ``len(view.lookahead)`` smallest of the whole queue."""
    queue, look = view.queue, view.lookahead
    if len(queue) == len(look):  # the common case: the lookahead is the queue
        running = [r for r in look if r.running]
        waiting = sorted((r for r in look if not r.running), key=key)
    else:
        running = [r for r in queue if r.running]
        waiting = heapq.nsmallest(len(look), (r for r in queue if not r.running), key=key)
    return running + waiting if running else waiting


def deadline_key(r: Request) -> tuple[float, int]:
    """EDF's order: the earliest TTFT deadline (arrival + its class's TTFT bound), then queue order."""
    return (r.deadline, r.seq)


class Edf(Policy):
    """Earliest TTFT deadline first, across SLO classes, within ``budget`` tokens per iteration.

    Every decode, then the prompts mid-prefill (queue order: they hold a batch slot and their KV, and
    vLLM too continues its running requests before it admits waiting ones), then the waiting prompts
    by ``Request.deadline`` (arrival + the TTFT bound of the request's class: an interactive prompt
    that arrived later may pass a batch one that arrived earlier).  A missed deadline keeps its place
    (no demotion of doomed prompts: that is ``rule: slack_doomed_last``'s, and this is plain EDF).
    ``admission`` as :class:`~baselines.sarathi.Sarathi`'s.
    """

    def __init__(self, budget: int = 512, admission: str = "stop") -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1 token, got {budget}")
        self.budget = budget
        self.admission = admission_named(admission)
        self.name = f"edf_{budget}"

    def plan(self, view: ServingView) -> Plan:
        if not view.queue:
            return plan_budget(view, self.budget, Rule.FCFS, admission=self.admission)
        return plan_budget(
            view, self.budget, Rule.FCFS, admission=self.admission, order=urgent_order(view, deadline_key)
        )


class Vtc(Policy):
    """VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24, Algorithm 2) over the
    shared planner at ``budget`` tokens per iteration.

    **Counters.**  Each tenant (``Request.tenant``) has a virtual token counter of the service it got:
    ``W_IN`` (1) per prompt token and ``W_OUT`` (2) per output token.  Prompt tokens are charged when
    this policy plans their chunk (exactly what is scheduled; a request's prefix-cache hit is charged
    with its first chunk, so a request is charged its whole prompt, as ``envs.serving.tenancy``
    measures it); output tokens from ``view.tokens_generated`` at each plan, the tokens emitted since
    the last charge, for every request it has started until it finishes.  A preempted request keeps
    its charges and its recompute is not charged again (only prompt tokens past those already charged
    are).  :class:`Wvtc` divides each charge by the request's class weight.

    **Order.**  Every decode, then the prompts mid-prefill (queue order; they hold a batch slot, as
    vLLM's running requests come first), then the waiting prompts, chosen one at a time: the
    backlogged tenant (one with a waiting prompt) with the least counter (ties: the earlier head of
    queue) gives its earliest waiting prompt (queue order: preempted ones first, then arrival).  VTC
    admits one request, charges it and picks again; here the planner takes one order per iteration, so
    a pick raises the tenant's counter provisionally, by the prompt's remaining prefill (times
    ``W_IN``, over the weight), for the next pick of the same plan, and the real charge is the chunk
    the planner then gives it.  The order holds as many prompts as the view's lookahead; under
    ``admission="stop"`` it ends once its prompts' remaining prefill covers the tokens the decodes and
    running prompts leave, or one more than the free batch slots.

    **Counter lift.**  A tenant that becomes backlogged (a prompt of it queued where none waited: an
    arrival, or a preempted request queued again) has its counter lifted to the least counter among
    the other backlogged tenants if it is below it; when none is backlogged, to the counter of the
    tenant that last left the backlog (the paper's rule: an idle tenant banks no credit).

    The waiting prompts come from the whole queue (module docstring), tracked incrementally: arrivals
    are appended to the queue, preempted requests are put back at its front.
    """

    weighted = False

    def __init__(self, budget: int = 512, admission: str = "stop") -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1 token, got {budget}")
        self.budget = budget
        self.admission = admission_named(admission)
        self.name = f"{'wvtc' if self.weighted else 'vtc'}_{budget}"
        self._fresh()

    def _fresh(self) -> None:
        self.counter: dict[str, float] = {}  # tenant -> charged service (over weights for Wvtc)
        self._waiting: dict[str, deque[tuple[int, Request]]] = {}  # tenant -> (seq when queued, request)
        self._backlog: dict[str, int] = {}  # tenant -> its waiting prompts (not started)
        self._known: set[int] = set()  # rids ever queued
        self._active: dict[int, Request] = {}  # started, not finished, not preempted since
        self._charged: dict[int, list[int]] = {}  # rid -> [prompt tokens charged, output tokens charged]
        self._last_left: str | None = None  # the tenant that last stopped being backlogged

    def reset(self, view: ServingView) -> None:
        self._fresh()

    def _weight(self, req: Request) -> float:
        return req.weight if self.weighted else 1.0

    # ---- bookkeeping --------------------------------------------------------------------
    def _queue_again(self, req: Request, front: bool) -> None:
        """``req`` waits (again): into its tenant's queue, lifting the tenant's counter if it was idle."""
        t = req.tenant
        n = self._backlog.get(t, 0)
        if n == 0:
            self._lift(t)
        self._backlog[t] = n + 1
        dq = self._waiting.get(t)
        if dq is None:
            dq = self._waiting[t] = deque()
        if front:
            dq.appendleft((req.seq, req))
        else:
            dq.append((req.seq, req))

    def _lift(self, tenant: str) -> None:
        counter = self.counter
        mine = counter.get(tenant, 0.0)
        others = [counter.get(u, 0.0) for u, n in self._backlog.items() if n and u != tenant]
        if others:
            mine = max(mine, min(others))
        elif self._last_left is not None and self._last_left != tenant:
            mine = max(mine, counter.get(self._last_left, 0.0))
        counter[tenant] = mine

    def charge(self, view: ServingView) -> None:
        """Bring the counters up to date with ``view`` (each ``plan`` does it first): the outputs a run
        emits after its last plan (decodes with no prompt waiting run without planning) are charged
        only here."""
        self._update(view)

    def _update(self, view: ServingView) -> list[Request]:
        """Charge the outputs emitted since the last plan, drop finished requests, queue preempted ones
        and arrivals again; the prompts mid-prefill, in queue order."""
        counter, charged = self.counter, self._charged
        running: list[Request] = []
        gone: list[Request] = []
        for rid, req in self._active.items():
            done = charged[rid]
            emitted = view.tokens_generated(req)
            if emitted > done[1]:
                counter[req.tenant] = counter.get(req.tenant, 0.0) + W_OUT * (
                    emitted - done[1]
                ) / self._weight(req)
                done[1] = emitted
            status = req.status
            if status is Status.WAITING:
                if req.running:
                    running.append(req)
                else:
                    gone.append(req)  # preempted: queued again, at the front
            elif status is not Status.DECODING:
                gone.append(req)  # finished (or rejected)
        if gone:
            gone.sort(key=_seq, reverse=True)  # preempted ones: the most recent (least seq) ends up first
            for req in gone:
                del self._active[req.rid]
                if req.status is Status.WAITING:
                    self._queue_again(req, front=True)
                else:
                    del charged[req.rid]
        queue, known = view.queue, self._known
        i = len(queue)
        while i and queue[i - 1].rid not in known:  # arrivals are appended: the unknown tail
            i -= 1
        for req in queue[i:]:
            known.add(req.rid)
            if req.running:  # only after a reset mid-run
                self._active[req.rid] = req
                self._charged[req.rid] = [min(req.computed, req.prompt_len), view.tokens_generated(req)]
                running.append(req)
            else:
                self._queue_again(req, front=False)
        running.sort(key=_seq)
        return running

    def _order(self, view: ServingView, running: list[Request]) -> list[Request]:
        """``running``, then waiting prompts by least (provisional) counter (class docstring)."""
        counter = self.counter
        heads: list[tuple[float, int, str, Request]] = []
        rests: dict[str, Iterator[Request]] = {}
        for t, dq in self._waiting.items():
            while dq and not _valid(dq[0]):
                dq.popleft()
            if dq:
                rest = rests[t] = _still_waiting(dq)
                head = next(rest)
                heads.append((counter.get(t, 0.0), head.seq, t, head))
        if not heads:
            return running
        heapq.heapify(heads)
        order = list(running)
        limit = max(1, len(view.lookahead))
        stop = self.admission is Admission.STOP
        left = 0
        if stop:
            limit = min(limit, view.free_slots + 1)
            left = self.budget - view.num_decode - sum(r.remaining_prefill for r in running)
        while heads and len(order) - len(running) < limit:
            prov, _, t, req = heads[0]
            order.append(req)
            rest_tokens = req.remaining_prefill
            if stop:
                left -= rest_tokens
                if left <= 0:
                    break
            nxt = next(rests[t], None)
            if nxt is None:
                heapq.heappop(heads)
            else:
                heapq.heapreplace(heads, (prov + W_IN * rest_tokens / self._weight(req), nxt.seq, t, nxt))
        return order

    def _charge(self, plan: Plan) -> None:
        """Charge the plan's prompt tokens; count the prompts it starts as no longer waiting."""
        counter, charged, backlog = self.counter, self._charged, self._backlog
        for req, n in plan.chunks:
            rid = req.rid
            done = charged.get(rid)
            if done is None:
                done = charged[rid] = [0, 0]
            upto = min(req.computed + n, req.prompt_len)
            if upto > done[0]:
                t = req.tenant
                counter[t] = counter.get(t, 0.0) + W_IN * (upto - done[0]) / self._weight(req)
                done[0] = upto
            if not req.running:  # it starts now
                self._active[rid] = req
                t = req.tenant
                backlog[t] -= 1
                if backlog[t] == 0:
                    self._last_left = t

    def plan(self, view: ServingView) -> Plan:
        running = self._update(view)
        order = self._order(view, running)
        plan = plan_budget(view, self.budget, Rule.FCFS, admission=self.admission, order=order)
        self._charge(plan)
        return plan


class Wvtc(Vtc):
    """Weighted VTC: :class:`Vtc` with each charge divided by the request's class weight
    (``Request.weight``, ``conf/slo_class``'s ``weight``; 1 without a class), so backlogged tenants'
    service evens out in proportion to their weights.  The weight is per class, so a tenant's weight
    is that of its requests' class, constant per tenant in the mix workloads (each tenant has one
    class); a tenant whose requests name several classes is charged each at its own weight.  With
    every weight equal (no classes, or one class), it plans exactly what :class:`Vtc` plans."""

    weighted = True


def _seq(r: Request) -> int:
    return r.seq


def _valid(entry: tuple[int, Request]) -> bool:
    """Whether a tenant-queue entry still waits: not started since, nor queued again (new seq)."""
    seq, req = entry
    return req.seq == seq and not req.running and req.status is Status.WAITING


def _still_waiting(dq: deque[tuple[int, Request]]) -> Iterator[Request]:
    """A tenant queue's requests that still wait, in order."""
    for entry in dq:
        if _valid(entry):
            yield entry[1]
