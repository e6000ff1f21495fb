"""A vLLM V1 scheduler that runs a chunkgym policy: ``--scheduler-cls
engine.vllm_backend.scheduler.ChunkgymScheduler``.

At each ``schedule()`` it rebuilds the :class:`~engine.vllm_backend.view.VllmView` from vLLM's
running and waiting requests and its KV block pool, asks the policy for a
:class:`~envs.serving.scheduling.Plan`, and has vLLM's own scheduling pass carry it out:

* the step's token budget (``max_num_scheduled_tokens``) is the plan's tokens, at most the
  configured ``max_num_batched_tokens`` (which sizes the model runner's buffers);
* the planned waiting prompts move to the front of the waiting queue, in the plan's order;
* every request's tokens are capped at its planned chunk (decodes: all or none, as the plan
  says; unplanned prompts get none), through the per-request hook vLLM applies after its own
  limits (``_reserve_prefill_lookahead``), so vLLM's limits (KV blocks, max_model_len,
  ``long_prefill_token_threshold``) can only shrink a chunk, never grow it.

KV allocation, prefix caching and preemption stay vLLM's.  The interface is not public
(vLLM says so), hence the pinned version range of the ``[vllm]`` extra and the tests in
``tests/vllm/``.  One class name serves both of vLLM's modes: with async scheduling on (vLLM's
default on GPUs; the CPU platform turns it off) it builds :class:`ChunkgymAsyncScheduler`, the
same scheduler over ``AsyncScheduler``, since a plain ``Scheduler`` subclass there loses
vLLM's output placeholders (a reported ~78% latency cost).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from engine.vllm_backend.config import load_plugin, plugin_config
from engine.vllm_backend.view import VllmView, mirrored
from envs.serving.scheduling import Plan

logger = init_logger(f"vllm.{__name__}")  # under "vllm", so vLLM's log setup prints it


@dataclass
class StepRecord:
    """One ``schedule()``: what the policy planned and what vLLM scheduled (request id -> tokens)."""

    start_s: float  # time.time() when the plan was made
    planned: dict[str, int]  # decodes at their one step's tokens
    scheduled: dict[str, int]
    num_decode: int  # decodes vLLM scheduled
    decode_context: int  # KV tokens they attend to, summed
    chunks: list[tuple[int, int]]  # prefill chunks vLLM scheduled: (query tokens, tokens already in KV)
    end_s: float = math.nan  # time.time() when its output came back
    emitted: dict[str, int] = field(default_factory=dict)  # tokens each request emitted at end_s

    @property
    def agrees(self) -> bool:
        """Whether vLLM scheduled exactly the plan."""
        return self.planned == self.scheduled


class ChunkgymScheduler(Scheduler):
    """vLLM's scheduler, driven by a chunkgym policy (see the module docstring)."""

    max_num_scheduled_tokens: int  # vLLM's: the step's token budget, read by every schedule()

    def __new__(cls, *args: Any, **kwargs: Any) -> ChunkgymScheduler:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if cls is ChunkgymScheduler and vllm_config.scheduler_config.async_scheduling:
            return object.__new__(ChunkgymAsyncScheduler)
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError(
                f"chunkgym's scheduler orders the waiting queue itself: run vLLM with --scheduling-policy fcfs, "
                f"not {self.policy.value!r}"
            )
        plugin = load_plugin(plugin_config(self.vllm_config.additional_config))
        self.chunkgym_policy = plugin.policy
        self.view = VllmView(
            plugin.slo,
            plugin.cost_model,
            plugin.lookahead,
            self.block_size,
            self.kv_cache_manager.block_pool.num_gpu_blocks - 1,  # less vLLM's null block
            self.max_num_running_reqs,
            self.max_model_len,
            plugin.tenants,
        )
        self.chunkgym_policy.reset(self.view)
        self.budget_limit: int = self.max_num_scheduled_tokens
        self.steps: list[StepRecord] | None = None  # set to a list to record every step
        self._caps: dict[str, int] | None = None
        self._in_flight: deque[tuple[SchedulerOutput, float, StepRecord | None]] = deque()
        self._last_end = -math.inf
        self._warned_budget = False
        logger.info(
            "chunkgym policy %s, SLO %s (TPOT %.4f s), cost %s, budget limit %d tokens",
            plugin.policy.name,
            plugin.slo.name,
            plugin.slo.tpot_s,
            plugin.cost_model.description.split(":")[0],
            self.budget_limit,
        )

    # ---- vLLM's hooks ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self.view.add(request, self._cached_tokens(request))

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        now = time.time()
        self.view.refresh(
            now,
            self.running,
            (*self.kv_holding_waiting, *self.waiting),
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
            self.max_num_active_reqs - len(self.running) - self.num_waiting_for_streaming_input,
            self._cached_tokens,
        )
        plan = self.chunkgym_policy.plan(self.view)
        caps = self._caps_of(plan)
        waiting = [mirrored(r).engine for r, _ in plan.chunks if not r.running]
        _put_first(self.kv_holding_waiting, waiting)
        _put_first(self.waiting, waiting)
        total = sum(caps.values())
        if total > self.budget_limit and not self._warned_budget:
            self._warned_budget = True
            logger.warning(
                "chunkgym policy %s planned %d tokens, over max_num_batched_tokens=%d: such plans are cut; "
                "raise --max-num-batched-tokens to the policy's largest budget",
                self.chunkgym_policy.name,
                total,
                self.budget_limit,
            )
        self.max_num_scheduled_tokens = min(total, self.budget_limit)
        self._caps = caps
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self._caps = None
        record = self._record(now, caps, out) if self.steps is not None else None
        self._in_flight.append((out, now, record))
        return out

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """vLLM's last per-request limit on a step's tokens; here also the plan's chunk."""
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        return n if self._caps is None else min(n, self._caps.get(request.request_id, 0))

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        t = time.time()
        start, record = t, None
        while self._in_flight:
            out, start, record = self._in_flight.popleft()
            if out is scheduler_output:
                break
        emitted = [(o.request_id, len(o.new_token_ids)) for group in outputs.values() for o in group.outputs]
        if record is not None:
            record.end_s = t
            record.emitted = {request_id: n for request_id, n in emitted if n}
        self.view.observe(emitted, t, t - max(start, self._last_end))
        self._last_end = t
        return outputs

    # ---- helpers -----------------------------------------------------------------------------
    def _cached_tokens(self, request: Any) -> int:
        """Tokens of a waiting prompt vLLM would take from the prefix cache if it started now."""
        if request.num_computed_tokens:
            return int(request.num_computed_tokens)
        return int(self.kv_cache_manager.get_computed_blocks(request)[1])

    def _caps_of(self, plan: Plan) -> dict[str, int]:
        """Tokens per request id the plan allows this step: decodes their next step, or nothing."""
        caps: dict[str, int] = {}
        if plan.decode:
            for req in self.view.decodes:
                e = req.engine
                caps[req.request_id] = (
                    e.num_tokens_with_spec + e.num_output_placeholders - e.num_computed_tokens
                )
        for chunk, n in plan.chunks:
            caps[mirrored(chunk).request_id] = n
        return {k: n for k, n in caps.items() if n > 0}

    def _record(self, now: float, caps: dict[str, int], out: SchedulerOutput) -> StepRecord:
        decodes = {r.request_id for r in self.view.decodes}
        record = StepRecord(now, caps, dict(out.num_scheduled_tokens), 0, 0, [])
        steps = self.steps
        assert steps is not None, "called only while recording"
        for request_id, n in out.num_scheduled_tokens.items():
            before = self.requests[request_id].num_computed_tokens - n  # vLLM advanced it on scheduling
            if request_id in decodes:
                record.num_decode += 1
                record.decode_context += before + n
            else:
                record.chunks.append((n, before))
        steps.append(record)
        return record


class ChunkgymAsyncScheduler(ChunkgymScheduler, AsyncScheduler):
    """:class:`ChunkgymScheduler` over vLLM's ``AsyncScheduler`` (built by it when async scheduling is on)."""


def _put_first(queue: RequestQueue, first: Iterable[Any]) -> None:
    """Move the requests of ``first`` that ``queue`` holds to its front, in that order (FCFS deque)."""
    held = set(queue)
    front = [r for r in first if r in held]
    if not front:
        return
    moved = set(front)
    rest = [r for r in queue if r not in moved]
    assert isinstance(queue, deque), "an FCFS request queue (checked at start)"
    queue.clear()
    queue.extend(front + rest)
