"""Rerun every row of a results file from its own columns and report every value that changed.

Rows are numbered from 1 (row 1 is the CSV's second line, the JSON array's first object). Every
column the rerun produces is compared exactly (numbers as numbers, NaN equal to NaN/empty/null),
except wall-clock time and where the row was made: ``UNCOMPARED``; the vLLM-named columns
(``metrics.VLLM_COLUMNS``), the fleet's and the tenants' fairness columns (``tenancy.FAIRNESS_COLUMNS``)
are compared where the file has them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from chunkgym.parallel import parallel_map
from envs.serving.metrics import VLLM_COLUMNS
from envs.serving.tenancy import FAIRNESS_COLUMNS
from leaderboard.cells import AllowedPaths, check_unique
from leaderboard.runs import FLEET_COLUMNS, RunSpec, SetupKey, cached_workload, run_row
from leaderboard.tables import read_rows
from policies.registry import make_policy

UNCOMPARED = ("sim_wall_s", "git_commit", "source")
"""Wall-clock seconds, the commit that wrote the row, and the trace file's path on that machine."""


def validate(
    path: str | Path,
    n_jobs: int = 0,
    progress: bool = True,
    backend: str = "local",
    allow_paths: Sequence[str | None] = (),
) -> tuple[int, list[str]]:
    """(rows checked, one message per differing value).

    ``path`` is a received file: every row is checked (:meth:`RunSpec.from_row`, paths only
    from ``allow_paths``), a run repeated is refused, and each serving setup, workload and policy
    is built once here, so a bad row is one ValueError naming the file and row before any worker
    starts.
    """
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"{path}: holds no rows")
    allowed = AllowedPaths.of(allow_paths)
    specs = [_spec(path, i, row, allowed) for i, row in enumerate(rows, 1)]
    try:
        check_unique([(spec.key, f"row {i}") for i, spec in enumerate(specs, 1)])
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    _build(path, specs)
    fresh = parallel_map(run_row, specs, n_jobs, desc="validate", progress=progress, backend=backend)
    problems = []
    for i, (row, spec, result) in enumerate(zip(rows, specs, fresh, strict=True), 1):
        problems += compare(row, result.row, f"row {i} ({spec.label})")
    return len(rows), problems


def _spec(path: str | Path, i: int, row: dict[str, Any], allowed: AllowedPaths) -> RunSpec:
    try:
        return RunSpec.from_row(row, allowed)
    except ValueError as exc:
        raise ValueError(f"{path}: row {i}: {exc}") from None


def _build(path: str | Path, specs: list[RunSpec]) -> None:
    """Each distinct setup, workload and policy of the rows, built in this process (and cached for
    it): a missing cost file or trace is one line naming its first row, not a worker's traceback."""
    build: dict[str, Callable[[Any], object]] = {
        "setup": SetupKey.build,
        "workload": cached_workload,
        "policy": make_policy,
    }
    first: dict[tuple[str, Any], int] = {}
    for i, spec in enumerate(specs, 1):
        for kind, part in (("setup", spec.setup), ("workload", spec.workload), ("policy", spec.policy)):
            first.setdefault((kind, part), i)
    for (kind, part), i in first.items():
        try:
            build[kind](part)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{path}: row {i} ({specs[i - 1].label}): {exc}") from None


def compare(expected: Mapping[str, Any], got: Mapping[str, Any], where: str) -> list[str]:
    """``where, column C: expected X, got Y`` for each compared column that differs or is missing."""
    problems = []
    for column, value in got.items():
        if column in UNCOMPARED:
            continue
        if column not in expected:
            # Added later: older files still validate.
            if column in VLLM_COLUMNS or column in FLEET_COLUMNS or column in FAIRNESS_COLUMNS:
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
