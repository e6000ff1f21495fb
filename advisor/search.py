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

With a fleet (``fleet.replicas`` > 1) every probe serves the trace on that many servers of the
candidate's settings behind ``fleet.router`` (:meth:`~envs.serving.setup.ServingSetup.fleet`), so a
capacity is the whole fleet's; the proofs read every server (the SLO counts summed, each server's
finished, rejected and waiting requests watched), checked as the fleet runs. A disaggregated fleet
(``fleet.prefill`` prefill and ``fleet.decode`` decode servers, :mod:`advisor.topology`'s splits)
is probed the same way: a handed-over request finishes on its decode server only, so every server
watched counts each request once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from advisor.engines import Candidate
from advisor.targets import REQUEST_METRICS, Target, above, holds, samples
from advisor.traffic import Traffic
from baselines.routers import make_router
from chunkgym import backends
from envs.serving.capacity import Probe, sequential_search, speculative_search
from envs.serving.core import ServingCore
from envs.serving.disaggregation import DisaggregatedFleet
from envs.serving.fleet import ONE_SERVER, Fleet, FleetSpec
from envs.serving.loop import CountStop, SimResult
from envs.serving.metrics import CapacityResult, RequestOutcomes
from envs.serving.request import Request
from envs.serving.setup import ServingSetup
from envs.serving.shortcuts import NO_SHORTCUTS, PROBE_SHORTCUTS, Shortcuts
from envs.serving.workloads.trace import Trace

UNLOGGED = Shortcuts(unlogged=True)
"""A run at today's rate that only its outcomes are read of: every default shortcut, no iteration log."""

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

    def preset_counts(self, n: int) -> tuple[int, int]:
        """The preset's proof over ``n`` requests, as attain90's: the known-good count that passes
        and the known-bad count that fails."""
        if not n:  # no requests: a fail (holds() says so too), known before the run starts
            return 1, 0
        good = next(g for g in range(n + 1) if g / n >= self.attainment)
        bad = next((b for b in range(n + 1) if (n - b) / n < self.attainment), n + 1)
        return good, bad


class TargetWatch:
    """Samples already known to exceed each target, counted as the run goes; :meth:`failed` once
    any count passes what its target allows of the most samples the run can end with.

    ``requests``: every request of the run; ``cores``: the servers serving them (one, or a fleet's).
    A finished request's samples are computed as the run's outcomes compute them
    (:meth:`RequestOutcomes.from_token_times`, so the counts are those of the final check); a
    request still waiting for its first token past a TTFT target on its server's clock is counted
    once, when seen.
    """

    def __init__(
        self, requests: Sequence[Request], cores: Sequence[ServingCore], targets: tuple[Target, ...]
    ) -> None:
        self.cores = tuple(cores)
        self.targets = targets
        self.requests = len(requests)
        self.gaps_at_most = sum(max(r.output_len - 1, 0) for r in requests)
        self.above = [0] * len(targets)
        self.late: list[set[int]] = [set() for _ in targets]  # rids past a TTFT target while waiting
        self.finished_seen = [0] * len(self.cores)
        self.rejected_seen = [0] * len(self.cores)

    def failed(self) -> bool:
        for k, core in enumerate(self.cores):
            self._watch(k, core)
        return any(
            n > t.allowed_above(self.gaps_at_most if t.metric == "itl" else self.requests)
            for n, t in zip(self.above, self.targets, strict=True)
        )

    def _watch(self, k: int, core: ServingCore) -> None:
        """Count what server ``k`` decided since it was last watched."""
        for req in core.rejected[self.rejected_seen[k] :]:
            self.gaps_at_most -= max(req.output_len - 1, 0)
            for i, t in enumerate(self.targets):
                self.above[i] += t.metric in REQUEST_METRICS
        self.rejected_seen[k] = len(core.rejected)
        if len(core.finished) > self.finished_seen[k]:
            self._count_finished(core, core.finished[self.finished_seen[k] :])
            self.finished_seen[k] = len(core.finished)
        now = core.now
        for i, t in enumerate(self.targets):
            if t.metric == "ttft":
                late = self.late[i]
                for req in core.queue:
                    if not req.generated and (now - req.arrival) * 1000.0 > t.ms and req.rid not in late:
                        late.add(req.rid)
                        self.above[i] += 1

    def _count_finished(self, core: ServingCore, reqs: Sequence[Request]) -> None:
        times = core.token_times
        out = RequestOutcomes.from_token_times(
            arrival=[r.arrival for r in reqs],
            prompt_len=[r.prompt_len for r in reqs],
            output_len=[r.output_len for r in reqs],
            token_times=[times[r.rid] for r in reqs],
            first_scheduled=[r.first_scheduled for r in reqs],
            ttft_bound=[r.ttft_bound for r in reqs],
            slo=core.slo,
        )
        for i, t in enumerate(self.targets):
            values = samples(out, t.metric)
            if t.metric == "ttft" and self.late[i]:
                values = values[[r.rid not in self.late[i] for r in reqs]]
            self.above[i] += above(values, t)


class FleetFail:
    """A ``stop`` for :meth:`Fleet.run_until`: true once ``watch`` proves a target broken, asked
    when the fleet's clock has moved ``step`` seconds since the last check (the fleet asks before
    each arrival and between a server's iterations; a server stopped while a router reads it
    stands there, and the fleet stops at the next ask)."""

    def __init__(self, fleet: Fleet | DisaggregatedFleet, watch: TargetWatch, step: float) -> None:
        self.fleet = fleet
        self.watch = watch
        self.step = step
        self.next_check = step
        self.proven = False  # once true, stays: every later ask (the fleet asks again) says so

    def __call__(self) -> bool:
        now = self.fleet.now
        if self.proven or now < self.next_check:
            return self.proven
        self.next_check = now + self.step
        self.proven = self.watch.failed()
        return self.proven


@dataclass(frozen=True)
class TargetProbe:
    """One load point of one candidate's search: small and picklable, so a pool worker runs it.
    ``fleet``: the servers it runs on (one: the candidate's single server, as without fleets)."""

    setup: ServingSetup
    candidate: Candidate
    criterion: Criterion
    fast: bool
    fleet: FleetSpec = ONE_SERVER

    def __call__(self, scale: float, trace: Trace) -> Probe:
        start = time.process_time()
        if self.fleet.servers > 1:
            probe = self._decide_fleet(trace) if self.fast else self._full_fleet(trace)
        else:
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
        sim.start(policy)
        if not self.criterion.targets:
            proof = CountStop(core, *self.criterion.preset_counts(len(core.requests)))
            if sim.run_until(policy, stop=proof):
                return core.n_good >= proof.good, True, core.n_good + core.n_bad
            return self.criterion.holds(sim.outcomes()), False, len(trace)
        watch = TargetWatch(core.requests, (core,), self.criterion.targets)
        step = max(trace.span_s, 1e-9) / CHECKS_PER_RUN
        until = step
        while sim.run_until(policy, until_s=until):
            if watch.failed():
                return False, True, len(core.finished) + len(core.rejected)
            until = core.now + step
        return self.criterion.holds(sim.outcomes()), False, len(trace)

    def _fleet(self, trace: Trace) -> Fleet | DisaggregatedFleet:
        return fleet_of(self.setup, trace, self.candidate, self.fleet)

    def _full_fleet(self, trace: Trace) -> tuple[bool, bool, int]:
        fleet = self._fleet(trace)
        fleet.set_shortcuts(NO_SHORTCUTS)
        return self.criterion.holds(fleet.run().outcomes), False, len(trace)

    def _decide_fleet(self, trace: Trace) -> tuple[bool, bool, int]:
        """:meth:`_decide` on the fleet: the preset's proof on the fleet's summed counts; the
        targets' (:class:`FleetFail`) as the fleet runs, which it never moves itself: when a router
        reads a server, where that server stands decides the routing, so the fleet runs exactly as
        the reference's."""
        fleet = self._fleet(trace)
        fleet.set_shortcuts(PROBE_SHORTCUTS)
        if not self.criterion.targets:
            good, bad = self.criterion.preset_counts(len(trace))
            if fleet.run_until(fleet.count_stop(good, bad)):
                return fleet.n_good >= good, True, fleet.n_good + fleet.n_bad
            return self.criterion.holds(fleet.result().outcomes), False, len(trace)
        cores = [s.core for s in fleet.servers]
        watch = TargetWatch(fleet.requests, cores, self.criterion.targets)
        proven = FleetFail(fleet, watch, max(trace.span_s, 1e-9) / CHECKS_PER_RUN)
        if fleet.run_until(proven):
            return False, True, sum(len(c.finished) + len(c.rejected) for c in cores)
        return self.criterion.holds(fleet.result().outcomes), False, len(trace)


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


def fleet_of(
    setup: ServingSetup, trace: Trace, candidate: Candidate, fleet: FleetSpec
) -> Fleet | DisaggregatedFleet:
    """``fleet``'s servers, each with ``candidate``'s settings, serving ``trace``: colocated behind
    ``fleet.router``, or prefill and decode pools joined by ``fleet.link``, the decode pool behind
    ``fleet.decode_router``."""
    decode_router = make_router(fleet.decode_router) if fleet.disaggregated else None
    return setup.fleet_for(trace, fleet, candidate.build_policy, make_router(fleet.router), decode_router)


def at_rate(
    setup: ServingSetup,
    candidate: Candidate,
    traffic: Traffic,
    fleet: FleetSpec = ONE_SERVER,
    scale: float = 1.0,
    recorded: bool = True,
) -> SimResult:
    """``candidate`` serving the traffic at ``scale`` (1: today's), every iteration recorded; on a
    fleet of more than one server, every server's iterations merged in time order.

    ``recorded=False`` (one server): the same run, outcomes only (:func:`outcomes_at_rate`)."""
    trace = traffic.trace_at(scale)
    if fleet.servers > 1:
        return fleet_of(setup, trace, candidate, fleet).run()
    if not recorded:
        return outcomes_at_rate(setup, candidate, trace)
    return setup.simulator(trace).run(candidate.build_policy())


def outcomes_at_rate(setup: ServingSetup, candidate: Candidate, trace: Trace) -> SimResult:
    """``candidate`` serving ``trace`` to the end with no iteration log
    (:attr:`~envs.serving.shortcuts.Shortcuts.unlogged`, whose outcomes are bit-identical to a
    recorded run's): a SimResult of its outcomes alone, no iterations, summary or token times.

    Why: the report reads every candidate's outcomes at today's rate but the iteration log and
    token times of two only (the current settings and the recommendation, which the advisor runs
    recorded); logging the others cost about half of each run and a 76 MB result to send back."""
    sim = setup.simulator(trace)
    sim.core.shortcuts = UNLOGGED
    policy = candidate.build_policy()
    sim.start(policy)
    sim.run_until(policy)
    return SimResult(sim.outcomes(), {}, {}, {})


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
    fleet: FleetSpec | Sequence[FleetSpec] = ONE_SERVER,
) -> list[Found]:
    """Each candidate's capacity, in order; ``setups[i]`` serves ``candidates[i]`` (on each of
    ``fleet``'s servers: the capacity is then the fleet's; a sequence: candidate ``i`` on ``fleet[i]``).

    ``at_scale_one``: each candidate's verdict at load scale 1 from its recorded run (the fast
    search starts from it; the reference probes scale 1 again, which must agree).
    """
    queries = [AdviceQuery(traffic, rel_tol) for _ in candidates]
    fleets = [fleet] * len(candidates) if isinstance(fleet, FleetSpec) else list(fleet)
    runs = [TargetProbe(s, c, criterion, fast, f) for s, c, f in zip(setups, candidates, fleets, strict=True)]
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
