"""Prefill-decode disaggregation on the leaderboard: evaluate.py's ``fleet.prefill/decode/link/
decode_router/layerwise``, the rows' topology and transfer columns, and colocated rows as before."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import subprocess
from pathlib import Path

import pytest

from baselines.routers import make_router
from chunkgym import REPO_ROOT
from envs.serving.fleet import FleetSpec
from evaluate import render
from leaderboard.cells import ROW_KEY, AllowedPaths, fleet_columns, row_fleet, row_key
from leaderboard.runs import TRANSFER_COLUMNS, RunSpec, run_row
from policies.registry import make_policy
from tests.test_evaluate_cli import evaluate, read_csv, write_trace
from tests.test_fleet_results import OLD_ROW

GRID = (
    "policies=[sarathi_512]",
    "load_scales=[1.0]",
    "seeds=[0]",
    "cost_model=roofline",
    "plots=false",
    "progress=false",
    "n_jobs=1",
)
PD = (
    "fleet.prefill=1",
    "fleet.decode=1",
    "fleet.link=eth_25g",
    "fleet.decode_router=least_outstanding_tokens",
)
COLOCATED = ("fleet.replicas=2", "fleet.router=least_outstanding_tokens")
PD_LABEL = "sarathi_512 1P1D eth_25g round_robin/least_outstanding_tokens"


@dataclasses.dataclass(frozen=True)
class Runs:
    trace: Path
    pd: dict[str, str]
    colocated: dict[str, str]
    folder: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    """One 1P1D run over 25 Gb/s Ethernet (with its capacity) and one of 2 colocated servers, on the
    40-request stall trace."""
    tmp = tmp_path_factory.mktemp("pd")
    trace = write_trace(tmp / "trace.csv")
    grid = (*GRID, f"workloads=[file:{trace}]")
    pd = evaluate(*grid, *PD, "capacity=true", "capacity_criteria=[attain90]", f"output_dir={tmp / 'pd'}")
    colocated = evaluate(*grid, *COLOCATED, f"output_dir={tmp / 'co'}")
    assert pd.returncode == colocated.returncode == 0, pd.stderr[-2000:] + colocated.stderr[-2000:]
    (p,) = read_csv(tmp / "pd" / "results.csv")
    (c,) = read_csv(tmp / "co" / "results.csv")
    return Runs(trace, p, c, tmp)


def spec_of(row: dict[str, str], trace: Path) -> RunSpec:
    return RunSpec.from_row(row, AllowedPaths.of([str(trace)]))


def test_a_disaggregated_row_carries_its_topology_and_its_transfer_columns(runs: Runs) -> None:
    row = runs.pd
    topology = [row[c] for c in ROW_KEY[5:]]
    assert topology == ["1", "round_robin", "1", "1", "eth_25g", "least_outstanding_tokens", "False"]
    assert float(row["goodput_per_gpu"]) == float(row["goodput_rps"]) / 2 > 0
    assert int(row["handovers"]) > 0
    for column in ("kv_transfer_s_mean", "first_decode_gap_transfer_share"):
        assert math.isfinite(float(row[column])) and float(row[column]) > 0, column
    assert 0 <= float(row["decode_admission_wait_s_mean"]) < math.inf
    assert float(row["ttft_transfer_share"]) == 0.0  # the first token leaves the prefill server before the KV
    assert "prefill_servers" not in row and "decode_servers" not in row  # fleet_prefill, fleet_decode say it
    board = (runs.folder / "pd" / "leaderboard.md").read_text()
    assert PD_LABEL in board and "goodput/GPU (req/s)" in board


def test_the_row_is_the_disaggregated_fleet_of_the_named_routers_link_and_policy(runs: Runs) -> None:
    """Every server of both pools schedules with ``policies=``'s policy, the prefill pool behind
    ``fleet.router`` and the decode pool behind ``fleet.decode_router``, over ``fleet.link``."""
    spec = spec_of(runs.pd, runs.trace)
    setup = spec.setup.build()
    direct = setup.disaggregated_fleet(
        spec.trace(),
        1,
        1,
        functools.partial(make_policy, "sarathi_512"),
        make_router("round_robin"),
        make_router("least_outstanding_tokens"),
        "eth_25g",
        spec.seed,
    ).run()
    for column in ("goodput_rps", "ttft_p99_s", "tpot_p99_s", *TRANSFER_COLUMNS):
        assert float(runs.pd[column]) == direct.metrics[column], column


def test_a_colocated_row_serves_as_before_with_empty_transfer_columns(runs: Runs) -> None:
    row = runs.colocated
    assert [row[c] for c in ROW_KEY[5:]] == ["2", "least_outstanding_tokens", "0", "0", "", "", ""]
    assert all(row[c] == "" for c in TRANSFER_COLUMNS)
    spec = spec_of(row, runs.trace)
    direct = (
        spec.setup.build()
        .fleet(
            spec.trace(),
            2,
            functools.partial(make_policy, "sarathi_512"),
            make_router("least_outstanding_tokens"),
            spec.seed,
        )
        .run()
    )
    assert float(row["goodput_rps"]) == direct.metrics["goodput_rps"]
    assert float(row["goodput_per_gpu"]) == direct.metrics["goodput_rps"] / 2
    assert row["config_hash"] != runs.pd["config_hash"]


def test_the_capacity_search_runs_the_disaggregated_fleet(runs: Runs) -> None:
    (row,) = read_csv(runs.folder / "pd" / "capacity.csv")
    assert [row[c] for c in ROW_KEY[5:]] == [runs.pd[c] for c in ROW_KEY[5:]]
    assert float(row["capacity_attain90_rps"]) > 0 and row["capacity_tbt_rps"] == ""


def test_both_files_validate_and_pool_into_one_board(runs: Runs, tmp_path: Path) -> None:
    for kind in ("pd", "co"):
        for suffix in ("csv", "json"):
            done = evaluate(
                f"validate={runs.folder / kind / f'results.{suffix}'}",
                f"allow_paths=[{runs.trace}]",
                "progress=false",
                "n_jobs=1",
                f"output_dir={tmp_path / kind / suffix}",
            )
            assert done.returncode == 0 and "all 1 rows reproduce" in done.stdout, done.stderr[-2000:]
    pooled = evaluate(f"results={runs.folder}/*/results.csv", f"output_dir={tmp_path / 'board'}")
    assert pooled.returncode == 0, pooled.stderr[-2000:]
    assert PD_LABEL in pooled.stdout and "sarathi_512 x2 least_outstanding_tokens" in pooled.stdout
    assert "| goodput/GPU (req/s) |" in pooled.stdout


def test_a_board_of_one_server_rows_renders_as_it_was(tmp_path: Path) -> None:
    """Goodput per GPU is goodput over tp at one server: the shipped one-server board (whose rows have
    ``goodput_per_gpu``) renders as shipped, without the column."""
    shipped = REPO_ROOT / "reports" / "tenants" / "mixes"
    assert render(str(shipped / "results.csv"), tmp_path) == (shipped / "leaderboard.md").read_text()


def test_layerwise_streaming_is_its_own_run_and_shortens_the_transfer(runs: Runs) -> None:
    spec = spec_of(runs.pd, runs.trace)
    layered = dataclasses.replace(spec, fleet=dataclasses.replace(spec.fleet, layerwise=True))
    row = run_row(layered).row
    assert row["fleet_layerwise"] is True and row["config_hash"] != runs.pd["config_hash"]
    assert row["kv_transfer_s_mean"] < float(runs.pd["kv_transfer_s_mean"])
    assert spec_of(json.loads(json.dumps(row)), runs.trace) == layered  # rebuilt from its own row
    assert row_key(row) == layered.key != spec.key


@pytest.mark.parametrize(
    "fleet",
    [
        FleetSpec(),
        FleetSpec(replicas=3, router="power_of_two"),
        FleetSpec(prefill=2, decode=3, link="ib_200g", decode_router="least_requests"),
        FleetSpec(prefill=1, decode=1, layerwise=True),
    ],
)
def test_a_fleet_reads_back_from_its_cells_as_text_or_json(fleet: FleetSpec) -> None:
    cells = fleet_columns(fleet)
    assert row_fleet({k: str(v) for k, v in cells.items()}) == fleet
    assert row_fleet(json.loads(json.dumps(cells))) == fleet


def test_rows_made_before_disaggregation_are_colocated_and_keep_their_hash() -> None:
    """A colocated fleet's config_hash is the one it had before ``fleet.layerwise`` existed (the
    value from the commit before it), so results files made then still validate."""
    spec = RunSpec.from_row({**OLD_ROW, "fleet_replicas": 2, "fleet_router": "least_requests"})
    assert spec.fleet == FleetSpec(replicas=2, router="least_requests")
    assert spec.config_hash() == "40a5850a7ac9"
    assert row_fleet(OLD_ROW) == FleetSpec()
    pd_row = {**OLD_ROW, **fleet_columns(FleetSpec(prefill=1, decode=1))}
    assert row_key(pd_row) != row_key(OLD_ROW)


@pytest.mark.parametrize(
    ("cells", "message"),
    [
        ({"fleet_layerwise": "maybe"}, "column fleet_layerwise: 'maybe' is not true or false"),
        ({"fleet_link": "copper"}, "column fleet_link: unknown link 'copper'"),
        ({"fleet_decode_router": "nope"}, "column fleet_decode_router: 'nope' is not one of"),
        ({"fleet_decode": "0"}, "fleet columns: fleet.prefill=1 and fleet.decode=0"),
    ],
)
def test_a_bad_fleet_cell_is_one_line_naming_its_column(cells: dict[str, str], message: str) -> None:
    row = {**OLD_ROW, **{k: str(v) for k, v in fleet_columns(FleetSpec(prefill=1, decode=1)).items()}}
    with pytest.raises(ValueError, match=message) as info:
        RunSpec.from_row({**row, **cells})
    assert "\n" not in str(info.value)


def test_fleet_spec_refuses_a_layerwise_that_is_not_a_bool_or_has_nothing_to_stream_to() -> None:
    with pytest.raises(ValueError, match=r"fleet.layerwise='yes': true or false"):
        FleetSpec(prefill=1, decode=1, layerwise="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fleet.layerwise=true: .*colocated fleet moves no KV"):
        FleetSpec(replicas=2, layerwise=True)


BAD_FLEET = {
    "layerwise not a bool": ([*PD, "fleet.layerwise=maybe"], "fleet.layerwise"),
    "an unknown decode router": ([*PD[:3], "fleet.decode_router=nope"], "fleet.decode_router='nope'"),
    "layerwise on a colocated fleet": ([*COLOCATED, "fleet.layerwise=true"], "fleet.layerwise=true"),
    "layerwise on one server": (["fleet.layerwise=true"], "fleet.layerwise=true"),
    "decode alone": (["fleet.decode=2"], "fleet.decode=2"),
}


@pytest.mark.parametrize("case", list(BAD_FLEET))
def test_bad_fleet_values_are_one_line_and_write_nothing(case: str, tmp_path: Path) -> None:
    overrides, named = BAD_FLEET[case]
    out = tmp_path / "out"
    proc: subprocess.CompletedProcess = evaluate(
        *GRID, "workloads=[azure_code]", *overrides, f"output_dir={out}"
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("evaluate.py: error: ") and named in lines[0], lines[0]
    assert not out.exists() and proc.stdout == ""
