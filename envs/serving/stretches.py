"""Chunk stretches: the simulator's way of running a long prompt's middle chunks without planning each.

A policy whose plan, while one running prompt (the head, :func:`stretch_head`) is prefilling and
nothing but its chunks, the decodes and time change the state, is "every decode plus so many
tokens of the head" implements :class:`FollowsChunks`: after ``plan`` it hands the loop a
:data:`ChunkFollower` that names those tokens, and the loop runs such iterations without asking
``plan`` (:meth:`~envs.serving.loop.ServingLoop.run_until`).  A :class:`SteadyFollower` can also say
for how long its answer holds, so the simulator's clock books a segment of them at once.

This is the simulator's business, not the scheduling interface's: a policy need not offer a
follower, and a real engine never asks for one.  Like the interface, this module imports no
implementation, so policies implement it; tests/test_shortcuts.py checks a run that follows chunks
is the run that plans each, bit for bit.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from envs.serving.request import Request
from envs.serving.scheduling import Plan, Rule, ServingView, remaining_key

ChunkFollower = Callable[[], tuple[int, float | None]]
"""A :meth:`FollowsChunks.follow` function: the head's prefill tokens in the next iteration (0: ask
``plan``), with that iteration's price if the policy computed it (as :attr:`Plan.latency`)."""


class FollowsChunks(ABC):
    """A policy that can name its chunk stretches' plans without planning them (mixed into a
    :class:`~envs.serving.scheduling.Policy`)."""

    @abstractmethod
    def follow(self, view: ServingView, plan: Plan) -> ChunkFollower | None:
        """Called after ``plan`` ran: where its last chunk's prompt (the head, see
        :func:`stretch_head`) is still prefilling and first in this policy's order, return a function
        that says how many prefill tokens this policy's plan would give the head in each next
        iteration, as long as nothing but the head's chunks, the decodes and time changes the state
        (no arrival, preemption, prefix release or other prompt's tokens come between two calls), and
        the chunk leaves the head more to prefill and its KV fits: the plan would then be every
        decode plus that one chunk, so the loop runs it without asking.  The function returns 0
        where it cannot say without planning, and the loop asks ``plan`` again.  Once arrivals have
        been admitted during a stretch, the loop calls this again, with the iteration that ran last
        as ``plan``, for a function that holds from the new state on (or None: the stretch ends).
        None: ``plan`` is asked in the next iteration."""


class Steady(NamedTuple):
    """How a :class:`SteadyFollower`'s answers go on while the decode count stays what it is."""

    tokens: int  # the head's chunk in this iteration and each next one...
    max_latency: float  # ...while the iteration's price (the cost model's) is at most this (inf: any)
    room: int  # ...and a chunk of this many tokens (>= tokens) would fit the head's rest and the KV room


class SteadyFollower(ABC):
    """A :data:`ChunkFollower` that can say how long its answer holds, so the simulator may run
    that many iterations of a stretch at once
    (:meth:`~envs.serving.simulator.CostModelClock.run_segment`)."""

    @abstractmethod
    def __call__(self) -> tuple[int, float | None]: ...

    @abstractmethod
    def steady(self) -> Steady | None:
        """Asked right after a call answered some tokens: its answers from that iteration on, as
        long as only the head's chunks, the decodes' steps and time change the state (the decode
        count included); None where it cannot say without being asked each iteration."""


@dataclass(frozen=True)
class BudgetChunk(SteadyFollower):
    """The follower under a fixed token budget: the head gets what the decodes leave of ``budget``;
    that changes only with the decode count."""

    view: ServingView
    budget: int

    def __call__(self) -> tuple[int, float | None]:
        return self.budget - self.view.num_decode, None

    def steady(self) -> Steady:
        tokens = self.budget - self.view.num_decode
        return Steady(tokens, math.inf, tokens)


STRETCH_RULES = (Rule.FCFS, Rule.SHORTEST_FIRST)
"""Rules under which a running prompt first in the order stays first while it alone gets prefill
tokens: started prompts keep their arrival order, and the head's remaining prefill only shrinks."""


def stretch_head(view: ServingView, plan: Plan, rule: Rule) -> Request | None:
    """The prompt a chunk stretch can follow after ``plan`` ran in ``view``: its last chunk's, when
    that prompt has more than that chunk's tokens left and is first in ``rule``'s order in a way
    that lasts while only it gets prefill tokens (see :data:`STRETCH_RULES`; FCFS: it is the only
    started prompt); None otherwise."""
    if not plan.chunks or rule not in STRETCH_RULES:
        return None
    head, n = plan.chunks[-1]
    if not head.running or head.target - head.computed <= n:
        return None  # done, or its next chunk as large as this one would be its last: no stretch
    if rule is Rule.FCFS:
        first = view.num_prefilling == 1
    else:
        first = min(view.lookahead, key=remaining_key) is head
    return head if first else None
