"""Whole-request measurements from Splitwise (``splitwise/perf_model.csv``), cleaned.

Each row is one run: ``batch_size`` prompts of ``prompt_size`` tokens prefilled together
(``prompt_time``, ms), then ``token_size`` decode iterations (``token_time``, ms per
iteration) and ``e2e_time``.  Three kinds of rows are left out, each found from the data
itself (see :func:`clean`), and every exclusion is recorded with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from chunkgym.data import MissingDataFile

COLUMNS = (
    "model",
    "hardware",
    "prompt_size",
    "batch_size",
    "token_size",
    "prompt_time",
    "token_time",
    "e2e_time",
    "tensor_parallel",
)
CONFIG = ["model", "hardware", "tensor_parallel", "prompt_size", "batch_size", "token_size"]
E2E_TOLERANCE = 0.05
"""``e2e`` must equal ``prompt + (token_size - 1) * token`` this closely for ``token_time`` to count."""
BATCH_DROP = 0.5
"""A prompt_time below this fraction of the half-as-large batch's marks a broken run."""


def perf_model_path(data_root: Path) -> Path:
    return data_root / "profiles" / "splitwise" / "perf_model.csv"


@dataclass(frozen=True)
class Exclusion:
    """Rows left out of the fits: which, what of them, and why."""

    rows: int
    what: str
    where: str
    reason: str


@dataclass(frozen=True)
class Measurements:
    """Medians over repeats, times in seconds; ``prompt`` and ``token`` are separate tables.

    ``prompt`` columns: model, hardware, tp, prompt, batch, seconds, repeats.
    ``token`` columns: the same plus ``tokens`` (decode iterations, i.e. token_size).
    """

    prompt: pd.DataFrame
    token: pd.DataFrame
    exclusions: tuple[Exclusion, ...]


def read_perf_model(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise MissingDataFile("whole-request measurements", path)
    table = pd.read_csv(path)
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}")
    bad = table[list(COLUMNS[5:8])].isna().any(axis=1) | (table[list(COLUMNS[5:8])] <= 0).any(axis=1)
    if bad.any():
        raise ValueError(f"{path}: row {int(bad.idxmax()) + 2} has a missing or non-positive time")
    return table


def clean(table: pd.DataFrame) -> Measurements:
    """Leave out broken runs, copied columns and decode times of unknown context.

    1. Broken runs: prompt_time falls below :data:`BATCH_DROP` of the same configuration
       with half the batch (more work cannot take less time).  In this file: Llama-2-70B,
       TP 2, batch 64 on every hardware, where e2e_time also jumps ~10x (likely memory
       exhaustion).  The whole row goes.
    2. Copied columns: a hardware whose token_time and e2e_time equal another hardware's
       exactly, row for row (``h100-80gb-pcap`` repeats ``h100-80gb``): its prompt_time is
       its own and kept; its token_time is not a measurement and goes.
    3. Unknown context: token_time counts only where e2e_time = prompt_time + (token_size - 1)
       x token_time within :data:`E2E_TOLERANCE`; elsewhere generation stopped early or was
       disturbed, so the mean decode context is unknown.
    """
    table = table.copy()
    exclusions: list[Exclusion] = []

    broken = _broken_runs(table)
    for where, rows in _describe(table[broken]):
        exclusions.append(Exclusion(rows, "whole row", where, "prompt_time falls as the batch doubles"))
    table = table[~broken]

    copied = _copied_token_times(table)
    for where, rows in _describe(table[copied]):
        exclusions.append(
            Exclusion(rows, "token_time", where, "token_time and e2e_time copy another hardware's")
        )

    implied = (table["e2e_time"] - table["prompt_time"]) / ((table["token_size"] - 1) * table["token_time"])
    inconsistent = ~copied & ((implied - 1).abs() > E2E_TOLERANCE)
    for where, rows in _describe(table[inconsistent]):
        exclusions.append(
            Exclusion(rows, "token_time", where, "e2e_time disagrees with prompt + (token_size - 1) x token")
        )

    prompt = _medians(table, "prompt_time")
    token = _medians(table[~copied & ~inconsistent], "token_time")
    return Measurements(prompt, token, tuple(exclusions))


def _broken_runs(table: pd.DataFrame) -> pd.Series:
    med = table.groupby(CONFIG)["prompt_time"].median()
    keys = med.index.to_frame(index=False)
    half = keys.assign(batch_size=keys["batch_size"] // 2)
    smaller = med.reindex(pd.MultiIndex.from_frame(half)).to_numpy()
    flagged = keys[(smaller > 0) & (med.to_numpy() < BATCH_DROP * smaller)]
    return table.set_index(CONFIG).index.isin(pd.MultiIndex.from_frame(flagged))


def _copied_token_times(table: pd.DataFrame) -> np.ndarray:
    copied = np.zeros(len(table), dtype=bool)
    key = [c for c in CONFIG if c != "hardware"]
    hardware = sorted(table["hardware"].unique())
    for i, original in enumerate(hardware):
        base = table[table["hardware"] == original].sort_values(key, kind="stable")
        for other in hardware[i + 1 :]:
            rows = table[table["hardware"] == other].sort_values(key, kind="stable")
            if len(rows) != len(base) or len(rows) == 0:
                continue
            same_keys = (rows[key].to_numpy() == base[key].to_numpy()).all()
            same = (
                rows[["token_time", "e2e_time"]].to_numpy() == base[["token_time", "e2e_time"]].to_numpy()
            ).all()
            if same_keys and same:
                copied |= (table["hardware"] == other).to_numpy()
    return copied


def _medians(table: pd.DataFrame, column: str) -> pd.DataFrame:
    keys = CONFIG if column == "token_time" else [c for c in CONFIG if c != "token_size"]
    grouped = table.groupby(keys, observed=True)[column].agg(["median", "size"]).reset_index()
    grouped = grouped.rename(
        columns={
            "tensor_parallel": "tp",
            "prompt_size": "prompt",
            "batch_size": "batch",
            "token_size": "tokens",
            "median": "seconds",
            "size": "repeats",
        }
    )
    grouped["seconds"] = grouped["seconds"] * 1e-3
    return grouped


def _describe(rows: pd.DataFrame) -> list[tuple[str, int]]:
    """Group excluded rows into readable 'model hardware TP n ...' labels with counts."""
    out = []
    for (model, hardware, tp), part in rows.groupby(["model", "hardware", "tensor_parallel"]):
        configs = sorted(
            {f"p{p} b{b} t{t}" for p, b, t in part[["prompt_size", "batch_size", "token_size"]].to_numpy()}
        )
        out.append((f"{model} {hardware} TP{tp}: {', '.join(configs)}", len(part)))
    return out
