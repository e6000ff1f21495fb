"""The leaderboard's files: exact CSV/JSON rows, and the Markdown ranking with confidence intervals.

Floats are written exactly: CSV cells hold ``repr`` (shortest round-trip) text and JSON holds
Python floats, with ``null`` for NaN. :func:`read_rows` reads either back without any parsing
that could round (CSV cells stay text), which is what validation compares.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from chunkgym.config import SEED, TP
from chunkgym.received import MiB, ReceivedFileError, parse_json, read_text
from leaderboard.cells import (
    FLEET_KEY,
    as_float,
    check_number,
    check_unique,
    check_workload,
    fleet_key,
    fleet_label,
    row_fleet,
    row_key,
    shown,
)
from policies.registry import check_policy_name

SARATHI_PREFIX = "sarathi_"
MEAN_COLUMNS = ("slo_attainment", "ttft_p99_s", "tbt_p99_s", "max_tbt_s")
"""Columns the ranking shows as plain means over seeds (goodput gets a confidence interval)."""
MAX_RESULTS_BYTES = 64 * MiB
"""A results file read whole (a grid of 10,000 rows is about 25 MB)."""
TEXT_COLUMNS = ("model", "hardware", "slo", "cost_model", "split", "env_version")
"""Columns the board shows as text, which must be text (not empty)."""
BOARD_COLUMNS = (
    "policy", "workload", "load_scale", "seed", "backend", "tp", "git_commit", *TEXT_COLUMNS,
    "goodput_rps", *MEAN_COLUMNS,
)  # fmt: skip
"""Columns ``results=`` reads from every row."""
PER_GPU = "goodput_per_gpu"
"""Read where a row has it (rows made before fleets lack it); the board shows it for fleets."""
CAPACITY_KEY = ("policy", "workload", "seed", *FLEET_KEY)
"""What makes a capacity row one search (without the fleet columns: one server)."""
MARKDOWN_SPECIAL = re.compile(r"[\\`|<>&()]")
"""Characters that would end a table cell, start code, HTML or a link in a rendered value."""


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
    """Rows of a ``results.csv`` (cells as text, "" for NaN) or ``results.json`` (null for NaN).

    The file may have been received: it is read as :mod:`chunkgym.received` reads (a regular
    file, not a link, within :data:`MAX_RESULTS_BYTES`; a leading byte-order mark, as Excel
    writes, dropped), and every problem is one line naming it.
    """
    text = read_text(path, MAX_RESULTS_BYTES)
    return _json_rows(text, path) if Path(path).suffix == ".json" else _csv_rows(text, path)


def _json_rows(text: str, path: str | Path) -> list[dict[str, Any]]:
    rows = parse_json(text, str(path))
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ReceivedFileError(f"{path}: expected a JSON array of row objects")
    return rows


def _csv_rows(text: str, path: str | Path) -> list[dict[str, str]]:
    """Rows as ``csv.DictReader`` gives them (blank lines skipped), after refusing a repeated
    column name or a row whose cell count differs from the header's."""
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        lines = [cells for cells in reader if cells]
    except csv.Error as exc:
        raise ReceivedFileError(f"{path}: line {reader.line_num}: not readable as CSV ({exc})") from None
    if not lines:
        return []
    header, *body = lines
    twice = sorted(name for name, n in Counter(header).items() if n > 1)
    if twice:
        raise ReceivedFileError(f"{path}: column {shown(twice[0])} appears more than once")
    for i, cells in enumerate(body, 1):
        if len(cells) != len(header):
            raise ReceivedFileError(f"{path}: row {i} has {len(cells)} cells, its header {len(header)}")
    return [dict(zip(header, cells, strict=True)) for cells in body]


def read_results(paths: Sequence[str]) -> pd.DataFrame:
    """The rows of results files to render (``evaluate.py results=``), pooled and checked.

    Each file is read as :func:`read_rows` reads it (a CSV parsed by pandas, as the board always
    was), and every row as a board reads it: the :data:`BOARD_COLUMNS` present, policies and
    workloads by name (a ``file:`` trace is shown, never opened), load scales and seeds within the
    grid's ranges, the metrics numbers, and each run (:data:`~leaderboard.cells.ROW_KEY`) once
    across all files.  Raises ValueError (one line) naming the file and row.
    """
    frames, keys = [], []
    for path in paths:
        frame = _frame(path)
        missing = [c for c in BOARD_COLUMNS if c not in frame.columns]
        if missing:
            raise ReceivedFileError(f"{path}: no column {', '.join(missing)}")
        for i, row in enumerate(frame.to_dict("records"), 1):
            try:
                keys.append((_board_key(row), f"{path} row {i}"))
            except ValueError as exc:
                raise ValueError(f"{path}: row {i}: {exc}") from None
        frames.append(frame)
    check_unique(keys)
    results = pd.concat(frames)
    if results.empty:
        raise ValueError(f"{', '.join(paths)}: holds no rows")
    return results.reset_index(drop=True)


def _check_names(row: Mapping[Any, Any]) -> None:
    """The row's policy and workload are names (a ``file:`` workload is shown, never opened)."""
    try:
        check_policy_name(row["policy"])
    except ValueError as exc:
        raise ValueError(f"column policy: {exc}") from None
    try:
        check_workload(row["workload"], None)
    except ValueError as exc:
        raise ValueError(f"column workload: {exc}") from None


def read_capacity(paths: Sequence[str]) -> pd.DataFrame | None:
    """The ``capacity.csv`` files beside ``paths`` (the runs' capacity searches), pooled and checked
    as :func:`read_results` checks rows (names, numbers, each search once); None if there are none."""
    files = [c for c in (Path(p).with_name("capacity.csv") for p in paths) if c.is_file()]
    if not files:
        return None
    frames, keys = [], []
    for f in files:
        frame = _frame(str(f))
        missing = [c for c in CAPACITY_KEY[:3] if c not in frame.columns]
        if missing:
            raise ReceivedFileError(f"{f}: no column {', '.join(missing)}")
        values = [c for c in frame.columns if c.startswith("capacity_")]
        for i, row in enumerate(frame.to_dict("records"), 1):
            try:
                _check_names(row)
                bad = [c for c in values if as_float(row[c]) is None]
                if bad:
                    raise ValueError(f"column {bad[0]}: {shown(row[bad[0]])} is not a number")
                seed = check_number("seed", row["seed"], SEED, integer=True)
                keys.append(
                    ((str(row["policy"]), str(row["workload"]), seed, *fleet_key(row)), f"{f} row {i}")
                )
            except ValueError as exc:
                raise ValueError(f"{f}: row {i}: {exc}") from None
        frames.append(frame)
    check_unique(keys, CAPACITY_KEY)
    return pd.concat(frames, ignore_index=True)


def _frame(path: str) -> pd.DataFrame:
    text = read_text(path, MAX_RESULTS_BYTES)
    if path.endswith(".json"):
        return pd.DataFrame(_json_rows(text, path))
    try:
        # fleet_layerwise as text: pooled with a file whose cells are empty, pandas would make it 0.0/1.0
        return pd.read_csv(io.StringIO(text), dtype={"fleet_layerwise": str})
    except (ValueError, csv.Error) as exc:  # pandas' ParserError and EmptyDataError are ValueErrors
        raise ReceivedFileError(
            f"{path}: not readable as CSV ({str(exc).strip().splitlines()[0][:200]})"
        ) from None


def _board_key(row: Mapping[Any, Any]) -> tuple[Any, ...]:
    """The row's run key, after checking each cell the board reads as a name or a number."""
    _check_names(row)
    for column in ("backend", *TEXT_COLUMNS):
        if not isinstance(row[column], str) or not row[column]:
            raise ValueError(f"column {column}: {shown(row[column])} is not text")
    for column in ("goodput_rps", *MEAN_COLUMNS, *([PER_GPU] if PER_GPU in row else [])):
        number = as_float(row[column])
        if number is None or math.isinf(number):
            raise ValueError(f"column {column}: {shown(row[column])} is not a finite number or empty")
    check_number("tp", row["tp"], TP, integer=True)
    return row_key(row)


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
    means of slo_attainment, ttft_p99_s, tbt_p99_s, max_tbt_s (and of goodput_per_gpu where the rows
    have it), and vs_best_sarathi: the mean
    goodput over the best ``sarathi_*`` policy's mean goodput in the same group and backend (a real
    engine run is compared with real Sarathi runs, not simulated ones; NaN without one).
    """
    out = []
    results = with_fleet_labels(results)
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
                    **({f"{PER_GPU}_mean": float(g[PER_GPU].astype(float).mean())} if PER_GPU in g else {}),
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


def with_fleet_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each fleet row's policy shown with its fleet (``sarathi_512 x8 prefix_affinity``,
    ``sarathi_512 1P1D eth_25g round_robin/least_requests``: :func:`~leaderboard.cells.fleet_label`),
    so rows of one policy on different fleets rank as different entries; one-server rows (and files
    made before fleets) as they are."""
    if "fleet_replicas" not in frame.columns:
        return frame
    fleets = [row_fleet(row) for row in frame.to_dict("records")]
    labels = [
        f"{p} {fleet_label(f)}" if f.servers > 1 else p for p, f in zip(frame["policy"], fleets, strict=True)
    ]
    return frame.assign(policy=labels)


def capacity_summary(capacity: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, policy): mean and 95% CI over seeds of each capacity column."""
    value_cols = [c for c in capacity.columns if c.startswith("capacity_")]
    out = []
    capacity = with_fleet_labels(capacity)
    for (wl, policy), g in capacity.groupby(["workload", "policy"], sort=False):
        row: dict[str, Any] = {"workload": wl, "policy": policy, "seeds": len(g)}
        for c in value_cols:
            row[f"{c}_mean"], row[f"{c}_ci95"] = mean_ci(g[c])
        out.append(row)
    return pd.DataFrame(out)


# ---- Markdown ------------------------------------------------------------------------------
def markdown(results: pd.DataFrame, ranked: pd.DataFrame, capacity: pd.DataFrame | None = None) -> str:
    """The leaderboard: a setup line, then one ranked table per workload and load scale (with goodput
    per GPU where a row ran on more than one server: at one server it is only goodput over tp)."""
    first = results.iloc[0]
    per_gpu = f"{PER_GPU}_mean" in ranked.columns and _has_fleets(results)
    seeds = sorted(results["seed"].unique())
    lines = [
        "# chunkgym leaderboard",
        "",
        f"{_text(first['model'])} on {_text(first['tp'])} x {_text(first['hardware'])}, SLO {_code(first['slo'])}, "
        f"cost model {_code(first['cost_model'])}, backend {_code(first['backend'])}; seeds "
        f"{', '.join(map(_text, seeds))}; env {', '.join(map(_text, sorted(results['env_version'].unique())))}, "
        f"commit {_code(first['git_commit'])}.",
        "",
        "Goodput: requests meeting their SLO per second of the window's arrivals, mean over seeds "
        "± the 95% confidence half-width (Student's t). *vs best sarathi*: mean goodput over the "
        "mean goodput of the best `sarathi_*` policy on the same workload and load."
        + (
            " *Goodput/GPU*: goodput over the GPUs serving it (servers x tp), mean over seeds."
            if per_gpu
            else ""
        ),
    ]
    for (wl, load), group in ranked.groupby(["workload", "load_scale"], sort=False):
        split = results.loc[results["workload"] == wl, "split"].iloc[0]
        lines += [
            "",
            f"## {_text(wl)} ({_text(split)} split), load {load:g}x",
            "",
            "| rank | policy | goodput (req/s) | "
            + ("goodput/GPU (req/s) | " if per_gpu else "")
            + "SLO attainment | TTFT p99 (s) | TBT p99 (s) | max TBT (s) | vs best sarathi |",
            "|---:|---|---:|" + ("---:|" if per_gpu else "") + "---:|---:|---:|---:|---:|",
        ]
        for r in group.itertuples():
            gpu = f"{_num(getattr(r, f'{PER_GPU}_mean'))} | " if per_gpu else ""
            lines.append(
                f"| {r.rank} | {_text(r.policy)} | {_pm(r.goodput_mean, r.goodput_ci95)} | {gpu}"
                f"{_num(r.slo_attainment_mean, '.3f')} | {_num(r.ttft_p99_s_mean)} | {_num(r.tbt_p99_s_mean)} | "
                f"{_num(r.max_tbt_s_mean)} | {_num(r.vs_best_sarathi, '.2f')} |"
            )
    if capacity is not None and len(capacity):
        lines += _capacity_markdown(capacity_summary(capacity))
    return "\n".join(lines) + "\n"


def _has_fleets(results: pd.DataFrame) -> bool:
    """Whether a row ran on more than one server (colocated or in pools)."""
    if "fleet_replicas" not in results.columns:
        return False
    return any(row_fleet(row).servers > 1 for row in results.to_dict("records"))


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
            f"### {_text(wl)}",
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
            lines.append(f"| {_text(r['policy'])} | " + " | ".join(cells) + f" | {_num(ratio, '.2f')} |")
    return lines


def _text(value: Any) -> str:
    """``value`` as Markdown that renders as its text and stays in its table cell: on one line,
    with no table pipe, code, HTML or link syntax of its own (a received cell is only text)."""
    line = " ".join(str(value).splitlines())
    return MARKDOWN_SPECIAL.sub(lambda m: _ENTITIES.get(m[0], "\\" + m[0]), line)


_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def _code(value: Any) -> str:
    """``value`` as a Markdown code span on one line: fenced by more backticks than it holds (padded
    where it starts or ends with one), so nothing in it ends the span early."""
    line = " ".join(str(value).splitlines())
    fence = "`" * (max((len(run) for run in re.findall("`+", line)), default=0) + 1)
    pad = " " if line.startswith("`") or line.endswith("`") else ""
    return f"{fence}{pad}{line}{pad}{fence}"


def _num(x: Any, fmt: str = ".3g") -> str:  # a table cell: a float, NaN or None
    return "" if x is None or math.isnan(x) else format(x, fmt)


def _pm(mean: Any, half: Any) -> str:  # table cells, as _num
    return _num(mean) if math.isnan(half) else f"{_num(mean)} ± {_num(half, '.2g')}"
