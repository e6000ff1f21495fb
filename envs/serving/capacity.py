"""Capacity of a policy on a workload: the shared load-scale search run on the simulator.

Two definitions (see :mod:`envs.serving.metrics`): ``attain90`` (DistServe: the highest
load at which >= 90% of requests meet their SLO) and ``tbt`` (Sarathi-Serve: the highest
load at which P99 TBT <= the TPOT bound and the median scheduling delay <= 2 s).  The
window (requests and their order) is fixed by the seed; load scaling only compresses
its arrival times, so every probe serves the same requests.

Three mechanisms make a search fast without changing its answer (``early_stop=False,
parallel=1`` is the reference path):

* early stop: an ``attain90`` probe is decided from the core's SLO counters
  (:mod:`envs.serving.early`): it ends the moment its pass/fail is proven, and it records
  no iteration log and builds no summary (nothing reads them); ``tbt`` probes always run
  to the end and are judged on the summary.
* shortcuts, one switch (:class:`~envs.serving.shortcuts.Shortcuts`, set on the probe's core):
  cheaper SLO verdicts and stretch bookkeeping, decode fast-forward, chunk stretches run without
  asking the policy (:class:`~envs.serving.stretches.FollowsChunks`), a segment up to the next
  event at a time (the probe's stop is a :class:`~envs.serving.loop.CountStop`), every budget
  level of an iteration from one pass (:func:`~envs.serving.budgets.budget_plans`), whose plans
  carry the price it computed, so the clock does not price them again (``Plan.latency``), and
  with ``early_stop`` a latency EWMA folded only if read and no iteration log
  (:data:`~envs.serving.shortcuts.PROBE_SHORTCUTS`).  The reference path's probes run with none
  of them (:data:`~envs.serving.shortcuts.NO_SHORTCUTS`).
* speculative search: with ``parallel=k``, k probes run at once, the next one of the
  sequential search and, breadth first, those it would make after each possible outcome;
  the search then follows the outcomes exactly as the sequential one does, so it decides
  on the same probe sequence and finds the same bracket, bit for bit.  In the local pool the
  quickest searches' next probes wait queued behind the running ones, so no worker idles
  between two probes and a long search's next one waits behind little.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field, replace
from typing import Protocol

from chunkgym import backends
from envs.serving.early import Attain90Stop
from envs.serving.fleet import ONE_SERVER, FleetSpec
from envs.serving.metrics import (
    MIN_REL_TOL,
    CapacityResult,
    attain90,
    capacity_search,
    capacity_steps,
    tbt_criterion,
)
from envs.serving.routing import Router
from envs.serving.scheduling import Policy
from envs.serving.setup import ServingSetup
from envs.serving.shortcuts import NO_SHORTCUTS, PROBE_SHORTCUTS
from envs.serving.simulator import Simulator
from envs.serving.workload import Workload
from envs.serving.workloads.trace import Trace

CRITERIA = ("attain90", "tbt")
MAX_PROBES = 64
"""Probes one search may make: doubling or halving between 1/64 and 1024 takes at most 17 and
bisecting to :data:`MIN_REL_TOL` about 20; more means the search is not converging."""


def check_rel_tol(rel_tol: float) -> None:
    """A search's relative tolerance: in ``[MIN_REL_TOL, 1)``."""
    if not MIN_REL_TOL <= rel_tol < 1:
        raise ValueError(f"capacity rel_tol must be in [{MIN_REL_TOL:g}, 1), got {rel_tol!r}")


@dataclass(frozen=True)
class Probe:
    """One load point of a search: its outcome and how much of the run decided it."""

    scale: float
    passed: bool
    decided_early: bool  # the run stopped as soon as the outcome was proven
    requests_decided: int  # requests known good or bad when it stopped (all of them at the end)
    requests: int
    seconds: float = field(default=0.0, compare=False)  # CPU seconds it took (to order searches by)
    # The most requests present on the server at once up to the verdict (ServingCore.peak_present;
    # None: not counted, as on a fleet): below a max_num_seqs, that cap never bound.
    peak_present: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Capacity:
    """A capacity in load scale and in requests per second, with the search's bracket.

    ``probes``: the sequential search's probes, in order (``result.evaluations``' scales);
    ``speculative``: probes run ahead of time that the search did not need.
    """

    criterion: str
    scale: float
    rps: float
    result: CapacityResult
    probes: tuple[Probe, ...] = ()
    speculative: int = 0


@dataclass(frozen=True)
class ProbeRun:
    """What a probe needs besides its trace: small and picklable, so a pool worker runs it."""

    setup: ServingSetup
    make_policy: Callable[[], Policy]
    criterion: str
    early_stop: bool
    fleet: FleetSpec = ONE_SERVER
    make_router: Callable[[], Router] | None = None  # for fleets of more than one server
    make_decode_router: Callable[[], Router] | None = None  # for a disaggregated fleet's decode pool

    def __call__(self, scale: float, trace: Trace) -> Probe:
        start = time.process_time()
        probe = self._run(scale, trace)
        return replace(probe, seconds=time.process_time() - start)

    def _run(self, scale: float, trace: Trace) -> Probe:
        if self.fleet.servers > 1:
            return self._run_fleet(scale, trace)
        sim = self.setup.simulator(trace)
        core = sim.core
        if not self.early_stop:
            core.shortcuts = NO_SHORTCUTS
        if self.early_stop and self.criterion == "attain90":
            return _decide(sim, self.make_policy(), Attain90Stop.for_requests(len(trace)), scale)
        result = sim.run(self.make_policy())
        decided = core.n_good + core.n_bad
        if self.criterion == "attain90":
            passed = attain90(result.metrics)
        else:
            passed = tbt_criterion(result.metrics, self.setup.slo.tpot_s)
        return Probe(scale, passed, False, decided, len(trace))

    def _run_fleet(self, scale: float, trace: Trace) -> Probe:
        """:meth:`_run` on the fleet ``fleet`` names (colocated or disaggregated), its SLO counts
        summed over its servers."""
        assert self.make_router is not None, "a fleet of more than one server needs a router"
        decode_router = None if self.make_decode_router is None else self.make_decode_router()
        fleet = self.setup.fleet_for(trace, self.fleet, self.make_policy, self.make_router(), decode_router)
        if not self.early_stop:
            fleet.set_shortcuts(NO_SHORTCUTS)
        elif self.criterion == "attain90":
            proof = Attain90Stop.for_requests(len(trace))
            fleet.set_shortcuts(PROBE_SHORTCUTS)
            stop = fleet.count_stop(proof.good, proof.bad)
            early = fleet.run_until(stop)
            assert stop(), "a finished run has every request known good or bad"
            return Probe(scale, fleet.n_good >= proof.good, early, fleet.n_good + fleet.n_bad, len(trace))
        result = fleet.run()
        decided = fleet.n_good + fleet.n_bad
        if self.criterion == "attain90":
            passed = attain90(result.metrics)
        else:
            passed = tbt_criterion(result.metrics, self.setup.slo.tpot_s)
        return Probe(scale, passed, False, decided, len(trace))


def _decide(sim: Simulator, policy: Policy, proof: Attain90Stop, scale: float) -> Probe:
    """Serve until ``proof`` knows the outcome, unrecorded: it always does by the end, where
    every request is known good or bad (``n_good + n_bad == N``, so one threshold is met)."""
    core = sim.core
    core.shortcuts = PROBE_SHORTCUTS
    sim.start(policy)
    proven = proof.watching(core)
    early = sim.run_until(policy, stop=proven)
    assert proven(), "a finished run has every request known good or bad"
    return Probe(scale, proof.passed(core), early, core.n_good + core.n_bad, len(core.requests))


class SearchQuery(Protocol):
    """What :func:`speculative_search` needs of a search: its trace at a scale and its tolerance."""

    @property
    def rel_tol(self) -> float: ...

    def trace_at(self, scale: float) -> Trace: ...


@dataclass(frozen=True)
class CapacityQuery:
    """One search: ``make_policy``'s capacity on one window of ``workload`` (or its whole split)."""

    setup: ServingSetup
    workload: Workload
    make_policy: Callable[[], Policy]
    criterion: str = "attain90"
    split: str = "test"
    seed: int = 0
    window_s: float | None = None
    rel_tol: float = 0.01
    whole_split: bool = False
    fleet: FleetSpec = ONE_SERVER
    make_router: Callable[[], Router] | None = None
    make_decode_router: Callable[[], Router] | None = None

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ValueError(f"unknown capacity criterion {self.criterion!r}; valid: {', '.join(CRITERIA)}")
        check_rel_tol(self.rel_tol)

    def trace_at(self, scale: float) -> Trace:
        if self.whole_split:
            return self.workload.split(self.split, self.seed, scale)
        return self.workload.window(self.split, self.seed, scale, self.window_s)

    def capacity(self, result: CapacityResult, probes: dict[float, Probe]) -> Capacity:
        rps = 0.0
        if result.scale > 0:
            trace = self.trace_at(result.scale)
            rps = len(trace) / trace.span_s
        used = tuple(probes[s] for s, _ in result.evaluations)
        return Capacity(self.criterion, result.scale, rps, result, used, len(probes) - len(used))


def measure_capacity(
    setup: ServingSetup,
    workload: Workload,
    make_policy: Callable[[], Policy],
    criterion: str = "attain90",
    split: str = "test",
    seed: int = 0,
    window_s: float | None = None,
    rel_tol: float = 0.01,
    whole_split: bool = False,
    early_stop: bool = True,
    parallel: int = 1,
    executor: Executor | None = None,
    fleet: FleetSpec = ONE_SERVER,
    make_router: Callable[[], Router] | None = None,
    make_decode_router: Callable[[], Router] | None = None,
) -> Capacity:
    """Search the load scale for ``criterion`` on one window (or the whole split).

    ``make_policy`` builds a fresh policy per probe, so stateful policies start clean (with
    ``parallel > 1`` it must pickle: a registry name in ``functools.partial``, not a lambda).
    ``rps`` is the request rate at the found scale: requests / span of the scaled window.
    ``early_stop`` and ``parallel``: see :func:`measure_capacities`.  ``fleet``: servers behind
    ``make_router()``'s router, each scheduling with its own ``make_policy()`` (the fleet's capacity);
    a disaggregated ``fleet`` routes its decode pool with ``make_decode_router()``.
    """
    query = CapacityQuery(
        setup,
        workload,
        make_policy,
        criterion,
        split,
        seed,
        window_s,
        rel_tol,
        whole_split,
        fleet,
        make_router,
        make_decode_router,
    )
    return measure_capacities([query], early_stop, parallel, executor)[0]


def measure_capacities(
    queries: Sequence[CapacityQuery],
    early_stop: bool = True,
    parallel: int = 1,
    executor: Executor | None = None,
) -> list[Capacity]:
    """Every query's capacity, in order.

    ``parallel``: probes in flight, on ``executor`` (None: a local process pool of that many
    workers; ``with chunkgym.backends.executor("ray", parallel) as pool``: a Ray cluster's tasks);
    the searches' next probes go first, then speculative ones, nearest first; in the local pool
    up to ``parallel`` more of the quickest searches' next probes wait queued behind them
    (``ahead``, see :func:`speculative_search`).  ``parallel=1`` runs the searches one after the other, each
    probe here when asked for.
    """
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    runs = [
        ProbeRun(
            q.setup, q.make_policy, q.criterion, early_stop, q.fleet, q.make_router, q.make_decode_router
        )
        for q in queries
    ]
    if parallel == 1:
        return [q.capacity(*sequential_search(q, run)) for q, run in zip(queries, runs, strict=True)]
    if executor is None:
        with backends.executor("local", parallel) as pool:
            found = speculative_search(queries, runs, pool, parallel, ahead=parallel)
    else:
        found = speculative_search(queries, runs, executor, parallel)
    return [q.capacity(*f) for q, f in zip(queries, found, strict=True)]


def sequential_search(
    query: SearchQuery, run: Callable[[float, Trace], Probe]
) -> tuple[CapacityResult, dict[float, Probe]]:
    """The reference search: :func:`metrics.capacity_search`, one probe at a time."""
    check_rel_tol(query.rel_tol)
    probes: dict[float, Probe] = {}

    def passes(scale: float) -> bool:
        if len(probes) >= MAX_PROBES:
            raise RuntimeError(
                f"capacity search: {MAX_PROBES} probes without converging (rel_tol={query.rel_tol!r})"
            )
        probes[scale] = probe = run(scale, query.trace_at(scale))
        return probe.passed

    return capacity_search(passes, rel_tol=query.rel_tol), probes


def speculative_search(
    queries: Sequence[SearchQuery],
    runs: Sequence[Callable[[float, Trace], Probe]],
    executor: Executor,
    width: int,
    ahead: int = 0,
    known: Sequence[dict[float, Probe]] | None = None,
) -> list[tuple[CapacityResult, dict[float, Probe]]]:
    """:func:`metrics.capacity_search` for each query with up to ``width`` probes in flight.

    Per query: its result and every probe run (its own and the speculative ones), by scale.
    The executor is the backend: anything whose ``submit`` returns futures (a local process
    pool, or :class:`chunkgym.backends.RayExecutor`'s tasks).  Probes nearer the searches'
    current state go first, and among those of one depth the slowest search's (by its probes'
    mean CPU seconds so far; a search with none yet counts as slowest), so that the long searches
    start at once and the short ones fill the gaps; the order changes no outcome.  Besides,
    a buffer of up to ``ahead`` more probes waits in the executor's queue (for an executor of
    ``width`` workers that runs them in order), so a worker that finishes starts one at once
    instead of idling while this process hears of it, picks and sends another: the quickest
    searches' next probes (never speculative ones), so that a long search's next probe, sent
    when its last one ends, waits behind little.  Probes pending when the search ends are
    cancelled (a process pool drops the queued ones; Ray also stops the running ones).
    ``known``: probes each search already has (by scale), which it follows without running again.
    """
    for query in queries:
        check_rel_tol(query.rel_tol)
    done: list[dict[float, Probe]] = [dict(k) for k in known] if known is not None else [{} for _ in queries]
    results: dict[int, CapacityResult] = {}
    running: dict[tuple[int, float], Future[Probe]] = {}
    buffered: set[tuple[int, float]] = set()  # those of them submitted as the buffer (``ahead``)
    seconds: list[list[float]] = [[] for _ in queries]  # each query's finished probes' CPU seconds

    def mean_seconds(i: int) -> float:
        took = seconds[i]
        return sum(took) / len(took) if took else math.inf

    def priority(item: tuple[int, int, float]) -> tuple[int, float]:
        return item[0], -mean_seconds(item[1])

    def submit(i: int, scale: float) -> None:
        running[i, scale] = executor.submit(runs[i], scale, queries[i].trace_at(scale))

    while True:
        frontiers, nexts = [], []
        for i, query in enumerate(queries):
            if i in results:
                continue
            state = _follow(done[i], rel_tol=query.rel_tol)
            if isinstance(state, CapacityResult):
                results[i] = state
                continue
            history, scale = state
            if len(history) >= MAX_PROBES:
                raise RuntimeError(
                    f"capacity search: {MAX_PROBES} probes without converging (rel_tol={query.rel_tol!r})"
                )
            frontiers.append(_frontier(i, history, done[i], rel_tol=query.rel_tol))
            nexts.append((i, scale))
        if len(results) == len(queries):
            for future in running.values():
                future.cancel()
            return [(results[i], done[i]) for i in range(len(queries))]
        picked = len(running) - len(buffered)
        for depth, i, scale in heapq.merge(*frontiers, key=priority) if picked < width else ():
            if depth and len(running) >= width:
                break  # speculative probes run only on a worker that would idle
            if (i, scale) not in running:
                submit(i, scale)
                picked += 1
                if picked >= width:
                    break
        # The buffer: the quickest searches' next probes, queued behind those, so a freed worker
        # starts one at once, and a long search's next probe, submitted when its last one ends,
        # waits behind little.
        waiting = sorted((mean_seconds(i), i, scale) for i, scale in nexts if (i, scale) not in running)
        for _, i, scale in waiting[: max(0, ahead - len(buffered))]:
            submit(i, scale)
            buffered.add((i, scale))
        finished, _ = wait(running.values(), return_when=FIRST_COMPLETED)
        for (i, scale), future in list(running.items()):
            if future in finished:
                done[i][scale] = probe = future.result()
                seconds[i].append(probe.seconds)
                del running[i, scale]
                buffered.discard((i, scale))


def _follow(done: dict[float, Probe], **search: float) -> tuple[list[bool], float] | CapacityResult:
    """The sequential search's outcomes so far (up to its first unknown probe) and that probe's
    scale, or its result."""
    history: list[bool] = []
    nxt = _after(history, **search)
    while not isinstance(nxt, CapacityResult) and nxt in done:
        history.append(done[nxt].passed)
        nxt = _after(history, **search)
    return nxt if isinstance(nxt, CapacityResult) else (history, nxt)


def _after(outcomes: list[bool], **search: float) -> float | CapacityResult:
    """The scale the sequential search probes after ``outcomes``, or its result (a replay)."""
    steps = capacity_steps(**search)
    try:
        scale = next(steps)
        for ok in outcomes:
            scale = steps.send(ok)
    except StopIteration as end:
        result: CapacityResult = end.value  # the generator's return value
        return result
    return scale


def _frontier(
    index: int, history: list[bool], done: dict[float, Probe], **search: float
) -> Iterator[tuple[int, int, float]]:
    """(depth, ``index``, scale) of the probes without a result that search ``index`` may make
    next, nearest first (breadth first, pass before fail); a known probe's subtree is followed
    along its outcome only."""
    level, depth = [history], 0
    while level:
        below = []
        for outcomes in level:
            scale = _after(outcomes, **search)
            if isinstance(scale, CapacityResult):
                continue
            if scale in done:
                below.append([*outcomes, done[scale].passed])
                continue
            yield depth, index, scale
            below += [[*outcomes, True], [*outcomes, False]]
        level, depth = below, depth + 1
