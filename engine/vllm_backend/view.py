"""The :class:`~envs.serving.scheduling.ServingView` over a vLLM scheduler's state.

vLLM keeps the running requests (decodes and partial prefills), the waiting queue and the
KV block pool; chunkgym's features, masks and planners read the view protocol.  This module
maps one onto the other without importing vLLM: it reads vLLM requests through the few
attributes of :class:`EngineRequest`, and keeps per request a :class:`VllmRequest` (an
:class:`~envs.serving.request.Request` plus vLLM's id) carrying what vLLM does not track the
way the policies need it: the TTFT bound from the cost model, token times against the SLO,
and the queue order (arrival, preempted requests first, as the simulator's core).

The scheduler calls :meth:`VllmView.add` for each new request, :meth:`VllmView.refresh` before
each plan, and :meth:`VllmView.observe` with each step's emitted tokens and latency.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

from envs.serving.core import LATENCY_EWMA_ALPHA
from envs.serving.cost_model import CostModel
from envs.serving.metrics import SLO
from envs.serving.request import Request, Status
from envs.serving.slo_classes import resolve_classes, slo_class_names
from envs.serving.traffic import TrafficStats
from envs.serving.workloads.trace import DEFAULT_TENANT, label_problem

log = logging.getLogger(__name__)


class EngineRequest(Protocol):
    """The attributes of ``vllm.v1.request.Request`` the view reads."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_placeholders: int
    num_preemptions: int
    max_tokens: int
    is_prefill_chunk: bool
    priority: int
    sampling_params: Any  # its ``extra_args`` (a dict or None) may name the tenant

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_tokens_with_spec(self) -> int: ...


class VllmRequest(Request):
    """A chunkgym request mirroring one vLLM request (``target``/``computed`` refreshed each step)."""

    __slots__ = ("request_id", "engine", "first_token_s", "last_token_s")

    def __init__(self, rid: int, engine: EngineRequest) -> None:
        super().__init__(rid, engine.arrival_time, engine.num_prompt_tokens, engine.max_tokens)
        self.request_id = engine.request_id
        self.engine = engine
        self.first_token_s = self.last_token_s = -math.inf


class VllmView:
    """The serving state a policy sees, rebuilt from vLLM's scheduler before every plan."""

    def __init__(
        self,
        slo: SLO,
        cost_model: CostModel,
        lookahead: int,
        block_size: int,
        total_blocks: int,
        max_num_seqs: int,
        max_model_len: int,
        tenants: bool = False,
    ) -> None:
        self.slo = slo
        # With ``tenants``: each request's class from its vLLM priority, its tenant from its
        # ``extra_args`` (PluginConfig.tenants); the classes resolved on this cost model.
        self.tenants = tenants
        self.classes_by_priority = (
            {c.priority: (name, c) for name, c in resolve_classes(slo_class_names(), cost_model).items()}
            if tenants
            else {}
        )
        self.cost_model = cost_model
        self.lookahead_len = lookahead
        self.block_size = block_size
        self.total_blocks = total_blocks
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # Seconds per prefill token on an idle engine, from a 1k prompt (as the simulator's core).
        self.prefill_s_per_token = cost_model.prefill_time_alone(1024) / 1024
        self.now = 0.0
        self.queue: list[VllmRequest] = []
        self.lookahead: list[VllmRequest] = []
        self.decodes: list[VllmRequest] = []
        self.num_decode = self.num_decode_doomed = self.decode_context = self.num_prefilling = 0
        self.free_blocks = self.free_slots = 0
        self.last_decode_time = -math.inf
        self.last_latency = self.latency_ewma = 0.0
        self.requests: dict[str, VllmRequest] = {}
        self._next_rid = 0
        self._preempt_seq = 0
        self.traffic = TrafficStats()  # arrival rate, prefix hits, prompt and output lengths seen so far

    # ---- bookkeeping, called by the scheduler --------------------------------------------
    def add(self, engine: EngineRequest, cached_tokens: int) -> None:
        """A new request arrived; ``cached_tokens`` of its prompt are in the prefix cache now."""
        if engine.request_id in self.requests:
            return
        req = VllmRequest(self._next_rid, engine)
        self._next_rid += 1
        slo = self.slo
        if self.tenants:
            req.tenant = tenant_of(engine)
            named = self.classes_by_priority.get(engine.priority)
            if named is not None:
                req.slo_class, cls = named
                slo, req.weight, req.priority = cls.slo, cls.weight, cls.priority
        req.ttft_bound = slo.ttft_bound(self.cost_model.prefill_time_alone(req.prompt_len))
        req.tpot_bound, req.stall_bound = slo.tpot_s, slo.stall_s
        req.deadline = req.arrival + req.ttft_bound
        req.prefix_hit = cached_tokens
        self.requests[req.request_id] = req
        self.traffic.arrive(req.arrival, req.prompt_len)
        self.traffic.prefix_hit(cached_tokens / req.prompt_len)

    def refresh(
        self,
        now: float,
        running: Sequence[EngineRequest],
        waiting: Iterable[EngineRequest],
        free_blocks: int,
        free_slots: int,
        cached_tokens: Callable[[EngineRequest], int],
    ) -> None:
        """Rebuild the view: ``running`` and ``waiting`` as vLLM holds them, ``free_blocks`` in its
        pool, ``free_slots`` for new requests; ``cached_tokens`` looks up a waiting prompt's prefix hit."""
        self.now = now
        seen: dict[str, VllmRequest] = {}
        queue: list[VllmRequest] = []
        decodes: list[VllmRequest] = []
        context = need = 0
        bs = self.block_size
        for engine in running:
            req = self._mirror(engine, seen)
            req.computed = engine.num_computed_tokens
            if engine.is_prefill_chunk:
                req.running = True
                req.target = engine.num_tokens + engine.num_output_placeholders
                queue.append(req)
            else:
                req.status = Status.DECODING
                decodes.append(req)
                context += req.computed + 1
                need += req.computed % bs == 0
        for engine in waiting:
            req = self._mirror(engine, seen)
            req.status = Status.WAITING
            req.running = False
            req.target = engine.num_tokens
            req.computed = engine.num_computed_tokens
            if engine.num_preemptions != req.preemptions:  # preempted: first in line, as the core's queue
                req.preemptions = engine.num_preemptions
                self._preempt_seq += 1
                req.seq = -self._preempt_seq
            queue.append(req)
        for request_id, req in self.requests.items():  # vLLM no longer holds them: finished or aborted
            if request_id not in seen:
                self.traffic.finish(req.generated)
        self.requests = seen
        queue.sort(key=_seq)
        self.queue = queue
        self.lookahead = queue[: self.lookahead_len]
        for req in self.lookahead:
            if not req.running and req.computed == 0:
                req.computed = cached_tokens(req.engine)
        for req in queue:
            if req.generated == 0 and not req.violated and now - req.arrival > req.ttft_bound:
                req.violated = True
        self.decodes = decodes
        self.num_decode = len(decodes)
        self.num_decode_doomed = sum(r.violated for r in decodes)
        self.decode_context = context
        self.num_prefilling = len(running) - len(decodes)
        self.free_blocks = max(0, free_blocks - need)
        self.free_slots = free_slots

    def _mirror(self, engine: EngineRequest, seen: dict[str, VllmRequest]) -> VllmRequest:
        req = self.requests.get(engine.request_id)
        if req is None:  # added without add() (a resumed session): no prefix-hit sample
            self.add(engine, 0)
            req = self.requests[engine.request_id]
        req.engine = engine
        seen[req.request_id] = req
        return req

    def observe(self, emitted: Iterable[tuple[str, int]], t: float, latency: float) -> None:
        """A step ended at ``t`` after ``latency`` s, emitting ``(request id, tokens)``: token times
        against the SLO (TTFT, stalls), the last decode emission, the latency EWMA."""
        self.last_latency = latency
        self.latency_ewma += LATENCY_EWMA_ALPHA * (latency - self.latency_ewma)
        for request_id, n in emitted:
            req = self.requests.get(request_id)
            if req is None or n == 0:
                continue
            if req.generated == 0:
                req.first_token_s = t
                if t - req.arrival > req.ttft_bound:
                    req.violated = True
            else:
                self.last_decode_time = t
                if t - req.last_token_s > req.stall_bound:
                    req.violated = True
            req.generated += n
            req.last_token_s = t

    # ---- the rest of the ServingView protocol ---------------------------------------------
    def tokens_generated(self, req: Request) -> int:
        """Output tokens ``req`` has emitted so far (counted by :meth:`observe` every step)."""
        return req.generated

    def min_tpot_slack(self) -> float:
        """Least ``B * (tokens - 1) - (last - first token time)`` of streams still able to meet
        their SLO and past their first decode step; inf if none."""
        tpot = self.slo.tpot_s
        slacks = [
            tpot * (r.generated - 1) - (r.last_token_s - r.first_token_s)
            for r in self.decodes
            if r.generated > 1 and not r.violated
        ]
        return min(slacks, default=math.inf)

    def predict_latency(
        self, num_decode: int, decode_context: int, query_lens: Sequence[int], computed_lens: Sequence[int]
    ) -> float:
        return self.cost_model.iteration_time(num_decode, decode_context, query_lens, computed_lens)

    @property
    def latency_monotone(self) -> bool:
        return self.cost_model.monotone


def tenant_of(engine: EngineRequest) -> str:
    """The tenant a request names in ``SamplingParams.extra_args["tenant"]`` (``vllm_xargs`` in the
    OpenAI API); ``default`` without one.  A value that is not a label (docs/tenants.md) is served as
    ``default`` and logged once per value, never dropped: the scheduler cannot refuse a request."""
    extra = getattr(engine.sampling_params, "extra_args", None)
    value = extra.get("tenant") if isinstance(extra, dict) else None
    if value is None:
        return DEFAULT_TENANT
    problem = label_problem(value)
    if problem is None:
        return cast(str, value)
    if len(_WARNED) < 100 and repr(value) not in _WARNED:
        _WARNED.add(repr(value))
        log.warning(
            "request %s: extra_args tenant: %s; served as tenant %r",
            engine.request_id,
            problem,
            DEFAULT_TENANT,
        )
    return DEFAULT_TENANT


_WARNED: set[str] = set()  # bad tenant values logged so far (at most 100)


def mirrored(req: Request) -> VllmRequest:
    """``req`` as the view's mirror of a vLLM request (what a plan over the view names)."""
    if not isinstance(req, VllmRequest):
        raise TypeError(f"the plan names {req!r}, which is not a request of the vLLM view")
    return req


def _seq(req: Request) -> int:
    return req.seq
