"""The scheduling interface every policy speaks: a read-only view in, a plan out.

A :class:`Plan` says, for the next iteration, whether the running decodes step (all
of them, one token each: engines never split the decode batch on purpose, and it
keeps an iteration's cost independent of how many users are streaming) and which
waiting prompts get how many prefill tokens.

:class:`ServingView` is all a policy, a feature or an action mask may read: the
simulator's and the engine's :class:`~envs.serving.core.ServingCore` satisfies it
directly (no copies, nothing per iteration), and any other scheduler state (a vLLM
plugin's, say) can implement it to run the same policies.

:func:`plan_budget` is the shared planner: Sarathi-Serve with budget B, the learned
policy choosing B every step, the ``adaptive`` heuristic and vLLM V1 under its knobs all call it.  Every
running decode is served first and counts against the budget (if decodes alone fill
it, no prefill runs); the rest goes to prefill chunks in the order of an allocation
:class:`Rule`, limited by free KV blocks and the batch-slot limit.  Work is sized by
the tokens left after prefix-cache hits (``Request.remaining_prefill``), never the raw
prompt length.  A prompt starts only when a batch slot and KV blocks for all of its
remaining prefill are free (vLLM's ``scheduler_reserve_full_isl``, :func:`may_prefill`), so
partial prefills rarely wait on memory; the core preempts if they ever deadlock.  What
happens to the prompts behind one that cannot start is the :class:`Admission` rule: vLLM
V1 and Sarathi-Serve end admission there, chunkgym's v0/v1 env skips ahead.  The core
validates plans with the same admission arithmetic, which is why it lives here.

Writing a new policy: subclass :class:`Policy`, implement ``plan(view)`` (usually one
call to :func:`plan_budget`), and add a YAML file under ``conf/policy/``.

This module is the interface alone: how the simulator runs a policy faster (following a long
prompt's chunks, :mod:`envs.serving.stretches`; every budget of an iteration from one pass,
:mod:`envs.serving.budgets`) lives beside it, and tests/test_import_direction.py checks it stays out.
It imports no implementation: the core imports it, never the reverse.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Protocol, runtime_checkable

from envs.serving.metrics import SLO
from envs.serving.request import Request
from envs.serving.traffic import TrafficStats


class Rule(IntEnum):
    """How the prefill share of the budget is allocated among waiting prompts."""

    FCFS = 0  # partly prefilled prompts first, then by arrival (Sarathi-Serve, vLLM)
    SHORTEST_FIRST = 1  # fewest remaining prefill tokens first
    LEAST_SLACK = 2  # least TTFT slack first: deadline minus estimated remaining prefill time
    SLACK_DOOMED_LAST = 3  # least slack first among prompts that can still meet TTFT; missed ones last


RULE_NAMES = tuple(r.name.lower() for r in Rule)


class Admission(Enum):
    """What the prompts behind a waiting prompt that cannot start (no batch slot, or no KV room
    for its whole remaining prompt) do in that iteration; running prompts always continue."""

    SKIP = "skip"  # later prompts of the lookahead that fit start (chunkgym's env v0 and v1)
    STOP = "stop"  # it ends admission, later prompts wait: vLLM V1 and Sarathi-Serve (a ``break``)


def admission_named(name: str) -> Admission:
    """The :class:`Admission` called ``name``; ValueError naming the valid ones otherwise."""
    try:
        return Admission(name)
    except ValueError:
        valid = ", ".join(a.value for a in Admission)
        raise ValueError(f"admission must be one of {valid}, got {name!r}") from None


@dataclass
class Plan:
    """One iteration's work: step every decode (or none), plus prefill chunks.

    ``latency``: the planner's price for it, :meth:`ServingView.predict_latency` of exactly this
    batch in the state it was planned in, when the planner priced it anyway
    (:class:`~envs.serving.budgets.BudgetPrefixes`);
    the simulator's clock then takes it rather than pricing the batch again.  None: not priced.
    """

    decode: bool
    chunks: list[tuple[Request, int]] = field(default_factory=list)
    latency: float | None = field(default=None, compare=False)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


@runtime_checkable
class ServingView(Protocol):
    """The serving state a policy sees each iteration, read-only.

    Requests in ``queue`` are read, never changed: policies name them in a :class:`Plan`.
    """

    @property
    def now(self) -> float: ...

    @property
    def slo(self) -> SLO: ...

    @property
    def queue(self) -> Sequence[Request]:
        """Prompts waiting for prefill, in queue order (preempted ones first, then by arrival)."""
        ...

    @property
    def lookahead(self) -> Sequence[Request]:
        """The first queued prompts, the ones allocation rules may reorder."""
        ...

    @property
    def num_decode(self) -> int:
        """Requests streaming tokens (the decode group)."""
        ...

    @property
    def num_decode_doomed(self) -> int:
        """Of those, the ones already known to miss their SLO."""
        ...

    @property
    def decode_context(self) -> int:
        """KV tokens the decode group's next step attends to, summed."""
        ...

    @property
    def last_decode_time(self) -> float:
        """When the decode group last emitted tokens (-inf if never)."""
        ...

    @property
    def num_prefilling(self) -> int:
        """Queued prompts holding a batch slot (mid-prefill)."""
        ...

    @property
    def free_blocks(self) -> int:
        """KV blocks available to prefill after reserving the decodes' next step."""
        ...

    @property
    def total_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def free_slots(self) -> int:
        """Batch slots left for prompts not yet running (max_num_seqs minus running)."""
        ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def prefill_s_per_token(self) -> float:
        """Seconds per prefill token on an idle engine (the slack rules' estimate)."""
        ...

    @property
    def last_latency(self) -> float:
        """The last iteration's latency (s)."""
        ...

    @property
    def latency_ewma(self) -> float: ...

    @property
    def traffic(self) -> TrafficStats:
        """What the server has seen of its workload: arrival rate, prefix hits, prompt and output lengths."""
        ...

    def tokens_generated(self, req: Request) -> int:
        """Output tokens ``req`` has emitted so far, a decoding request's included (what a
        scheduler that charges service per token, VTC, counts)."""
        ...

    def min_tpot_slack(self) -> float:
        """Least TPOT slack (s) among streams still able to meet their SLO; inf if none."""
        ...

    def predict_latency(
        self, num_decode: int, decode_context: int, query_lens: Sequence[int], computed_lens: Sequence[int]
    ) -> float:
        """The cost model's latency (s) for an iteration of that shape."""
        ...

    @property
    def latency_monotone(self) -> bool:
        """Whether :meth:`predict_latency` never falls as a batch gains tokens or chunks (its cost
        model's :attr:`~envs.serving.cost_model.CostModel.monotone`)."""
        ...


class Preemption(Enum):
    """Which running request the core preempts (for recompute) when the decodes need KV blocks
    that are not free: a property of the engine's scheduling policy, which a policy declares."""

    LATEST_STARTED = "latest_started"  # vLLM's default (fcfs): the last request of its running list
    LOWEST_PRIORITY = "lowest_priority"  # vLLM's --scheduling-policy priority: max (priority, arrival)


class Policy(ABC):
    """A scheduler: turns a view into a plan, once per iteration."""

    name: str = "policy"
    preemption: Preemption = Preemption.LATEST_STARTED  # the core reads it when the run starts

    def reset(self, view: ServingView) -> None:  # noqa: B027 - optional hook
        """Called before a run, for policies that read the SLO or the limits once."""

    @abstractmethod
    def plan(self, view: ServingView) -> Plan: ...


# ---- admission arithmetic: pure, shared by the planners and the core's plan validation --------
def blocks_needed(block_size: int, req: Request, tokens: int) -> int:
    """Extra private KV blocks ``req`` needs to compute ``tokens`` more tokens."""
    c = req.computed
    return -(-(c + tokens) // block_size) - -(-c // block_size)


def tokens_fitting(block_size: int, req: Request, free_blocks: int) -> int:
    """The most prefill tokens of ``req`` whose KV fits in ``free_blocks`` more blocks."""
    c = req.computed
    return max(0, min(req.target - c, (-(-c // block_size) + free_blocks) * block_size - c))


def may_prefill(block_size: int, req: Request, free_blocks: int, free_slots: int) -> bool:
    """Whether ``req`` may get prefill tokens: a running prompt if one more token's KV fits; a new
    one (admission, as vLLM) only with a free batch slot and KV room for its whole remaining prompt."""
    if req.running:
        return tokens_fitting(block_size, req, free_blocks) > 0
    return free_slots > 0 and blocks_needed(block_size, req, req.target - req.computed) <= free_blocks


# ---- the shared planner ------------------------------------------------------------------------
def rule_order(view: ServingView, rule: Rule) -> Sequence[Request]:
    """The lookahead of waiting prompts, in the order ``rule`` serves them."""
    cands = view.lookahead
    if len(cands) <= 1:
        return cands
    if rule == Rule.FCFS:
        return sorted(cands, key=_fcfs_key)
    if rule == Rule.SHORTEST_FIRST:
        return sorted(cands, key=remaining_key)
    per_token = view.prefill_s_per_token
    if rule == Rule.LEAST_SLACK:
        return sorted(cands, key=lambda r: r.deadline - per_token * r.remaining_prefill)
    return sorted(cands, key=lambda r: (r.violated, r.deadline - per_token * r.remaining_prefill))


def _fcfs_key(r: Request) -> tuple[bool, int]:
    return (not r.running, r.seq)


def remaining_key(r: Request) -> tuple[int, int]:
    """SHORTEST_FIRST's order: fewest remaining prefill tokens, then arrival."""
    return (r.target - r.computed, r.seq)


def plan_budget(
    view: ServingView,
    budget: int,
    rule: Rule = Rule.FCFS,
    with_decodes: bool = True,
    admission: Admission = Admission.SKIP,
    *,
    chunk_cap: int = 0,
    whole_chunks: bool = False,
    free_slots: int | None = None,
    order: Sequence[Request] | None = None,
) -> Plan:
    """The shared planner: all decodes, then prefill chunks by ``rule`` within ``budget`` tokens.

    With ``with_decodes=False`` the decodes wait this iteration and the whole budget
    goes to prefill (prefill-first engines).  ``admission`` decides whether a waiting prompt
    that cannot start blocks the ones after it in ``rule``'s order (see :class:`Admission`).

    The keywords are engine knobs (vLLM V1's, ``baselines/vllm_v1.py``); their defaults change
    nothing.  ``chunk_cap``: the most prefill tokens one prompt gets this iteration, 0 for no cap
    (``long_prefill_token_threshold``).  ``whole_chunks``: a prompt not yet started gets its
    chunk (its remaining prompt, or ``chunk_cap`` if smaller) whole or not at all; one whose chunk
    exceeds the tokens left cannot start, as one without KV room (``enable_chunked_prefill``
    off).  ``free_slots``: the batch slots new prompts may take, in place of the view's (an
    admission cap below ``max_num_seqs``: ``max_num_active_seqs``).  ``order``: the lookahead in
    the order to serve it, a policy's own (the fairness baselines'), in place of ``rule``'s.
    """
    n_dec = view.num_decode if with_decodes else 0
    left = budget - n_dec
    plan = Plan(decode=n_dec > 0)
    if left <= 0 or not view.queue:
        return plan
    bs = view.block_size
    free = view.free_blocks
    slots = view.free_slots if free_slots is None else free_slots
    stop = admission is Admission.STOP
    admitting = True
    for req in rule_order(view, rule) if order is None else order:
        running = req.running
        if not (running or admitting):
            continue
        if not may_prefill(bs, req, free, slots):
            if stop and not running:
                admitting = False  # it ends admission: the prompts behind it wait
            continue
        n = req.target - req.computed
        if chunk_cap and n > chunk_cap:
            n = chunk_cap
        if n > left:
            if whole_chunks and not running:
                if stop:
                    admitting = False
                continue
            n = left
        need = blocks_needed(bs, req, n)
        if need > free:  # a running prompt: the chunk that fits
            n = tokens_fitting(bs, req, free)
            need = blocks_needed(bs, req, n)
        plan.chunks.append((req, n))
        left -= n
        free -= need
        if not running:
            slots -= 1
        if left <= 0:
            break
    if stop and not plan.chunks and not view.num_decode and not view.num_prefilling:
        # Nothing runs, so the blocked prompt (which fits the empty cache: the core rejects any that
        # cannot) waits only on prefix blocks other queued prompts pin. vLLM pins none and would evict
        # them; chunkgym keeps them, so rather than idle, the next prompt that fits starts.
        return plan_budget(
            view,
            budget,
            rule,
            with_decodes,
            Admission.SKIP,
            chunk_cap=chunk_cap,
            whole_chunks=whole_chunks,
            free_slots=free_slots,
            order=order,
        )
    return plan


def plan_latency(view: ServingView, plan: Plan) -> float:
    """The cost model's prediction for ``plan`` in the current state (seconds)."""
    n_dec = view.num_decode if plan.decode else 0
    return view.predict_latency(
        n_dec,
        view.decode_context if n_dec else 0,
        [n for _, n in plan.chunks],
        [r.computed for r, _ in plan.chunks],
    )
