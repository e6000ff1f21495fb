"""The simulator against vLLM over several windows: errors per policy, plan agreement, rank agreement.

Pure arithmetic on finished runs (no vLLM import), so it is tested in the default install.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations
from typing import Any

import numpy as np

from engine.sim_to_real import COMPARED, iteration_mape
from envs.serving.loop import SimResult


def plan_agreement(iterations: dict[str, np.ndarray]) -> float:
    """Fraction of vLLM's steps that ran exactly the policy's plan (NaN without steps)."""
    return float(np.mean(iterations["plan_agrees"])) if len(iterations["plan_agrees"]) else math.nan


def kendall_tau_b(a: Sequence[float], b: Sequence[float], tie: float = 0.0) -> float:
    """Kendall's tau-b of two scorings of the same items; values less than ``tie`` apart
    (relative to the larger magnitude) are tied.  NaN when either scoring ties every pair."""
    concordant = discordant = ties_a = ties_b = 0
    pairs = 0

    def order(x: float, y: float) -> int:
        return 0 if abs(x - y) <= tie * max(abs(x), abs(y)) else (1 if x > y else -1)

    for i, j in combinations(range(len(a)), 2):
        pairs += 1
        sa, sb = order(a[i], a[j]), order(b[i], b[j])
        ties_a += sa == 0
        ties_b += sb == 0
        if sa and sb:
            concordant += sa == sb
            discordant += sa != sb
    denom = math.sqrt((pairs - ties_a) * (pairs - ties_b))
    return (concordant - discordant) / denom if denom else math.nan


def compare(
    runs: dict[tuple[str, str, int], SimResult],
    policies: Sequence[str],
    seeds: Sequence[int],
    tie: float,
    time_scales: dict[tuple[str, int], float] | None = None,
) -> dict:
    """Per-policy and headline errors of the simulator against vLLM over the windows.

    ``time_scales``: per (policy, window), the engine's measured step time over the profile's, at
    which the simulator's clock ran that window (1 where absent); ``iteration_mape`` compares each
    step with the prediction times it, ``iteration_mape_profile`` with the prediction alone.
    """
    scales = time_scales or {}
    per: dict[str, dict[str, Any]] = {}
    steps: dict[str, list[dict[str, np.ndarray]]] = {"scaled": [], "profile": []}
    for p in policies:
        real = [runs[(p, "vllm", s)] for s in seeds]
        sim = [runs[(p, "sim", s)] for s in seeds]
        its = {
            k: np.concatenate([r.iterations[k] for r in real])
            for k in ("predicted", "latency", "plan_agrees")
        }
        scaled = {
            "predicted": np.concatenate(
                [
                    r.iterations["predicted"] * scales.get((p, s), 1.0)
                    for r, s in zip(real, seeds, strict=True)
                ]
            ),
            "latency": its["latency"],
        }
        steps["scaled"].append(scaled)
        steps["profile"].append(its)
        mean = {
            side: {m: float(np.mean([r.metrics[m] for r in rs])) for m in (*COMPARED, "goodput_rps")}
            for side, rs in (("vllm", real), ("sim", sim))
        }
        per[p] = {
            "iteration_mape": iteration_mape(scaled),
            "iteration_mape_profile": iteration_mape(its),
            **{
                f"{m.removesuffix('_s')}_rel_err": abs(mean["sim"][m] / mean["vllm"][m] - 1.0)
                for m in COMPARED
            },
            "plan_agreement": plan_agreement(its),
            "iterations": len(its["latency"]),
            # median predicted / measured step latency per window: well below 1, vLLM ran slower than
            # profiled throughout that replay (on a shared machine: another process held the core)
            "step_speed_per_window": [
                float(np.median(r.iterations["predicted"] / r.iterations["latency"])) for r in real
            ],
            "time_scale_per_window": [scales.get((p, s), 1.0) for s in seeds],
            "goodput_per_window": {
                side: [r.metrics["goodput_rps"] for r in rs] for side, rs in (("vllm", real), ("sim", sim))
            },
            **mean,
        }
    pooled = {side: {k: np.concatenate([d[k] for d in ds]) for k in ds[0]} for side, ds in steps.items()}
    headline: dict[str, Any] = {
        "iteration_mape": iteration_mape(pooled["scaled"]),
        "iteration_mape_profile": iteration_mape(pooled["profile"]),
    }
    for m in COMPARED:
        key = f"{m.removesuffix('_s')}_rel_err"
        headline[key] = max(per[p][key] for p in policies)
    headline["plan_agreement"] = plan_agreement(pooled["profile"])
    # how far the machine's speed moved from the profile's over every replay: the errors follow it
    speeds = [v for p in policies for v in per[p]["step_speed_per_window"]]
    headline["step_speed_range"] = [min(speeds), max(speeds)]
    headline["kendall_tau"] = kendall_tau_b(
        [per[p]["vllm"]["goodput_rps"] for p in policies],
        [per[p]["sim"]["goodput_rps"] for p in policies],
        tie,
    )
    return {**headline, "per_policy": per}


def table(summary: dict) -> str:
    """The per-policy comparison as a Markdown table."""
    lines = [
        "| policy | steps | iteration MAPE (profile alone) | TTFT P50 vLLM / sim | TTFT P99 vLLM / sim | TBT P99 vLLM / sim "
        "| plan agreement | step speed vs profile | goodput vLLM / sim |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, s in summary["per_policy"].items():
        v, m = s["vllm"], s["sim"]
        lines.append(
            f"| `{p}` | {s['iterations']} | {s['iteration_mape']:.1%} ({s['iteration_mape_profile']:.1%}) "
            f"| {v['ttft_p50_s'] * 1e3:.0f} / {m['ttft_p50_s'] * 1e3:.0f} ms ({s['ttft_p50_rel_err']:.1%}) "
            f"| {v['ttft_p99_s'] * 1e3:.0f} / {m['ttft_p99_s'] * 1e3:.0f} ms ({s['ttft_p99_rel_err']:.1%}) "
            f"| {v['tbt_p99_s'] * 1e3:.1f} / {m['tbt_p99_s'] * 1e3:.1f} ms ({s['tbt_p99_rel_err']:.1%}) "
            f"| {s['plan_agreement']:.3f} | {_span(s['step_speed_per_window'])} "
            f"| {v['goodput_rps']:.3f} / {m['goodput_rps']:.3f} req/s |"
        )
    lines.append(
        f"| all / worst | | {summary['iteration_mape']:.1%} ({summary['iteration_mape_profile']:.1%}) "
        f"| {summary['ttft_p50_rel_err']:.1%} "
        f"| {summary['ttft_p99_rel_err']:.1%} | {summary['tbt_p99_rel_err']:.1%} | {summary['plan_agreement']:.3f} "
        f"| {_span(summary['step_speed_range'])} | Kendall tau-b {summary['kendall_tau']:.3f} |"
    )
    return "\n".join(lines)


def _span(values: Sequence[float]) -> str:
    """``0.95-1.03``: the least and the largest of ``values``."""
    return f"{min(values):.2f}-{max(values):.2f}"
