"""The one run loop: schedule, execute, book-keep, once per iteration, for every driver.

:class:`ServingLoop` drives a :class:`~envs.serving.core.ServingCore` with an
:class:`Executor`; per iteration of :meth:`ServingLoop.run_until` (nano-vllm's
``LLMEngine.step``: schedule, run, postprocess)::

    core.advance_to_work(executor.wait_until)   # admit arrivals; idle: wait for the next one
    plan = policy.plan(view)                    # the core, read through ServingView
    batch = core.begin(plan)                    # validate, allocate KV
    t_end, latency = executor.execute(batch, start)
    core.end(batch, t_end)                      # tokens, finishes, SLO bookkeeping
    log.append(...)                             # one row of ITERATION_COLUMNS

Two executors exist: the simulator's cost-model clock (:class:`~envs.serving.simulator.CostModelClock`,
which also fast-forwards decode-only stretches without asking the policy) and the real
engine (:class:`~engine.serve.Engine`: forward passes on a wall clock).  The simulator, the
engine, the env's decision steps and the hindsight oracle all run through
:meth:`ServingLoop.run_until`, so stopping rules (a clock horizon, a predicate checked
between iterations) mean the same thing everywhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from envs.serving.budgets import one_pass_planning, planning_one_pass
from envs.serving.core import Batch, ServingCore
from envs.serving.metrics import SLO, RequestOutcomes, request_summary
from envs.serving.request import Request
from envs.serving.scheduling import Plan, Policy, ServingView, blocks_needed
from envs.serving.stretches import ChunkFollower, FollowsChunks, Steady, SteadyFollower

ITERATION_COLUMNS = {
    "start": np.float64,  # iteration start time (s)
    "latency": np.float64,  # its duration (s)
    "decode_tokens": np.int64,
    "prefill_tokens": np.int64,
    "prefill_seqs": np.int64,  # prefill chunks in the batch
    "kv_used": np.int64,  # KV blocks in use after the iteration's allocation
}


class IterationLog:
    """Per-iteration records, one Python list per column (cheap appends), numpy on demand."""

    records = True  # False: appends are dropped, so callers may skip building the rows

    def __init__(self) -> None:
        self.cols: dict[str, list[float]] = {name: [] for name in ITERATION_COLUMNS}
        # The columns once more, in row order; plain lists, not bound appends, so that a deep copy
        # (Simulator.fork) writes to its own columns.
        self._columns = tuple(self.cols.values())

    def append(
        self,
        start: float,
        latency: float,
        decode_tokens: int,
        prefill_tokens: int,
        prefill_seqs: int,
        kv_used: int,
    ) -> None:
        a, b, c, d, e, f = self._columns
        a.append(start)
        b.append(latency)
        c.append(decode_tokens)
        d.append(prefill_tokens)
        e.append(prefill_seqs)
        f.append(kv_used)

    def extend(self, **columns: Sequence[float]) -> None:
        for name, values in columns.items():
            self.cols[name].extend(values)

    def __getitem__(self, name: str) -> list[float]:
        return self.cols[name]

    def __len__(self) -> int:
        return len(self.cols["start"])

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: np.array(self.cols[name], dtype=dt) for name, dt in ITERATION_COLUMNS.items()}


class UnrecordedLog(IterationLog):
    """An iteration log that keeps nothing: for runs judged only on the core's SLO counters (a
    capacity probe decided early: :attr:`~envs.serving.shortcuts.Shortcuts.unlogged`; the oracle's
    rollouts), which never read their log."""

    records = False

    def append(
        self,
        start: float,
        latency: float,
        decode_tokens: int,
        prefill_tokens: int,
        prefill_seqs: int,
        kv_used: int,
    ) -> None:
        pass

    def extend(self, **columns: Sequence[float]) -> None:
        pass


@dataclass(frozen=True)
class CountStop:
    """A ``stop`` for :meth:`ServingLoop.run_until` that reads nothing but the core's counts of
    requests known good and known bad: true once ``n_good >= good`` or ``n_bad >= bad``.

    Those counts change only when a request finishes or is known to miss its SLO, so the
    simulator may run a stretch of iterations in which neither happens before the last one and
    ask once, before it (:meth:`~envs.serving.simulator.CostModelClock.run_segment`); any other
    predicate is asked before every iteration a policy's chunk follower runs.
    """

    core: ServingCore
    good: int
    bad: int

    def __call__(self) -> bool:
        core = self.core
        return core.n_good >= self.good or core.n_bad >= self.bad


@dataclass
class SimResult:
    """Everything a run produced: per-request outcomes, per-iteration records, system metrics."""

    outcomes: RequestOutcomes
    iterations: dict[str, np.ndarray]
    metrics: dict[str, float]
    token_times: dict[int, np.ndarray]
    stopped: bool = False  # ``run``'s ``stop`` ended it before the trace was done: the results are partial


class ChunkClock(Protocol):
    """What an executor on whose clock planning takes no time (the simulator's) offers the loop, so
    it runs a policy's followed chunks (:meth:`FollowsChunks.follow`) without asking it to plan and
    without building a batch."""

    def chunk_latency(
        self, num_decode: int, decode_context: int, tokens: int, computed: int, price: float | None
    ) -> float:
        """:meth:`Executor.execute`'s latency, bit for bit, of every decode (``num_decode``, their KV
        tokens summed) plus one chunk of ``tokens`` whose prompt has ``computed`` in KV; ``price``:
        the plan's (:attr:`Plan.latency`), or None."""
        ...

    def run_segment(
        self,
        core: ServingCore,
        log: IterationLog,
        head: Request,
        steady: Steady,
        t_arr: float,
        until_s: float,
    ) -> bool:
        """Run and book the iterations of every decode plus ``steady.tokens`` of ``head`` that
        :meth:`ServingLoop._follow` would run one by one with a :class:`SteadyFollower` that promised
        ``steady`` and a :class:`CountStop` (or no stop), the first of which it has checked, up to the
        next event (arrival at ``t_arr``, ``until_s``, a finish, a stall, a TTFT deadline, KV room,
        the head's last chunk, the promise's end); False if it left them to the loop."""
        ...


class Executor(Protocol):
    """What runs the batches the core schedules, and what time is."""

    @property
    def chunk_clock(self) -> ChunkClock | None:
        """This executor's :class:`ChunkClock`, where planning takes no time on its clock; None
        (a real engine): every iteration is planned and executed."""
        ...

    def wait_until(self, t: float) -> float:
        """The engine is idle until trace time ``t``: wait for it; the time it is then (>= ``t``)."""
        ...

    def execute(self, batch: Batch, start: float) -> tuple[float, float]:
        """Run ``batch``, started at ``start``; its end time and latency (s)."""
        ...

    def fast_forward(self, core: ServingCore, log: IterationLog) -> bool:
        """Run forced decode-only iterations without the policy if this executor can do so
        faster and identically; False if none ran."""
        ...


class StepDecodes(Policy):
    """Steps the running decodes and nothing else: the only plan while no prompt waits."""

    name = "step_decodes"

    def plan(self, view: ServingView) -> Plan:
        return Plan(decode=True)


class ServingLoop:
    """A core, an executor and the iteration log: runs policies over them and reports results.

    Args:
        core: the serving state (fresh for a run).
        executor: the cost-model clock or the engine.
        span_s: the trace's span, the denominator of rates in :meth:`result`.
    """

    def __init__(self, core: ServingCore, executor: Executor, span_s: float) -> None:
        self.core = core
        self.executor = executor
        self.span_s = span_s
        self.log = IterationLog()

    @property
    def view(self) -> ServingView:
        """The core, as policies, features and masks may read it."""
        return self.core

    def advance_to_work(self) -> bool:
        """Admit arrivals, waiting (executor's clock) while idle; False once the trace is done."""
        return self.core.advance_to_work(self.executor.wait_until)

    def step(self, plan: Plan) -> float:
        """Run one iteration of ``plan``; returns its latency in seconds."""
        return self._run(self.core.begin(plan))

    def _run(self, batch: Batch) -> float:
        """Execute a batch the core has begun, book it on the core and log it; its latency."""
        core = self.core
        start = core.now
        log = self.log
        used = core.kv.used if log.records else 0
        end, latency = self.executor.execute(batch, start)
        core.end(batch, end)
        if log.records:
            chunks = batch.chunks
            log.append(start, latency, batch.num_decode, sum(q for _, q, _ in chunks), len(chunks), used)
        return latency

    def run_until(
        self, policy: Policy, stop: Callable[[], bool] | None = None, until_s: float = math.inf
    ) -> bool:
        """Serve with ``policy``, asked once per iteration; False once the trace is done.

        Returns True, before the next iteration, as soon as the clock has reached
        ``until_s`` (checked first, before arrivals are admitted) or ``stop()`` holds
        (checked after admission, on the state the policy would see next).  The core's
        :attr:`~ServingCore.shortcuts` say which fast paths the run takes: decode-only stretches
        fast-forwarded, chunk stretches followed, budgets planned in one pass, no iteration log
        (the results are identical, bit for bit, with any of them off).
        """
        shortcuts = self.core.shortcuts
        if shortcuts.unlogged and self.log.records:
            self.log = UnrecordedLog()
        if shortcuts.one_pass_budgets == planning_one_pass():  # already so (a fleet calls this per arrival)
            return self._serve(policy, stop, until_s)
        with one_pass_planning(shortcuts.one_pass_budgets):
            return self._serve(policy, stop, until_s)

    def _serve(self, policy: Policy, stop: Callable[[], bool] | None, until_s: float) -> bool:
        """:meth:`run_until`'s loop."""
        core = view = self.core
        log, step, plan = self.log, self.step, policy.plan
        advance, wait = core.advance_to_work, self.executor.wait_until
        shortcuts = core.shortcuts
        skip = self.executor.fast_forward if shortcuts.fast_forward else None
        stretch = (
            policy.follow
            if shortcuts.chunk_stretches
            and isinstance(policy, FollowsChunks)
            and self.executor.chunk_clock is not None
            else None
        )
        while core.now < until_s:
            if not advance(wait):
                return False
            if stop is not None and stop():
                return True
            if skip is not None and not core.queue and skip(core, log):  # forced: no prompt waits
                continue
            todo = plan(view)
            while not todo.chunks and not (todo.decode and core.decode.n) and core.release_idle_prefix():
                todo = plan(view)  # nothing runs and nothing could be planned: evict, ask again
            step(todo)
            if (
                stretch is not None
                and (chunk := stretch(view, todo)) is not None
                and self._follow(stretch, todo, chunk, stop, until_s)
            ):
                return True  # stop() held: asked once per iteration
        return True

    def _follow(
        self,
        follow: Callable[[ServingView, Plan], ChunkFollower | None],
        plan: Plan,
        chunk: ChunkFollower,
        stop: Callable[[], bool] | None,
        until_s: float,
    ) -> bool:
        """Run every decode plus ``chunk()`` tokens of the head (``plan``'s last chunk's prompt)
        while that is what the policy would plan; True if it ended because ``stop()`` held.

        The iterations :meth:`run_until` would run, without asking the policy, until one would not
        be such an iteration: the clock reaches ``until_s``, ``chunk()`` says 0 or would finish the
        head's prefill, the chunk's KV and the decodes' do not fit (the next
        :meth:`~ServingCore.prepare` preempts, or the plan differs), ``stop()`` holds (asked before
        every iteration, as there), or, once arrivals have been admitted (as :meth:`run_until`
        would admit them, before ``stop()``), the policy's ``follow`` on the iteration that ran last
        no longer names a function (a new prompt comes first); then :meth:`run_until` goes on as it
        would have.  Between arrivals nothing else changes the state, which is what
        :meth:`FollowsChunks.follow`'s function assumes.  A :class:`SteadyFollower`'s iterations run
        a segment at a time (:meth:`ChunkClock.run_segment`, with :attr:`Shortcuts.segments`) when
        ``stop`` is none or a :class:`CountStop`, whose answer no iteration of a segment but the last
        can change; it is then asked before each segment.
        """
        core, kv, dec, log = self.core, self.core.kv, self.core.decode, self.log
        clock = self.executor.chunk_clock
        assert clock is not None, "only executors with a chunk clock follow chunks"
        segmented = core.shortcuts.segments and (stop is None or isinstance(stop, CountStop))
        head = plan.chunks[-1][0]
        t_arr = core.next_arrival_time()
        while core.now < until_s:
            if core.now >= t_arr:
                core.advance_to_work(self.executor.wait_until)  # the head is queued: admits, never waits
                found = follow(core, plan)
                if found is None:
                    return False
                chunk, t_arr = found, core.next_arrival_time()
            tokens, price = chunk()
            if tokens <= 0 or tokens >= head.target - head.computed:
                return False
            blocks = core.decode_block_need() + blocks_needed(kv.block_size, head, tokens)
            if blocks > kv.free:
                return False
            if stop is not None and stop():
                return True
            n = dec.n
            if (
                segmented
                and isinstance(chunk, SteadyFollower)
                and (steady := chunk.steady()) is not None
                and clock.run_segment(core, log, head, steady, t_arr, until_s)
            ):
                price = None  # the segment's last iteration was priced by the clock
            else:  # what begin, execute, the log and end do for this batch, without building it
                start = core.now
                latency = clock.chunk_latency(
                    n, dec.context_sum(dec.clock) if n else 0, tokens, head.computed, price
                )
                if log.records:
                    log.append(start, latency, n, tokens, 1, kv.used + blocks)
                core.run_followed(head, tokens, blocks, start + latency)
            if core.now >= t_arr:  # follow asks about the iteration that ran last
                plan = Plan(n > 0, [(head, tokens)], price)
        return False

    def start(self, policy: Policy) -> None:
        """Before a run with ``policy``: the core takes its preemption rule, the policy is reset."""
        self.core.preemption = policy.preemption
        policy.reset(self.view)

    def run(self, policy: Policy, stop: Callable[[], bool] | None = None) -> SimResult:
        """Serve the trace with ``policy`` (started first) and summarise the run: to the end, or
        until ``stop()`` holds (see :meth:`run_until`; a search that has its answer stops early)."""
        wall = time.perf_counter()
        self.start(policy)
        stopped = self.run_until(policy, stop=stop)
        result = self.result(time.perf_counter() - wall)
        result.stopped = stopped
        return result

    def result(self, wall_s: float = math.nan) -> SimResult:
        """The run so far: per-request outcomes, per-iteration records, system metrics."""
        core = self.core
        times = core.token_times
        outcomes = self.outcomes()
        it = self.log.arrays()
        metrics = request_summary(outcomes, self.span_s)
        metrics.update(iteration_summary(it, core.kv.total, outcomes))
        metrics["sim_wall_s"] = wall_s
        return SimResult(outcomes, it, metrics, times)

    def outcomes(self) -> RequestOutcomes:
        """Every request's outcome so far, from the core alone (no iteration log needed)."""
        core = self.core
        return request_outcomes(core.requests, core.token_times, core.slo)


def request_outcomes(reqs: Sequence[Request], times: dict[int, np.ndarray], slo: SLO) -> RequestOutcomes:
    """The outcomes of ``reqs`` (in that order) from their state and the finished ones' token times,
    whichever server served each."""
    return RequestOutcomes.from_token_times(
        arrival=[r.arrival for r in reqs],
        prompt_len=[r.prompt_len for r in reqs],
        output_len=[r.output_len for r in reqs],
        token_times=[times.get(r.rid) for r in reqs],
        first_scheduled=[r.first_scheduled for r in reqs],
        ttft_bound=[r.ttft_bound for r in reqs],
        slo=slo,
        reject_reason=[r.reject_reason for r in reqs],
        prefix_hit=[r.prefix_hit for r in reqs],
        preemptions=[r.preemptions for r in reqs],
        tpot_bound=[r.tpot_bound for r in reqs],
        stall_bound=[r.stall_bound for r in reqs],
    )


def iteration_summary(it: dict[str, np.ndarray], kv_total: int, out: RequestOutcomes) -> dict[str, float]:
    """System metrics from the per-iteration records."""
    n = len(it["latency"])
    if not n:
        return {
            k: math.nan
            for k in (
                "iterations",
                "throughput_tok_s",
                "busy_fraction",
                "prefill_token_share",
                "kv_util_mean",
            )
        }
    busy = float(it["latency"].sum())
    first = float(out.arrival.min()) if len(out.arrival) else 0.0
    end = float(it["start"][-1] + it["latency"][-1])
    span = max(end - first, 1e-12)
    tokens = it["decode_tokens"] + it["prefill_tokens"]
    generated = int(out.output_len[out.finished].sum())
    return {
        "iterations": n,
        "throughput_tok_s": generated / span,
        "busy_fraction": busy / span,
        "prefill_token_share": float(np.mean(it["prefill_tokens"] / np.maximum(tokens, 1))),
        "kv_util_mean": float(np.mean(it["kv_used"]) / kv_total),
    }
