"""``chunkgym/ChunkedPrefill-v5``: route each arrival to one server of a fleet.

One class, :class:`FleetRoutingEnv`, over :class:`~envs.serving.fleet.Fleet`: the agent is the
fleet's router (:class:`~envs.serving.routing.Router`), each server schedules with a configured
scheduling policy.  The single-server versions v0-v4 (:mod:`envs.chunked_prefill`) stay as they are.

## Description

``replicas`` simulated servers (one model, one GPU type, one scheduling policy each: ``server_policy``)
serve a window of a real trace.  At each step one request arrives; the agent names the server it
goes to.  Between arrivals every server runs on its own (:meth:`Fleet.advance_to`), so the agent
sees each server at its first iteration boundary at or after the arrival, as a production router
sees engines that report between steps.

## Action Space

``Discrete(replicas)``: the index of the server the arrival goes to.

**Masks**: ``action_masks()`` (sb3-contrib's MaskablePPO) and ``info["action_mask"]``: a server is
valid when it can ever take the request, its prompt under the server's ``max_model_len`` and within
its KV cache (a router does not know the output length).  When no server can, every one is valid
(the request is rejected wherever it goes).  An invalid action is served as given: the server
rejects the request, and the reward counts it bad.

## Observation Space

``Box(0, 1, (5 * replicas + 1,), float32)``: per server (:data:`SERVER_FEATURES`, in server order)
waiting requests ``w / (w + 16)``, running requests ``r / (r + 64)``, outstanding prefill tokens
``t / (t + 16384)``, KV use, and the share of the arrival's prompt its prefix cache holds now; then
the arrival's prompt length, ``log(1 + p) / log(1 + 131072)`` capped at 1.  Every value is read from
the fleet's :class:`~envs.serving.routing.ServerView` s (:func:`routing_features`), so a router
outside the env computes the same observation from the same views.  Fixed size for a fixed
``replicas``.

## Rewards

Goodput: per step, the increase of the fleet's known-good minus known-bad requests (a request is
known good when it finishes within its SLO, bad the moment it is known to miss it: the SLO counts
of :class:`~envs.serving.fleet.FleetCountStop`), times ``reward_scale``.  A request's verdict lands
on the step during which its server decided it, not on the step that routed it.  Every request
of the window ends good or bad, so the return is ``(good - bad) * reward_scale
= (2 * goodput_rps * span_s - requests) * reward_scale``: an affine function of the window's goodput.

## Starting State

Each reset draws a workload from ``workloads``, a window of ``split`` and a load from ``load_scale``
(the workload's own 1x, which is one server's: a fleet of ``replicas`` servers carries about
``replicas`` times that) from the env's seeded generator, or, with ``input_seed`` set, from
``(input_seed, episode index)``.  The servers start empty and run to the first arrival.

## Episode End

**Terminated** after the last arrival is routed: the fleet then serves every request to its end
(no further decision can change the return), and that step's reward holds every remaining verdict.
Never truncated.

## Arguments

``gym.make("chunkgym/ChunkedPrefill-v5", replicas=8, server_policy="sarathi_512",
workloads=["mooncake_conv"], load_scale=(8.0, 16.0))``; see :class:`FleetRoutingEnv`.  The
registered id resolves ``server_policy`` names through ``policies.registry:make_policy`` (the
``policy_factory`` argument): the envs layer names no policy itself.

## info

``reset()``: ``requests``, ``load_scale``, ``workload``, ``now``, ``action_mask``.  ``step()``:
``now``, ``server`` (where the arrival went), ``good``, ``bad``, ``requests``, ``action_mask``; at the
end also ``serving`` (the fleet's metrics, :meth:`Fleet.result`).

## Version History

* v5: the routing env (this module): one step per arrival, the server as the action.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import load_env_creator

from chunkgym import OWN_PACKAGES
from envs.episodes import draw_window, episode_rng
from envs.serving.core import ServingConfig
from envs.serving.fleet import Fleet
from envs.serving.metrics import SLOSpec, load_slo
from envs.serving.request import Request
from envs.serving.routing import ServerView
from envs.serving.scheduling import Policy
from envs.serving.setup import DEFAULT_HARDWARE, DEFAULT_MODEL, ServingSetup
from envs.serving.specs import HardwareSpec, ModelSpec, load_hardware, load_model
from envs.serving.workload import Workload, load_workload

SERVER_FEATURES = (
    "waiting",
    "running",
    "outstanding_prefill_tokens",
    "kv_utilization",
    "cached_prefix_share",
)
"""Each server's features, in observation order."""
WAITING_HALF, RUNNING_HALF, TOKENS_HALF = 16.0, 64.0, 16384.0
"""The counts at which each squashed count feature reads 0.5."""
PROMPT_LOG_MAX = math.log1p(131072)
DEFAULT_WORKLOADS = ("mooncake_conv", "azure_code")
PolicyFactory = Callable[[str], Policy]


def routing_features(req: Request, views: Sequence[ServerView]) -> np.ndarray:
    """The observation of ``req``'s arrival at servers ``views``: :data:`SERVER_FEATURES` per server,
    then the prompt length (see the module docstring), float32 in [0, 1]."""
    out = np.empty(len(SERVER_FEATURES) * len(views) + 1, np.float32)
    for i, v in enumerate(views):
        waiting, running, tokens = v.waiting, v.running, v.outstanding_prefill_tokens
        cached = v.cached_prefix_tokens(req) / req.prompt_len if req.prompt_len else 0.0
        out[5 * i : 5 * i + 5] = (
            waiting / (waiting + WAITING_HALF),
            running / (running + RUNNING_HALF),
            tokens / (tokens + TOKENS_HALF),
            v.kv_utilization,
            cached,
        )
    out[-1] = math.log1p(req.prompt_len) / PROMPT_LOG_MAX
    return np.clip(out, 0.0, 1.0, out=out)


def resolve_factory(factory: str | PolicyFactory) -> PolicyFactory:
    """A policy factory, or a ``"module:attr"`` naming one in this repository's packages (the
    registered id's way of naming ``policies.registry:make_policy`` without the envs layer importing it)."""
    if not isinstance(factory, str):
        return factory
    module = factory.partition(":")[0]
    if module.split(".")[0] not in OWN_PACKAGES or ":" not in factory:
        raise ValueError(
            f"policy_factory={factory!r}: a 'module:attr' of this repository's packages ({', '.join(OWN_PACKAGES)})"
        )
    return cast(PolicyFactory, load_env_creator(factory))


class _Given:
    """The router of the env's fleet: routes to the server the agent named last."""

    name = "agent"
    reads_state = True  # the agent reads the servers: the fleet stops at every arrival

    def __init__(self) -> None:
        self.server = 0

    def reset(self, servers: int, seed: int) -> None:
        self.server = 0

    def route(self, req: Request, servers: Sequence[ServerView]) -> int:
        return self.server


class FleetRoutingEnv(gym.Env[np.ndarray, np.int64]):
    """Route each arrival to one of ``replicas`` simulated servers; see the module docstring.

    Args:
        policy_factory: a callable from a policy name to a fresh :class:`Policy`, or its
            ``"module:attr"`` name (the registered id passes ``policies.registry:make_policy``).
        server_policy: the scheduling policy of every server, by name.
        replicas: servers in the fleet.
        workloads: names in ``conf/workload`` or ``file:PATH``, or loaded :class:`Workload` s.
        split: ``train`` (default), ``val``, ``test`` or ``all``.
        model, hardware, tp, slo, cost_model, serving: the servers' setup (as
            :class:`~envs.chunked_prefill.ChunkedPrefillEnv`'s).
        load_scale: a float, or a (low, high) pair sampled uniformly per episode.
        workload_loads: per workload name, its own ``load_scale`` in place of ``load_scale``.
        window_s: trace-seconds per episode (default: ``window_scale`` x the workload's ``window_s``).
        window_scale: see ``window_s``.
        input_seed: if set, episode inputs come from ``(input_seed, episode index)``.
        reward_scale: multiplies the per-request rewards.
        data_root: where the traces live (default ``chunkgym.data_root()``).
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        policy_factory: str | PolicyFactory,
        server_policy: str = "sarathi_512",
        replicas: int = 8,
        workloads: Sequence[str | Workload] | str | Workload | None = None,
        split: str = "train",
        model: str | ModelSpec = DEFAULT_MODEL,
        hardware: str | HardwareSpec = DEFAULT_HARDWARE,
        tp: int = 1,
        slo: str | SLOSpec = "strict",
        cost_model: str = "calibrated",
        load_scale: float | Sequence[float] = (8.0, 16.0),
        workload_loads: Mapping[str, float | Sequence[float]] | None = None,
        window_s: float | None = None,
        window_scale: float = 1.0,
        input_seed: int | None = None,
        reward_scale: float = 1.0,
        serving: dict[str, Any] | ServingConfig | None = None,
        data_root: str | None = None,
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas={replicas!r}: an integer >= 1")
        if window_scale <= 0:
            raise ValueError(f"window_scale={window_scale!r}: a number > 0")
        self.make_policy = resolve_factory(policy_factory)
        self.make_policy(server_policy)  # an unknown name fails here, not at the first reset
        self.server_policy = server_policy
        self.replicas = replicas
        if workloads is None:
            workloads = DEFAULT_WORKLOADS
        elif isinstance(workloads, str | Workload):
            workloads = [workloads]
        if not workloads:
            raise ValueError("workloads must name at least one workload")
        self.workloads = [w if isinstance(w, Workload) else load_workload(w, data_root) for w in workloads]
        self.split = split
        self.setup = ServingSetup.from_specs(
            load_model(model) if isinstance(model, str) else model,
            load_hardware(hardware) if isinstance(hardware, str) else hardware,
            tp,
            load_slo(slo) if isinstance(slo, str) else slo,
            cost_model,
            serving,
        )
        names = [w.spec.name for w in self.workloads]
        unknown = sorted(set(workload_loads or {}) - set(names))
        if unknown:
            raise ValueError(
                f"workload_loads names {unknown}, which are not among this env's workloads {names}"
            )
        own = {
            name: load_range(f"workload_loads[{name}]", load) for name, load in (workload_loads or {}).items()
        }
        default = load_range("load_scale", load_scale)
        self.load_ranges = {name: own.get(name, default) for name in names}
        self.window_s = window_s
        self.window_scale = window_scale
        self.input_seed = input_seed
        self.reward_scale = reward_scale
        self.action_space = spaces.Discrete(replicas)
        self.observation_space = spaces.Box(0.0, 1.0, (len(SERVER_FEATURES) * replicas + 1,), np.float32)
        self.fleet: Fleet | None = None
        self._router = _Given()
        self._mask = np.ones(replicas, dtype=bool)
        self._score = 0
        self._episodes = 0

    # ---- gymnasium API -------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._episodes += 1
        rng = episode_rng(self.np_random, self.input_seed, self._episodes)
        workload, load, trace = draw_window(
            rng, self.workloads, self.load_ranges, self.split, self.window_s, self.window_scale
        )
        self.workload, self.load = workload, load
        self.fleet = fleet = self.setup.fleet(
            trace, self.replicas, lambda: self.make_policy(self.server_policy), self._router
        )
        fleet.start()
        fleet.advance_to(fleet.requests[0].arrival)
        self._score = 0
        info = {
            "requests": len(trace),
            "load_scale": load,
            "workload": workload.spec.name,
            "now": fleet.now,
        }
        return self._observe(), {**info, "action_mask": self._mask}

    def step(self, action: int | np.integer) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        fleet = self.fleet
        if fleet is None:
            raise RuntimeError("call reset() before step()")
        if fleet.next_arrival >= len(fleet.requests):
            raise RuntimeError("the episode has ended: call reset()")
        self._router.server = int(action)
        server = fleet.route_next()
        reqs = fleet.requests
        if fleet.next_arrival < len(reqs):
            fleet.advance_to(reqs[fleet.next_arrival].arrival)
        else:
            fleet.run_until()  # every arrival is routed: this serves each server to its end
        score = fleet.n_good - fleet.n_bad
        reward = (score - self._score) * self.reward_scale
        self._score = score
        terminated = fleet.next_arrival >= len(reqs)
        obs = self._observe()
        info: dict[str, Any] = {
            "now": fleet.now,
            "server": server,
            "good": fleet.n_good,
            "bad": fleet.n_bad,
            "requests": len(reqs),
            "action_mask": self._mask,
        }
        if terminated:
            info["serving"] = fleet.result().metrics
        return obs, float(reward), terminated, False, info

    def action_masks(self) -> np.ndarray:
        """Servers that can take the arrival, for sb3-contrib's MaskablePPO (``info["action_mask"]``)."""
        return self._mask

    # ---- observing -----------------------------------------------------------------------
    def _observe(self) -> np.ndarray:
        """The observation of the next arrival; sets its mask (a fresh array shared with ``info``).
        After the last arrival: zeros, every server valid."""
        fleet = self.fleet
        assert fleet is not None, "only called after reset()"
        if fleet.next_arrival >= len(fleet.requests):
            self._mask = np.ones(self.replicas, dtype=bool)
            return np.zeros(len(SERVER_FEATURES) * self.replicas + 1, np.float32)
        req = fleet.requests[fleet.next_arrival]
        self._mask = servers_that_fit(req, fleet)
        return routing_features(req, fleet.views)


def servers_that_fit(req: Request, fleet: Fleet) -> np.ndarray:
    """The mask of ``req``: servers whose ``max_model_len`` and KV cache can hold its prompt (all of
    them when none can: the request is rejected wherever it goes)."""
    mask = np.array(
        [
            req.prompt_len < s.core.max_model_len and s.core.kv.blocks_for(req.prompt_len) <= s.core.kv.total
            for s in fleet.servers
        ],
        dtype=bool,
    )
    return mask if mask.any() else np.ones(len(mask), dtype=bool)


def load_range(name: str, load: float | Sequence[float]) -> tuple[float, float]:
    """A load scale, or a (low, high) pair, as the pair episodes draw from uniformly."""
    pair = (load, load) if isinstance(load, int | float) else tuple(load)
    if len(pair) not in (1, 2) or not 0 < float(pair[0]) <= float(pair[-1]):
        raise ValueError(f"{name}={load!r}: a positive number or an ordered (low, high) pair")
    return float(pair[0]), float(pair[-1])
