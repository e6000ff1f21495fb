r"""Prefill-decode disaggregation: a pool of prefill servers, a pool of decode servers, a KV link between.

Roles (hooks on :class:`~envs.serving.core.ServingCore`, docs/disaggregation.md "Roles and hand-over"):

* a **prefill server** serves arrivals (routed by ``router``) under any scheduling policy, whole or
  chunked.  When a prompt's prefill ends it emits the first token there (TTFT ends, the prefill
  server's SLO book judges it) and, if the request has tokens left, hands it over instead of
  decoding it: its KV blocks stay held on the prefill server;
* the **link** of that prefill server (one :class:`~envs.serving.kv_transfer.Link` per prefill
  server: its NIC or NVLink port; transfers leaving the same server share its bandwidth) carries
  ``kv_transfer_bytes(model, req.computed, tp)`` from the hand-over on; with ``layerwise`` only the
  part :func:`~envs.serving.kv_transfer.exposed_transfer_time` leaves after the prefill is put on the
  shared link (the layers streamed during the prefill are taken as sent alone);
* at the hand-over ``decode_router`` names the decode server (reading :class:`DecodeView`\ s, which
  count requests on their way there); once the KV has landed, the decode server admits the request
  at its first iteration start with room for the request's blocks, the decodes' next blocks and a
  batch slot (first landed, first admitted), and at that moment the prefill server frees its blocks:
  at every instant a request's KV blocks are held by exactly one server;
* a **decode server** decodes (and recomputes a request it preempts, as a colocated server would);
  its first decode token's gap from the first token includes the transfer and the wait for room, and
  its stall and TPOT checks see it, as every token time of a request is one sequence (the first a
  time, the rest ranges of the decode server's clock).  The decode server judges stalls, TPOT and the
  finish; a request judged bad at the prefill server is never judged again, so each request counts
  good or bad once, fleet-wide.

Time is kept **eagerly**: one event at a time, in time order, each server run one iteration per
event (its fast paths cut at that iteration's end).  Events at one time go: link completions,
hand-overs, arrivals, decode servers' iterations, prefill servers' iterations (by index), so a
server plans with every release, landing and arrival up to its iteration start, and a router reads
servers at their first iteration boundary at or after the event, as :class:`~envs.serving.fleet.Fleet`'s
views do.  A prefill server whose queue cannot move for KV held by handed-over requests waits for
their release (instead of preempting).  Reruns are bit-identical.  Laziness (running a server past
other servers' events) is left out: a decode admission frees blocks on a prefill server at a time no
bound known in advance limits, which would make it risky.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from envs.serving.core import ServingCore, requests_of
from envs.serving.fleet import OverServers
from envs.serving.kv_transfer import Link, LinkSpec, exposed_transfer_time, kv_transfer_bytes
from envs.serving.loop import ServingLoop, SimResult
from envs.serving.request import Request
from envs.serving.routing import Router, ServerView
from envs.serving.scheduling import Plan, Policy, ServingView
from envs.serving.specs import ModelSpec
from envs.serving.workloads.trace import Trace

# Event kinds, in the order they are taken at one time.
LANDING, HANDOVER, ARRIVAL, DECODE_STEP, PREFILL_STEP = range(5)


class _Blocked(Exception):
    """A prefill server's policy has nothing to plan while handed-over KV is held there."""


class WaitsForHeldKv(Policy):
    """A prefill server's policy: ``inner``'s plans, but where it plans nothing while the server holds
    handed-over KV the server waits for that KV to be taken (:class:`_Blocked` ends the iteration
    before anything changes) instead of evicting cached prefixes or failing on an empty plan."""

    def __init__(self, inner: Policy, core: ServingCore) -> None:
        self.inner = inner
        self.core = core
        self.name = inner.name
        self.preemption = inner.preemption

    def reset(self, view: ServingView) -> None:
        self.inner.reset(view)

    def plan(self, view: ServingView) -> Plan:
        plan = self.inner.plan(view)
        core = self.core
        if core.held and not plan.chunks and not (plan.decode and core.decode.n):
            raise _Blocked
        return plan


@dataclass
class Transfer:
    """One request's hand-over: its times (s) and where it went."""

    rid: int
    prefill: int  # index of the prefill server
    decode: int = -1  # index of the decode server (-1: not chosen yet)
    start: float = math.nan  # prefill end: the first token, the transfer's start
    landed: float = math.nan  # the KV is on the decode side
    admitted: float = math.nan  # the decode server took it: the prefill server freed its blocks
    nbytes: float = 0.0

    @property
    def transfer_s(self) -> float:
        return self.landed - self.start


class DecodeView(ServerView):
    """A decode server as the decode router reads it: requests handed to it whose KV has not been
    admitted yet (in flight on a link, or landed and waiting for room) count as waiting."""

    __slots__ = ("_incoming",)

    def __init__(self, index: int, core: ServingCore, incoming: list[int]) -> None:
        super().__init__(index, core)
        self._incoming = incoming  # the fleet's counts per decode server, read live

    @property
    def waiting(self) -> int:
        return super().waiting + self._incoming[self.index]

    @property
    def in_flight(self) -> int:
        return super().in_flight + self._incoming[self.index]


class DisaggregatedFleet(OverServers):
    """``prefill`` servers behind ``router`` and ``decode`` servers behind ``decode_router``, joined by
    ``link`` (see the module's docstring).

    Args:
        trace: every request of the run.
        prefill, decode: loops with empty cores (``Simulator(..., serve_trace=False)``), one per server;
            the two pools may have different setups (GPU, cost model, KV size).
        prefill_policies, decode_policies: one fresh scheduling policy per server.
        router, decode_router: name the prefill server of each arrival, the decode server of each
            hand-over; ``reset`` with ``seed``.
        link: the link kind of every prefill server's link.
        model, tp: what sizes a transfer (:func:`~envs.serving.kv_transfer.kv_transfer_bytes`, with
            the prefill side's ``tp``, as the link model assumes one ``tp`` on both sides).
        layerwise: stream the KV layer by layer during the prefill (only the exposed part is sent
            after it; see the module's docstring).
        decode_tp: GPUs per decode server (default ``tp``), for ``goodput_per_gpu``.
    """

    def __init__(
        self,
        trace: Trace,
        prefill: Sequence[ServingLoop],
        decode: Sequence[ServingLoop],
        prefill_policies: Sequence[Policy],
        decode_policies: Sequence[Policy],
        router: Router,
        decode_router: Router,
        link: LinkSpec,
        model: ModelSpec,
        tp: int = 1,
        layerwise: bool = False,
        seed: int = 0,
        decode_tp: int | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError(
                f"a disaggregated fleet needs >= 1 prefill and >= 1 decode server, got "
                f"{len(prefill)} and {len(decode)}"
            )
        if len(prefill) != len(prefill_policies) or len(decode) != len(decode_policies):
            raise ValueError("one scheduling policy per server")
        if any(s.core.requests for s in (*prefill, *decode)):
            raise ValueError("fleet servers start empty: requests reach them only through the routers")
        self.trace = trace
        self.prefill = tuple(prefill)
        self.decode = tuple(decode)
        self.servers = (*self.prefill, *self.decode)
        self.prefill_policies = tuple(
            WaitsForHeldKv(p, s.core) for p, s in zip(prefill_policies, prefill, strict=True)
        )
        self.decode_policies = tuple(decode_policies)
        self.router = router
        self.decode_router = decode_router
        self.link_spec = link
        self.model = model
        self.tp = tp
        self.decode_tp = tp if decode_tp is None else decode_tp
        self.layerwise = layerwise
        self.seed = seed
        self.requests = requests_of(trace)
        self.next_arrival = 0
        self.links = tuple(Link(link) for _ in self.prefill)
        self._peek: list[tuple[float, int] | None] = [None] * len(self.links)  # next completion, cached
        self._peeked = [False] * len(self.links)
        self.transfers: dict[int, Transfer] = {}  # by request id, in hand-over order
        self._handovers: list[tuple[float, int, int]] = []  # heap of (time, seq, rid): to route and send
        self._seq = 0
        self.incoming = [0] * len(self.decode)  # handed to each decode server, not admitted yet
        self.prefill_views = tuple(ServerView(i, s.core) for i, s in enumerate(self.prefill))
        self.decode_views = tuple(DecodeView(k, s.core, self.incoming) for k, s in enumerate(self.decode))
        self.blocked = [False] * len(self.prefill)  # waits for held KV to be taken
        self.time = -math.inf  # the time of the last event taken
        self._stop: Callable[[], bool] | None = None
        self._stopped = False
        self._started = False
        for i, server in enumerate(self.prefill):
            core = server.core
            core.on_handover = self._make_handover(i)
            core.extra_refusal = self._decode_refusal
        for server in self.decode:
            server.core.on_accept = self._accepted

    # ---- the Fleet's interface -------------------------------------------------------------
    @property
    def now(self) -> float:
        """The fleet's clock: the last event taken (the end of the last iteration once all are)."""
        if self.done():
            return max(s.core.now for s in self.servers)
        return self.time

    def start(self) -> None:
        for server, policy in zip(self.servers, (*self.prefill_policies, *self.decode_policies), strict=True):
            server.start(policy)
        self.router.reset(len(self.prefill), self.seed)
        self.decode_router.reset(len(self.decode), self.seed)
        self._started = True

    # ---- hooks the cores call ----------------------------------------------------------------
    def _make_handover(self, i: int) -> Callable[[Request, float], None]:
        def handover(req: Request, t: float) -> None:
            self.transfers[req.rid] = Transfer(req.rid, i, start=t)
            heapq.heappush(self._handovers, (t, self._seq, req.rid))
            self._seq += 1

        return handover

    def _decode_refusal(self, req: Request) -> str:
        """Why the decode pool could never hold ``req`` ("" if it can, or it never goes there)."""
        if req.output_len <= 1:
            return ""
        reason = self.decode[0].core.refusal(req)  # one setup for the pool
        return f"decode pool: {reason}" if reason else ""

    def _accepted(self, req: Request) -> None:
        """A decode server admitted ``req`` (at its clock): the prefill server frees its KV now."""
        tr = self.transfers[req.rid]
        tr.admitted = t = self.decode[tr.decode].core.now
        self.incoming[tr.decode] -= 1
        self.prefill[tr.prefill].core.release_held(req)
        if self.blocked[tr.prefill]:
            self._wake(tr.prefill, t)

    def _wake(self, i: int, t: float) -> None:
        """Prefill server ``i`` waited (idle) until ``t``: it may plan again."""
        self.blocked[i] = False
        core = self.prefill[i].core
        core.now = max(core.now, t)

    # ---- events ------------------------------------------------------------------------------
    def _link_next(self, i: int) -> tuple[float, int] | None:
        if not self._peeked[i]:
            self._peek[i] = self.links[i].next_completion()
            self._peeked[i] = True
        return self._peek[i]

    def _step_time(self, server: ServingLoop) -> float:
        core = server.core
        if core.queue or core.decode.n or core.landed:
            return core.now
        i = core.next_arrival
        return max(core.now, core.requests[i].arrival) if i < len(core.requests) else math.inf

    def next_event(self) -> tuple[float, int, int] | None:
        """``(time, kind, index)`` of the next event (None: the run is over)."""
        best: tuple[float, int, int] | None = None
        for i in range(len(self.links)):
            nxt = self._link_next(i)
            if nxt is not None and (best is None or (nxt[0], LANDING, i) < best):
                best = (nxt[0], LANDING, i)
        if self._handovers:
            ev = (self._handovers[0][0], HANDOVER, 0)
            best = ev if best is None or ev < best else best
        if self.next_arrival < len(self.requests):
            ev = (self.requests[self.next_arrival].arrival, ARRIVAL, 0)
            best = ev if best is None or ev < best else best
        for kind, pool in ((DECODE_STEP, self.decode), (PREFILL_STEP, self.prefill)):
            for i, server in enumerate(pool):
                if kind == PREFILL_STEP and self.blocked[i]:
                    continue
                t = self._step_time(server)
                if t < math.inf and (best is None or (t, kind, i) < best):
                    best = (t, kind, i)
        return best

    def done(self) -> bool:
        return self.next_event() is None

    def step(self) -> bool:
        """Take the next event; False when none is left (the run is over).  True as well when the
        fleet's ``stop`` held during a server's iteration (see :meth:`run_until`)."""
        event = self.next_event()
        if event is None:
            if any(self.blocked) or any(s.core.held for s in self.prefill):
                raise RuntimeError("prefill servers wait for KV no decode server will take")
            return False
        t, kind, i = event
        self.time = t
        if kind == LANDING:
            self._land(i, t)
        elif kind == HANDOVER:
            self._hand_over()
        elif kind == ARRIVAL:
            self._route_arrival()
        elif kind == DECODE_STEP:
            self._run_one(self.decode[i], self.decode_policies[i], t)
        else:
            self._step_prefill(i, t)
        return True

    def _land(self, i: int, t: float) -> None:
        self._deliver(i, self.links[i].advance(t))

    def _deliver(self, i: int, landed: list[tuple[float, int]]) -> None:
        """The transfers of prefill server ``i``'s link that ``landed`` reach their decode servers."""
        self._peeked[i] = False
        for when, rid in landed:
            tr = self.transfers[rid]
            tr.landed = when
            core = self.decode[tr.decode].core
            if not (core.queue or core.decode.n or core.landed):
                core.now = max(core.now, when)  # idle: it waits for the landing
            core.accept(self.prefill[i].core.held[rid])

    def _hand_over(self) -> None:
        t, _, rid = heapq.heappop(self._handovers)
        tr = self.transfers[rid]
        req = self.prefill[tr.prefill].core.held[rid]
        k = self.decode_router.route(req, self.decode_views)
        if not 0 <= k < len(self.decode):
            raise ValueError(
                f"decode router {self.decode_router.name!r} sent request {rid} to server {k} of {len(self.decode)}"
            )
        tr.decode = k
        self.incoming[k] += 1
        nbytes = float(kv_transfer_bytes(self.model, req.computed, self.tp))
        if self.layerwise:  # the part still to send after the prefill (alone: exactly the exposed time)
            prefill_s = t - req.first_scheduled
            exposed = exposed_transfer_time(self.link_spec, nbytes, prefill_s, self.model.num_layers)
            nbytes = (exposed - self.link_spec.base_latency_s) * self.link_spec.bandwidth_bytes_s
        tr.nbytes = nbytes
        link = self.links[tr.prefill]
        self._deliver(tr.prefill, link.advance(t))  # none but a landing rounding put after its event
        link.start(rid, t, nbytes)
        self._peeked[tr.prefill] = False

    def _route_arrival(self) -> None:
        req = self.requests[self.next_arrival]
        k = self.router.route(req, self.prefill_views)
        if not 0 <= k < len(self.prefill):
            raise ValueError(
                f"router {self.router.name!r} sent request {req.rid} to server {k} of {len(self.prefill)}"
            )
        self.prefill[k].core.submit(req)
        if self.blocked[k]:
            self._wake(k, req.arrival)
        self.next_arrival += 1

    def _step_prefill(self, i: int, t: float) -> None:
        try:
            self._run_one(self.prefill[i], self.prefill_policies[i], t)
        except _Blocked:  # nothing to plan until a decode server takes some of the KV held here
            self.blocked[i] = True

    def _run_one(self, server: ServingLoop, policy: Policy, t: float) -> None:
        """Run ``server`` for one iteration, the one starting at ``t`` (its fast paths cut at its end)."""
        server.core.horizon = until = math.nextafter(t, math.inf)
        if (
            server.run_until(policy, stop=self._stop, until_s=until)
            and self._stop is not None
            and self._stop()
        ):
            self._stopped = True

    # ---- runs --------------------------------------------------------------------------------
    def run_until(self, stop: Callable[[], bool] | None = None) -> bool:
        """Serve the trace to the end; True if ``stop()`` held first (asked before every event and
        between a server's iterations)."""
        if not self._started:
            self.start()
        self._stop = stop
        self._stopped = False
        while True:
            if stop is not None and stop():
                return True
            if not self.step():
                return False
            if self._stopped:
                return True

    def result(self, wall_s: float = math.nan) -> SimResult:
        """Fleet-wide outcomes and metrics: the single-server ones over every request (iterations of
        both pools merged, utilisation averaged over servers), plus the disaggregation's columns:

        ``goodput_per_gpu`` (goodput over all GPUs of both pools), ``handovers``,
        ``kv_transfer_s_mean`` (hand-over to landing), ``decode_admission_wait_s_mean`` (landing to
        admission), ``first_decode_gap_transfer_share`` (mean over handed-over requests that decoded
        of transfer time / the gap from the first token to the second), ``ttft_transfer_share`` (0 by
        construction: the first token is emitted on the prefill server, before the transfer), and
        ``load_imbalance`` (the larger of the pools': prompt tokens routed to each prefill server,
        output tokens each decode server emitted)."""
        result, logs = self.served()
        metrics, merged, times = result.metrics, result.iterations, result.token_times
        used = [it["kv_used"] / s.core.kv.total for it, s in zip(logs, self.servers, strict=True)]
        metrics["kv_util_mean"] = float(np.mean(np.concatenate(used))) if len(merged["start"]) else math.nan
        gpus = len(self.prefill) * self.tp + len(self.decode) * self.decode_tp
        metrics["goodput_per_gpu"] = metrics["goodput_rps"] / gpus
        metrics["prefill_servers"] = len(self.prefill)
        metrics["decode_servers"] = len(self.decode)
        routed = np.array([sum(r.prompt_len for r in s.core.requests) for s in self.prefill], float)
        emitted = np.array([sum(r.generated for r in s.core.finished) for s in self.decode], float)
        metrics["load_imbalance"] = max(_imbalance(routed), _imbalance(emitted))
        done = [tr for tr in self.transfers.values() if not math.isnan(tr.landed)]
        metrics["handovers"] = len(self.transfers)
        metrics["kv_transfer_s_mean"] = _mean([tr.transfer_s for tr in done])
        metrics["decode_admission_wait_s_mean"] = _mean(
            [tr.admitted - tr.landed for tr in done if not math.isnan(tr.admitted)]
        )
        shares = [
            tr.transfer_s / float(ts[1] - ts[0])
            for tr in done
            if (ts := times.get(tr.rid)) is not None and len(ts) > 1
        ]
        metrics["first_decode_gap_transfer_share"] = _mean(shares)
        metrics["ttft_transfer_share"] = 0.0
        metrics["sim_wall_s"] = wall_s
        return result


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def _imbalance(load: np.ndarray) -> float:
    return float(load.max() / load.mean()) if load.sum() > 0 else math.nan
