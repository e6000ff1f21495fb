"""The modern-engine validation table: its rows are well-formed and how each benchmark is simulated."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from calibration.validation import VALIDATION_CSV, mape_max, predict, read_rows, validate
from envs.serving.cost_model import COST_DIR, CostModel, cost_file_name

HEADER = VALIDATION_CSV.read_text().splitlines()
COLUMNS = next(line for line in HEADER if line.startswith("id,"))
GOOD = (
    "r1,vLLM,v0.6,a100_80gb,llama2_7b,1,bf16,first_token_latency,1,128,1,0.02,s,"
    "https://example.org/post,Table 1,none"
)


class Constant(CostModel):
    """A cost model whose prefill takes ``prefill`` s and each decode ``decode`` s plus 1 us per cached token."""

    description = "test"

    def __init__(self, prefill: float, decode: float) -> None:
        self.prefill, self.decode = prefill, decode
        self.prefills: list[tuple[int, ...]] = []  # each prefill iteration's chunks, in call order

    def iteration_time(
        self,
        num_decode: int,
        decode_context: int,
        prefill_tokens: Sequence[int],
        prefill_context: Sequence[int],
    ) -> float:
        if prefill_tokens:
            self.prefills.append(tuple(prefill_tokens))
            return self.prefill
        return self.decode + 1e-6 * decode_context

    def decode_times(self, num_decode: int, decode_context: np.ndarray) -> np.ndarray:
        return self.decode + 1e-6 * np.asarray(decode_context, dtype=np.float64)


def test_shipped_table_has_enough_real_rows_for_configurations_we_model() -> None:
    rows = read_rows()
    assert len(rows) >= 12
    assert len({r.id for r in rows}) == len(rows)
    for r in rows:
        assert (COST_DIR / cost_file_name(r.hardware, r.model, r.tp)).is_file(), r.id
        assert r.source.startswith("https://github.com/") and r.location, r.id


def test_gpt_session_benchmarks_are_simulated_as_their_setup_says() -> None:
    rows = read_rows()
    ftl = next(r for r in rows if r.kind == "first_token_latency")
    cost = Constant(0.125, 0.01)
    assert predict(ftl, cost) == 0.125  # the context phase alone: output length 1 runs no generation step
    assert cost.prefills == [(ftl.input_len,)]
    static = next(r for r in rows if r.kind == "static_batch_throughput")
    cost = Constant(0.5, 0.01)
    ks = np.arange(1, static.output_len)
    total = 0.5 + np.sum(0.01 + 1e-6 * static.batch * (static.input_len + ks))
    assert predict(static, cost) == pytest.approx(static.batch * static.output_len / total, rel=1e-12)
    assert cost.prefills == [(static.input_len,) * static.batch]
    results = validate(rows[:2], lambda r: cost)
    assert mape_max(results) == max(abs(r.predicted / r.row.measured - 1) for r in results)


def test_profile_generation_benchmarks_run_turbominds_loop() -> None:
    rows = read_rows()
    tput = next(r for r in rows if r.kind == "profile_generation_throughput" and r.batch > 1)
    assert tput.input_len == 1
    cost = Constant(0.5, 0.01)
    steps = np.arange(tput.output_len)  # a 1-token prompt: no context pass, output_len decode steps
    total = np.sum(0.01 + 1e-6 * tput.batch * (1 + steps))
    assert predict(tput, cost) == pytest.approx(tput.batch * tput.output_len / total, rel=1e-12)
    assert cost.prefills == []
    ftl = next(r for r in rows if r.kind == "profile_generation_first_token_latency")
    cost = Constant(0.125, 0.01)
    # the context pass holds all but the last prompt token; the decode step after it yields the first token
    assert predict(ftl, cost) == pytest.approx(0.125 + 0.01 + 1e-6 * ftl.input_len, rel=1e-12)
    assert cost.prefills == [(ftl.input_len - 1,)]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (GOOD.replace("first_token_latency", "ttft_p50"), r"row 1 \(r1\): kind 'ttft_p50'"),
        (GOOD.replace(",s,", ",ms,"), r"row 1 \(r1\): unit 'ms', but first_token_latency is in 's'"),
        (GOOD.replace("bf16", "fp8"), r"row 1 \(r1\): dtype 'fp8'"),
        (GOOD.replace(",128,1,", ",128,x,"), r"row 1 \(r1\): invalid literal"),
        (GOOD.replace("https://example.org/post", "a blog"), r"row 1 \(r1\): source must be a URL"),
        (GOOD.replace(",0.02,", ",0,"), r"row 1 \(r1\): .*must be positive"),
        (
            GOOD.replace("first_token_latency,1,128", "profile_generation_first_token_latency,2,128"),
            r"row 1 \(r1\): profile_generation_first_token_latency with batch > 1 needs 1-token prompts",
        ),
    ],
)
def test_bad_row_names_file_row_and_field(tmp_path: Path, row: str, message: str) -> None:
    path = tmp_path / "table.csv"
    path.write_text(f"# comment\n{COLUMNS}\n{row}\n")
    with pytest.raises(ValueError, match=message) as err:
        read_rows(path)
    assert "table.csv" in str(err.value) and "\n" not in str(err.value)
    path.write_text(f"{COLUMNS}\n{GOOD}\n")
    assert read_rows(path)[0].measured == 0.02
    path.write_text("id,engine\nr1,vLLM\n")
    with pytest.raises(ValueError, match="table.csv: columns must be"):
        read_rows(path)
