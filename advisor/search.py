"""Every candidate's capacity on the operator's traffic: the highest load scale at which the SLO holds.

The search is chunkgym's bracketing-then-bisection (:func:`envs.serving.metrics.capacity_steps`)
from load scale 1 (today's traffic) to a relative tolerance. Two ways to run it give the same
capacities bit for bit (``bench/advise_speed.py`` checks):

* the reference: candidates one after another, every probe served to the end with the core's
  shortcuts off and every budget planned from scratch;
* the fast one: probes in flight on ``n_jobs`` workers (the speculative search of
  :mod:`envs.serving.capacity`), the core's shortcuts on, and a probe stopped once it is proven to
  fail: the samples known to exceed a target only grow, so once they pass what the target allows
  of the run's final sample count no later iteration can save it (:class:`TargetWatch`); a probe
  served to the end is judged on the same counts, not on outcomes built again. Load scale 1 is
  each candidate's full run at today's rate, which the report reads too (``search(today=True)``:
  those runs are the searches' first probes, on the same workers). A candidate that differs from
  the current settings only in having more batch slots takes each of their probes in which the
  requests present never reached the current slots: its own run would be that run
  (:func:`slot_twins`).

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
from dataclasses import dataclass, field, replace

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
from envs.serving.simulator import Simulator
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
        self.gaps_seen = 0  # ITL samples of the finished requests counted so far
        self.finished_seen = [0] * len(self.cores)
        self.rejected_seen = [0] * len(self.cores)

    def failed(self) -> bool:
        for k, core in enumerate(self.cores):
            self._watch(k, core)
        return any(
            n > t.allowed_above(self.gaps_at_most if t.metric == "itl" else self.requests)
            for n, t in zip(self.above, self.targets, strict=True)
        )

    def holds_at_end(self) -> bool | None:
        """The verdict of a run served to the end, from the counts: :func:`~advisor.targets.holds`'s
        (every request's samples counted once, a rejected one as over every request target), so the
        run's outcomes need not be built again; None if a request neither finished nor was rejected
        (the outcomes then decide)."""
        for k, core in enumerate(self.cores):
            self._watch(k, core)
        if not self.requests or sum(self.finished_seen) + sum(self.rejected_seen) != self.requests:
            return None
        return all(
            n <= t.allowed_above(self.gaps_seen if t.metric == "itl" else self.requests)
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
        self.gaps_seen += sum(len(g) for g in out.gaps)
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
    today: bool = False  # scale 1 is the run at today's rate, kept whole (a TodayProbe)
    recorded: bool = False  # that run with its iteration log (the current settings')

    def __call__(self, scale: float, trace: Trace) -> Probe:
        start = time.process_time()
        if self.today and scale == 1.0:
            run, peak = serve(self.setup, self.candidate, trace, self.fleet, self.recorded)
            seconds = time.process_time() - start
            passed = self.criterion.holds(run.outcomes)
            return TodayProbe(scale, passed, False, len(trace), len(trace), seconds, peak, run)
        peak = None
        if self.fleet.servers > 1:
            probe = self._decide_fleet(trace) if self.fast else self._full_fleet(trace)
        elif self.fast:
            sim = self.setup.simulator(trace)
            probe, peak = self._decide(sim, trace), sim.core.peak_present
        else:
            probe = self._full(trace)
        seconds = time.process_time() - start
        return Probe(scale, probe[0], probe[1], probe[2], len(trace), seconds=seconds, peak_present=peak)

    @property
    def slot_bound(self) -> int:
        """Requests present at once below which this run's batch slots and lookahead never bind."""
        config = self.setup.config
        return min(config.max_num_seqs, config.lookahead)

    def slot_twin_of(self, other: TargetProbe) -> bool:
        """Whether this and ``other`` differ in the batch slots and lookahead alone (vLLM's own
        scheduler, the same knobs otherwise, one server each)."""
        a, b = self.candidate, other.candidate
        if (
            a.policy is not None
            or b.policy is not None
            or self.fleet.servers > 1
            or self.fleet != other.fleet
        ):
            return False
        if replace(b.knobs, max_num_seqs=a.knobs.max_num_seqs) != a.knobs:
            return False
        mine = self.setup.config
        config = replace(other.setup.config, max_num_seqs=mine.max_num_seqs, lookahead=mine.lookahead)
        return replace(other.setup, config=config) == self.setup and self.criterion == other.criterion

    def _full(self, trace: Trace) -> tuple[bool, bool, int]:
        sim = self.setup.simulator(trace)
        sim.core.shortcuts = NO_SHORTCUTS
        result = sim.run(self.candidate.build_policy())
        return self.criterion.holds(result.outcomes), False, len(trace)

    def _decide(self, sim: Simulator, trace: Trace) -> tuple[bool, bool, int]:
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
        verdict = watch.holds_at_end()
        return self.criterion.holds(sim.outcomes()) if verdict is None else verdict, False, len(trace)

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
        verdict = watch.holds_at_end()
        if verdict is None:
            verdict = self.criterion.holds(fleet.result().outcomes)
        return verdict, False, len(trace)


@dataclass(frozen=True)
class AdviceQuery:
    """One candidate's search over the traffic's load scale."""

    traffic: Traffic
    rel_tol: float

    def trace_at(self, scale: float) -> Trace:
        return self.traffic.trace_at(scale)


@dataclass(frozen=True)
class TodayProbe(Probe):
    """The probe at load scale 1 that is the candidate's run at today's rate, with that run."""

    run: SimResult | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Found:
    """A candidate's capacity (load scale and req/s, 0 when even the lowest probe fails) and its
    search; ``today``: its run at today's rate, where the search ran it (``search(today=True)``)."""

    candidate: Candidate
    scale: float
    rps: float
    result: CapacityResult
    probes: tuple[Probe, ...] = field(default=())
    today: SimResult | None = field(default=None, compare=False, repr=False)


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

    ``recorded=False`` (one server): the same run, outcomes only (:func:`serve`)."""
    return serve(setup, candidate, traffic.trace_at(scale), fleet, recorded)[0]


def serve(
    setup: ServingSetup, candidate: Candidate, trace: Trace, fleet: FleetSpec, recorded: bool
) -> tuple[SimResult, int | None]:
    """:func:`at_rate` on ``trace``, and the most requests present at once on its server
    (:attr:`ServingCore.peak_present`; None on a fleet).

    ``recorded=False`` (one server): served to the end with no iteration log
    (:attr:`~envs.serving.shortcuts.Shortcuts.unlogged`, whose outcomes are bit-identical to a
    recorded run's), a SimResult of its outcomes alone, no iterations, summary or token times.
    Why: the report reads every candidate's outcomes at today's rate but the iteration log and
    token times of two only (the current settings and the recommendation, which the advisor runs
    recorded); logging the others cost about half of each run and a 76 MB result to send back."""
    if fleet.servers > 1:
        return fleet_of(setup, trace, candidate, fleet).run(), None
    sim = setup.simulator(trace)
    policy = candidate.build_policy()
    if recorded:
        return sim.run(policy), sim.core.peak_present
    sim.core.shortcuts = UNLOGGED
    sim.start(policy)
    sim.run_until(policy)
    return SimResult(sim.outcomes(), {}, {}, {}), sim.core.peak_present


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
    today: bool = False,
) -> list[Found]:
    """Each candidate's capacity, in order; ``setups[i]`` serves ``candidates[i]`` (on each of
    ``fleet``'s servers: the capacity is then the fleet's; a sequence: candidate ``i`` on ``fleet[i]``).

    ``at_scale_one``: each candidate's verdict at load scale 1 from its recorded run (the fast
    search starts from it; the reference probes scale 1 again, which must agree). ``today`` (the
    fast search): instead, each search's probe at scale 1 is its run at today's rate, kept whole in
    ``Found.today`` (the first candidate's recorded, the others' outcomes only: :func:`serve`), so
    those runs share the workers with the searches rather than going first as a batch of their own.
    """
    if today and (not fast or at_scale_one is not None):
        raise ValueError(
            "today=True is the fast search's own scale-1 run: not with fast=False or at_scale_one"
        )
    queries = [AdviceQuery(traffic, rel_tol) for _ in candidates]
    fleets = [fleet] * len(candidates) if isinstance(fleet, FleetSpec) else list(fleet)
    runs = [
        TargetProbe(s, c, criterion, fast, f, today, today and i == 0)
        for i, (s, c, f) in enumerate(zip(setups, candidates, fleets, strict=True))
    ]
    if not fast:
        found = [sequential_search(q, run) for q, run in zip(queries, runs, strict=True)]
    else:
        known = [
            {} if at_scale_one is None else {1.0: Probe(1.0, at_scale_one[i], False, 0, 0)}
            for i in range(len(runs))
        ]
        if executor is not None:
            found = _fast_search(queries, runs, known, executor, n_jobs, 0)
        else:
            with backends.executor("local", n_jobs) as pool:
                found = _fast_search(queries, runs, known, pool, n_jobs, n_jobs)
    out = []
    for c, (result, probes) in zip(candidates, found, strict=True):
        rps = traffic.rate_at(result.scale) if result.scale > 0 else 0.0
        used = tuple(probes[s] for s, _ in result.evaluations)
        first = probes.get(1.0)
        out.append(
            Found(c, result.scale, rps, result, used, first.run if isinstance(first, TodayProbe) else None)
        )
    return out


def _fast_search(
    queries: Sequence[AdviceQuery],
    runs: Sequence[TargetProbe],
    known: list[dict[float, Probe]],
    executor: Executor,
    n_jobs: int,
    ahead: int,
) -> list[tuple[CapacityResult, dict[float, Probe]]]:
    """The speculative search, in two rounds: first every candidate but the larger-slot twins
    (:func:`slot_twins`), then each twin, which takes as known every probe of its leader's whose
    requests present stayed below both candidates' slots (the twin's run is that same run), and
    runs only the probes it still needs."""
    twins = slot_twins(runs)
    first = [i for i in range(len(runs)) if i not in twins]
    found: dict[int, tuple[CapacityResult, dict[float, Probe]]] = dict(
        zip(first, speculative_search([queries[i] for i in first], [runs[i] for i in first], executor,
                                      n_jobs, ahead=ahead, known=[known[i] for i in first]), strict=True)
    )  # fmt: skip
    second = list(twins)
    for i in second:
        j = twins[i]
        bound = min(runs[i].slot_bound, runs[j].slot_bound)
        shared = {
            s: _shared(p)
            for s, p in found[j][1].items()
            if p.peak_present is not None and p.peak_present < bound and s not in known[i]
        }
        known[i] = {**shared, **known[i]}
    if second:
        done = speculative_search([queries[i] for i in second], [runs[i] for i in second], executor, n_jobs,
                                  ahead=ahead, known=[known[i] for i in second])  # fmt: skip
        found.update(zip(second, done, strict=True))
    return [found[i] for i in range(len(runs))]


def _shared(probe: Probe) -> Probe:
    """A leader's probe as its twin's: no CPU seconds of its own, and a run at today's rate as
    outcomes only (as the twin's own would be; the report serves it again recorded if it needs to)."""
    if isinstance(probe, TodayProbe) and probe.run is not None:
        return replace(probe, seconds=0.0, run=SimResult(probe.run.outcomes, {}, {}, {}))
    return replace(probe, seconds=0.0)


def slot_twins(runs: Sequence[TargetProbe]) -> dict[int, int]:
    """The candidates that differ from the first (the current settings) in ``max_num_seqs`` (and
    the lookahead that follows it) alone, with more slots, each mapped to 0, its leader. Both are
    vLLM's scheduler on one server, so while the requests present stay below both candidates'
    slots neither run can tell them apart: every batch-slot check passes and the lookahead holds
    the whole queue (:attr:`ServingCore.peak_present`). Only larger caps follow: they are the ones
    the current settings' probes can speak for; a smaller cap may bind, and its own search then
    runs after the first round's instead of beside it."""
    if not runs:
        return {}
    lead = runs[0]
    return {i: 0 for i, r in enumerate(runs) if i and r.slot_bound > lead.slot_bound and r.slot_twin_of(lead)}
