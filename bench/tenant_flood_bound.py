"""Why the interactive tenants miss their SLO under a flood even with VTC: how far any order could lift them.

On a mix's test windows (default ``mix_flood`` at 1x, where the flood alone fills the server), per
policy and seed: each tenant's SLO attainment and the shares of its requests within each bound
(TTFT, TPOT, stall), ``min_within_share_attainment`` and ``jain_maxmin``
(:func:`envs.serving.tenancy.fairness_summary`), the mean iteration time and batch, and for the
interactive requests that missed, their mean scheduling delay (arrival to first chunk) beside the
met ones'.  The same windows without the flood tenant (the other arrivals unchanged) say what the
flood costs.

Beside the baselines (``policies``, FCFS-order ``sarathi_512`` and ``vtc`` by default) run three
**unfair upper bounds**, not baselines: orders that give the light tenants (every tenant but the
flood) absolute priority over the flood at VTC's budget (512 tokens) and admission (``stop``).  A
tenant-fair order serves the flood whenever its turn comes; these never do while a light prompt
waits, so they bound what fairness between tenants can give the light ones:

* ``bound_light_fcfs``: prompts mid-prefill first (non-preemptive, as VTC), then the light
  tenants' waiting prompts by arrival, then the flood's;
* ``bound_light_edf``: the same, the light prompts by earliest TTFT deadline;
* ``bound_light_overtake``: the light tenants' prompts, waiting ones included, even ahead of the
  flood's prompts mid-prefill (a flood chunk yields its turn).

Where even the best of them leaves the interactive tenants below a target, no order of tenants
reaches it: what remains is the flood's load on every iteration (full batches make each one slow)
and the light tenants' own queueing.

    python bench/tenant_flood_bound.py [seeds=[0,1]] [load_scale=1.0] [out=outputs/tenant_flood_bound/result.json]

Writes ``out`` (JSON: every run); the last stdout line is one JSON object: per policy ``mws``,
``jain``, the interactive tenants' least attainment with and without the flood, the mean
iteration time, and ``best_bound_min_interactive_attainment`` (the highest of the bounds').
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from baselines.fairness import urgent_order
from chunkgym.cli import hydra_cli
from chunkgym.config import AT_LEAST_ONE, LOAD_SCALE, NON_EMPTY, NON_NEGATIVE, SEED, ConfigError, Rule, each
from chunkgym.io import atomic_write_text
from envs.serving.request import Request
from envs.serving.scheduling import Admission, Plan, Policy, ServingView, plan_budget
from envs.serving.scheduling import Rule as Allocation
from envs.serving.setup import ServingSetup
from envs.serving.tenancy import class_weights, fairness_summary, group_row, trace_tenants
from envs.serving.workload import load_workload
from envs.serving.workloads.trace import Trace
from policies.registry import make_policy, policy_names

BOUNDS = ("bound_light_fcfs", "bound_light_edf", "bound_light_overtake")
"""The unfair upper bounds, least to most generous to the light tenants."""


class LightFirstBound(Policy):
    """An unfair order, not a baseline: every light tenant's prompt before any flood prompt that waits
    (``overtake``: before the flood's prompts mid-prefill too), within ``budget`` tokens, admission
    ``stop``.  ``key`` orders the waiting prompts after that split (arrival or deadline)."""

    def __init__(
        self, name: str, flood: str, key: Callable[[Request], Any], overtake: bool, budget: int
    ) -> None:
        self.name, self.flood, self.key, self.overtake, self.budget = name, flood, key, overtake, budget

    def plan(self, view: ServingView) -> Plan:
        if not view.queue:
            return plan_budget(view, self.budget, Allocation.FCFS, admission=Admission.STOP)
        order = urgent_order(view, self.key)
        if self.overtake:
            order = sorted(order, key=lambda r: r.tenant == self.flood)  # stable: light ones first
        return plan_budget(view, self.budget, Allocation.FCFS, admission=Admission.STOP, order=order)


def make_bound(name: str, flood: str, budget: int) -> LightFirstBound:
    """The bound called ``name`` (one of :data:`BOUNDS`)."""

    def by_arrival(r: Request) -> tuple[bool, int]:
        return (r.tenant == flood, r.seq)

    def by_deadline(r: Request) -> tuple[bool, float, int]:
        return (r.tenant == flood, r.deadline, r.seq)

    key = by_deadline if name == "bound_light_edf" else by_arrival
    return LightFirstBound(name, flood, key, name == "bound_light_overtake", budget)


@dataclass
class Options:
    """``python bench/tenant_flood_bound.py KEY=VALUE ...``."""

    workload: str = "mix_flood"
    flood: str = "flood"  # the tenant the bounds put last and the no-flood runs drop
    interactive_class: str = "interactive"  # the SLO class whose tenants' attainment is summarised
    policies: list[str] = field(default_factory=lambda: ["sarathi_512", "vtc"])  # baselines
    seeds: list[int] = field(default_factory=lambda: [0, 1])  # test windows
    load_scale: float = 1.0
    window_s: float = 0.0  # seconds of each window; 0: the workload's own
    budget: int = 512  # the bounds' token budget (vtc's)
    out: str = "outputs/tenant_flood_bound/result.json"


RULES = {
    "policies": Rule(
        lambda v: len(v) > 0 and set(v) <= set(policy_names()), "a non-empty list of policy names"
    ),
    "seeds": Rule(lambda v: NON_EMPTY.test(v) and each(SEED).test(v), "a non-empty list of seeds"),
    "load_scale": LOAD_SCALE,
    "window_s": NON_NEGATIVE,
    "budget": AT_LEAST_ONE,
    "out": Rule(lambda v: bool(v), "a file path"),
}


def without_tenant(trace: Trace, tenant: str) -> Trace:
    """``trace`` without ``tenant``'s requests: the others' arrivals, lengths and labels unchanged."""
    keep = [i for i, t in enumerate(trace.tenants()) if t != tenant]

    def pick(values: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        return None if values is None else tuple(values[i] for i in keep)

    return dataclasses.replace(
        trace,
        arrival_s=trace.arrival_s[keep],
        prompt_len=trace.prompt_len[keep],
        output_len=trace.output_len[keep],
        hash_ids=pick(trace.hash_ids),
        tenant=pick(trace.tenant),
        slo_class=pick(trace.slo_class),
    )


def share(mask: np.ndarray) -> float:
    """The fraction of ``mask`` that is true; NaN when empty."""
    return float(mask.mean()) if len(mask) else math.nan


def mean_or_nan(values: np.ndarray) -> float:
    """The mean of the finite values; NaN when there are none."""
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if len(finite) else math.nan


def measure(setup: ServingSetup, trace: Trace, policy: Policy, interactive: Sequence[str]) -> dict[str, Any]:
    """One run of ``policy`` on ``trace``: the record the module docstring lists."""
    sim = setup.simulator(trace)
    result = sim.run(policy)
    out, tenants = result.outcomes, trace_tenants(trace)
    token_times = [result.token_times.get(i) for i in range(len(out.arrival))]
    requests = sim.core.requests
    with np.errstate(invalid="ignore"):  # unfinished requests' NaNs meet no bound
        ttft_ok = out.ttft <= out.ttft_bound
        tpot_ok = out.tpot <= np.array([r.tpot_bound for r in requests])
        stall_ok = out.stall <= np.array([r.stall_bound for r in requests])
    per_tenant = {}
    for name in sorted(set(tenants.tolist())):
        mine = tenants == name
        row = group_row("tenant", name, out.subset(mine), trace.span_s)
        per_tenant[name] = {
            "requests": int(mine.sum()),
            "attainment": float(row["attainment"]),
            "ttft_met": share(ttft_ok[mine]),
            "tpot_met": share(tpot_ok[mine]),
            "stall_met": share(stall_ok[mine]),
            "ttft_p99_s": float(row["ttft_p99_s"]),
        }
    fair = fairness_summary(out, tenants, token_times, trace.span_s, class_weights(trace))
    chat = np.isin(tenants, list(interactive))
    iters = result.iterations
    return {
        "tenants": per_tenant,
        "min_within_share_attainment": fair["min_within_share_attainment"],
        "jain_maxmin": fair["jain_maxmin"],
        "min_interactive_attainment": min(per_tenant[t]["attainment"] for t in interactive),
        "interactive_ttft_met": share(ttft_ok[chat]),
        "interactive_tpot_met": share(tpot_ok[chat]),
        "interactive_stall_met": share(stall_ok[chat]),
        "missed_interactive_sched_delay_s": mean_or_nan(out.sched_delay[chat & ~out.good]),
        "met_interactive_sched_delay_s": mean_or_nan(out.sched_delay[chat & out.good]),
        "iteration_mean_s": mean_or_nan(np.asarray(iters["latency"])),
        "decodes_per_iteration": mean_or_nan(np.asarray(iters["decode_tokens"], dtype=np.float64)),
        "prefill_tokens_per_iteration": mean_or_nan(np.asarray(iters["prefill_tokens"], dtype=np.float64)),
    }


def mean_over(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The records' field-wise means over seeds (nested per-tenant fields too; NaNs left out)."""
    first = records[0]
    return {
        k: mean_over([r[k] for r in records])
        if isinstance(first[k], dict)
        else mean_or_nan(np.array([r[k] for r in records], dtype=np.float64))
        for k in first
    }


def interactive_tenants(trace: Trace, slo_class: str) -> list[str]:
    """The tenants whose requests are judged by ``slo_class``."""
    classes = trace.slo_class or ()
    return sorted({t for t, c in zip(trace.tenants(), classes, strict=True) if c == slo_class})


def check_mix(trace: Trace, args: Options) -> list[str]:
    """The interactive tenants of ``trace``; ConfigError (one line) when the flood or they are missing."""
    names = sorted(set(trace.tenants()))
    if args.flood not in names:
        raise ConfigError(
            f"flood: no tenant {args.flood!r} in {args.workload}; its tenants: {', '.join(names)}"
        )
    interactive = interactive_tenants(trace, args.interactive_class)
    if not interactive:
        raise ConfigError(
            f"interactive_class: no tenant of class {args.interactive_class!r} in {args.workload}"
        )
    return interactive


def policy_maker(name: str, args: Options) -> Callable[[], Policy]:
    """A fresh policy per run: a bound of :data:`BOUNDS` or a registered baseline."""
    if name in BOUNDS:
        return lambda: make_bound(name, args.flood, args.budget)
    return lambda: make_policy(name)


def run_all(args: Options) -> dict[str, Any]:
    """Every policy on every seed's window, with and without the flood: per-seed records and means."""
    setup, workload = ServingSetup.from_names(), load_workload(args.workload)
    window = args.window_s or None
    traces = {seed: workload.window("test", seed, args.load_scale, window) for seed in args.seeds}
    interactive = check_mix(traces[args.seeds[0]], args)
    policies: dict[str, Any] = {}
    for name in [*args.policies, *BOUNDS]:
        make = policy_maker(name, args)
        entry: dict[str, Any] = {"kind": "unfair_bound" if name in BOUNDS else "baseline"}
        for label, cut in (("flood", False), ("no_flood", True)):
            runs = {
                seed: measure(setup, without_tenant(t, args.flood) if cut else t, make(), interactive)
                for seed, t in traces.items()
            }
            entry[label] = {"per_seed": runs, "mean": mean_over(list(runs.values()))}
        policies[name] = entry
    best = max(BOUNDS, key=lambda b: policies[b]["flood"]["mean"]["min_interactive_attainment"])
    return {
        "workload": args.workload,
        "split": "test",
        "seeds": list(args.seeds),
        "load_scale": args.load_scale,
        "flood": args.flood,
        "interactive_tenants": interactive,
        "policies": policies,
        "best_bound": best,
        "best_bound_min_interactive_attainment": policies[best]["flood"]["mean"][
            "min_interactive_attainment"
        ],
    }


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The last stdout line: the means over seeds that the docs quote."""
    pols = report["policies"]

    def pick(label: str, key: str) -> dict[str, float]:
        return {name: round(p[label]["mean"][key], 4) for name, p in pols.items()}

    return {
        "mws": pick("flood", "min_within_share_attainment"),
        "jain": pick("flood", "jain_maxmin"),
        "min_interactive_attainment": pick("flood", "min_interactive_attainment"),
        "no_flood_min_interactive_attainment": pick("no_flood", "min_interactive_attainment"),
        "interactive_ttft_met": pick("flood", "interactive_ttft_met"),
        "missed_interactive_sched_delay_s": pick("flood", "missed_interactive_sched_delay_s"),
        "iteration_mean_s": pick("flood", "iteration_mean_s"),
        "no_flood_iteration_mean_s": pick("no_flood", "iteration_mean_s"),
        "best_bound": report["best_bound"],
        "best_bound_min_interactive_attainment": round(report["best_bound_min_interactive_attainment"], 4),
        "out": report["out"],
    }


def lines(report: dict[str, Any]) -> list[str]:
    """One readable line per policy and flood setting (means over seeds)."""
    rows = []
    for name, p in report["policies"].items():
        for label in ("flood", "no_flood"):
            m = p[label]["mean"]
            att = " ".join(f"{t} {v['attainment']:.3f}" for t, v in m["tenants"].items())
            rows.append(
                f"{name:21s} {label:8s} mws {m['min_within_share_attainment']:.3f} jain {m['jain_maxmin']:.3f}"
                f" | {att} | interactive met ttft {m['interactive_ttft_met']:.3f} tpot {m['interactive_tpot_met']:.3f}"
                f" stall {m['interactive_stall_met']:.3f}, sched delay missed {m['missed_interactive_sched_delay_s']:.3f}"
                f" s met {m['met_interactive_sched_delay_s']:.3f} s | iteration {1e3 * m['iteration_mean_s']:.1f} ms"
                f" ({m['decodes_per_iteration']:.0f} decodes, {m['prefill_tokens_per_iteration']:.0f} prefill tokens)"
            )
    return rows


def finite(value: Any) -> Any:
    """``value`` with NaNs as None, so the file is strict JSON."""
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


@hydra_cli(Options, "tenant_flood_bound", RULES)
def main(args: Options) -> None:
    load_start, wall = os.getloadavg()[0], time.perf_counter()
    report = run_all(args)
    report["out"] = args.out
    report["wall_s"] = round(time.perf_counter() - wall, 1)
    report["load_avg"] = round((load_start + os.getloadavg()[0]) / 2, 2)
    for row in lines(report):
        print(row, flush=True)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(finite(report), indent=1) + "\n")
    print(json.dumps(finite(summary(report))))


if __name__ == "__main__":
    main()
