"""Reproduce Sarathi-Serve's headline: capacity of Sarathi (budget 512) vs vLLM without chunking.

Setup as in the paper's Mistral-7B experiment: one A100, ShareGPT lengths with Poisson
arrivals, and its capacity definition (P99 TBT <= 100 ms, median scheduling delay <= 2 s),
found by the shared capacity search on a ~2,000-request window of the test split.
The paper reports Sarathi-Serve (512) at 2.6x the capacity of vLLM.

    python bench/sarathi_capacity.py [window_s=500] [seed=0] [cost_model=calibrated]

The last stdout line is one JSON object: sarathi_capacity_rps, fcfs_capacity_rps, ratio, ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import chunkgym
from chunkgym.cli import hydra_cli
from chunkgym.config import POSITIVE
from envs.serving.metrics import capacity_search, tbt_criterion
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.registry import make_policy

TBT_BOUND_S = 0.100
MEDIAN_DELAY_S = 2.0


@dataclass
class Options:
    """``python bench/sarathi_capacity.py KEY=VALUE ...``."""

    window_s: float = 500.0  # trace seconds of the test-split window
    seed: int = 0
    cost_model: str = "calibrated"  # calibrated | roofline | coefficient file


@hydra_cli(Options, "sarathi_capacity", {"window_s": POSITIVE})
def main(args: Options) -> None:
    chunkgym.require_own_packages()

    setup = ServingSetup.from_names("mistral_7b", "a100_80gb", 1, "strict", args.cost_model)
    workload = load_workload("sharegpt_poisson")
    out = {}
    for policy in ("sarathi_512", "fcfs"):
        print(f"{policy}: load scale -> requests/s, P99 TBT, median scheduling delay")

        def passes(scale: float, policy: str = policy) -> bool:
            trace = workload.window("test", args.seed, scale, args.window_s)
            m = setup.simulator(trace).run(make_policy(policy)).metrics
            ok = tbt_criterion(m, TBT_BOUND_S, MEDIAN_DELAY_S)
            rps = len(trace) / trace.span_s
            print(
                f"  scale {scale:.4f}  {rps:6.3f} req/s  P99 TBT {m['tbt_p99_s'] * 1e3:6.1f} ms  "
                f"median delay {m['sched_delay_p50_s']:8.3f} s  {'pass' if ok else 'fail'}"
            )
            return ok

        res = capacity_search(passes, rel_tol=0.01)
        trace = workload.window("test", args.seed, res.scale, args.window_s)
        rps = len(trace) / trace.span_s if res.scale else 0.0
        print(f"  capacity: scale {res.scale:.4f} ({rps:.3f} req/s), bracket {res.bracket}")
        out[policy] = (rps, res)
    ratio = out["sarathi_512"][0] / out["fcfs"][0] if out["fcfs"][0] else float("inf")
    print(f"Sarathi-512 / FCFS capacity: {ratio:.2f}x (paper: 2.6x)")
    print(
        json.dumps(
            {
                "sarathi_capacity_rps": out["sarathi_512"][0],
                "fcfs_capacity_rps": out["fcfs"][0],
                "ratio": ratio,
                "sarathi_bracket": list(out["sarathi_512"][1].bracket),
                "fcfs_bracket": list(out["fcfs"][1].bracket),
                "model": "mistral_7b",
                "hardware": "a100_80gb",
                "workload": "sharegpt_poisson",
                "tbt_bound_s": TBT_BOUND_S,
                "median_delay_bound_s": MEDIAN_DELAY_S,
                "cost_model": args.cost_model,
            }
        )
    )


if __name__ == "__main__":
    main()
