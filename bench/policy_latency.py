"""Decision cost of an exported policy: features + normalise + forward + plan, per engine iteration.

    python bench/policy_latency.py [policy=DIR] [workload=W] [load_scale=X]

Replays one test window in the simulator with the policy loaded by
``policies.exported.load_policy`` (the shipped ``policies/artifacts/learned`` by
default; an untrained network of the default shape, exported to a temporary
directory, when there is none) and times every ``plan(view)`` call.  Also times
the stages separately (features, action mask, network, planner) and Sarathi-512's
``plan`` on the same replay for reference.  The target is <= 50 us per decision on
one CPU core.  Last stdout line: one JSON object with ``us_per_decision``.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chunkgym.cli import hydra_cli
from chunkgym.config import POSITIVE
from envs import ENV_ID
from envs.chunked_prefill import version_of
from envs.serving.scheduling import Plan, Policy, ServingView
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.export import write_export
from policies.exported import ExportedPolicy, PolicyNet, load_policy
from policies.registry import SHIPPED_LEARNED, make_policy


class Timed(Policy):
    """Times each ``plan`` call of ``inner``; for an exported policy also each stage, separately."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.ns: list[int] = []
        self.stages: dict[str, list[int]] = {"features": [], "mask": [], "network": [], "planner": []}

    def plan(self, view: ServingView) -> Plan:
        clock = time.perf_counter_ns
        start = clock()
        plan = self.inner.plan(view)
        self.ns.append(clock() - start)
        if isinstance(self.inner, ExportedPolicy):
            t0 = clock()
            obs = self.inner.features(view)
            t1 = clock()
            mask = self.inner.actions.mask(view)
            t2 = clock()
            level, rule = self.inner.act_one(obs, mask)
            t3 = clock()
            self.inner.actions.plan(view, level, rule)
            t4 = clock()
            for key, ns in zip(self.stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                self.stages[key].append(ns)
        return plan


def untrained_policy(directory: Path, env_id: str) -> ExportedPolicy:
    """A freshly initialised network of train.py's default shape for ``env_id``, exported and loaded back."""
    torch.manual_seed(0)
    version = version_of(env_id)
    net = PolicyNet([len(version.feature_names), 64, 64], version.actions.nvec)
    write_export(net, env_id, directory, {"note": "untrained, for latency only"})
    return load_policy(directory)


def replay(setup: ServingSetup, trace, policy: Policy) -> Timed:
    timed = Timed(policy)
    setup.simulator(trace).run(timed)
    return timed


def us(ns: list[int]) -> float:
    return float(np.mean(ns)) / 1e3


@dataclass
class Options:
    """``python bench/policy_latency.py KEY=VALUE ...``."""

    policy: str | None = None  # exported policy directory; null: the shipped one, else untrained
    env: str = ENV_ID  # env of the untrained policy (when none is given)
    workload: str = "synthetic_azure_conv"
    load_scale: float = 1.5
    seed: int = 0
    cost_model: str = "roofline"  # calibrated | roofline | coefficient file


@hydra_cli(Options, "policy_latency", {"load_scale": POSITIVE})
def main(args: Options) -> None:
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        if args.policy:
            policy, source = load_policy(args.policy), args.policy
        elif SHIPPED_LEARNED.is_dir():
            policy, source = load_policy(SHIPPED_LEARNED), str(SHIPPED_LEARNED)
        else:
            policy, source = untrained_policy(Path(tmp), args.env), f"untrained ({args.env}, default shape)"
        setup = ServingSetup.from_names(cost_model=args.cost_model)
        trace = load_workload(args.workload).window("test", args.seed, args.load_scale)
        replay(setup, trace, policy)  # warm-up: caches, lazy imports
        timed = replay(setup, trace, policy)
        base = replay(setup, trace, make_policy("sarathi_512"))

    ns = np.asarray(timed.ns)
    result = {
        "us_per_decision": round(us(timed.ns), 2),
        "p50_us": round(float(np.percentile(ns, 50)) / 1e3, 2),
        "p99_us": round(float(np.percentile(ns, 99)) / 1e3, 2),
        "decisions": len(ns),
        **{f"{k}_us": round(us(v), 2) for k, v in timed.stages.items()},
        "sarathi_512_us_per_decision": round(us(base.ns), 2),
        "policy": source,
        "workload": args.workload,
        "load_scale": args.load_scale,
        "requests": len(trace),
    }
    print(
        f"{result['decisions']} decisions: {result['us_per_decision']} us each on average "
        f"(p50 {result['p50_us']}, p99 {result['p99_us']}); features {result['features_us']}, "
        f"mask {result['mask_us']}, network {result['network_us']}, planner {result['planner_us']} us; "
        f"Sarathi-512 {result['sarathi_512_us_per_decision']} us"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
