"""The per-op profiler's smoke mode writes a Vidur-format table that the fitting code reads (CPU only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

import chunkgym
from calibration import table_fits
from calibration.sources import vidur
from calibration.sources.torch_ops import SMOKE_TOKENS, default_tokens, main, vidur_columns


def test_smoke_profile_is_a_fittable_vidur_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "mlp.csv"
    monkeypatch.setattr(sys, "argv", ["torch_ops", "smoke=true", "device=cpu", f"out={out}"])
    main()
    table = vidur.read_op_table(out)
    assert list(table.columns) == vidur_columns()
    assert sorted(table["num_tensor_parallel_workers"].unique()) == [1, 2]
    assert table["num_tokens"].tolist() == list(SMOKE_TOKENS) * 2
    stats = table[[vidur.op_column(op, s) for op in vidur.ALL_OPS for s in ("min", "median", "max")]]
    assert (stats > 0).all().all()
    assert (table[vidur.op_column("add", "min")] <= table[vidur.op_column("add", "max")]).all()
    fit = table_fits.fit_layer(vidur.op_times(table, 1, str(out)))
    assert fit.points == len(SMOKE_TOKENS) and fit.heldout_mape >= 0


def test_columns_match_vidur_and_grid_matches_its_token_points() -> None:
    sample = vidur.compute_table_path(chunkgym.data_root(), "a100", "meta-llama/Llama-2-7b-hf")
    if sample.is_file():  # without the data only the grid's ends are checked
        reference = pd.read_csv(sample)
        assert list(reference.columns) == vidur_columns()
        assert sorted(reference["num_tokens"].unique().tolist()) == default_tokens(4096)
    assert default_tokens(4096)[:4] == [1, 2, 4, 8] and default_tokens(4096)[-1] == 4096


@pytest.mark.parametrize(
    ("args", "with_out"), [(["smoke=true"], False), (["tp=[one]"], True), (["dtype=int8"], True)]
)
def test_bad_command_line_stops_before_profiling(
    args: list[str], with_out: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = [f"out={tmp_path / 'mlp.csv'}"] if with_out else []
    monkeypatch.setattr(sys, "argv", ["torch_ops", *args, *out])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code not in (0, None)
    assert not list(tmp_path.iterdir())
