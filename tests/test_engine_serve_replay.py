"""Real-time replays by `python -m engine.replay`: evaluate.py's columns, backend=engine, the leaderboard."""

from __future__ import annotations

import csv
import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import engine.replay
from chunkgym import REPO_ROOT
from engine.replay import ReplayConfig, load_config, main
from tests.simtools import make_trace
from tests.test_evaluate_cli import CONTRACT_COLUMNS


def write_trace(path: Path) -> Path:
    """Six short chats (length-only: Poisson arrivals at 4 req/s, drawn from the seed)."""
    rows = [(120, 6), (300, 3), (60, 9), (500, 4), (90, 7), (200, 5)]
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{p},{o}\n" for p, o in rows))
    return path


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("replay")
    trace = write_trace(tmp / "trace.csv")
    out = tmp / "out"
    main(
        [
            f"workload=file:{trace}",
            "policies=[sarathi_512,fcfs]",
            "backends=[engine,sim]",
            "length_scale=2",
            "load_scale=4",
            f"output_dir={out}",
        ]
    )
    return out


def read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_rows_have_evaluates_columns_for_both_backends(replayed):
    rows = read(replayed / "results.csv")
    assert [(r["policy"], r["backend"]) for r in rows] == [
        ("sarathi_512", "engine"),
        ("sarathi_512", "sim"),
        ("fcfs", "engine"),
        ("fcfs", "sim"),
    ]
    assert set(CONTRACT_COLUMNS) <= set(rows[0])
    assert all(list(r) == list(rows[0]) for r in rows)
    for r in rows:
        assert (r["hardware"], r["model"], r["requests"], r["finished"]) == ("cpu", "engine_small", "6", "6")
        assert r["workload"].endswith("/len2") and r["split"] == "all"
    engine, sim = rows[0], rows[1]
    assert engine["config_hash"] != sim["config_hash"]
    last = pd.read_csv(replayed / "iterations.csv").query("backend == 'engine' and policy == 'sarathi_512'")
    assert float(engine["sim_wall_s"]) >= (last["start"] + last["latency"]).max() > 0.1  # real time
    assert len(read(replayed / "buckets.csv")) == 4 * 5


def test_iterations_record_engine_predictions(replayed):
    it = pd.read_csv(replayed / "iterations.csv")
    engine = it[it["backend"] == "engine"]
    assert engine["predicted"].gt(0).all() and engine["latency"].gt(0).all()
    assert (engine["execute"] <= engine["latency"]).all()
    assert it[it["backend"] == "sim"]["predicted"].isna().all()
    tokens = engine.groupby("policy")[["decode_tokens", "prefill_tokens"]].sum()
    # Every prompt token (halved) is prefilled once, every output token but the first is decoded.
    prompts = [60, 150, 30, 250, 45, 100]
    outputs = [3, 2, 4, 2, 4, 2]  # round(o / 2): Python's rint rounds halves to even
    for policy in ("sarathi_512", "fcfs"):
        assert tokens.loc[policy, "prefill_tokens"] == sum(prompts)
        assert tokens.loc[policy, "decode_tokens"] == sum(outputs) - len(outputs)


@pytest.mark.slow
def test_evaluate_renders_the_leaderboard_of_engine_rows(replayed, tmp_path):
    proc = subprocess.run(
        [sys.executable, "evaluate.py", f"results={replayed / 'results.csv'}", f"output_dir={tmp_path}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    board = (tmp_path / "leaderboard.md").read_text()
    assert board == proc.stdout
    for label in ("| sarathi_512 [engine] |", "| sarathi_512 |", "| fcfs [engine] |", "| fcfs |"):
        assert label in board
    from evaluate import render

    assert render(str(replayed / "results.json"), tmp_path / "json") == board


def test_length_scale_divides_and_rounds_with_at_least_one_token():
    trace = make_trace([0.0, 1.0, 2.0], [1000, 7, 1], [129, 1, 12])
    scaled = trace.scale_lengths(8)
    assert scaled.prompt_len.tolist() == [125, 1, 1] and scaled.output_len.tolist() == [16, 1, 2]
    np.testing.assert_array_equal(scaled.arrival_s, trace.arrival_s)
    assert trace.scale_lengths(1.0) is trace


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("backends=[gpu]", "backends"),
        ("length_scale=0.5", "length_scale"),
        ("serving.block_sise=8", "block_sise"),
        ("threads=0", "threads"),
        ("idle=nap", "idle"),
        ("nosuch=1", "nosuch"),
        ("threads=abc", "threads"),
    ],
)
def test_bad_settings_fail_before_any_run(override, message):
    with pytest.raises(ValueError, match=message):
        load_config([override])


def test_the_cpu_config_is_the_documented_default():
    conf = load_config([])
    assert isinstance(conf, ReplayConfig)
    assert (conf.model, conf.hardware, conf.threads, conf.length_scale) == ("engine_small", "cpu", 1, 8.0)
    assert conf.idle == "spin"
    assert conf.serving.num_blocks > 0


def test_the_engine_serves_with_what_the_process_held_frozen_out_of_the_collector(tmp_path, monkeypatch):
    held = [[]]  # alive before the run: tracked by the collector until the engine starts serving
    assert any(o is held for o in gc.get_objects())
    tracked_while_serving: list[bool] = []
    run = engine.replay.Engine.run

    def watched_run(self, policy):
        tracked_while_serving.append(any(o is held for o in gc.get_objects()))
        return run(self, policy)

    monkeypatch.setattr(engine.replay.Engine, "run", watched_run)
    trace = write_trace(tmp_path / "trace.csv")
    main(
        [
            f"workload=file:{trace}",
            "policies=[sarathi_512]",
            "backends=[engine]",
            f"output_dir={tmp_path / 'out'}",
        ]
    )
    assert tracked_while_serving == [False]
    assert any(o is held for o in gc.get_objects())  # and tracked again once it is done
