"""Colocated chunked prefill against every prefill-decode split on the same GPUs.

    python bench/pd_study.py [full=true] [out=reports/pd_study] [parallel=2]

A cell is one workload x SLO x model x link x GPU count.  Its two answers, by DistServe's metric
(the highest request rate at which 90% of requests meet both TTFT and TPOT, per GPU; the study's
SLOs ``ttft_tight`` and ``tpot_tight`` set the stall bound so loose that it never binds):

* colocated: GPUs / tp servers behind ``least_outstanding_tokens``, each running the best of
  :data:`COLOCATED_POLICIES` (the Sarathi budgets and ``adaptive_srpf``).  It uses no link, so it
  is searched once per workload x SLO x model x GPUs and shared by that group's cells.
* disaggregated: every xPyD with (x + y) x tp = GPUs, x, y >= 1, prefill pool behind
  ``least_outstanding_tokens``, decode pool behind ``least_requests``, every server running the
  best of :data:`DISAGGREGATED_POLICIES`.

The winner is decided by :func:`winner`: a strict win beyond :data:`WIN_MARGIN`, else a tie.  Each
cell also carries the best configurations' metrics at their capacity (transfer time, its share of
the first decode gap, load imbalance, TTFT and TPOT percentiles): the reasons behind the numbers.

The default run is the subset that fits in 30 minutes on 2 cores: the shipped Azure LLM 2023 traces
(``azure_code``, prompt-heavy; ``azure_conv``, chat) x both SLOs x Llama-3-8B (tp 1) and
Llama-2-70B (tp 2) x ``nvlink`` and ``eth_25g`` x 2 and 4 GPUs (the 70B at 4 only), on A100-80GB.
``full=true`` adds 8 GPUs (both models).  Writes ``out``/pd_study.json (keys ``cells``, ``agg_wins``,
``pd_wins``, the settings, ``wall_s``, ``load_avg``) and ``out``/pd_study.png; the last stdout line
is the JSON's summary.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

import chunkgym  # noqa: E402
from advisor.topology import STRICT_WIN, splits  # noqa: E402
from baselines.routers import make_router  # noqa: E402
from chunkgym.cli import hydra_cli  # noqa: E402
from chunkgym.config import AT_LEAST_ONE, NON_EMPTY, SEED, ConfigError  # noqa: E402
from chunkgym.config import Rule as OptionRule  # noqa: E402
from chunkgym.io import atomic_write_text  # noqa: E402
from envs.serving.capacity import Capacity, CapacityQuery, measure_capacities  # noqa: E402
from envs.serving.fleet import LINKS, FleetSpec  # noqa: E402
from envs.serving.metrics import MIN_REL_TOL, slo_names  # noqa: E402
from envs.serving.setup import ServingSetup  # noqa: E402
from envs.serving.specs import hardware_names  # noqa: E402
from envs.serving.workload import Workload, load_workload, workload_names  # noqa: E402
from policies.registry import make_policy  # noqa: E402

MODEL_TP = {"llama3_8b": 1, "llama2_70b": 2}
"""The study's models and their tensor parallelism: the smallest tp whose weights fit an 80 GB GPU."""
COLOCATED_POLICIES = ("sarathi_256", "sarathi_512", "sarathi_1024", "sarathi_2048", "adaptive_srpf")
DISAGGREGATED_POLICIES = ("sarathi_512", "sarathi_2048")
"""Small and large prefill chunks; the decode pool runs the same policy (it only decodes)."""
ROUTER = "least_outstanding_tokens"  # colocated servers and the prefill pool
DECODE_ROUTER = "least_requests"
WIN_MARGIN = STRICT_WIN
"""A strict win: more than 2% above the other side, the margin the advisor's ``topology=auto`` uses."""
FULL_GPUS = [2, 4, 8]
DIAGNOSTICS = (
    "slo_attainment",
    "rejected",
    "ttft_p50_s",
    "ttft_p95_s",
    "tpot_p95_s",
    "busy_fraction",
    "kv_transfer_s_mean",
    "first_decode_gap_transfer_share",
    "load_imbalance",
)
"""Metrics of a cell's best configuration, at its capacity (at its lowest probe when that is 0)."""


@dataclass
class Options:
    """``python bench/pd_study.py KEY=VALUE ...``; the defaults are the default subset."""

    workloads: list[str] = field(default_factory=lambda: ["azure_code", "azure_conv"])
    slos: list[str] = field(default_factory=lambda: ["ttft_tight", "tpot_tight"])
    models: list[str] = field(default_factory=lambda: list(MODEL_TP))
    links: list[str] = field(default_factory=lambda: ["nvlink", "eth_25g"])
    gpus: list[int] = field(default_factory=lambda: [2, 4])
    full: bool = False  # gpus 2, 4 and 8
    hardware: str = "a100_80gb"
    seed: int = 0  # picks the test-split window
    window_s: float = 0.0  # trace seconds of the window; 0: the workload's own
    rel_tol: float = 0.01
    parallel: int = 2
    out: str = "reports/pd_study"


RULES = {
    "workloads": OptionRule(
        lambda v: len(v) > 0 and all(n in workload_names() for n in v),
        f"a non-empty list of workload names ({', '.join(workload_names())})",
    ),
    "slos": OptionRule(
        lambda v: len(v) > 0 and all(n in slo_names() for n in v),
        f"a non-empty list of conf/slo names ({', '.join(slo_names())})",
    ),
    "models": OptionRule(
        lambda v: len(v) > 0 and all(n in MODEL_TP for n in v),
        f"a non-empty list of the study's models ({', '.join(MODEL_TP)})",
    ),
    "links": OptionRule(
        lambda v: len(v) > 0 and all(n in LINKS for n in v), f"a non-empty list of links ({', '.join(LINKS)})"
    ),
    "gpus": OptionRule(
        lambda v: len(v) > 0 and all(isinstance(g, int) and 2 <= g <= 64 for g in v),
        "a non-empty list of GPU counts in [2, 64]",
    ),
    "hardware": OptionRule(lambda v: v in hardware_names(), f"one of {', '.join(hardware_names())}"),
    "seed": SEED,
    "window_s": OptionRule(lambda v: 0 <= v <= 30 * 86400, "seconds in [0, 2592000] (0: the workload's own)"),
    "rel_tol": OptionRule(lambda v: MIN_REL_TOL <= v < 1, f"a capacity rel_tol in [{MIN_REL_TOL:g}, 1)"),
    "parallel": AT_LEAST_ONE,
    "out": NON_EMPTY,
}


def winner(agg: float, pd: float, margin: float = WIN_MARGIN) -> str:
    """ "agg" or "pd" for a strict win by more than ``margin`` (relative), else "tie" (counts for neither)."""
    if pd > (1 + margin) * agg:
        return "pd"
    if agg > (1 + margin) * pd:
        return "agg"
    return "tie"


def gpu_counts(gpus: Sequence[int], tp: int) -> list[int]:
    """The counts a model of ``tp`` takes: multiples of tp with room for two servers."""
    return [g for g in gpus if g % tp == 0 and g // tp >= 2]


@dataclass(frozen=True)
class Candidate:
    """One configuration of a cell: its fleet and policy, and which group of cells it answers."""

    workload: str
    slo: str
    model: str
    gpus: int
    link: str  # "" for colocated (no link)
    fleet: FleetSpec
    policy: str

    @property
    def config(self) -> str:
        f = self.fleet
        shape = f"{f.prefill}P{f.decode}D" if f.disaggregated else f"{f.replicas}x"
        return f"{shape} tp{self.gpus // f.servers} {self.policy}"


def candidates(args: Options, gpus: Sequence[int]) -> list[Candidate]:
    """Every search of the run: each group's colocated policies once, each link's splits (the advisor's
    :func:`~advisor.topology.splits` of those servers) and policies."""
    out = []
    for w in args.workloads:
        for s in args.slos:
            for m in args.models:
                tp = MODEL_TP[m]
                for g in gpu_counts(gpus, tp):
                    colocated = FleetSpec(replicas=g // tp, router=ROUTER)
                    out += [Candidate(w, s, m, g, "", colocated, p) for p in COLOCATED_POLICIES]
                    for link in args.links:
                        servers = FleetSpec(
                            replicas=g // tp, router=ROUTER, link=link, decode_router=DECODE_ROUTER
                        )
                        for fleet in splits("auto", servers):
                            out += [Candidate(w, s, m, g, link, fleet, p) for p in DISAGGREGATED_POLICIES]
    return out


def query(c: Candidate, setup: ServingSetup, workload: Workload, args: Options) -> CapacityQuery:
    """``c``'s capacity search; its policy and routers as registry names, so a pool worker can run it."""
    return CapacityQuery(
        setup,
        workload,
        functools.partial(make_policy, c.policy),
        seed=args.seed,
        window_s=args.window_s or None,
        rel_tol=args.rel_tol,
        fleet=c.fleet,
        make_router=functools.partial(make_router, ROUTER),
        make_decode_router=functools.partial(make_router, DECODE_ROUTER),
    )


def diagnose(c: Candidate, cap: Capacity, setup: ServingSetup, q: CapacityQuery) -> dict[str, float]:
    """:data:`DIAGNOSTICS` of ``c`` run at its capacity (at its lowest probe when it has none)."""
    scale = cap.scale if cap.scale > 0 else min(p.scale for p in cap.probes)
    trace = q.trace_at(scale)
    fleet = setup.fleet_for(trace, c.fleet, q.make_policy, make_router(ROUTER), make_router(DECODE_ROUTER))
    metrics = fleet.run().metrics
    return {"at_rps": round(len(trace) / trace.span_s, 4)} | {
        k: round(float(metrics[k]), 4) for k in DIAGNOSTICS if k in metrics
    }


def best(
    found: Sequence[tuple[Candidate, Capacity, CapacityQuery]],
    setups: dict[tuple[str, str, str], ServingSetup],
) -> dict[str, Any]:
    """The highest capacity of ``found`` (ties: the first, so the order of the candidates decides),
    per GPU, with its configuration and diagnostics, and every configuration's (``searched``: how
    much the choice of chunk budget or split matters)."""
    c, cap, q = max(found, key=lambda f: f[1].rps)
    return {
        "capacity_per_gpu_rps": round(cap.rps / c.gpus, 4),
        "config": c.config,
        "at_capacity": diagnose(c, cap, setups[c.workload, c.slo, c.model], q),
        "searched": {f[0].config: round(f[1].rps / f[0].gpus, 4) for f in found},
    }


def cells(
    found: Sequence[tuple[Candidate, Capacity, CapacityQuery]],
    args: Options,
    gpus: Sequence[int],
    setups: dict[tuple[str, str, str], ServingSetup],
) -> list[dict[str, Any]]:
    """One row per workload x SLO x model x link x GPUs: best colocated, best disaggregated, winner."""
    rows = []
    for w in args.workloads:
        for s in args.slos:
            for m in args.models:
                for g in gpu_counts(gpus, MODEL_TP[m]):
                    group = [
                        f for f in found if (f[0].workload, f[0].slo, f[0].model, f[0].gpus) == (w, s, m, g)
                    ]
                    agg = best([f for f in group if not f[0].link], setups)
                    for link in args.links:
                        pd = best([f for f in group if f[0].link == link], setups)
                        win = winner(agg["capacity_per_gpu_rps"], pd["capacity_per_gpu_rps"])
                        rows.append(
                            {"workload": w, "slo": s, "model": m, "link": link, "gpus": g}
                            | {"colocated": agg, "disaggregated": pd, "winner": win}
                        )
    return rows


@hydra_cli(Options, "pd_study", RULES)
def main(args: Options) -> None:
    chunkgym.require_own_packages()
    if args.full and args.gpus != Options().gpus:
        raise ConfigError(f"full=true with gpus={args.gpus}: full runs gpus={FULL_GPUS}; leave gpus unset")
    gpus = FULL_GPUS if args.full else args.gpus
    todo = candidates(args, gpus)
    if not todo:
        raise ConfigError(
            f"models={args.models} gpus={list(gpus)}: no cell; a model of tp t needs a multiple of t, at least 2t "
            f"({', '.join(f'{m} tp {t}' for m, t in MODEL_TP.items())})"
        )
    load_start, wall = os.getloadavg()[0], time.perf_counter()
    setups = {
        (w, s, m): ServingSetup.from_names(m, args.hardware, MODEL_TP[m], s)
        for w in args.workloads
        for s in args.slos
        for m in args.models
    }
    workloads = {w: load_workload(w) for w in args.workloads}
    queries = [query(c, setups[c.workload, c.slo, c.model], workloads[c.workload], args) for c in todo]
    caps = measure_capacities(queries, parallel=args.parallel)
    rows = cells(list(zip(todo, caps, queries, strict=True)), args, gpus, setups)
    out = {
        "cells": rows,
        "agg_wins": sum(r["winner"] == "agg" for r in rows),
        "pd_wins": sum(r["winner"] == "pd" for r in rows),
        "ties": sum(r["winner"] == "tie" for r in rows),
        "settings": asdict(args)
        | {"gpus": list(gpus), "model_tp": MODEL_TP, "win_margin": WIN_MARGIN}
        | {
            "colocated_policies": list(COLOCATED_POLICIES),
            "disaggregated_policies": list(DISAGGREGATED_POLICIES),
        }
        | {"router": ROUTER, "decode_router": DECODE_ROUTER, "searches": len(queries)},
        "wall_s": round(time.perf_counter() - wall, 1),
        "load_avg": round((load_start + os.getloadavg()[0]) / 2, 2),
    }
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "pd_study.json", json.dumps(out, indent=1) + "\n")
    plot(rows, folder / "pd_study.png")
    summary = {k: out[k] for k in ("agg_wins", "pd_wins", "ties", "wall_s", "load_avg")}
    print(json.dumps(summary | {"cells": len(rows), "out": str(folder)}))


SHORT = {"azure_code": "Azure code", "azure_conv": "Azure conv", "llama3_8b": "8B", "llama2_70b": "70B"}


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """One panel per workload x SLO, one row per model x GPUs x link: colocated and disaggregated
    goodput per GPU as two dots joined by a line (log scale); a capacity of 0 sits at the left edge."""
    panels = list(dict.fromkeys((r["workload"], r["slo"]) for r in rows))
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.2 + 0.42 * len(rows)), squeeze=False)
    for ax, (w, s) in zip(axes[:, 0], panels, strict=True):
        _panel(ax, [r for r in rows if (r["workload"], r["slo"]) == (w, s)], f"{SHORT.get(w, w)}, {s}")
    axes[-1, 0].set_xlabel(
        "goodput per GPU at capacity (req/s, log scale; 90% of requests meet TTFT and TPOT)"
    )
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    fig.legend(handles, labels, loc="upper center", ncols=3, fontsize=9, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _panel(ax: Any, rows: Sequence[dict[str, Any]], title: str) -> None:
    values = [r[k]["capacity_per_gpu_rps"] for r in rows for k in ("colocated", "disaggregated")]
    positive = [v for v in values if v > 0] or [1.0]
    floor = min(positive) / 3
    show: Callable[[float], float] = lambda v: v if v > 0 else floor  # noqa: E731
    colors = {"agg": "tab:blue", "pd": "tab:orange", "tie": "0.5"}
    for i, r in enumerate(rows):
        agg, pd = r["colocated"]["capacity_per_gpu_rps"], r["disaggregated"]["capacity_per_gpu_rps"]
        ax.plot([show(agg), show(pd)], [i, i], color=colors[r["winner"]], lw=2.5, alpha=0.5, zorder=1)
        ax.scatter(
            show(agg), i, color="tab:blue", marker="o", s=40, zorder=2, label="colocated" if i == 0 else None
        )
        ax.scatter(
            show(pd),
            i,
            color="tab:orange",
            marker="D",
            s=40,
            zorder=2,
            label="disaggregated" if i == 0 else None,
        )
        for v in (agg, pd):
            if v == 0:
                ax.annotate("0", (floor, i), xytext=(-10, -3), textcoords="offset points", fontsize=8)
        ax.text(1.01, i, _verdict(r["winner"], agg, pd), transform=ax.get_yaxis_transform(), va="center",
                fontsize=8, color=colors[r["winner"]])  # fmt: skip
    ax.plot([], [], color="0.5", lw=2.5, alpha=0.5, label="line: the winner's colour (grey: tie within 2%)")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(
        [f"{SHORT.get(r['model'], r['model'])} {r['gpus']} GPUs {r['link']}" for r in rows], fontsize=8
    )
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", which="both", alpha=0.3)


def _verdict(won: str, agg: float, pd: float) -> str:
    """The right-hand note of a row: who wins and by what factor."""
    if won == "tie":
        return "tie" if agg > 0 else "both 0"
    ratio = max(agg, pd) / min(agg, pd) if min(agg, pd) > 0 else float("inf")
    who = "colocated" if won == "agg" else "disagg."
    return f"{who} x{ratio:.2f}" if ratio < float("inf") else f"{who} (other 0)"


if __name__ == "__main__":
    main()
