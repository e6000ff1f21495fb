"""Discrete-event simulation of one serving instance: the run loop on a cost-model clock.

No wall clock anywhere: each iteration advances time by the cost model's latency;
an idle engine jumps to the next arrival.  Stretches of decode-only iterations (no
prompt waiting, so every policy's only valid plan is "step the decodes") are advanced
without consulting the policy, up to the next event (arrival, finish, KV-block
shortage), which is what makes an hour-long production trace take seconds; and, since
planning takes no clock time here, the loop runs a policy's followed chunks without asking
it (:attr:`CostModelClock.chunk_clock`, :class:`~envs.serving.stretches.FollowsChunks`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import numpy as np

from envs.serving.core import Batch, ServingConfig, ServingCore
from envs.serving.cost_model import CostModel
from envs.serving.loop import IterationLog, ServingLoop
from envs.serving.metrics import SLO
from envs.serving.request import Request
from envs.serving.specs import HardwareSpec, ModelSpec
from envs.serving.stretches import Steady
from envs.serving.workloads.trace import Trace

FAST_FORWARD_MAX = 4096  # decode-only iterations per fast-forward call
STRETCH_MIN = 16  # stretches that may run this many iterations are computed with numpy
SEGMENT_MIN = 2  # a segment of one iteration is the loop's own, which it runs itself

# End times; latencies and KV blocks used after each (lists, or arrays from the numpy path, turned
# into lists only for a log that records them; the numpy path counts the latter only for such a
# log); the blocks they allocate; and (numpy path) each end minus the one before.
Stretch = tuple[list[float], list[float] | np.ndarray, list[int] | np.ndarray | None, int, np.ndarray | None]


class CostModelClock:
    """The simulator's executor: a batch takes the cost model's latency on a virtual clock.

    ``time_scale``: every iteration takes that multiple of the cost model's latency (1: exactly it),
    as an engine whose speed was measured against its profile runs; the policies still plan with
    the model itself, as they do on that engine.
    """

    def __init__(self, cost_model: CostModel, time_scale: float = 1.0) -> None:
        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
        self.cost = cost_model
        self.time_scale = time_scale

    @property
    def chunk_clock(self) -> CostModelClock:
        """Itself: a plan takes no clock time here, so a stretch need not ask the policy."""
        return self

    def wait_until(self, t: float) -> float:
        """The virtual clock reaches the next arrival at once."""
        return t

    def execute(self, batch: Batch, start: float) -> tuple[float, float]:
        """The batch's cost-model latency; a batch its planner priced (``Batch.latency``) keeps that
        price, the same number: the planner asked the core's cost model, which is this one (see
        :class:`Simulator`), with the same arguments."""
        if batch.latency is not None:
            latency = batch.latency if self.time_scale == 1.0 else batch.latency * self.time_scale
            return start + latency, latency
        chunks = batch.chunks
        queries: Sequence[int]
        computed: Sequence[int]
        if len(chunks) == 1:  # the common shape: no list building
            _, q, c = chunks[0]
            queries, computed = (q,), (c,)
        else:
            queries, computed = [q for _, q, _ in chunks], [c for _, _, c in chunks]
        latency = self.cost.iteration_time(batch.num_decode, batch.decode_context, queries, computed)
        if self.time_scale != 1.0:
            latency *= self.time_scale
        return start + latency, latency

    def chunk_latency(
        self, num_decode: int, decode_context: int, tokens: int, computed: int, price: float | None
    ) -> float:
        """:meth:`execute`'s latency of every decode plus one chunk (see :class:`~envs.serving.loop.ChunkClock`)."""
        if price is None:
            price = self.cost.iteration_time(num_decode, decode_context, (tokens,), (computed,))
        return price if self.time_scale == 1.0 else price * self.time_scale

    def fast_forward(self, core: ServingCore, log: IterationLog) -> bool:
        """Run decode-only iterations back to back while no prompt waits; False if none ran.

        Exactly what :meth:`ServingLoop.step` would do with the only valid plan (step the
        decodes), minus the policy call and the plan validation, up to the next event: an
        arrival, a finish, a KV-block shortage (preemption) or a stall violation.  A long
        stretch is priced and checked with numpy in a few calls (the same float operations
        in the same order, so bit for bit the step-by-step result), a short one in Python.
        """
        dec = core.decode
        if core.queue or not dec.n or dec.joiners:
            return False
        n, clock, now = dec.n, dec.clock, core.now
        t_arr = core.next_arrival_time()
        limit = min(dec.next_finish(), clock + FAST_FORWARD_MAX) - clock
        if limit <= 0 or now >= t_arr:
            return False
        if limit >= STRETCH_MIN and t_arr < math.inf:
            # Latencies grow with the context, so iterations past this one start after the arrival.
            first = self.cost.iteration_time(n, dec.context_sum(clock), (), ()) * self.time_scale
            if first > 0:
                limit = min(limit, int((t_arr - now) / first) + 2)
        if limit >= STRETCH_MIN:
            stretch = self._stretch_numpy(core, limit, t_arr, log.records)
        else:
            stretch = self._stretch_python(core, limit, t_arr)
        ends, latencies, kv_used, blocks, gaps = stretch
        k = len(ends)
        if not k:
            return False
        if log.records:
            assert kv_used is not None, "counted for a log that records them"
            log.extend(
                start=[now, *ends[:-1]],
                latency=_as_list(latencies),
                decode_tokens=[n] * k,
                prefill_tokens=[0] * k,
                prefill_seqs=[0] * k,
                kv_used=_as_list(kv_used),
            )
        core.run_stretch(ends, blocks, gaps)
        return True

    def run_segment(
        self,
        core: ServingCore,
        log: IterationLog,
        head: Request,
        steady: Steady,
        t_arr: float,
        until_s: float,
    ) -> bool:
        """A chunk stretch's iterations (every decode plus ``steady.tokens`` of ``head``) back to back,
        priced in one call (:meth:`~envs.serving.cost_model.CostModel.chunk_iteration_times`, as many
        as could start before the next arrival or deadline at the first one's latency), checked in
        one loop, then booked at once, up to the first one that must not run
        in a segment: one that would start at or after ``t_arr`` or ``until_s``, stall the decodes,
        pass a TTFT deadline, leave the head no tokens, or break ``steady``'s promise (its price over
        ``max_latency``, ``room`` not fitting in the KV left, which ``tokens`` then do), or one after
        the next decode finish (the segment's last); the loop has checked the first.  False, running
        none, where fewer than :data:`SEGMENT_MIN` could run, or a decode has just joined."""
        dec = core.decode
        if dec.joiners:  # their first decode step checks their own gaps
            return False
        tokens, max_latency, room = steady
        n, clock, c = dec.n, dec.clock, head.computed
        limit = min((head.target - c - 1) // tokens, (head.target - c - room) // tokens + 1, FAST_FORWARD_MAX)
        if n:
            limit = min(limit, dec.next_finish() - clock)
        if limit < SEGMENT_MIN:
            return False
        bound, deadline = min(t_arr, until_s), core.next_deadline()
        now, scale, context = core.now, self.time_scale, dec.context_sum(clock) if n else 0
        cost, horizon = self.cost.chunk_iteration_times, min(bound, deadline)
        prices = cost(n, context, tokens, c, 1)
        if prices[0] > 0 and horizon < math.inf:
            # Latencies grow with the contexts: iterations past these would start after the horizon
            # (at least the first, which the loop checks against it).
            limit = min(limit, max(1, int((horizon - now) / (prices[0] * scale)) + 2))
        prices += cost(n, context + n, tokens, c + tokens, limit - 1)
        bs, phase, stall = dec.bs, dec.phase, core.stall_floor if n else math.inf
        last, slack, tpot, spare = dec.last_time, dec.slack_base, dec.tpot_s, core.kv.free
        records = log.records
        held = -(-c // bs)  # the head's blocks
        ends: list[float] = []
        latencies: list[float] = []
        kv_used: list[int] = []
        for step, price in zip(range(clock, clock + limit), prices, strict=True):
            if now >= bound:
                break
            need = phase[-step % bs] if n else 0
            if -(-(c + room) // bs) - held > spare - need:
                break
            if not price <= max_latency:
                break
            latency = price if scale == 1.0 else price * scale
            end = now + latency
            gap = end - last
            if gap > stall or end > deadline:
                break
            slack += tpot - gap  # as DecodeGroup.record sums it
            c += tokens
            grown = -(-c // bs)
            blocks = grown - held + need
            held = grown
            spare -= blocks
            ends.append(end)
            if records:
                latencies.append(latency)
                kv_used.append(core.kv.total - spare)
            now = last = end
        k = len(ends)
        if not k:
            return False
        if records:
            log.extend(
                start=[core.now, *ends[:-1]],
                latency=latencies,
                decode_tokens=[n] * k,
                prefill_tokens=[tokens] * k,
                prefill_seqs=[1] * k,
                kv_used=kv_used,
            )
        core.run_stretch(ends, core.kv.free - spare, None, head, tokens * k, slack)
        return True

    def _stretch_python(self, core: ServingCore, limit: int, t_arr: float) -> Stretch:
        """Up to ``limit`` iterations of the stretch, one by one (see :data:`Stretch`)."""
        dec = core.decode
        n, bs, phase, clock = dec.n, dec.bs, dec.phase, dec.clock
        free, stall, used = core.kv.free, core.stall_floor, core.kv.used
        step_time, scale = self.cost.decode_step_time(n), self.time_scale
        context = dec.context_sum(clock)  # grows by n each iteration (DecodeGroup.context_sum)
        now, last, allocated = core.now, dec.last_time, 0
        ends: list[float] = []
        latencies: list[float] = []
        kv_used: list[int] = []
        for c in range(clock, clock + limit):
            if now >= t_arr:  # a step starts only while no arrival is due
                break
            need = phase[-c % bs]
            if allocated + need > free:
                break
            lat = step_time(context)
            context += n
            if scale != 1.0:
                lat *= scale
            end = now + lat
            if end - last > stall:
                break
            allocated += need
            ends.append(end)
            latencies.append(lat)
            kv_used.append(used + allocated)
            now = last = end
        return ends, latencies, kv_used, allocated, None

    def _stretch_numpy(self, core: ServingCore, limit: int, t_arr: float, kv_log: bool) -> Stretch:
        """:meth:`_stretch_python` in a few numpy calls: cumulative sums are sequential, as the loop's.
        The KV blocks used after each iteration only with ``kv_log``."""
        dec = core.decode
        clock, free = dec.clock, core.kv.free
        latency = self.cost.decode_iteration_times(dec.n, dec.context_sums(clock, limit))
        if self.time_scale != 1.0:
            latency *= self.time_scale  # elementwise, as the scalar path's product
        times = np.concatenate(([core.now], latency)).cumsum()  # [i]: start of iteration i, end of i - 1
        starts, ends = times[:-1], times[1:]
        gaps = ends - starts
        gaps[0] = ends[0] - dec.last_time
        # The first iteration that must not run: it would start at or after the arrival, over-commit
        # the KV cache (both searched: start times and allocations only grow) or stall.
        k = int(starts.searchsorted(t_arr))
        allocated = None
        if kv_log or free < dec.n * -(-limit // dec.bs):  # a member needs a block every bs iterations
            allocated = dec.block_needs(clock, limit).cumsum()
            k = min(k, int(allocated.searchsorted(free, "right")))
        stalls = (gaps[:k] > core.stall_floor).nonzero()[0]
        if len(stalls):
            k = int(stalls[0])
        if allocated is None:
            return ends[:k].tolist(), latency[:k], None, dec.blocks_over(clock, k), gaps[:k]
        blocks = int(allocated[k - 1]) if k else 0
        return ends[:k].tolist(), latency[:k], core.kv.used + allocated[:k], blocks, gaps[:k]


def _as_list(values: list[float] | list[int] | np.ndarray) -> list[float] | list[int]:
    """A stretch column as the log's Python numbers."""
    return values.tolist() if isinstance(values, np.ndarray) else values


class Simulator(ServingLoop):
    """Replays a trace through a policy on a simulated engine: :class:`ServingLoop` with a
    :class:`CostModelClock`, plus :meth:`fork` for what-if rollouts.  ``serve_trace=False``: the
    core starts empty, a server of a :class:`~envs.serving.fleet.Fleet` (the trace then sizes the
    prefix cache's units and gives the span)."""

    def __init__(
        self,
        trace: Trace,
        model: ModelSpec,
        hardware: HardwareSpec,
        cost_model: CostModel,
        slo: SLO,
        config: ServingConfig | None = None,
        tp: int = 1,
        time_scale: float = 1.0,
        serve_trace: bool = True,
    ) -> None:
        self.trace = trace
        self.config = config = config or ServingConfig()
        self.cost = cost_model
        self.slo = slo
        # serve_trace=False: an empty server of a fleet, whose router submits the trace's requests.
        core = ServingCore.for_trace(trace, model, hardware, cost_model, slo, config, tp, submit=serve_trace)
        # One cost model for the core's predictions and the clock: a plan's price is its latency
        # (times ``time_scale``, an engine's measured speed against the model; see CostModelClock).
        super().__init__(core, CostModelClock(cost_model, time_scale), trace.span_s)

    def fork(self, keep_log: bool = True, foresight: bool = True) -> Simulator:
        """An independent copy of the current state for what-if rollouts.

        Immutable parts (trace, cost model, SLO, finished and rejected requests, which never
        change again, and their token times) are shared, and lists of them or of floats are
        copied shallowly, so a fork costs the live state, not the history (the hindsight
        oracle forks every action every period); ``keep_log=False`` starts the copy with an
        empty iteration log; ``foresight=False`` leaves out the requests still to arrive, so the
        copy serves only those that have arrived (a causal rollout).
        """
        core = self.core
        shared = [
            self.trace,
            self.cost,
            self.slo,
            self.config,
            core.cost_model,
            core.slo,
            core.config,
            core.classes,
        ]
        shared += [r.hash_ids for r in core.requests if r.hash_ids is not None]
        shared += core.token_times.values()
        shared += core.finished
        shared += core.rejected
        if not keep_log:
            shared.append(self.log)
        memo: dict[int, object] = {id(x): x for x in shared}
        for history in (core.finished, core.rejected, core._token_times, core.decode.end):
            memo[id(history)] = history.copy()
        if not foresight:  # copied first, so the queues' references to them map to these copies
            memo[id(core.requests)] = copy.deepcopy(core.requests[: core.next_arrival], memo)
        twin = copy.deepcopy(self, memo)
        if not keep_log:
            twin.log = IterationLog()
        return twin
