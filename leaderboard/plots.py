"""The leaderboard's PNG plots (matplotlib, no display needed).

* goodput and SLO attainment against load, per workload: the policies a reader compares
  (:data:`HIGHLIGHT` and the best other heuristic) drawn strong with 95% bands, the rest faint;
* CDFs of the pooled token gaps (TBT), per workload and load (:data:`TBT_HIGHLIGHT` strong, the rest faint);
* the stall picture: one streaming request's token gaps while a long prompt is prefilled,
  FCFS beside Sarathi (:func:`find_stall` picks the pair);
* per-iteration batch composition (prefill vs decode tokens) over the same stretch of time;
* with more than one tenant, each tenant's service over the showcase window (VTC's figure).

Every figure's title names the workload, load and seed it shows and the setup (:func:`setup_label`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from envs.serving.loop import SimResult  # noqa: E402
from envs.serving.metrics import SLO  # noqa: E402
from envs.serving.tenancy import W_IN, W_OUT, service_events, service_over_time, tenant_codes  # noqa: E402

HIGHLIGHT = {"fcfs": "tab:red", "adaptive_srpf": "tab:green", "learned": "tab:blue"}
"""Always drawn strong in the goodput plot: no chunking, the best adaptive heuristic, the learned policy."""
BEST_COLOR = "tab:orange"
"""The best heuristic outside :data:`HIGHLIGHT` (highest mean goodput over the workload's loads)."""
TBT_HIGHLIGHT = {
    "fcfs": "tab:red",
    "sarathi_512": "tab:orange",
    "adaptive_srpf": "tab:green",
    "learned": "tab:blue",
}
"""Drawn strong in the TBT CDFs: the stall chunked prefill removes, its standard fix, the best
adaptive heuristic and the learned policy; every other policy faint grey."""
LONGEST_CANDIDATES = 20
"""Longest prompts tried, longest first, when looking for one prefilled while another request streams."""


def _tbt_style(policy: str) -> dict:
    """A TBT-CDF line: strong and named for :data:`TBT_HIGHLIGHT`, faint grey (one legend entry) otherwise."""
    if policy in TBT_HIGHLIGHT:
        return {"color": TBT_HIGHLIGHT[policy], "lw": 2.0, "label": policy, "zorder": 3}
    return {"color": "0.6", "lw": 0.8, "alpha": 0.5, "label": "other policies", "zorder": 1}


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def setup_label(rows: pd.DataFrame, with_seeds: bool = True) -> str:
    """Model, hardware, SLO (with its bounds), cost model and (``with_seeds``) seeds of results ``rows``."""
    r = rows.iloc[0]
    label = (
        f"{r['model']} on {int(r['tp'])} x {r['hardware']}, SLO {r['slo']} (TPOT <= {1e3 * r['slo_tpot_s']:.0f} ms, "
        f"stall <= {r['slo_stall_s']:.2f} s), {r['cost_model']} cost model"
    )
    seeds = ", ".join(str(int(s)) for s in sorted(rows["seed"].unique()))
    return f"{label}, seeds {seeds}" if with_seeds else label


def _best_heuristic(sub: pd.DataFrame) -> str | None:
    """The policy outside HIGHLIGHT and the learned ones with the highest goodput summed over loads."""
    others = sub[~sub["policy"].isin(list(HIGHLIGHT)) & ~sub["policy"].str.startswith("learned")]
    if others.empty:
        return None
    return str(others.groupby("policy")["goodput_mean"].sum().idxmax())


def _legend_key(label: str, best: str | None) -> str | None:
    """The policy a goodput-plot label stands for (None for the faint ones)."""
    policy = label.removesuffix(" (best other heuristic)")
    return policy if policy in HIGHLIGHT or policy == best else None


def goodput_vs_load(ranked: pd.DataFrame, setup: str, path: Path) -> Path:
    """:func:`goodput_figure` saved to ``path``."""
    return _save(goodput_figure(ranked, setup), path)


def goodput_figure(ranked: pd.DataFrame, setup: str) -> plt.Figure:
    """Goodput (95% band over seeds, clipped at 0) and SLO attainment against load; a column per workload.

    Strong: :data:`HIGHLIGHT` and the best other heuristic per workload; every other policy faint grey.
    """
    workloads = list(dict.fromkeys(ranked["workload"]))
    fig, axes = plt.subplots(
        2,
        len(workloads),
        figsize=(4.5 * len(workloads), 7.8),
        squeeze=False,
        sharex="col",
        layout="constrained",
    )
    for j, wl in enumerate(workloads):
        sub = ranked[ranked["workload"] == wl]
        best = _best_heuristic(sub)
        strong = {**HIGHLIGHT, **({best: BEST_COLOR} if best else {})}
        faint_label = "other policies"
        for policy, g in sub.groupby("policy", sort=False):
            g = g.sort_values("load_scale")
            x, mean = g["load_scale"], g["goodput_mean"]
            if policy in strong:
                label = f"{policy} (best other heuristic)" if policy == best else policy
                kw = {"color": strong[policy], "lw": 2.2, "marker": "o", "ms": 4, "label": label, "zorder": 3}
                half = g["goodput_ci95"].fillna(0.0)
                axes[0, j].fill_between(
                    x, np.maximum(mean - half, 0.0), mean + half, color=strong[policy], alpha=0.12, lw=0
                )
            else:
                kw = {"color": "0.6", "lw": 0.9, "alpha": 0.45, "label": faint_label, "zorder": 1}
                faint_label = "_nolegend_"
            axes[0, j].plot(x, mean, **kw)
            axes[1, j].plot(x, g["slo_attainment_mean"], **kw)
        axes[0, j].set_ylim(bottom=0.0)
        axes[0, j].set_title(f"{wl} (test split)")
        order = [*HIGHLIGHT, best, None]  # a fixed order in every column; None: the faint ones
        handles = dict(zip(*reversed(axes[1, j].get_legend_handles_labels()), strict=True))
        labels = sorted(handles, key=lambda lab: order.index(_legend_key(lab, best)))
        axes[1, j].legend(
            [handles[lab] for lab in labels],
            labels,
            fontsize=7,
            ncol=2,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.2),
        )
        axes[0, j].set_ylabel("goodput (req/s)")
        axes[1, j].set_ylabel("SLO attainment")
        axes[1, j].set_ylim(-0.02, 1.02)
        axes[1, j].set_xlabel("load scale")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            loads = sorted(sub["load_scale"].unique())
            ax.set_xticks(loads, labels=[f"{x:g}x" for x in loads])
            ax.grid(alpha=0.3)
    fig.suptitle(f"Goodput and SLO attainment vs load: mean over seeds, band = 95% CI\n{setup}", fontsize=10)
    return fig


def tbt_cdfs(rows: pd.DataFrame, quantiles: Sequence[np.ndarray], probs: np.ndarray, path: Path) -> Path:
    """CDF of every token gap of the first seed's window, per workload (rows) and load (columns);
    :data:`TBT_HIGHLIGHT` strong, the rest faint."""
    seed = rows["seed"].min()
    workloads = list(dict.fromkeys(rows["workload"]))
    loads = sorted(rows["load_scale"].unique())
    fig, axes = plt.subplots(
        len(workloads),
        len(loads),
        figsize=(4.2 * len(loads), 3.2 * len(workloads)),
        squeeze=False,
        layout="constrained",
    )
    for (_, row), q in zip(rows.iterrows(), quantiles, strict=True):
        if row["seed"] != seed or np.isnan(q).all():
            continue
        ax = axes[workloads.index(row["workload"]), loads.index(row["load_scale"])]
        ax.plot(np.maximum(q, 1e-4), probs, **_tbt_style(row["policy"]))
    for i, wl in enumerate(workloads):
        bounds = rows.loc[rows["workload"] == wl, ["slo_tpot_s", "slo_stall_s"]].iloc[0]
        for j, load in enumerate(loads):
            ax = axes[i, j]
            ax.axvline(bounds["slo_tpot_s"], color="k", ls="--", lw=0.8)
            ax.axvline(bounds["slo_stall_s"], color="k", ls=":", lw=0.8)
            ax.set_xscale("log")
            ax.set_ylim(0, 1.01)
            ax.set_title(f"{wl}, load {load:g}x, seed {seed}", fontsize=9)
            ax.set_ylabel("CDF")
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("token gap (s); dashed: TPOT bound, dotted: stall bound", fontsize=8)
    handles = dict(zip(*reversed(axes[0, -1].get_legend_handles_labels()), strict=True))
    order = [p for p in (*TBT_HIGHLIGHT, "other policies") if p in handles]
    axes[0, -1].legend(
        [handles[p] for p in order], order, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8
    )
    fig.suptitle(
        f"CDF of every token gap, one window per panel\n{setup_label(rows, with_seeds=False)}", fontsize=10
    )
    return _save(fig, path)


@dataclass(frozen=True)
class Stall:
    """A long prompt (``long``) and a request streaming across its prefill (``stream``), by request id."""

    long: int
    stream: int


def find_stall(result: SimResult) -> Stall | None:
    """In ``result`` (an FCFS run), the longest prompt prefilled while another request was decoding,
    and the request with the most tokens among those streaming across that prefill."""
    out, times = result.outcomes, result.token_times
    finished = np.flatnonzero(out.finished)
    longest = finished[np.argsort(-out.prompt_len[finished], kind="stable")][:LONGEST_CANDIDATES]
    for long in longest:
        span = prefill_span(result, long)
        assert span is not None, "drawn from the finished requests"
        start, end = span
        streams = [
            (len(t), -rid)
            for rid, t in times.items()
            if rid != long and len(t) > 1 and t[0] < start and t[-1] > end
        ]
        if streams:
            return Stall(int(long), -max(streams)[1])
    return None


def prefill_span(result: SimResult, rid: int) -> tuple[float, float] | None:
    """From request ``rid``'s first scheduled iteration to its first token; None if it never finished."""
    out = result.outcomes
    if not out.finished[rid]:
        return None
    return float(out.arrival[rid] + out.sched_delay[rid]), float(result.token_times[rid][0])


def stall_window(
    results: Mapping[str, SimResult], stall: Stall, margin_s: float = 2.0
) -> tuple[float, float]:
    """From ``margin_s`` before the long prompt arrives to ``margin_s`` after its last prefill ends."""
    first = next(iter(results.values()))
    ends = [span[1] for r in results.values() if (span := prefill_span(r, stall.long))]
    return float(first.outcomes.arrival[stall.long]) - margin_s, max(ends) + margin_s


def timeline(results: Mapping[str, SimResult], stall: Stall, slo: SLO, title: str, path: Path) -> Path:
    """Side by side per policy: the streaming request's token gaps over time, the long prompt's
    arrival (line) and prefill (shaded), and the TPOT and stall bounds."""
    fig, axes = plt.subplots(
        1, len(results), figsize=(6 * len(results), 4), squeeze=False, sharey=True, layout="constrained"
    )
    prompt = int(next(iter(results.values())).outcomes.prompt_len[stall.long])
    for ax, (policy, result) in zip(axes[0], results.items(), strict=True):
        t = result.token_times.get(stall.stream, np.empty(0))
        gaps = np.diff(t)
        if len(gaps):
            ax.stairs(gaps, t, baseline=None, lw=1.2, label=f"request {stall.stream}: gap between its tokens")
            ax.set_title(f"{policy}: max gap {gaps.max() * 1e3:.0f} ms", fontsize=10)
        arrival = result.outcomes.arrival[stall.long]
        ax.axvline(arrival, color="tab:red", lw=1, label=f"request {stall.long} arrives")
        span = prefill_span(result, stall.long)
        if span:
            ax.axvspan(*span, color="tab:red", alpha=0.15, label="its prefill")
        ax.axhline(slo.tpot_s, color="k", ls="--", lw=0.8, label="TPOT bound")
        ax.axhline(slo.stall_s, color="k", ls=":", lw=0.8, label="stall bound")
        ax.set_yscale("log")
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("token gap (s)")
    axes[0, 0].legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"{title}: a {prompt}-token prompt arrives while request {stall.stream} streams", fontsize=11
    )
    return _save(fig, path)


def batch_composition(
    results: Mapping[str, SimResult], span: tuple[float, float], title: str, path: Path
) -> Path:
    """Stacked decode and prefill tokens of every iteration starting within ``span`` (seconds),
    on a scale linear up to 32 tokens and logarithmic above; ``title`` names the window and setup."""
    fig, axes = plt.subplots(
        len(results), 1, figsize=(10, 2.6 * len(results)), squeeze=False, sharex=True, layout="constrained"
    )
    for ax, (policy, result) in zip(axes[:, 0], results.items(), strict=True):
        it = result.iterations
        keep = (it["start"] >= span[0]) & (it["start"] <= span[1])
        x: np.ndarray | list[float] = (
            np.append(it["start"][keep], it["start"][keep][-1] + it["latency"][keep][-1])
            if keep.any()
            else []
        )
        dec = np.append(it["decode_tokens"][keep], 0)
        both = dec + np.append(it["prefill_tokens"][keep], 0)
        if len(x):
            ax.fill_between(x, 0, dec, step="post", color="tab:blue", lw=0, label="decode tokens")
            ax.fill_between(x, dec, both, step="post", color="tab:orange", lw=0, label="prefill tokens")
        ax.set_yscale("symlog", linthresh=32)  # decodes (tens of tokens) stay visible beside long prefills
        ax.set_title(policy, fontsize=10)
        ax.set_ylabel("tokens / iteration")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    axes[-1, 0].set_xlim(*span)
    fig.suptitle(f"Tokens per iteration: {title}", fontsize=10)
    return _save(fig, path)


SERVICE_GRID = 200
"""Times at which :func:`service_by_tenant` samples each tenant's service."""


def service_by_tenant(
    results: Mapping[str, SimResult], tenants: np.ndarray, span_s: float, title: str, path: Path
) -> Path:
    """VTC's figure, a column per policy: each tenant's cumulative service (weighted tokens,
    :mod:`envs.serving.tenancy`) and its service rate over time; the arrival window's end dashed."""
    names, codes = tenant_codes(tenants)
    fig, axes = plt.subplots(
        2, len(results), figsize=(6 * len(results), 6.5), squeeze=False, sharex=True, layout="constrained"
    )
    for j, (policy, result) in enumerate(results.items()):
        out = result.outcomes
        times = [result.token_times.get(i) for i in range(len(out.arrival))]
        service = service_events(out, codes, times)
        end = float(service.time[-1]) if len(service.time) else span_s
        grid = np.linspace(0.0, max(end, span_s), SERVICE_GRID)
        curves = service_over_time(service, len(names), grid)
        rates = np.diff(curves, axis=1) / np.diff(grid)
        for k, name in enumerate(names):
            axes[0, j].plot(grid, curves[k], lw=1.5, label=name)
            axes[1, j].stairs(rates[k], grid, lw=1.2, label=name)
        axes[0, j].set_title(policy, fontsize=10)
        for ax in axes[:, j]:
            ax.axvline(span_s, color="k", ls="--", lw=0.8)
            ax.grid(alpha=0.3)
        axes[1, j].set_xlabel("time (s); dashed: end of the arrival window")
    axes[0, 0].set_ylabel("service received (weighted tokens)")
    axes[1, 0].set_ylabel("service rate (weighted tokens/s)")
    axes[0, -1].legend(title="tenant", fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(
        f"Service per tenant (prompt tokens x{W_IN:g}, output tokens x{W_OUT:g}): {title}", fontsize=10
    )
    return _save(fig, path)
