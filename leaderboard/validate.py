"""Rerun every row of a results file from its own columns and report every value that changed.

Rows are numbered from 1 (row 1 is the CSV's second line, the JSON array's first object). Every
column the rerun produces is compared exactly (numbers as numbers, NaN equal to NaN/empty/null),
except wall-clock time and where the row was made: ``UNCOMPARED``; the vLLM-named columns
(``metrics.VLLM_COLUMNS``) are compared where the file has them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chunkgym.parallel import parallel_map
from envs.serving.metrics import VLLM_COLUMNS
from leaderboard.runs import RunSpec, run_row
from leaderboard.tables import read_rows

UNCOMPARED = ("sim_wall_s", "git_commit", "source")
"""Wall-clock seconds, the commit that wrote the row, and the trace file's path on that machine."""


def validate(
    path: str | Path, n_jobs: int = 0, progress: bool = True, backend: str = "local"
) -> tuple[int, list[str]]:
    """(rows checked, one message per differing value); raises ValueError for an unreadable row."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path}: holds no rows")
    specs = []
    for i, row in enumerate(rows, 1):
        try:
            specs.append(RunSpec.from_row(row))
        except ValueError as exc:
            raise ValueError(f"{path}: row {i}: {exc}") from exc
    fresh = parallel_map(run_row, specs, n_jobs, desc="validate", progress=progress, backend=backend)
    problems = []
    for i, (row, spec, result) in enumerate(zip(rows, specs, fresh, strict=True), 1):
        problems += compare(row, result.row, f"row {i} ({spec.label})")
    return len(rows), problems


def compare(expected: Mapping[str, Any], got: Mapping[str, Any], where: str) -> list[str]:
    """``where, column C: expected X, got Y`` for each compared column that differs or is missing."""
    problems = []
    for column, value in got.items():
        if column in UNCOMPARED:
            continue
        if column not in expected:
            if column in VLLM_COLUMNS:  # added later: files written before them still validate
                continue
            problems.append(f"{where}, column {column}: missing from the file (rerun gives {value!r})")
        elif not same(expected[column], value):
            problems.append(f"{where}, column {column}: expected {expected[column]!r}, got {value!r}")
    return problems


def same(a: Any, b: Any) -> bool:
    """Equal as numbers when both read as numbers (NaN == NaN), else equal as text."""
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y or (math.isnan(x) and math.isnan(y))
    return str(a) == str(b)


def _number(value: Any) -> float | None:
    if value is None or value == "":
        return math.nan
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
