"""The leaderboard's tables: exact row files, confidence intervals, ranking, comparison for validation."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.serving.metrics import VLLM_COLUMNS
from leaderboard.tables import markdown, mean_ci, ranking, read_rows, write_csv, write_json
from leaderboard.validate import compare, same

floats = st.floats(allow_infinity=False, width=64)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(floats, min_size=1, max_size=6), ints=st.lists(st.integers(-(2**53), 2**53), min_size=6)
)
def test_rows_round_trip_exactly_through_csv_and_json(tmp_path_factory, values, ints) -> None:
    tmp = tmp_path_factory.mktemp("rows")
    rows = [{"name": f"r{i}", "x": v, "n": ints[i]} for i, v in enumerate(values)]
    write_csv(rows, tmp / "r.csv")
    write_json(rows, tmp / "r.json")
    for path in (tmp / "r.csv", tmp / "r.json"):
        back = read_rows(path)
        assert len(back) == len(rows)
        for row, got in zip(rows, back, strict=True):
            assert compare(row, got, str(path)) == []
            if math.isnan(row["x"]):
                assert got["x"] in ("", None)
            else:
                assert float(got["x"]) == row["x"]
            assert int(got["n"]) == row["n"]


def test_same_compares_numbers_exactly_and_nan_as_missing() -> None:
    assert same("0.30000000000000004", 0.1 + 0.2)
    assert not same("0.3", 0.1 + 0.2)
    assert same("", math.nan) and same(None, math.nan) and same("nan", math.nan)
    assert not same("", 0.0)
    assert same("7", 7) and same(7.0, 7)
    assert same("strict", "strict") and not same("strict", "relaxed")


def test_compare_names_the_column_and_both_values() -> None:
    problems = compare({"a": "1.5", "b": "x"}, {"a": 1.25, "b": "x", "c": 2}, "row 4 (p)")
    assert problems[0] == "row 4 (p), column a: expected '1.5', got 1.25"
    assert problems[1].startswith("row 4 (p), column c: missing from the file")
    assert len(problems) == 2


def test_confidence_interval_covers_the_mean_about_95_percent_of_the_time() -> None:
    rng = np.random.default_rng(0)
    trials, n, hits = 4000, 3, 0
    for _ in range(trials):
        mean, half = mean_ci(rng.normal(10.0, 2.0, n))
        hits += abs(mean - 10.0) <= half
    assert 0.935 <= hits / trials <= 0.965  # a normal (z) interval would cover only ~88% at n=3


def test_confidence_interval_needs_two_seeds() -> None:
    mean, half = mean_ci([3.5])
    assert mean == 3.5 and math.isnan(half)
    assert mean_ci([2.0, 2.0, 2.0]) == (2.0, 0.0)


def frame(goodputs: dict[str, list[float]], workload: str = "w", load: float = 1.0) -> pd.DataFrame:
    rows = []
    for policy, values in goodputs.items():
        for seed, g in enumerate(values):
            rows.append(
                {
                    "policy": policy,
                    "workload": workload,
                    "load_scale": load,
                    "seed": seed,
                    "goodput_rps": g,
                    "slo_attainment": g / 10,
                    "ttft_p99_s": 1.0,
                    "tbt_p99_s": 0.1,
                    "max_tbt_s": 0.2,
                    "model": "m",
                    "tp": 1,
                    "hardware": "h",
                    "slo": "strict",
                    "cost_model": "roofline",
                    "backend": "sim",
                    "env_version": "v0",
                    "git_commit": "abc",
                    "split": "test",
                }
            )
    return pd.DataFrame(rows)


def test_ranking_orders_by_mean_goodput_and_divides_by_the_best_sarathi() -> None:
    results = pd.concat(
        [
            frame(
                {
                    "fcfs": [1, 1, 1],
                    "sarathi_512": [1, 2, 3],
                    "sarathi_256": [0.5, 0.5, 0.5],
                    "adaptive": [4, 4, 4],
                }
            ),
            frame({"fcfs": [2, 2, 2], "sarathi_512": [1, 1, 1]}, load=2.0),
        ]
    )
    ranked = ranking(results)
    low = ranked[ranked["load_scale"] == 1.0].set_index("policy")
    assert list(low.sort_values("rank").index) == ["adaptive", "sarathi_512", "fcfs", "sarathi_256"]
    assert low.loc["sarathi_512", "vs_best_sarathi"] == 1.0
    assert low.loc["adaptive", "vs_best_sarathi"] == 2.0
    assert low.loc["sarathi_256", "vs_best_sarathi"] == 0.25
    assert low.loc["sarathi_512", "goodput_ci95"] > low.loc["fcfs", "goodput_ci95"] == 0.0
    high = ranked[ranked["load_scale"] == 2.0].set_index("policy")
    assert high.loc["fcfs", "rank"] == 1 and high.loc["fcfs", "vs_best_sarathi"] == 2.0


def test_engine_rows_are_compared_with_engine_sarathi_runs() -> None:
    sim = frame({"sarathi_512": [2.0, 2.0], "learned": [3.0, 3.0]})
    real = frame({"sarathi_512 [engine]": [1.0, 1.0], "learned [engine]": [1.5, 1.5]})
    real["backend"] = "engine"
    ranked = ranking(pd.concat([sim, real])).set_index("policy")
    assert ranked.loc["learned", "vs_best_sarathi"] == 1.5
    assert ranked.loc["learned [engine]", "vs_best_sarathi"] == 1.5, "engine over engine, not over sim"
    assert ranked.loc["sarathi_512 [engine]", "vs_best_sarathi"] == 1.0


def test_ratio_is_blank_without_a_sarathi_policy() -> None:
    results = frame({"fcfs": [1.0, 2.0], "adaptive": [3.0, 3.0]})
    ranked = ranking(results)
    assert ranked["vs_best_sarathi"].isna().all()
    board = markdown(results, ranked)
    row = next(line for line in board.splitlines() if line.startswith("| 1 | adaptive"))
    assert row.endswith("|  |")


def test_markdown_has_one_table_per_workload_and_load() -> None:
    results = pd.concat(
        [frame({"fcfs": [1, 2], "sarathi_512": [2, 3]}, w, x) for w in ("a", "b") for x in (1.0, 4.0)]
    )
    board = markdown(results, ranking(results))
    headings = [line for line in board.splitlines() if line.startswith("## ")]
    assert headings == [
        "## a (test split), load 1x",
        "## a (test split), load 4x",
        "## b (test split), load 1x",
        "## b (test split), load 4x",
    ]
    assert "| 1 | sarathi_512 | 2.5 ± " in board


def test_a_results_file_from_before_the_vllm_columns_still_validates() -> None:
    old = {"a": "1.5", "goodput_rps": "2.0"}
    fresh = {"a": 1.5, "goodput_rps": 2.0, **dict.fromkeys(VLLM_COLUMNS, 7.0)}
    assert compare(old, fresh, "row 1 (p)") == []
    changed = compare({**old, "ttft_ms_p99": "6.0"}, fresh, "row 1 (p)")  # compared where the file has it
    assert changed == ["row 1 (p), column ttft_ms_p99: expected '6.0', got 7.0"]
