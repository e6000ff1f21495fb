"""The scheduling interface every policy speaks: a read-only view in, a plan out.

A :class:`Plan` says, for the next iteration, whether the running decodes step (all
of them, one token each: engines never split the decode batch on purpose, and it
keeps an iteration's cost independent of how many users are streaming) and which
waiting prompts get how many prefill tokens.

:func:`plan_budget` is the shared planner: Sarathi-Serve with budget B, the learned
policy choosing B every step, and the ``adaptive`` heuristic all call it.  Every
running decode is served first and counts against the budget (if decodes alone fill
it, no prefill runs); the rest goes to prefill chunks in the order of an allocation
:class:`Rule`, limited by free KV blocks and the batch-slot limit.  Work is sized by
the tokens left after prefix-cache hits (``Request.remaining_prefill``), never the raw
prompt length.  A prompt starts only when a batch slot and KV blocks for all of its
remaining prefill are free (vLLM's admission rule), so partial prefills rarely wait
on memory; the core preempts if they ever deadlock.

Writing a new policy: subclass :class:`Policy`, implement ``plan(view)`` (usually one
call to :func:`plan_budget`), and add a YAML file under ``conf/policy/``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from envs.serving.request import Request

if TYPE_CHECKING:
    from envs.serving.core import ServingCore


class Rule(IntEnum):
    """How the prefill share of the budget is allocated among waiting prompts."""

    FCFS = 0  # partly prefilled prompts first, then by arrival (Sarathi-Serve, vLLM)
    SHORTEST_FIRST = 1  # fewest remaining prefill tokens first
    LEAST_SLACK = 2  # least TTFT slack first: deadline minus estimated remaining prefill time
    SLACK_DOOMED_LAST = 3  # least slack first among prompts that can still meet TTFT; missed ones last


RULE_NAMES = tuple(r.name.lower() for r in Rule)


@dataclass
class Plan:
    """One iteration's work: step every decode (or none), plus prefill chunks."""

    decode: bool
    chunks: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


class View:
    """A read-only window onto the serving state, handed to policies each iteration.

    It is a thin façade over the live core (no copies, so it costs nothing per
    iteration); policies must not mutate what it exposes.
    """

    __slots__ = ("_core",)

    def __init__(self, core: ServingCore) -> None:
        self._core = core

    @property
    def now(self) -> float:
        return self._core.now

    @property
    def num_decode(self) -> int:
        """Requests streaming tokens (the decode group)."""
        return self._core.decode.n

    @property
    def decode_context(self) -> int:
        """KV tokens the decode group's next step attends to, summed."""
        return self._core.decode.context_sum(self._core.decode.clock)

    @property
    def last_decode_time(self) -> float:
        """When the decode group last emitted tokens (-inf if never)."""
        return self._core.decode.last_time

    @property
    def queue(self) -> Sequence[Request]:
        """Prompts waiting for prefill, in queue order (preempted ones first, then by arrival)."""
        return self._core.queue

    @property
    def lookahead(self) -> Sequence[Request]:
        """The first ``lookahead_len`` queued prompts: the ones allocation rules reorder."""
        return self._core.lookahead()

    @property
    def free_blocks(self) -> int:
        """KV blocks available to prefill after reserving the decodes' next step."""
        core = self._core
        return core.kv.free - core.decode_block_need()

    @property
    def total_blocks(self) -> int:
        return self._core.kv.total

    @property
    def block_size(self) -> int:
        return self._core.kv.block_size

    @property
    def free_slots(self) -> int:
        """Batch slots left for prompts not yet running (max_num_seqs minus running)."""
        return self._core.free_slots()

    def blocks_needed(self, req: Request, tokens: int) -> int:
        """Extra private KV blocks ``req`` needs to compute ``tokens`` more tokens."""
        return self._core.blocks_needed(req, tokens)

    @property
    def core(self) -> ServingCore:
        """The live core, for features that need more (read-only by convention)."""
        return self._core


class Policy(ABC):
    """A scheduler: turns a view into a plan, once per iteration."""

    name: str = "policy"

    def reset(self, core: ServingCore) -> None:  # noqa: B027 - optional hook
        """Called before a run; ``core`` exposes the cost model and SLO for policies that predict."""

    @abstractmethod
    def plan(self, view: View) -> Plan: ...


def rule_order(view: View, rule: Rule) -> Sequence[Request]:
    """The lookahead of waiting prompts, in the order ``rule`` serves them."""
    cands = view.lookahead
    if len(cands) <= 1:
        return cands
    if rule == Rule.FCFS:
        return sorted(cands, key=_fcfs_key)
    if rule == Rule.SHORTEST_FIRST:
        return sorted(cands, key=_remaining_key)
    per_token = view.core.prefill_s_per_token
    if rule == Rule.LEAST_SLACK:
        return sorted(cands, key=lambda r: r.deadline - per_token * r.remaining_prefill)
    return sorted(cands, key=lambda r: (r.violated, r.deadline - per_token * r.remaining_prefill))


def _fcfs_key(r: Request) -> tuple[bool, int]:
    return (not r.running, r.seq)


def _remaining_key(r: Request) -> tuple[int, int]:
    return (r.target - r.computed, r.seq)


def plan_budget(view: View, budget: int, rule: Rule = Rule.FCFS, with_decodes: bool = True) -> Plan:
    """The shared planner: all decodes, then prefill chunks by ``rule`` within ``budget`` tokens.

    With ``with_decodes=False`` the decodes wait this iteration and the whole budget
    goes to prefill (prefill-first engines).
    """
    n_dec = view.num_decode if with_decodes else 0
    left = budget - n_dec
    plan = Plan(decode=n_dec > 0)
    if left <= 0 or not view.queue:
        return plan
    core = view.core
    free = view.free_blocks
    slots = view.free_slots
    for req in rule_order(view, rule):
        if not core.may_prefill(req, free, slots):
            continue
        n = min(req.target - req.computed, left)
        need = core.blocks_needed(req, n)
        if need > free:  # a running prompt: the chunk that fits
            n = core.tokens_fitting(req, free)
            need = core.blocks_needed(req, n)
        plan.chunks.append((req, n))
        left -= n
        free -= need
        if not req.running:
            slots -= 1
        if left <= 0:
            break
    return plan


def plan_latency(view: View, plan: Plan) -> float:
    """The cost model's prediction for ``plan`` in the current state (seconds)."""
    core = view.core
    n_dec = core.decode.n if plan.decode else 0
    return core.cost_model.iteration_time(
        n_dec,
        view.decode_context if n_dec else 0,
        [n for _, n in plan.chunks],
        [r.computed for r, _ in plan.chunks],
    )
