"""The modern-engine validation table: published measurements, predicted by the calibrated model.

``calibration/validation/modern_engines.csv`` holds real published measurements (source, engine,
version, GPU, model, TP, dtype, batch, lengths, value), chosen before any fitting and never fitted
to.  Each row is predicted by simulating its benchmark's setup with the cost model:

* ``first_token_latency`` (s): one prompt of ``input_len`` tokens prefilled alone;
* ``static_batch_throughput`` (out tok/s): ``batch`` prompts of ``input_len`` prefilled in one
  iteration, then ``output_len - 1`` decode iterations (the first token comes with the prefill),
  ``batch * output_len`` tokens over the total time.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from envs.serving.cost_model import CostModel

VALIDATION_CSV = Path(__file__).parent / "validation" / "modern_engines.csv"
UNITS = {"first_token_latency": "s", "static_batch_throughput": "tok/s"}
DTYPES = ("bf16", "fp16")
TEXT = (
    "id",
    "engine",
    "engine_version",
    "hardware",
    "model",
    "dtype",
    "kind",
    "unit",
    "source",
    "location",
    "note",
)
INTEGER = ("tp", "batch", "input_len", "output_len")


@dataclass(frozen=True)
class Row:
    id: str
    engine: str
    engine_version: str
    hardware: str
    model: str
    tp: int
    dtype: str
    kind: str
    batch: int
    input_len: int
    output_len: int
    measured: float
    unit: str
    source: str
    location: str
    note: str


@dataclass(frozen=True)
class Result:
    row: Row
    predicted: float

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return self.predicted / self.row.measured - 1.0


def read_rows(path: Path = VALIDATION_CSV) -> list[Row]:
    """The table's rows, checked: one-line errors name the file, the row and the field."""
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    reader = csv.DictReader(lines)
    expected = [f for f in Row.__dataclass_fields__]
    if reader.fieldnames != expected:
        raise ValueError(f"{path}: columns must be {expected}, got {reader.fieldnames}")
    rows = []
    for n, raw in enumerate(reader, start=1):
        where = f"{path}: row {n} ({raw.get('id') or '?'})"
        try:
            values: dict = {k: raw[k] for k in TEXT}
            values.update({k: int(raw[k]) for k in INTEGER})
            values["measured"] = float(raw["measured"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        row = Row(**values)
        if row.kind not in UNITS:
            raise ValueError(f"{where}: kind {row.kind!r}; valid: {sorted(UNITS)}")
        if row.unit != UNITS[row.kind]:
            raise ValueError(f"{where}: unit {row.unit!r}, but {row.kind} is in {UNITS[row.kind]!r}")
        if row.dtype not in DTYPES:
            raise ValueError(f"{where}: dtype {row.dtype!r}; only {DTYPES} are compared")
        if min(row.tp, row.batch, row.input_len, row.output_len) < 1 or not row.measured > 0:
            raise ValueError(f"{where}: tp, batch, lengths and the measured value must be positive")
        if not row.source.startswith("https://"):
            raise ValueError(f"{where}: source must be a URL, got {row.source!r}")
        rows.append(row)
    return rows


def predict(row: Row, cost: CostModel) -> float:
    """The row's metric as the cost model simulates its benchmark (see the module docstring)."""
    prefill = cost.iteration_time(0, 0, (row.input_len,) * row.batch, (0,) * row.batch)
    if row.kind == "first_token_latency":
        return prefill
    contexts = row.batch * (row.input_len + np.arange(1, row.output_len, dtype=np.int64))
    decode = float(np.sum(cost.decode_iteration_times(row.batch, contexts)))
    return row.batch * row.output_len / (prefill + decode)


def validate(rows: list[Row], cost_for: Callable[[Row], CostModel]) -> list[Result]:
    return [Result(row, predict(row, cost_for(row))) for row in rows]


def mape_max(results: list[Result]) -> float:
    """The worst row's absolute relative error."""
    return max(abs(r.error) for r in results)
