"""Every candidate's capacity on the operator's traffic: the highest load scale at which the SLO holds.

The search is chunkgym's bracketing-then-bisection (:func:`envs.serving.metrics.capacity_steps`)
from load scale 1 (today's traffic) to a relative tolerance. Two ways to run it give the same
capacities bit for bit (``bench/advise_speed.py`` checks):

* the reference: candidates one after another, every probe served to the end with the core's
  shortcuts off and every budget planned from scratch;
* the fast one: probes in flight on ``n_jobs`` workers (the speculative search of
  :mod:`envs.serving.capacity`), the core's shortcuts on, and a probe stopped once it is proven to
  fail: the samples known to exceed a target only grow, so once they pass what the target allows
  of the run's final sample count no later iteration can save it (:class:`TargetWatch`). Load
  scale 1 is each candidate's full, recorded run at today's rate, which the report reads too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from advisor.engines import Candidate
from advisor.targets import REQUEST_METRICS, Target, above, holds, samples
from advisor.traffic import Traffic
from chunkgym import backends
from envs.serving.capacity import Probe, sequential_search, speculative_search
from envs.serving.core import ServingCore
from envs.serving.loop import CountStop, SimResult
from envs.serving.metrics import CapacityResult, RequestOutcomes
from envs.serving.request import Request
from envs.serving.setup import ServingSetup
from envs.serving.shortcuts import NO_SHORTCUTS, PROBE_SHORTCUTS
from envs.serving.workloads.trace import Trace

CHECKS_PER_RUN = 32
"""How often a fast probe checks whether its fail is proven, evenly over the trace's span."""


@dataclass(frozen=True)
class Criterion:
    """When a run meets the operator's SLO: every percentile target holds, or, for a chunkgym
    preset (``targets`` empty), at least ``attainment`` of all requests meet its bounds."""

    targets: tuple[Target, ...] = ()
    attainment: float = 0.9

    def holds(self, out: RequestOutcomes) -> bool:
        if self.targets:
            return holds(out, self.targets)
        n = len(out.good)
        return n > 0 and int(out.good.sum()) / n >= self.attainment

    def preset_stop(self, core: ServingCore) -> CountStop:
        """The preset's proof from the core's known-good and known-bad counts, as attain90's."""
        n = len(core.requests)
        if not n:  # no requests: a fail (holds() says so too), known before the run starts
            return CountStop(core, 1, 0)
        good = next(g for g in range(n + 1) if g / n >= self.attainment)
        bad = next((b for b in range(n + 1) if (n - b) / n < self.attainment), n + 1)
        return CountStop(core, good, bad)


class TargetWatch:
    """Samples already known to exceed each target, counted as the run goes; :meth:`failed` once
    any count passes what its target allows of the most samples the run can end with.

    A finished request's samples are computed as the run's outcomes compute them
    (:meth:`RequestOutcomes.from_token_times`, so the counts are those of the final check); a
    request still waiting for its first token past a TTFT target is counted once, when seen.
    """

    def __init__(self, core: ServingCore, targets: tuple[Target, ...]) -> None:
        self.core = core
        self.targets = targets
        self.requests = len(core.requests)
        self.gaps_at_most = sum(max(r.output_len - 1, 0) for r in core.requests)
        self.above = [0] * len(targets)
        self.late: list[set[int]] = [set() for _ in targets]  # rids past a TTFT target while waiting
        self.finished_seen = 0
        self.rejected_seen = 0

    def failed(self) -> bool:
        core = self.core
        for req in core.rejected[self.rejected_seen :]:
            self.gaps_at_most -= max(req.output_len - 1, 0)
            for i, t in enumerate(self.targets):
                self.above[i] += t.metric in REQUEST_METRICS
        self.rejected_seen = len(core.rejected)
        if len(core.finished) > self.finished_seen:
            self._count_finished(core.finished[self.finished_seen :])
            self.finished_seen = len(core.finished)
        now = core.now
        for i, t in enumerate(self.targets):
            if t.metric == "ttft":
                late = self.late[i]
                for req in core.queue:
                    if not req.generated and (now - req.arrival) * 1000.0 > t.ms and req.rid not in late:
                        late.add(req.rid)
                        self.above[i] += 1
        return any(
            n > t.allowed_above(self.gaps_at_most if t.metric == "itl" else self.requests)
            for n, t in zip(self.above, self.targets, strict=True)
        )

    def _count_finished(self, reqs: Sequence[Request]) -> None:
        times = self.core.token_times
        out = RequestOutcomes.from_token_times(
            arrival=[r.arrival for r in reqs],
            prompt_len=[r.prompt_len for r in reqs],
            output_len=[r.output_len for r in reqs],
            token_times=[times[r.rid] for r in reqs],
            first_scheduled=[r.first_scheduled for r in reqs],
            ttft_bound=[r.ttft_bound for r in reqs],
            slo=self.core.slo,
        )
        for i, t in enumerate(self.targets):
            values = samples(out, t.metric)
            if t.metric == "ttft" and self.late[i]:
                values = values[[r.rid not in self.late[i] for r in reqs]]
            self.above[i] += above(values, t)


@dataclass(frozen=True)
class TargetProbe:
    """One load point of one candidate's search: small and picklable, so a pool worker runs it."""

    setup: ServingSetup
    candidate: Candidate
    criterion: Criterion
    fast: bool

    def __call__(self, scale: float, trace: Trace) -> Probe:
        start = time.process_time()
        probe = self._decide(scale, trace) if self.fast else self._full(scale, trace)
        return Probe(scale, probe[0], probe[1], probe[2], len(trace), seconds=time.process_time() - start)

    def _full(self, scale: float, trace: Trace) -> tuple[bool, bool, int]:
        sim = self.setup.simulator(trace)
        sim.core.shortcuts = NO_SHORTCUTS
        result = sim.run(self.candidate.build_policy())
        return self.criterion.holds(result.outcomes), False, len(trace)

    def _decide(self, scale: float, trace: Trace) -> tuple[bool, bool, int]:
        sim = self.setup.simulator(trace)
        core = sim.core
        core.shortcuts = PROBE_SHORTCUTS
        policy = self.candidate.build_policy()
        policy.reset(sim.view)
        if not self.criterion.targets:
            proof = self.criterion.preset_stop(core)
            if sim.run_until(policy, stop=proof):
                return core.n_good >= proof.good, True, core.n_good + core.n_bad
            return self.criterion.holds(sim.outcomes()), False, len(trace)
        watch = TargetWatch(core, self.criterion.targets)
        step = max(trace.span_s, 1e-9) / CHECKS_PER_RUN
        until = step
        while sim.run_until(policy, until_s=until):
            if watch.failed():
                return False, True, len(core.finished) + len(core.rejected)
            until = core.now + step
        return self.criterion.holds(sim.outcomes()), False, len(trace)


@dataclass(frozen=True)
class AdviceQuery:
    """One candidate's search over the traffic's load scale."""

    traffic: Traffic
    rel_tol: float

    def trace_at(self, scale: float) -> Trace:
        return self.traffic.trace_at(scale)


@dataclass(frozen=True)
class Found:
    """A candidate's capacity (load scale and req/s, 0 when even the lowest probe fails) and its search."""

    candidate: Candidate
    scale: float
    rps: float
    result: CapacityResult
    probes: tuple[Probe, ...] = field(default=())


def at_rate(setup: ServingSetup, candidate: Candidate, traffic: Traffic) -> SimResult:
    """``candidate`` serving today's traffic (load scale 1), every iteration recorded."""
    return setup.simulator(traffic.trace_at(1.0)).run(candidate.build_policy())


def search(
    setups: Sequence[ServingSetup],
    candidates: Sequence[Candidate],
    traffic: Traffic,
    criterion: Criterion,
    rel_tol: float,
    fast: bool = True,
    n_jobs: int = 1,
    executor: Executor | None = None,
    at_scale_one: Sequence[bool] | None = None,
) -> list[Found]:
    """Each candidate's capacity, in order; ``setups[i]`` serves ``candidates[i]``.

    ``at_scale_one``: each candidate's verdict at load scale 1 from its recorded run (the fast
    search starts from it; the reference probes scale 1 again, which must agree).
    """
    queries = [AdviceQuery(traffic, rel_tol) for _ in candidates]
    runs = [TargetProbe(s, c, criterion, fast) for s, c in zip(setups, candidates, strict=True)]
    if not fast:
        found = [sequential_search(q, run) for q, run in zip(queries, runs, strict=True)]
    else:
        known = None
        if at_scale_one is not None:
            known = [{1.0: Probe(1.0, ok, False, 0, 0)} for ok in at_scale_one]
        if executor is not None:
            found = speculative_search(queries, runs, executor, n_jobs, known=known)
        else:
            with backends.executor("local", n_jobs) as pool:
                found = speculative_search(queries, runs, pool, n_jobs, ahead=n_jobs, known=known)
    out = []
    for c, (result, probes) in zip(candidates, found, strict=True):
        rps = traffic.rate_at(result.scale) if result.scale > 0 else 0.0
        used = tuple(probes[s] for s, _ in result.evaluations)
        out.append(Found(c, result.scale, rps, result, used))
    return out
