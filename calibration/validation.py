"""The modern-engine validation table: published measurements, predicted by the calibrated model.

``calibration/validation/modern_engines.csv`` holds real published measurements (source, engine,
version, GPU, model, TP, dtype, batch, lengths, value), chosen before any fitting and never fitted
to.  Each row is predicted by simulating the setup of the program that measured it, as its source
reads (the CSV's header names the commits):

* TensorRT-LLM's ``benchmarks/cpp/gptSessionBenchmark.cpp`` times whole ``GptSession::generate``
  calls on a static batch (the mean of 5 after a warm-up), each with its host syncs.  The first
  token is sampled from the context phase's logits.

  - ``first_token_latency`` (s), output length 1: the context phase over ``input_len`` tokens and
    the sampling of its token, one prefill iteration; no generation step runs.
  - ``static_batch_throughput`` (out tok/s): ``batch`` prompts prefilled in one iteration, then
    ``output_len - 1`` decode iterations; ``batch * output_len`` tokens over the total time.

* LMDeploy's ``benchmark/profile_generation.py`` on TurboMind v0.1.0a1 starts ``batch`` Python
  threads; each issues 6 requests (``test_round``) one after another, each ``input_len`` prompt
  tokens and ``output_len`` output tokens, while TurboMind batches whatever has arrived at each
  iteration of its loop.  There a new prompt's first ``input_len - 1`` tokens are context-decoded in
  a pass of their own and its last token goes through the decode step that yields the first
  output token (no pass for a 1-token prompt).  TurboMind splits a pass into sub-batches of at most
  ``max_context_token_num`` tokens (4 x the session length in the benchmark scripts' config); a
  row's prompts go in one pass here, so a row with several multi-token prompts is refused.  The
  client's own time (thread start, per-request Python, the GIL) is not in the cost model, so it is
  zero here: the threads' identical requests arrive together and come back together, every round
  is the same lock-step batch, and one round gives the program's numbers.

  - ``profile_generation_throughput`` (out tok/s): output tokens only, over the wall time of the
    rounds (first tokens included, the warm-up round not): ``batch * output_len`` over one
    round's context pass and ``output_len`` decode steps.
  - ``profile_generation_first_token_latency`` (s): the mean time to the first token, the context
    pass plus the first decode step.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from envs.serving.cost_model import CostModel

VALIDATION_CSV = Path(__file__).parent / "validation" / "modern_engines.csv"
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
        if row.kind not in KINDS:
            raise ValueError(f"{where}: kind {row.kind!r}; valid: {sorted(KINDS)}")
        unit = KINDS[row.kind][0]
        if row.unit != unit:
            raise ValueError(f"{where}: unit {row.unit!r}, but {row.kind} is in {unit!r}")
        if row.dtype not in DTYPES:
            raise ValueError(f"{where}: dtype {row.dtype!r}; only {DTYPES} are compared")
        if min(row.tp, row.batch, row.input_len, row.output_len) < 1 or not row.measured > 0:
            raise ValueError(f"{where}: tp, batch, lengths and the measured value must be positive")
        if row.kind.startswith("profile_generation") and row.batch > 1 and row.input_len > 1:
            raise ValueError(
                f"{where}: {row.kind} with batch > 1 needs 1-token prompts (sub-batches are not simulated)"
            )
        if not row.source.startswith("https://"):
            raise ValueError(f"{where}: source must be a URL, got {row.source!r}")
        rows.append(row)
    return rows


def gpt_session(row: Row, cost: CostModel) -> float:
    """gptSessionBenchmark's row: one prefill iteration of the batch, then its decode iterations."""
    prefill = cost.iteration_time(0, 0, (row.input_len,) * row.batch, (0,) * row.batch)
    if row.kind == "first_token_latency":
        return prefill
    contexts = row.batch * (row.input_len + np.arange(1, row.output_len, dtype=np.int64))
    decode = float(np.sum(cost.decode_iteration_times(row.batch, contexts)))
    return row.batch * row.output_len / (prefill + decode)


def profile_generation(row: Row, cost: CostModel) -> float:
    """profile_generation's row: one lock-step round of TurboMind's loop (see the module docstring)."""
    context = row.input_len - 1
    prefill = cost.iteration_time(0, 0, (context,) * row.batch, (0,) * row.batch) if context else 0.0
    # decode step j reads the prompt's cached tokens, the j tokens generated before it, and its own
    contexts = row.batch * (row.input_len + np.arange(row.output_len, dtype=np.int64))
    decode = cost.decode_iteration_times(row.batch, contexts)
    if row.kind == "profile_generation_first_token_latency":
        return prefill + float(decode[0])
    return row.batch * row.output_len / (prefill + float(np.sum(decode)))


KINDS: dict[str, tuple[str, Callable[[Row, CostModel], float]]] = {
    "first_token_latency": ("s", gpt_session),
    "static_batch_throughput": ("tok/s", gpt_session),
    "profile_generation_throughput": ("tok/s", profile_generation),
    "profile_generation_first_token_latency": ("s", profile_generation),
}
"""Each kind's unit and simulation."""


def predict(row: Row, cost: CostModel) -> float:
    """The row's metric as the cost model simulates its benchmark (see the module docstring)."""
    return KINDS[row.kind][1](row, cost)


def validate(rows: list[Row], cost_for: Callable[[Row], CostModel]) -> list[Result]:
    return [Result(row, predict(row, cost_for(row))) for row in rows]


def mape_max(results: list[Result]) -> float:
    """The worst row's absolute relative error."""
    return max(abs(r.error) for r in results)
