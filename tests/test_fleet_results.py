"""Fleet rows on the leaderboard: evaluate.py's fleet options, the results key, and files made before fleets."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from envs.serving.fleet import ONE_SERVER, FleetSpec
from leaderboard.cells import check_unique, row_key
from leaderboard.runs import RunSpec, run_row
from leaderboard.tables import ranking
from tests.test_evaluate_cli import evaluate

GRID = (
    "policies=[sarathi_512]",
    "workloads=[azure_code]",
    "load_scales=[4.0]",
    "seeds=[0]",
    "cost_model=roofline",
)
QUIET = ("window_s=60", "plots=false", "progress=false")


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_fleet_row_carries_its_fleet_and_validates(tmp_path: Path) -> None:
    fleet = evaluate(
        *GRID, *QUIET, "fleet.replicas=2", "fleet.router=least_requests", f"output_dir={tmp_path / 'f'}"
    )
    single = evaluate(*GRID, *QUIET, f"output_dir={tmp_path / 's'}")
    assert fleet.returncode == single.returncode == 0, fleet.stderr[-2000:] + single.stderr[-2000:]
    (f,) = rows(tmp_path / "f" / "results.csv")
    (s,) = rows(tmp_path / "s" / "results.csv")
    assert (f["fleet_replicas"], f["fleet_router"], s["fleet_replicas"], s["fleet_router"]) == (
        "2",
        "least_requests",
        "1",
        "",
    )
    assert float(f["goodput_per_gpu"]) == float(f["goodput_rps"]) / 2
    assert float(s["goodput_per_gpu"]) == float(s["goodput_rps"]) and float(s["load_imbalance"]) == 1.0
    assert f["config_hash"] != s["config_hash"]
    assert "sarathi_512 x2 least_requests" in (tmp_path / "f" / "leaderboard.md").read_text()
    again = evaluate(
        f"validate={tmp_path / 'f' / 'results.csv'}", "progress=false", f"output_dir={tmp_path / 'v'}"
    )
    assert again.returncode == 0 and "reproduce" in again.stdout, again.stderr[-2000:]


def test_one_server_is_todays_row_whatever_the_router(tmp_path: Path) -> None:
    """At one server the router is ignored: the row (hash and numbers) is the one made before fleets."""
    plain = evaluate(*GRID, *QUIET, f"output_dir={tmp_path / 'a'}")
    routed = evaluate(*GRID, *QUIET, "fleet.router=prefix_affinity", f"output_dir={tmp_path / 'b'}")
    assert plain.returncode == routed.returncode == 0
    (a,) = rows(tmp_path / "a" / "results.csv")
    (b,) = rows(tmp_path / "b" / "results.csv")
    assert {k: v for k, v in a.items() if k != "sim_wall_s"} == {
        k: v for k, v in b.items() if k != "sim_wall_s"
    }


def test_a_row_made_before_fleets_is_one_server_and_keys_apart_from_fleet_rows() -> None:
    spec = RunSpec.from_row({**OLD_ROW})
    assert spec.fleet == ONE_SERVER
    assert row_key(OLD_ROW) == ("sim", "fcfs", "azure_code", 1.0, 0, 1, "", 0, 0, "", "", "")
    two = {**OLD_ROW, "fleet_replicas": 2, "fleet_router": "round_robin"}
    other = {**OLD_ROW, "fleet_replicas": 2, "fleet_router": "prefix_affinity"}
    check_unique([(row_key(r), f"row {i}") for i, r in enumerate((OLD_ROW, two, other))])  # three runs
    with pytest.raises(ValueError, match="repeat one run"):
        check_unique(
            [(row_key(r), f"row {i}") for i, r in enumerate((OLD_ROW, {**OLD_ROW, "fleet_replicas": 1}))]
        )
    with pytest.raises(ValueError, match="column fleet_router: 'nope'"):
        row_key({**OLD_ROW, "fleet_replicas": 2, "fleet_router": "nope"})


def test_the_board_ranks_each_fleet_as_its_own_entry() -> None:
    spec = RunSpec.from_row({**OLD_ROW})
    single = run_row(spec).row
    fleet = run_row(RunSpec(**{**spec.__dict__, "fleet": FleetSpec(replicas=2, router="least_requests")})).row
    import pandas as pd

    board = ranking(pd.DataFrame([single, fleet]))
    assert set(board["policy"]) == {"fcfs", "fcfs x2 least_requests"}


OLD_ROW = {
    "backend": "sim",
    "policy": "fcfs",
    "workload": "azure_code",
    "load_scale": 1.0,
    "seed": 0,
    "model": "llama3_8b",
    "hardware": "h100_80gb",
    "tp": 1,
    "cost_model": "roofline",
    "split": "test",
    "window_s": 60.0,
    "slo_spec": '{"name": "strict", "reference_batch": 64, "reference_context": 2048, "stall_factor": 5.0, '
    '"tpot_multiplier": 3.0, "ttft_base_s": 0.25, "ttft_factor": 2.0}',
    "serving": "{}",
}


def test_rows_made_before_fleets_and_tenants_still_validate(tmp_path: Path) -> None:
    """Three Azure rows of reports/learned/strict/learned/results.csv (made 2026-12-01, before
    fleets and mixes): every column reproduces, config_hash included."""
    fixture = Path(__file__).parent / "fixtures" / "results_before_fleets.csv"
    done = evaluate(f"validate={fixture}", "progress=false", "n_jobs=1", f"output_dir={tmp_path / 'v'}")
    assert done.returncode == 0 and "all 3 rows reproduce" in done.stdout, done.stderr[-2000:]
