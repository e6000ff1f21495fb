"""The leaderboard's files: exact CSV/JSON rows, and the Markdown ranking with confidence intervals.

Floats are written exactly: CSV cells hold ``repr`` (shortest round-trip) text and JSON holds
Python floats, with ``null`` for NaN. :func:`read_rows` reads either back without any parsing
that could round (CSV cells stay text), which is what validation compares.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

SARATHI_PREFIX = "sarathi_"
MEAN_COLUMNS = ("slo_attainment", "ttft_p99_s", "tbt_p99_s", "max_tbt_s")
"""Columns the ranking shows as plain means over seeds (goodput gets a confidence interval)."""


# ---- rows on disk --------------------------------------------------------------------------
def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> pd.DataFrame:
    """One CSV line per row (NaN as an empty cell, floats as ``repr``); returns the frame written."""
    frame = pd.DataFrame(list(rows))
    frame.to_csv(path, index=False)
    return frame


def write_json(rows: Iterable[Mapping[str, Any]], path: Path) -> None:
    """A JSON array of row objects: Python floats (exact), NaN as null."""
    plain = [{k: _plain(v) for k, v in row.items()} for row in rows]
    path.write_text(json.dumps(plain, indent=1, allow_nan=False) + "\n")


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``results.csv`` (cells as text, "" for NaN) or ``results.json`` (null for NaN)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such results file")
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: expected a JSON array of row objects")
        return rows
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# ---- statistics ----------------------------------------------------------------------------
def mean_ci(values: Sequence[float] | pd.Series) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student's t); NaN half-width for n < 2."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        return math.nan, math.nan
    mean = float(x.mean())
    if n < 2:
        return mean, math.nan
    from scipy import stats  # ~0.5 s to import: only once there is something to summarise

    return mean, float(stats.t.ppf(0.975, n - 1) * x.std(ddof=1) / math.sqrt(n))


def ranking(results: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, load_scale): policies ranked by mean goodput over seeds.

    Columns: workload, load_scale, rank, policy, seeds, goodput_mean, goodput_ci95 (half-width),
    means of slo_attainment, ttft_p99_s, tbt_p99_s, max_tbt_s, and vs_best_sarathi: the mean
    goodput over the best ``sarathi_*`` policy's mean goodput in the same group and backend (a real
    engine run is compared with real Sarathi runs, not simulated ones; NaN without one).
    """
    out = []
    for (wl, load), group in results.groupby(["workload", "load_scale"], sort=False):
        per = []
        for policy, g in group.groupby("policy", sort=False):
            mean, half = mean_ci(g["goodput_rps"])
            per.append(
                {
                    "workload": wl,
                    "load_scale": load,
                    "policy": policy,
                    "backend": g["backend"].iloc[0],
                    "seeds": len(g),
                    "goodput_mean": mean,
                    "goodput_ci95": half,
                    **{f"{c}_mean": float(g[c].mean()) for c in MEAN_COLUMNS},
                }
            )
        best: dict[str, float] = {}
        for p in per:
            if p["policy"].startswith(SARATHI_PREFIX):
                best[p["backend"]] = max(best.get(p["backend"], -math.inf), p["goodput_mean"])
        per.sort(key=lambda p: (-p["goodput_mean"], p["policy"]))
        for rank, p in enumerate(per, 1):
            p["rank"] = rank
            b = best.get(p["backend"], math.nan)
            p["vs_best_sarathi"] = p["goodput_mean"] / b if b > 0 else math.nan
        out += per
    return pd.DataFrame(out)


def capacity_summary(capacity: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, policy): mean and 95% CI over seeds of each capacity column."""
    value_cols = [c for c in capacity.columns if c.startswith("capacity_")]
    out = []
    for (wl, policy), g in capacity.groupby(["workload", "policy"], sort=False):
        row: dict[str, Any] = {"workload": wl, "policy": policy, "seeds": len(g)}
        for c in value_cols:
            row[f"{c}_mean"], row[f"{c}_ci95"] = mean_ci(g[c])
        out.append(row)
    return pd.DataFrame(out)


# ---- Markdown ------------------------------------------------------------------------------
def markdown(results: pd.DataFrame, ranked: pd.DataFrame, capacity: pd.DataFrame | None = None) -> str:
    """The leaderboard: a setup line, then one ranked table per workload and load scale."""
    first = results.iloc[0]
    seeds = sorted(results["seed"].unique())
    lines = [
        "# chunkgym leaderboard",
        "",
        f"{first['model']} on {first['tp']} x {first['hardware']}, SLO `{first['slo']}`, cost model "
        f"`{first['cost_model']}`, backend `{first['backend']}`; seeds {', '.join(map(str, seeds))}; "
        f"env {', '.join(sorted(results['env_version'].unique()))}, commit `{first['git_commit']}`.",
        "",
        "Goodput: requests meeting their SLO per second of the window's arrivals, mean over seeds "
        "± the 95% confidence half-width (Student's t). *vs best sarathi*: mean goodput over the "
        "mean goodput of the best `sarathi_*` policy on the same workload and load.",
    ]
    for (wl, load), group in ranked.groupby(["workload", "load_scale"], sort=False):
        split = results.loc[results["workload"] == wl, "split"].iloc[0]
        lines += [
            "",
            f"## {wl} ({split} split), load {load:g}x",
            "",
            "| rank | policy | goodput (req/s) | SLO attainment | TTFT p99 (s) | TBT p99 (s) "
            "| max TBT (s) | vs best sarathi |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in group.itertuples():
            lines.append(
                f"| {r.rank} | {r.policy} | {_pm(r.goodput_mean, r.goodput_ci95)} | "
                f"{_num(r.slo_attainment_mean, '.3f')} | {_num(r.ttft_p99_s_mean)} | {_num(r.tbt_p99_s_mean)} | "
                f"{_num(r.max_tbt_s_mean)} | {_num(r.vs_best_sarathi, '.2f')} |"
            )
    if capacity is not None and len(capacity):
        lines += _capacity_markdown(capacity_summary(capacity))
    return "\n".join(lines) + "\n"


def _capacity_markdown(summary: pd.DataFrame) -> list[str]:
    lines = [
        "",
        "## Capacity",
        "",
        "Highest load scale (and request rate) meeting each criterion: *attain90*, >= 90% of requests "
        "within SLO; *tbt*, P99 TBT within the TPOT bound and median scheduling delay <= 2 s. Mean over "
        "seeds ± 95% CI. *vs best sarathi*: attain90 capacity over that of the best fixed `sarathi_*` "
        "budget on the workload (the best chosen per workload, by mean).",
    ]
    for wl, group in summary.groupby("workload", sort=False):
        sarathi = group.loc[group["policy"].str.startswith("sarathi_"), "capacity_attain90_scale_mean"]
        best = sarathi.max() if len(sarathi) else math.nan
        lines += [
            "",
            f"### {wl}",
            "",
            "| policy | attain90 scale | attain90 req/s | tbt scale | tbt req/s | vs best sarathi |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in group.sort_values("capacity_attain90_rps_mean", ascending=False).to_dict("records"):
            cells = [
                _pm(r[f"capacity_{c}_mean"], r[f"capacity_{c}_ci95"])
                for c in ("attain90_scale", "attain90_rps", "tbt_scale", "tbt_rps")
            ]
            ratio = r["capacity_attain90_scale_mean"] / best if best else math.nan
            lines.append(f"| {r['policy']} | " + " | ".join(cells) + f" | {_num(ratio, '.2f')} |")
    return lines


def _num(x: Any, fmt: str = ".3g") -> str:  # a table cell: a float, NaN or None
    return "" if x is None or math.isnan(x) else format(x, fmt)


def _pm(mean: Any, half: Any) -> str:  # table cells, as _num
    return _num(mean) if math.isnan(half) else f"{_num(mean)} ± {_num(half, '.2g')}"
