"""vLLM V1's own scheduler (the pinned vLLM 0.32) under its scheduling knobs, so a simulation of a
flag setting schedules what ``vllm serve`` with those flags would."""

from __future__ import annotations

import math
from dataclasses import dataclass

from baselines.fairness import urgent_order
from envs.serving.request import Request
from envs.serving.scheduling import Admission, Plan, Policy, Preemption, Rule, ServingView, plan_budget
from envs.serving.stretches import (
    BudgetChunk,
    ChunkFollower,
    FollowsChunks,
    Steady,
    SteadyFollower,
    stretch_head,
)


class VllmV1(Policy, FollowsChunks):
    """``vllm.v1.core.sched.scheduler.Scheduler.schedule()`` with the flags of the same names.

    What vLLM does each step (``vllm/v1/core/sched/scheduler.py``; the knobs are
    ``SchedulerConfig``'s, ``vllm/config/scheduler.py``):

    * The step's token budget is ``max_num_batched_tokens`` (``max_num_scheduled_tokens``, equal to
      it without speculative decoding).  Running requests come first, in running order: a decode
      takes 1 token, a partly prefilled prompt ``min(its rest, threshold, tokens left)``.  Then
      waiting requests in FCFS order, while tokens are left; the first that cannot start ends
      admission for the step (a ``break``): no KV room for its whole prompt
      (``scheduler_reserve_full_isl``, default on), or the admission cap below.
    * ``long_prefill_token_threshold`` T caps every request's tokens in the step, running or new
      (0: no cap), but only when more than one request is running or waiting: a request alone has
      nobody to starve.  With ``long_prefill_token_threshold_adaptive`` the cap is at least the fair
      share ``max_num_batched_tokens // (running + waiting)``.  Both are fixed at the step's start.
    * ``enable_chunked_prefill`` off: a waiting prompt whose tokens (after the cap) exceed the
      tokens left does not start, and admission ends there (a ``break``, not a skip).  A prompt
      already running still takes ``min(rest, cap, left)``.  vLLM refuses to start with chunking off
      unless ``max_num_batched_tokens >= max_model_len``, so a lone prompt always fits.
    * ``max_num_active_seqs`` A: a waiting prompt starts only while fewer than A requests run
      (running = decoding or prefilling).  Unset, the cap is ``max_num_seqs``, chunkgym's
      ``ServingConfig.max_num_seqs`` (the view's batch slots): it is a setting of the simulated
      engine, not of this policy.
    * ``scheduling_policy`` (``--scheduling-policy``): ``"fcfs"`` (the default) or ``"priority"``.
      Under ``priority`` the waiting queue is a heap ordered by ``(priority, arrival_time,
      request_id)`` (``vllm/v1/core/sched/request_queue.py``, ``PriorityRequestQueue``;
      ``vllm/v1/request.py``, ``Request.__lt__``): a request's priority is its SLO class's
      (``conf/slo_class``: interactive 0, standard 1, batch 2; 0 without a class), a preempted
      request goes back into the heap at its own place (not to the front), and running requests still
      come first in running order, with the same loop and the same ``break``.  When the decodes need
      KV blocks the victim is ``max(running, key=(priority, arrival_time))`` (``scheduler.py``,
      ``schedule()``), not the newest running request: this policy's ``preemption`` is
      ``Preemption.LOWEST_PRIORITY``, which the core reads.

    :meth:`reset` refuses the settings vLLM's ``SchedulerConfig`` refuses, against the view's limits:
    ``max_num_batched_tokens < max_num_seqs``, ``max_num_active_seqs > max_num_seqs``,
    ``long_prefill_token_threshold > max_model_len``, chunking off with
    ``max_num_batched_tokens < max_model_len``.

    Where chunkgym's model of a step differs from vLLM's:

    * Decodes step all together or not at all, and first: chunkgym serves every decode, then the
      partly prefilled prompts in arrival order; vLLM serves running requests in running
      (admission) order, where a decode behind mid-prefill prompts would get nothing if their
      chunks used up the budget.  That never happens, so the two agree: the requests ahead of a
      decode ask for no more than they took in the step it started (when a cap binds, a prompt
      that was cut asks for at most the cap again), unless the adaptive floor raised the cap, and
      under the floor every running request's tokens fit, ``n_prefill * (B // n) + n_decode <= B``
      for ``n >= n_prefill + n_decode`` requests.  So a step's budget runs out only at a prompt
      behind every decode, where chunkgym's order cuts the same chunk (tests/test_vllm_v1_knobs.py
      checks every plan of generated runs against a transcription of vLLM's loop).
    * KV: a running prompt short of KV room gets the chunk that fits, where vLLM preempts its newest
      running request and admits no waiting one in that step.  Equal whenever the cache never runs
      out.
    * Only the first ``ServingConfig.lookahead`` queued prompts (64) may start in an iteration;
      vLLM reads its whole queue.  Equal unless more than that many would start in one step: set
      the lookahead to ``max_num_seqs`` or more to rule it out.
    * Under ``priority``, the waiting prompts considered are the lookahead's count of the whole
      queue's smallest ``(priority, arrival, rid)`` (:func:`~baselines.fairness.urgent_order`), where
      vLLM pops its whole heap: equal unless more than that many would start in one step.
    * No speculative decoding, no async scheduling, no encoder inputs, pipeline parallelism or
      KV connectors; prefix-cache hits are chunkgym's (``Request.remaining_prefill``).

    With the threshold at 0, chunking on, no active cap and ``fcfs`` this plans exactly what
    ``Sarathi(max_num_batched_tokens, admission="stop")`` plans (``conf/policy/vllm_v1_8192.yaml``).
    """

    def __init__(
        self,
        max_num_batched_tokens: int = 8192,
        long_prefill_token_threshold: int = 0,
        long_prefill_token_threshold_adaptive: bool = False,
        enable_chunked_prefill: bool = True,
        max_num_active_seqs: int | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        _check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        _check_int("long_prefill_token_threshold", long_prefill_token_threshold, 0)
        _check_bool("long_prefill_token_threshold_adaptive", long_prefill_token_threshold_adaptive)
        _check_bool("enable_chunked_prefill", enable_chunked_prefill)
        if max_num_active_seqs is not None:
            _check_int("max_num_active_seqs", max_num_active_seqs, 1)
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {scheduling_policy!r}"
            )
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.long_prefill_token_threshold_adaptive = long_prefill_token_threshold_adaptive
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_num_active_seqs = max_num_active_seqs
        self.scheduling_policy = scheduling_policy
        self.priority = scheduling_policy == "priority"
        if self.priority:
            self.preemption = Preemption.LOWEST_PRIORITY  # vLLM's victim under the priority policy
        name = f"vllm_v1_{max_num_batched_tokens}"
        if long_prefill_token_threshold:
            name += f"_lpt{long_prefill_token_threshold}" + (
                "a" if long_prefill_token_threshold_adaptive else ""
            )
        if not enable_chunked_prefill:
            name += "_nochunk"
        if max_num_active_seqs is not None:
            name += f"_active{max_num_active_seqs}"
        if self.priority:
            name += "_priority"
        self.name = name

    def reset(self, view: ServingView) -> None:
        budget, active = self.max_num_batched_tokens, self.max_num_active_seqs
        if budget < view.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({view.max_num_seqs}), as vLLM requires"
            )
        if active is not None and active > view.max_num_seqs:
            raise ValueError(
                f"max_num_active_seqs ({active}) cannot be greater than max_num_seqs ({view.max_num_seqs})"
            )
        if self.long_prefill_token_threshold > view.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot be greater than "
                f"max_model_len ({view.max_model_len})"
            )
        if not self.enable_chunked_prefill and budget < view.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({view.max_model_len}): "
                "vLLM refuses that with enable_chunked_prefill off (lower max_model_len or raise the budget)"
            )

    def chunk_cap(self, view: ServingView) -> int:
        """The step's per-request token cap (0: none): the threshold, unless one request is all there
        is, floored at the fair share of the budget when adaptive."""
        cap = self.long_prefill_token_threshold
        if not cap:
            return 0
        eligible = view.num_decode + len(view.queue)  # vLLM's running plus waiting requests
        if eligible <= 1:
            return 0
        if self.long_prefill_token_threshold_adaptive:
            return max(cap, self.max_num_batched_tokens // eligible)
        return cap

    def plan(self, view: ServingView) -> Plan:
        active = self.max_num_active_seqs
        return plan_budget(
            view,
            self.max_num_batched_tokens,
            Rule.FCFS,
            admission=Admission.STOP,
            chunk_cap=self.chunk_cap(view),
            whole_chunks=not self.enable_chunked_prefill,
            free_slots=(
                None
                if active is None
                else min(view.free_slots, active - view.num_decode - view.num_prefilling)
            ),
            order=urgent_order(view, priority_key) if self.priority and view.queue else None,
        )

    def follow(self, view: ServingView, plan: Plan) -> ChunkFollower | None:
        """Sarathi's follower without a threshold (the head, the only prompt mid-prefill, takes what
        the decodes leave; chunking off and the active cap touch only prompts not yet started);
        with one, :class:`CappedChunk`.  Under ``priority`` too: the head is the only prompt
        mid-prefill, and running prompts come first in either order, so its chunk (``min(rest, cap,
        left)``) and whether tokens are left for a waiting prompt do not depend on the waiting order
        (tests/test_fairness_baselines.py checks the runs with and without stretches agree)."""
        if stretch_head(view, plan, Rule.FCFS) is None:
            return None
        if not self.long_prefill_token_threshold:
            return BudgetChunk(view, self.max_num_batched_tokens)
        return CappedChunk(view, self)


@dataclass(frozen=True)
class CappedChunk(SteadyFollower):
    """The follower under a threshold.  The head, the only prompt mid-prefill and first in FCFS
    order, gets ``min(rest, cap, left)`` (left: the budget less the decodes); the loop has checked
    the rest is larger.  If the cap does not bind, the head takes everything left, as under
    Sarathi; if it binds and the head is the only queued prompt, it takes the cap and nothing else
    runs; otherwise the tokens left over would go to a waiting prompt (or not), so 0: ask ``plan``.
    The cap depends on the decode count and the queue's length alone, which only arrivals change
    besides the decodes (the loop asks ``follow`` again after arrivals), so the answer holds while
    the decode count does."""

    view: ServingView
    policy: VllmV1

    def __call__(self) -> tuple[int, float | None]:
        view = self.view
        left = self.policy.max_num_batched_tokens - view.num_decode
        cap = self.policy.chunk_cap(view)
        if not cap or cap >= left:
            return left, None
        return (cap if len(view.queue) == 1 else 0), None

    def steady(self) -> Steady | None:
        tokens, _ = self()
        return Steady(tokens, math.inf, tokens) if tokens > 0 else None


SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's ``--scheduling-policy`` values (``SchedulingPolicy``)."""


def priority_key(r: Request) -> tuple[int, float, int]:
    """vLLM's priority heap order, ``Request.__lt__``: priority, then arrival time, then request id."""
    return (r.priority, r.arrival, r.rid)


def _check_int(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
