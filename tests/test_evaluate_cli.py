"""evaluate.py through its command line: the files and columns of the contract, validation, bad names."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from chunkgym import REPO_ROOT
from evaluate import render

CONTRACT_COLUMNS = (
    "policy workload load_scale seed backend hardware model tp slo split requests finished rejected "
    "goodput_rps slo_attainment ttft_p50_s ttft_p99_s tpot_p50_s tpot_p99_s tbt_p99_s max_tbt_s "
    "throughput_tok_s preemptions prefix_hit_rate busy_fraction prefill_token_share kv_util_mean sim_wall_s "
    "env_version config_hash git_commit"
).split()
BUCKET_COLUMNS = (
    "policy workload load_scale seed bucket requests slo_attainment ttft_p50_s ttft_p95_s ttft_p99_s "
    "tbt_p50_s tbt_p95_s tbt_p99_s max_sched_delay_s"
).split()
CAPACITY_COLUMNS = (
    "policy workload seed capacity_attain90_scale capacity_attain90_rps capacity_tbt_scale capacity_tbt_rps"
).split()
PLOTS = ("goodput_vs_load.png", "tbt_cdf.png", "timeline_fcfs_vs_sarathi.png", "batch_composition.png")


def evaluate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "evaluate.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )


def write_trace(path: Path) -> Path:
    """A length-only trace: short chats, and one long prompt that stalls FCFS's decodes."""
    rows = [(300 + 37 * (i % 11), 60 + 13 * (i % 7)) for i in range(40)]
    rows[12] = (7000, 20)
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{p},{o}\n" for p, o in rows))
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, str]:
    tmp = tmp_path_factory.mktemp("evaluate")
    trace = f"file:{write_trace(tmp / 'trace.csv')}"
    out = tmp / "out"
    proc = evaluate(
        "policies=[fcfs,sarathi_512]",
        f"workloads=[{trace},synthetic_azure_conv]",
        "load_scales=[1.0,2.0]",
        "seeds=[0,1]",
        "slo=strict",
        "capacity=true",
        "capacity_rel_tol=0.1",
        "cost_model=roofline",
        "window_s=15",
        "n_jobs=2",
        "progress=false",
        f"output_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc, trace


@pytest.mark.slow
def test_tiny_evaluation_writes_every_file_with_the_contract_columns(tiny) -> None:
    out, proc, trace = tiny
    rows = read_csv(out / "results.csv")
    assert set(CONTRACT_COLUMNS) <= set(rows[0])
    grid = {(r["policy"], r["workload"], float(r["load_scale"]), int(r["seed"])) for r in rows}
    assert len(rows) == len(grid) == 2 * 2 * 2 * 2
    assert {r["backend"] for r in rows} == {"sim"}
    assert {(r["workload"], r["split"]) for r in rows} == {(trace, "all"), ("synthetic_azure_conv", "test")}
    seeds = {
        s: {r["offset_s"] for r in rows if r["workload"] == "synthetic_azure_conv" and r["seed"] == s}
        for s in "01"
    }
    assert seeds["0"] != seeds["1"], "each seed must select a different window"

    buckets = read_csv(out / "buckets.csv")
    assert set(BUCKET_COLUMNS) <= set(buckets[0])
    assert len(buckets) == 5 * len(rows)
    capacity = read_csv(out / "capacity.csv")
    assert set(CAPACITY_COLUMNS) <= set(capacity[0]) and len(capacity) == 2 * 2 * 2
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name

    board = (out / "leaderboard.md").read_text()
    for wl in (trace, "synthetic_azure_conv"):
        for load in ("1x", "2x"):
            assert f"## {wl} (" in board and f"load {load}" in board
    assert "vs best sarathi" in board and "## Capacity" in board
    assert board.strip() in proc.stdout, "the leaderboard is printed"


def test_json_holds_the_same_rows_with_exact_floats(tiny) -> None:
    out, _, _ = tiny
    rows = read_csv(out / "results.csv")
    objects = json.loads((out / "results.json").read_text())
    assert [o["policy"] for o in objects] == [r["policy"] for r in rows]
    checked = 0
    for obj, row in zip(objects, rows, strict=True):
        assert set(obj) == set(row)
        for key, value in obj.items():
            if isinstance(value, float):
                assert float(row[key]) == value, key
                checked += 1
            elif value is None:
                assert row[key] == "", key
    assert checked > 100


def test_sarathi_beats_fcfs_on_the_stall_trace(tiny) -> None:
    out, _, trace = tiny
    rows = [r for r in read_csv(out / "results.csv") if r["workload"] == trace]
    stall = {p: max(float(r["max_tbt_s"]) for r in rows if r["policy"] == p) for p in ("fcfs", "sarathi_512")}
    assert stall["fcfs"] > float(rows[0]["slo_stall_s"]) > stall["sarathi_512"]


@pytest.mark.slow
def test_validate_passes_on_untouched_results_and_names_a_tampered_value(tiny, tmp_path) -> None:
    out, _, trace = tiny
    allow = f"allow_paths=[{trace}]"  # the file: trace the rows name, allowed as a received file's must be
    ok = evaluate(f"validate={out / 'results.csv'}", allow, "progress=false", f"output_dir={tmp_path / 'v1'}")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "reproduce" in ok.stdout

    rows = read_csv(out / "results.csv")
    rows[2]["goodput_rps"] = repr(float(rows[2]["goodput_rps"]) * (1 + 1e-12) + 1e-300)
    tampered = tmp_path / "results.csv"
    with tampered.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    bad = evaluate(f"validate={tampered}", allow, "progress=false", f"output_dir={tmp_path / 'v2'}")
    assert bad.returncode != 0
    assert "row 3 (" in bad.stderr and "column goodput_rps: expected" in bad.stderr
    assert "1 value(s)" in bad.stderr


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("policies=[fcfs,no_such_policy]", ["'no_such_policy'", "sarathi_512", "fcfs", "learned:PATH"]),
        (
            "workloads=[no_such_workload]",
            ["'no_such_workload'", "azure_conv", "synthetic_azure_conv", "file:PATH"],
        ),
        ("workloads=[file:/no/such/trace.csv]", ["/no/such/trace.csv", "not found"]),
        ("capacity_criteria=[attain95]", ["attain95", "attain90", "tbt"]),
        ("split=train", ["split", "'train'", "test, val"]),
    ],
)
@pytest.mark.slow
def test_an_unknown_name_fails_at_once_listing_the_valid_ones(tmp_path, override, expected) -> None:
    proc = evaluate(override, "cost_model=roofline", f"output_dir={tmp_path}")
    assert proc.returncode != 0
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr)
    assert not (tmp_path / "results.csv").exists()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("polices=[fcfs]", "polices"),
        ("load_scales=[fast]", "load_scales"),
        ("slo.tpot_multipler=3", "tpot_multipler"),
    ],
)
def test_an_unknown_key_or_a_wrong_type_fails_before_running(tmp_path, override, key) -> None:
    proc = evaluate(override, "cost_model=roofline", f"output_dir={tmp_path}")
    assert proc.returncode != 0 and key in proc.stderr
    assert not (tmp_path / "results.csv").exists()


def test_nan_cells_stay_empty_in_csv_and_null_in_json(tiny) -> None:
    out, _, trace = tiny
    objects = json.loads((out / "results.json").read_text())
    whole = [o for o in objects if o["workload"] == trace]
    assert all(o["window_s"] is None for o in whole), "a file: workload is used whole: no window length"
    assert all(
        isinstance(o["window_s"], float) and not math.isnan(o["window_s"]) for o in objects if o not in whole
    )


def test_capacity_criteria_searches_only_those_named(tmp_path) -> None:
    trace = f"file:{write_trace(tmp_path / 'trace.csv')}"
    proc = evaluate(
        "policies=[sarathi_512]",
        f"workloads=[{trace}]",
        "load_scales=[1.0]",
        "seeds=[0]",
        "capacity=true",
        "capacity_criteria=[tbt]",
        "capacity_rel_tol=0.1",
        "cost_model=roofline",
        "plots=false",
        "progress=false",
        f"output_dir={tmp_path / 'out'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_csv(tmp_path / "out" / "capacity.csv")
    assert row["capacity_attain90_scale"] == row["capacity_attain90_rps"] == ""
    assert float(row["capacity_tbt_scale"]) > 0 and float(row["capacity_tbt_rps"]) > 0


@pytest.mark.slow
def test_the_val_split_serves_selection_and_its_rows_validate(tmp_path) -> None:
    common = ["policies=[sarathi_512]", "workloads=[synthetic_azure_conv]", "load_scales=[1.0]", "seeds=[0]"]
    common += ["cost_model=roofline", "window_s=15", "plots=false", "progress=false"]
    val = evaluate(*common, "split=val", f"output_dir={tmp_path / 'val'}")
    test = evaluate(*common, f"output_dir={tmp_path / 'test'}")
    assert val.returncode == test.returncode == 0, val.stderr[-3000:]
    (v,) = read_csv(tmp_path / "val" / "results.csv")
    (t,) = read_csv(tmp_path / "test" / "results.csv")
    assert (v["split"], t["split"]) == ("val", "test")
    assert v["offset_s"] != t["offset_s"] and v["config_hash"] != t["config_hash"]
    assert "(val split)" in (tmp_path / "val" / "leaderboard.md").read_text()
    again = evaluate(
        f"validate={tmp_path / 'val' / 'results.csv'}", "progress=false", f"output_dir={tmp_path / 'v'}"
    )
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("+unknown=1", "unknown config key(s) ['unknown']"),
        ("serving.max_num_seqs=0", "serving.max_num_seqs=0: must be an integer >= 1"),
        ("serving.lookahead=0", "serving.lookahead=0: must be an integer >= 1"),
        ("serving.block_size=-16", "serving.block_size=-16: must be an integer >= 1"),
        ("serving.max_model_len=-1", "serving.max_model_len=-1: must be an integer >= 0"),
        (
            "serving.activation_reserve_gib=nan",
            "serving.activation_reserve_gib=nan: must be a finite number >= 0",
        ),
        ("slo.tpot_multiplier=inf", "slo.tpot_multiplier=inf: must be a positive finite number"),
        ("slo.ttft_base_s=0", "slo.ttft_base_s=0.0: must be a positive finite number"),
        ("slo.stall_factor=-5", "slo.stall_factor=-5.0: must be a positive finite number"),
        ("capacity_rel_tol=0", "capacity_rel_tol=0.0: must be a relative tolerance in [1e-06, 1)"),
        ("capacity_rel_tol=1.5", "capacity_rel_tol=1.5: must be a relative tolerance in [1e-06, 1)"),
        ("serving.lookahead=many", "Error merging override serving.lookahead=many: Value 'many'"),
        ("hardware=h300", "Could not find 'hardware/h300' Available options in 'hardware': a100_80gb"),
        ("model.num_layers=4", "model.num_layers=4: evaluate.py runs the named files of conf/model only"),
    ],
)
@pytest.mark.slow
def test_a_bad_value_fails_up_front_in_one_line_naming_key_and_value(tmp_path, override, line) -> None:
    proc = evaluate(override, f"output_dir={tmp_path}")
    assert proc.returncode != 0
    assert proc.stderr.strip() == f"evaluate.py: error: {proc.stderr.strip().split('error: ', 1)[1]}"
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert line in proc.stderr, proc.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_hardware_and_model_are_chosen_by_name(tmp_path) -> None:
    proc = evaluate(
        "hardware=h100_80gb",
        "model=llama2_7b",
        "policies=[sarathi_512]",
        "workloads=[synthetic_azure_conv]",
        "load_scales=[1.0]",
        "seeds=[0]",
        "cost_model=roofline",
        "window_s=10",
        "plots=false",
        "progress=false",
        f"output_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_csv(tmp_path / "results.csv")
    assert (row["hardware"], row["model"]) == ("h100_80gb", "llama2_7b")


@pytest.mark.slow
def test_rendering_a_run_pools_its_capacity_file_into_the_same_board(tiny, tmp_path) -> None:
    out, _, _ = tiny
    assert render(str(out / "results.csv"), tmp_path / "board") == (out / "leaderboard.md").read_text()
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "results.csv").write_text((out / "results.csv").read_text())
    (tmp_path / "runs" / "a" / "capacity.csv").write_text("policy,seed\nfcfs,0\n")
    with pytest.raises(ValueError, match="capacity.csv: no column workload"):
        render(str(tmp_path / "runs" / "a" / "results.csv"), tmp_path / "bad")
