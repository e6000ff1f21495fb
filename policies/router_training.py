"""Train a learned router on ``chunkgym/ChunkedPrefill-v5`` by imitating the best router baseline.

``python train.py +experiment=learned_router`` (``env.id`` v5) lands here.  The recipe:

1. **Teacher labels.**  Each training episode (a window of a train split at a drawn load, from the
   routing env) is served behind every router baseline of :data:`baselines.routers.ROUTERS`; the
   one with the most goodput on that window is its teacher (the first of :data:`CANDIDATES` unless
   another serves more than ``algo.bc_margin`` x its goodput more).  The env is then stepped with
   the teacher's choices, each state's observation and choice recorded, until ``algo.bc_steps``
   states are labelled.
2. **Cloning.**  A per-server scorer (:mod:`policies.router_export`; ``algo.net_arch`` hidden widths,
   ``algo.activation``) is fitted by cross-entropy of the softmax over the valid servers' scores
   against the teacher's server, ``algo.bc_epochs`` epochs of Adam at ``algo.learning_rate``.
3. **Evaluation and export.**  The router and every baseline serve the val windows of each
   training workload (``eval.seeds`` at ``eval.load_scale``, or the workload's ``env.workload_loads``
   midpoint); the router is exported (safetensors + JSON) to ``RUN_DIR/export``.

No PPO: ``algo.total_timesteps`` must be 0.  The fleet has ``fleet.replicas`` servers, each
scheduling with :data:`SERVER_POLICY`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from baselines.routers import ROUTERS, make_router
from chunkgym.config import ConfigError
from chunkgym.io import atomic_write_text
from envs.fleet_routing import FleetRoutingEnv
from envs.serving.routing import Router
from envs.serving.setup import ServingSetup
from envs.serving.workload import Workload, load_workload
from policies.config import TrainConfig
from policies.registry import make_policy
from policies.router_export import LearnedRouter, scorer_inputs, write_router

log = logging.getLogger("train")
SERVER_POLICY = "sarathi_512"
CANDIDATES = ("least_outstanding_tokens", *(name for name in ROUTERS if name != "least_outstanding_tokens"))
"""Teacher candidates, the first preferred on ties: a router whose choices the observation shows
(round robin's turn is not in it), so windows where every router serves alike teach a learnable rule."""


@dataclass
class Labels:
    """States of the routing env and the teacher's server for each."""

    obs: np.ndarray  # float32 [N, 5 * replicas + 1]
    mask: np.ndarray  # bool [N, replicas]
    action: np.ndarray  # int64 [N]
    teachers: dict[str, int]  # episodes taught by each router


def workload_names(cfg: TrainConfig) -> list[str]:
    return list(dict.fromkeys([cfg.workload.name, *cfg.env.workloads]))


def make_env(cfg: TrainConfig, split: str = "train") -> FleetRoutingEnv:
    """The routing env of the run's training episodes."""
    main = Workload(cfg.workload, cfg.data_root)
    others = [load_workload(name, cfg.data_root) for name in cfg.env.workloads if name != main.spec.name]
    return FleetRoutingEnv(
        make_policy,
        SERVER_POLICY,
        cfg.fleet.replicas,
        [main, *others],
        split,
        cfg.model,
        cfg.hardware,
        cfg.env.tp,
        cfg.slo,
        cfg.env.cost_model,
        load_scale=cfg.env.load_scale,
        workload_loads=cfg.env.workload_loads,
        window_s=cfg.env.window_s,
        input_seed=cfg.seed,
        reward_scale=cfg.env.reward_scale,
        serving=cfg.serving,
        data_root=cfg.data_root,
    )


def best_router(setup: ServingSetup, env: FleetRoutingEnv, margin: float) -> str:
    """The teacher of the env's current window: the candidate with the most goodput on it."""
    assert env.fleet is not None, "only called after reset()"
    trace = env.fleet.trace
    goodput = {}
    for name in CANDIDATES:
        fleet = setup.fleet(trace, env.replicas, lambda: make_policy(SERVER_POLICY), make_router(name))
        goodput[name] = fleet.run().metrics["goodput_rps"]
    first = CANDIDATES[0]
    best = max(CANDIDATES, key=lambda n: goodput[n])
    return best if goodput[best] > goodput[first] * (1 + margin) else first


def collect(env: FleetRoutingEnv, steps: int, margin: float) -> Labels:
    """``steps`` states of episodes driven by each window's teacher, with its choices."""
    obs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    actions: list[int] = []
    teachers: dict[str, int] = {}
    while len(actions) < steps:
        o, info = env.reset()
        name = best_router(env.setup, env, margin)
        teachers[name] = teachers.get(name, 0) + 1
        teacher = make_router(name)
        teacher.reset(env.replicas, 0)
        fleet = env.fleet
        assert fleet is not None, "set by reset()"
        done = False
        while not done and len(actions) < steps:
            k = teacher.route(fleet.requests[fleet.next_arrival], fleet.views)
            obs.append(o)
            masks.append(info["action_mask"])
            actions.append(k)
            o, _, done, _, info = env.step(k)
    return Labels(np.array(obs, np.float32), np.array(masks, bool), np.array(actions, np.int64), teachers)


def scorer(sizes: list[int], activation: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh() if activation == "tanh" else nn.ReLU())
    return nn.Sequential(*layers)


def clone(labels: Labels, cfg: TrainConfig) -> tuple[LearnedRouter, float]:
    """Fit a scorer to the labels; the router and its agreement with the teacher on them."""
    torch.manual_seed(cfg.seed)
    rows = torch.as_tensor(np.stack([scorer_inputs(o) for o in labels.obs]))  # [N, replicas, inputs]
    mask = torch.as_tensor(labels.mask)
    target = torch.as_tensor(labels.action)
    activation = cfg.algo.activation.value
    net = scorer([rows.shape[-1], *cfg.algo.net_arch, 1], activation)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.algo.learning_rate)
    gen = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.algo.bc_epochs):
        for batch in torch.randperm(len(target), generator=gen).split(cfg.algo.batch_size):
            logits = net(rows[batch]).squeeze(-1).masked_fill(~mask[batch], -1e9)
            loss = nn.functional.cross_entropy(logits, target[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        chosen = net(rows).squeeze(-1).masked_fill(~mask, -1e9).argmax(-1)
    linears = [m for m in net if isinstance(m, nn.Linear)]
    layers = [(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy()) for m in linears]
    return LearnedRouter(layers, activation, "learned_router"), float((chosen == target).float().mean())


def evaluate(
    cfg: TrainConfig, setup: ServingSetup, routers: dict[str, Router]
) -> dict[str, dict[str, float]]:
    """Mean goodput and SLO attainment of each router on the val windows of each training workload."""
    out: dict[str, dict[str, float]] = {}
    for name in workload_names(cfg):
        workload = (
            Workload(cfg.workload, cfg.data_root)
            if name == cfg.workload.name
            else load_workload(name, cfg.data_root)
        )
        load = cfg.env.workload_loads.get(name)
        scale = float(np.mean(load)) if load else cfg.eval.load_scale
        traces = [workload.window("val", seed, scale, cfg.eval.window_s) for seed in cfg.eval.seeds]
        for label, router in routers.items():
            runs = [
                setup.fleet(t, cfg.fleet.replicas, lambda: make_policy(SERVER_POLICY), router).run().metrics
                for t in traces
            ]
            out[f"{name}/{label}"] = {
                "goodput_rps": float(np.mean([m["goodput_rps"] for m in runs])),
                "slo_attainment": float(np.mean([m["slo_attainment"] for m in runs])),
                "load_scale": scale,
            }
    return out


def train(cfg: TrainConfig, config: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Run the recipe of the module docstring in ``run_dir``; returns the run's summary."""
    if cfg.algo.total_timesteps:
        raise ConfigError(
            f"algo.total_timesteps={cfg.algo.total_timesteps}: the routing env (v5) trains by imitation only; set it to 0"
        )
    started = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.json", json.dumps(config, indent=2) + "\n")
    env = make_env(cfg)
    labels = collect(env, cfg.algo.bc_steps, cfg.algo.bc_margin)
    router, agreement = clone(labels, cfg)
    log.info(
        "behaviour cloning on %d states (teachers %s): %.1f%% agreement",
        len(labels.action),
        labels.teachers,
        100 * agreement,
    )
    results = evaluate(cfg, env.setup, {"learned_router": router, **{n: make_router(n) for n in CANDIDATES}})
    export_dir = run_dir / "export"
    provenance = {
        "env_id": cfg.env.id,
        "replicas": cfg.fleet.replicas,
        "server_policy": SERVER_POLICY,
        "workloads": workload_names(cfg),
        "teachers": labels.teachers,
        "samples": len(labels.action),
        "agreement": agreement,
        "seed": cfg.seed,
    }
    write_router(router, export_dir, provenance)
    summary = {
        "run_dir": str(run_dir),
        "samples": len(labels.action),
        "teachers": labels.teachers,
        "agreement": round(agreement, 4),
        "val": results,
        "export_dir": str(export_dir),
        "wall_s": round(time.perf_counter() - started, 2),
    }
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
