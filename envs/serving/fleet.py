r"""Servers behind a router: the clock across N serving loops, as Vidur's global scheduler keeps it.

What a server owns: its queue, KV cache, decode group, clock and fast paths (a
:class:`~envs.serving.loop.ServingLoop` with its own scheduling policy).  What the fleet owns: the
arrivals (the trace, outside every server), the fleet-wide clock, the router and the SLO counts
across servers.  Per arrival at time ``t``::

    k = router.route(request, views)       # a view reads its server as of t (see below)
    servers[k].core.submit(request)

A router reads servers through :class:`~envs.serving.routing.ServerView`\ s, and a view brings its
server to ``t`` when read: the server runs to its first iteration boundary at or after ``t`` (or,
idle, to ``t``), its own fast-forwards and chunk stretches cut at ``t`` (its
:attr:`~envs.serving.core.ServingCore.horizon`), so the router sees it at most one iteration past
the arrival (an iteration is atomic, as in a real engine's step).  Servers nobody reads run on only
when read later or at the end, and a count (requests in flight, waiting, running) is read without
running a server that provably changes none of them before ``t`` (decodes only, none finishing
before ``t``, room for their KV): reading it after the run would give the same number.  So round
robin, which reads nothing, costs what N independent servers cost, and a load-aware router runs
only the servers whose counts may have moved.  After the last arrival every server runs to the end.
One server behind any router serves exactly what the single-server loop serves: the same
iterations at the same times (tested), since its stretches already end at every arrival.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from envs.serving.core import requests_of
from envs.serving.loop import (
    CountStop,
    ServingLoop,
    SimResult,
    iteration_summary,
    request_outcomes,
)
from envs.serving.metrics import request_summary
from envs.serving.request import Request
from envs.serving.routing import COUNTS, IN_FLIGHT, Router, ServerView
from envs.serving.scheduling import Policy
from envs.serving.shortcuts import Shortcuts
from envs.serving.simulator import CostModelClock
from envs.serving.workloads.trace import Trace

LINKS = ("nvlink", "ib_400g", "ib_200g", "eth_25g")
"""KV-transfer link kinds ``fleet.link`` names (used by prefill-decode disaggregation)."""
MAX_SERVERS = 1024


@dataclass(unsafe_hash=True)  # a Hydra schema (overridable) and part of a hashable run key
class FleetSpec:
    """The ``fleet`` schema: how many servers, behind which routers, in which roles.

    ``replicas`` colocated servers (prefill and decode on each) behind ``router``; or, with
    ``prefill`` > 0, ``prefill`` prefill servers and ``decode`` decode servers joined by ``link``
    (prefill-decode disaggregation), the decode side routed by ``decode_router``; ``layerwise``
    streams each prompt's KV layer by layer during its prefill, so only the rest crosses ``link``
    after it (a colocated fleet moves no KV: refused there).  The GPU count is servers x tp.  One
    server (the default) is today's single-server run, whatever the router.
    """

    replicas: int = 1
    router: str = "round_robin"
    prefill: int = 0
    decode: int = 0
    link: str = "nvlink"
    decode_router: str = "round_robin"
    layerwise: bool = False

    def __post_init__(self) -> None:
        for key in ("replicas", "prefill", "decode"):
            value = getattr(self, key)
            low = 1 if key == "replicas" else 0
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SERVERS:
                raise ValueError(f"fleet.{key}={value!r}: an integer in {low}..{MAX_SERVERS}")
        if self.link not in LINKS:
            raise ValueError(f"fleet.link={self.link!r}: one of {', '.join(LINKS)}")
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError(
                f"fleet.prefill={self.prefill} and fleet.decode={self.decode}: disaggregation needs both > 0 "
                "(both 0: colocated servers)"
            )
        if self.prefill and self.replicas != 1:
            raise ValueError(
                f"fleet.prefill={self.prefill} with fleet.replicas={self.replicas}: a disaggregated fleet "
                "sizes its pools with prefill and decode; leave replicas at 1"
            )
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"fleet.layerwise={self.layerwise!r}: true or false")
        if self.layerwise and not self.prefill:
            raise ValueError(
                "fleet.layerwise=true: layer-wise KV streaming needs a decode pool to stream to "
                "(set fleet.prefill and fleet.decode); a colocated fleet moves no KV"
            )

    @property
    def servers(self) -> int:
        return self.prefill + self.decode if self.prefill else self.replicas

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0


ONE_SERVER = FleetSpec()
"""The default fleet: one server, today's single-server run."""


@dataclass(frozen=True)
class FleetCountStop(CountStop):
    """:class:`CountStop` over every server's counts: true once the fleet's known-good requests reach
    ``good`` or its known-bad ones ``bad``.  While one server runs, the others' counts stand still, so
    the segment rule of :class:`CountStop` holds for the sums too."""

    servers: tuple[ServingLoop, ...] = ()

    def __call__(self) -> bool:
        good = bad = 0
        for s in self.servers:
            good += s.core.n_good
            bad += s.core.n_bad
        return good >= self.good or bad >= self.bad


class OverServers(ABC):
    """What every fleet (colocated or disaggregated) reads and sets over all of its ``servers``: the
    SLO counts summed (the reward, early stops and capacity probes see the whole fleet), the
    shortcuts, and a stop on the counts."""

    servers: tuple[ServingLoop, ...]
    requests: list[Request]
    trace: Trace

    @property
    def n_good(self) -> int:
        return sum(s.core.n_good for s in self.servers)

    @property
    def n_bad(self) -> int:
        return sum(s.core.n_bad for s in self.servers)

    def set_shortcuts(self, shortcuts: Shortcuts) -> None:
        for s in self.servers:
            s.core.shortcuts = shortcuts

    def count_stop(self, good: int, bad: int) -> FleetCountStop:
        """A stop on the fleet's SLO counts (see :class:`FleetCountStop`)."""
        return FleetCountStop(self.servers[0].core, good, bad, self.servers)

    @abstractmethod
    def run_until(self, stop: Callable[[], bool] | None = None) -> bool:
        """Serve the trace to the end; True if ``stop()`` held first."""

    @abstractmethod
    def result(self, wall_s: float = math.nan) -> SimResult:
        """The run's outcomes and metrics (:meth:`served` and the fleet's own columns)."""

    def run(self, stop: Callable[[], bool] | None = None) -> SimResult:
        """Serve the trace and summarise the run (see :meth:`result`)."""
        wall = time.perf_counter()
        stopped = self.run_until(stop)
        result = self.result(time.perf_counter() - wall)
        result.stopped = stopped
        return result

    def served(self) -> tuple[SimResult, list[dict[str, np.ndarray]]]:
        """The single-server summary over the whole fleet, and each server's iteration log: every
        request's outcome (``requests``, judged by the first server's SLO), the iterations of every
        server merged in time order and summarised (utilisation averaged over servers), the token
        times; :meth:`result` adds the fleet's own columns."""
        times: dict[int, np.ndarray] = {}
        for s in self.servers:
            times.update(s.core.token_times)
        outcomes = request_outcomes(self.requests, times, self.servers[0].core.slo)
        metrics = request_summary(outcomes, self.trace.span_s)
        logs = [s.log.arrays() for s in self.servers]
        order = np.argsort(np.concatenate([it["start"] for it in logs]), kind="stable")
        merged = {k: np.concatenate([it[k] for it in logs])[order] for k in logs[0]}
        metrics.update(iteration_summary(merged, self.servers[0].core.kv.total, outcomes))
        metrics["busy_fraction"] /= len(self.servers)  # the mean over servers
        return SimResult(outcomes, merged, metrics, times), logs


class Fleet(OverServers):
    """N serving loops, one scheduling policy each, behind ``router``, serving ``trace``.

    Args:
        trace: every request of the run (arrivals come from here, never from a server).
        servers: loops with empty cores (``Simulator(..., serve_trace=False)``), one per replica.
        policies: each server's scheduling policy (a fresh object per server: policies keep state).
        router: names the server of each arrival; its ``reset`` is called with ``seed``.
    """

    def __init__(
        self,
        trace: Trace,
        servers: Sequence[ServingLoop],
        policies: Sequence[Policy],
        router: Router,
        seed: int = 0,
    ) -> None:
        if not servers or len(servers) != len(policies):
            raise ValueError(
                f"a fleet needs >= 1 server and one policy per server, got {len(servers)} and {len(policies)}"
            )
        if any(s.core.requests for s in servers):
            raise ValueError("fleet servers start empty: requests reach them only through the router")
        self.trace = trace
        self.servers = tuple(servers)
        self.policies = tuple(policies)
        self.router = router
        self.seed = seed
        self.requests = requests_of(trace)
        self.next_arrival = 0  # index of the next request to route
        self.views = tuple(ServerView(i, s.core, self._sync) for i, s in enumerate(self.servers))
        self._t = -math.inf  # the arrival being routed: views bring their servers to it
        # Per server, a time before which its counts cannot change (settled_until), None: not known.
        self._settled: list[float | None] = [None] * len(self.servers)
        self._flight_settled: list[float | None] = [None] * len(self.servers)  # in_flight_settled_until
        self._floors: list[float | None] = [None] * len(self.servers)  # least_iteration_latency
        self._refusable = [False] * len(self.servers)  # a routed, unadmitted request it will reject
        self._stop: Callable[[], bool] | None = None
        self._started = False

    @property
    def now(self) -> float:
        """The fleet's clock: the next arrival to route (the end of the last iteration once all are)."""
        if self.next_arrival < len(self.requests):
            return self.requests[self.next_arrival].arrival
        return max(s.core.now for s in self.servers)

    def start(self) -> None:
        """Reset the policies and the router; called once, before the first arrival is routed."""
        for server, policy in zip(self.servers, self.policies, strict=True):
            server.start(policy)
        self.router.reset(len(self.servers), self.seed)
        self._started = True

    def advance_to(self, t: float, stop: Callable[[], bool] | None = None) -> bool:
        """Run every server with work to its first iteration boundary at or after ``t`` (idle ones
        wait); True if ``stop()`` held first (the servers then stand where it held)."""
        return any(self._advance(i, t, stop) for i in range(len(self.servers)))

    def _advance(self, i: int, t: float, stop: Callable[[], bool] | None) -> bool:
        """Run server ``i`` to its first iteration boundary at or after ``t``; True if ``stop()`` held."""
        server, core = self.servers[i], self.servers[i].core
        if core.now >= t or not (core.queue or core.decode.n or core.next_arrival < len(core.requests)):
            return False
        core.horizon = t
        return server.run_until(self.policies[i], stop=stop, until_s=t) and (stop is not None and stop())

    def _sync(self, i: int, reads: int) -> None:
        """What a view of server ``i`` calls before it reads (``reads``: :data:`~envs.serving.routing.IN_FLIGHT`,
        :data:`~envs.serving.routing.COUNTS` or :data:`~envs.serving.routing.STATE`): bring the server
        to the arrival being routed, unless what is read provably stands until then."""
        t = self._t
        if self.servers[i].core.now >= t:
            return
        if reads == IN_FLIGHT:
            settled = self._flight_settled[i]
            if settled is None:
                server = self.servers[i]
                if self._refusable[i] and server.core.next_arrival == len(server.core.requests):
                    self._refusable[i] = False  # every routed request admitted: the refused ones are out
                self._flight_settled[i] = settled = (
                    -math.inf if self._refusable[i] else in_flight_settled_until(server, self._floor(i))
                )
            if t < settled:
                return
        elif reads == COUNTS:
            settled = self._settled[i]
            if settled is None:
                self._settled[i] = settled = settled_until(self.servers[i])
            if t < settled:
                return
        self._settled[i] = self._flight_settled[i] = None  # the server moves: computed again when asked
        self._advance(i, t, self._stop)

    def _floor(self, i: int) -> float:
        """Server ``i``'s least possible iteration latency (0: none known), once per run."""
        floor = self._floors[i]
        if floor is None:
            self._floors[i] = floor = least_iteration_latency(self.servers[i])
        return floor

    def route_next(self) -> int:
        """Route the next arrival (views bring the servers the router reads to its time); the server
        it went to."""
        req = self.requests[self.next_arrival]
        self._t = req.arrival
        k = self.router.route(req, self.views)
        if not 0 <= k < len(self.servers):
            raise ValueError(
                f"router {self.router.name!r} sent request {req.rid} to server {k} of {len(self.servers)}"
            )
        core = self.servers[k].core
        core.submit(req)
        self._settled[k] = -math.inf  # a request to admit: its counts move at its arrival
        self._flight_settled[k] = None
        self._refusable[k] = self._refusable[k] or bool(core.refusal(req))  # leaves flight at admission
        self.next_arrival += 1
        return k

    def run_until(self, stop: Callable[[], bool] | None = None) -> bool:
        """Route every arrival and serve to the end; True if ``stop()`` held first (asked between a
        server's iterations, as :meth:`ServingLoop.run_until` asks it, and before each arrival)."""
        if not self._started:
            self.start()
        self._stop = stop
        reqs = self.requests
        while self.next_arrival < len(reqs):
            if stop is not None and stop():
                return True
            self.route_next()
        for server, policy in zip(self.servers, self.policies, strict=True):
            server.core.horizon = math.inf
            if server.run_until(policy, stop=stop) and stop is not None and stop():
                return True
        return False

    def result(self, wall_s: float = math.nan) -> SimResult:
        """Fleet-wide outcomes and metrics: the single-server ones over every request, iterations
        summed, utilisation averaged over servers, plus the fleet's own columns."""
        result, _ = self.served()
        metrics = result.metrics
        served = np.array(
            [sum(r.prompt_len + r.generated for r in s.core.finished) for s in self.servers], float
        )
        metrics["load_imbalance"] = float(served.max() / served.mean()) if served.sum() > 0 else math.nan
        metrics["sim_wall_s"] = wall_s
        return result


def settled_until(server: ServingLoop) -> float:
    """A time before which no request of ``server`` is admitted, rejected, finished or preempted
    (-inf: none is known).  It holds when nothing is queued or routed and not yet admitted, and the
    decodes (if any) run on a cost-model clock whose latencies never shrink as contexts grow: then
    the next finish or KV shortage is at least that many decode iterations of today's latency away.
    The counts a router reads stay as they are until then."""
    core = server.core
    if core.queue or core.next_arrival < len(core.requests):
        return -math.inf
    dec = core.decode
    if not dec.n:
        return math.inf  # idle: nothing happens until a request is routed here
    clock = server.executor.chunk_clock
    if not isinstance(clock, CostModelClock) or not core.latency_monotone:
        return -math.inf
    first = clock.cost.iteration_time(dec.n, dec.context_sum(dec.clock), (), ()) * clock.time_scale
    if not first > 0:
        return -math.inf
    # Iterations that surely run without a change: before the next finish, and while every member's
    # next block (one per block_size iterations each) fits in the free KV blocks.
    quiet = min(dec.next_finish() - dec.clock, core.kv.free // dec.n * dec.bs) - 1
    return core.now + quiet * first if quiet > 0 else -math.inf


def least_iteration_latency(server: ServingLoop) -> float:
    """A lower bound on any iteration's latency on ``server`` (0: none known): on a cost-model clock
    whose latencies never shrink as a batch grows, the smaller of one decode over one token of
    context and a one-token prefill chunk."""
    clock = server.executor.chunk_clock
    if not isinstance(clock, CostModelClock) or not server.core.latency_monotone:
        return 0.0
    cost = clock.cost
    return min(cost.iteration_time(1, 1, (), ()), cost.iteration_time(0, 0, (1,), (0,))) * clock.time_scale


def in_flight_settled_until(server: ServingLoop, floor: float) -> float:
    """A time before which no request of ``server`` finishes or is rejected, so its requests in flight
    stay as they are (-inf: none known).  Admissions, prefill chunks and preemptions move requests
    between waiting and running, never in or out of flight (the caller rules out rejections: they are
    known from the request and the server, :meth:`~envs.serving.core.ServingCore.refusal`).  A finish needs at least as
    many more iterations as the request has tokens left to emit (the decodes' next finish, a queued
    prompt's tokens left after its prefill's one), each at least ``floor`` long; and while the KV cache
    can hold every block the queued prompts and the decodes could take until then (so nobody is
    preempted), an iteration that steps the decodes costs at least what they cost now."""
    if not floor > 0:
        return -math.inf
    core = server.core
    kv, dec = core.kv, core.decode
    steps, blocks = math.inf, 0
    for req in core.queue:
        steps = min(steps, req.output_len - req.generated)
        blocks += kv.blocks_for(req.target + req.output_len - req.generated)
    for req in core.pending:  # none the server rejects (the fleet asks before it calls this)
        steps = min(steps, req.output_len)
        blocks += kv.blocks_for(req.prompt_len + req.output_len)
    until = core.now + (steps - 1) * floor if steps > 1 else -math.inf
    if not dec.n:
        return until  # inf when idle with nothing routed here: nothing happens until a request is
    left = dec.next_finish() - dec.clock
    decode = core.now + (left - 1) * floor
    clock = server.executor.chunk_clock
    if isinstance(clock, CostModelClock) and blocks + dec.n * -(-left // dec.bs) <= kv.free:
        step = clock.cost.iteration_time(dec.n, dec.context_sum(dec.clock), (), ()) * clock.time_scale
        decode = core.now + (left - 1) * max(step, floor)
    return min(until, decode) if left > 1 else -math.inf
