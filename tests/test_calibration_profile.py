"""The per-op profiler's smoke mode writes a Vidur-format table that the fitting code reads (CPU only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import chunkgym
from calibration import table_fits
from calibration.sources import vidur
from calibration.sources.torch_ops import SMOKE_TOKENS, Options, default_tokens, run, vidur_columns


def torch_ops(*args: str) -> subprocess.CompletedProcess:
    """The command line, in its own process (Hydra configures logging for the whole process)."""
    cmd = [sys.executable, "-m", "calibration.sources.torch_ops", *args]
    return subprocess.run(cmd, cwd=chunkgym.REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_smoke_profile_is_a_fittable_vidur_table(tmp_path: Path) -> None:
    out = tmp_path / "mlp.csv"
    proc = torch_ops("smoke=true", "device=cpu", f"out={out}")
    assert proc.returncode == 0, proc.stderr
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


@pytest.mark.parametrize(("args", "key"), [(["smoke=true"], "out"), (["tp=[one]", "out=x.csv"], "tp")])
@pytest.mark.slow
def test_bad_command_line_is_named_before_profiling(args: list[str], key: str) -> None:
    proc = torch_ops(*args)
    assert proc.returncode != 0 and key in proc.stderr
    assert not (chunkgym.REPO_ROOT / "x.csv").exists()


def test_unknown_dtype_stops_before_profiling(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="dtype: 'int8'"):
        run(Options(out=str(tmp_path / "mlp.csv"), dtype="int8"))
    assert not list(tmp_path.iterdir())
