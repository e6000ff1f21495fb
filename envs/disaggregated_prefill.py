"""``chunkgym/ChunkedPrefill-v7``: plan the prefill pool's iterations in a disaggregated fleet.

:class:`DisaggregatedPrefillEnv` is :class:`~envs.chunked_prefill.ChunkedPrefillEnv` serving a
:class:`~envs.serving.disaggregation.DisaggregatedFleet` instead of one server; v7 is a row of its
:data:`~envs.chunked_prefill.VERSIONS` (v4's features, actions and first-token reward), so a policy
trained on either env plans a colocated server and a prefill server alike, and the two routes
compare on one policy.

## Description

``fleet.prefill`` prefill servers behind ``fleet.router`` and ``fleet.decode`` decode servers behind
``fleet.decode_router``, joined by ``fleet.link`` (docs/disaggregation.md), serve a window of a real
trace.  At each step the agent picks the token budget and allocation of the next iteration of the
prefill server that plans next (the fleet's next event, in its time order); decode servers schedule
with ``decode_policy`` (default :data:`DECODE_POLICY`, ``sarathi_512``: train.py's default baseline),
which the agent never sets.  Prefill iterations with no prompt waiting run without asking the agent, as v1-v6's forced
iterations do.

## Action Space

v4's (:data:`~envs.actions.ACTIONS_V3`): ``MultiDiscrete([17, 8])``, (mode, allocation); ``(level, 0)``
is ``sarathi_B``, so a constant action is that preset on every prefill server.

**Masks**: v4's, of the prefill server that plans next (``action_masks()``, ``info["action_mask"]``).

## Observation Space

v4's 33 features (``FEATURES_V4``) of the prefill server that plans next, read from its
:class:`~envs.serving.scheduling.ServingView` as an exported policy reads it: which server it is,
and the decode pool, are not observed.

## Rewards

v4's first-token reward over the fleet's requests: +1 when a request's first token (on its prefill
server) meets its TTFT bound, -2 if a decode server later finds it missing TPOT or stall (-1 if it
never met TTFT), times ``reward_scale``.  Each request nets +1 or -1, so the episode return is
``(2 * goodput_rps * span - requests) * reward_scale``: affine in the fleet's goodput (and in
``goodput_per_gpu``, the fleet's GPUs being fixed).

## Starting State

As v4's (the same draw of workload, window and load); the fleet starts empty and runs to the first
iteration whose plan asks the agent.  The routers are reset with seed 0 each episode.

## Episode End

As v4's: truncated when every request of the window is decided, the fleet has run out of events, or
after ``max_steps`` steps; never terminated.

## Arguments

``gym.make("chunkgym/ChunkedPrefill-v7", fleet=FleetSpec(prefill=1, decode=1, link="nvlink"),
workloads=[...], load_scale=...)``; :class:`DisaggregatedPrefillEnv`'s, then
:class:`~envs.chunked_prefill.ChunkedPrefillEnv`'s.  The registered id names its policy and router
factories (``policies.registry:make_policy``, ``baselines.routers:make_router``), as v5 does: the envs
layer names no policy or router itself.

## info

v4's keys, where ``latency``, ``decode_tokens`` and ``prefill_tokens`` are those of the iteration the
action planned (0 where the server then waited for its held KV to be taken instead), plus ``server``:
the prefill server it planned.  At the end ``serving`` holds the fleet's metrics
(:meth:`~envs.serving.disaggregation.DisaggregatedFleet.result`, ``goodput_per_gpu`` among them).

## Rendering

v4's, of the prefill server that plans next.

## Version History

* v7: v4's observation, actions and reward on the prefill pool of a disaggregated fleet (this module).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from chunkgym.config import from_mapping
from envs.actions import ActionSpace
from envs.chunked_prefill import FORCED, ChunkedPrefillEnv
from envs.fleet_routing import PolicyFactory, resolve_factory
from envs.serving.disaggregation import PREFILL_STEP, DisaggregatedFleet
from envs.serving.fleet import FleetSpec
from envs.serving.routing import Router
from envs.serving.scheduling import Plan, Policy, ServingView
from envs.serving.simulator import Simulator
from envs.serving.workloads.trace import Trace

RouterFactory = Callable[[str], Router]
DECODE_POLICY = "sarathi_512"
"""The decode servers' default policy: train.py's default baseline, v5's default server policy."""


class _Agent(Policy):
    """The prefill servers' policy: the plan of the agent's action while one is given (the env gives
    it for the one iteration it planned), the forced plan otherwise."""

    name = "agent"

    def __init__(self, actions: ActionSpace) -> None:
        self.actions = actions
        self.action: tuple[int, int, Any] | None = None  # (mode, allocation, valid actions or None)

    def plan(self, view: ServingView) -> Plan:
        if self.action is None:
            return FORCED.plan(view)
        a, b, valid = self.action
        self.action = (a, b, None)  # a second ask (after a prefix release) sees another state
        return self.actions.plan(view, a, b, valid)


class DisaggregatedPrefillEnv(ChunkedPrefillEnv):
    """Plan the prefill pool of a disaggregated fleet; see the module docstring.

    Args:
        policy_factory: a callable from a policy name to a fresh :class:`Policy`, or its
            ``"module:attr"`` name (the registered id passes ``policies.registry:make_policy``).
        router_factory: likewise from a router name (``fleet.router``, ``fleet.decode_router``) to a
            fresh router (the registered id passes ``baselines.routers:make_router``).
        fleet: the fleet (a :class:`~envs.serving.fleet.FleetSpec` or a mapping of its fields), with
            ``prefill`` >= 1 and ``decode`` >= 1.
        decode_policy: the decode servers' scheduling policy, by name.
        version: a disaggregated version of :data:`~envs.chunked_prefill.VERSIONS` (the registered id sets it).
        **kwargs: :class:`~envs.chunked_prefill.ChunkedPrefillEnv`'s arguments.
    """

    drives_fleet = True

    def __init__(
        self,
        policy_factory: str | PolicyFactory,
        router_factory: str | RouterFactory,
        fleet: FleetSpec | Mapping[str, Any] | None = None,
        decode_policy: str = DECODE_POLICY,
        version: int = 7,
        **kwargs: Any,
    ) -> None:
        spec = fleet if isinstance(fleet, FleetSpec) else from_mapping(FleetSpec, fleet or {}, "fleet")
        if not spec.disaggregated:
            raise ValueError(
                f"fleet.prefill={spec.prefill}: chunkgym/ChunkedPrefill-v{version} plans the prefill pool "
                "of a disaggregated fleet; give fleet with prefill >= 1 and decode >= 1"
            )
        self.make_policy = resolve_factory(policy_factory)
        self.make_policy(decode_policy)  # an unknown name fails here, not at the first reset
        self.make_router = cast(RouterFactory, resolve_factory(cast(Any, router_factory)))
        for name in (spec.router, spec.decode_router):
            self.make_router(name)
        super().__init__(version=version, **kwargs)
        self.fleet_spec = spec
        self.decode_policy = decode_policy
        self.fleet: DisaggregatedFleet | None = None
        self.server = 0  # the prefill server whose iteration the agent plans next (``sim``)
        self._agent = _Agent(self.actions)

    def _serve(self, trace: Trace) -> Simulator:
        """Start serving ``trace``: a fresh fleet, every prefill server planned by the agent; its first
        prefill server (:meth:`_advance` then names the one that plans first)."""
        spec, agent = self.fleet_spec, self._agent
        self.fleet = fleet = cast(
            DisaggregatedFleet,
            self.setup.fleet_for(
                trace,
                spec,
                lambda: agent,
                self.make_router(spec.router),
                self.make_router(spec.decode_router),
                make_decode_policy=lambda: self.make_policy(self.decode_policy),
            ),
        )
        fleet.start()
        self.server = 0
        return cast(Simulator, fleet.prefill[0])

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        fleet, sim = self.fleet, self.sim
        if fleet is None or sim is None:
            raise RuntimeError("call reset() before step()")
        server, cols = self.server, sim.log.cols
        row = len(sim.log)
        self._agent.action = (int(action[0]), int(action[1]), self._valid)
        fleet.step()  # the agent's server's iteration: the fleet's next event
        self._agent.action = None
        ran = len(sim.log) > row  # not when the server waits for its held KV to be taken instead
        more = self._advance()
        self._steps += 1
        score = sum(self.version.score(s.core) for s in fleet.servers)
        reward = (score - self._score) * self.reward_scale
        self._score = score
        good, bad, n = fleet.n_good, fleet.n_bad, len(fleet.requests)
        truncated = good + bad == n or not more or self._steps >= self.max_steps
        obs = self._observe()
        info: dict[str, Any] = {
            "now": fleet.now,
            "server": server,
            "latency": cols["latency"][row] if ran else 0.0,
            "decode_tokens": cols["decode_tokens"][row] if ran else 0,
            "prefill_tokens": cols["prefill_tokens"][row] if ran else 0,
            "good": good,
            "bad": bad,
            "requests": n,
            "action_mask": self._mask,
        }
        if truncated:
            info["serving"] = fleet.result().metrics
        return obs, float(reward), False, truncated, info

    def _advance(self) -> bool:
        """Run the fleet to the next prefill iteration that asks the agent (a prompt waits); ``sim``
        is then that server.  False once the fleet has no event left."""
        fleet = self.fleet
        assert fleet is not None, "only called after reset()"
        while (event := fleet.next_event()) is not None:
            t, kind, i = event
            if kind == PREFILL_STEP and self._asks(i, t):
                self.server, self.sim = i, cast(Simulator, fleet.prefill[i])
                return True
            fleet.step()
        return False

    def _asks(self, i: int, t: float) -> bool:
        """Whether prefill server ``i``'s iteration at ``t`` asks the agent: the server admits what it
        admits at that iteration's start (under the horizon the fleet's run sets, so that run then
        admits nothing more), and a prompt waits."""
        assert self.fleet is not None, "only called after reset()"
        server = self.fleet.prefill[i]
        server.core.horizon = math.nextafter(t, math.inf)
        return server.advance_to_work() and bool(server.core.queue)
