"""Leaderboard rows: determinism across processes, rebuilding a row's run, the stall pick, the tracker."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from baselines import PrefillFirst, Sarathi
from chunkgym.parallel import JobError, parallel_map
from chunkgym.tracking import LoggerConfig, TrackerMode, upload
from envs.serving.metrics import load_slo
from leaderboard.plots import find_stall, prefill_span
from leaderboard.runs import RunSpec, SetupKey, run_row
from tests.simtools import make_sim, make_trace

SETUP = SetupKey.create("llama3_8b", "a100_80gb", 1, load_slo("strict"), "roofline")


def specs() -> list[RunSpec]:
    return [
        RunSpec(policy, "synthetic_azure_conv", load, seed, SETUP, window_s=10.0)
        for policy in ("fcfs", "sarathi_512")
        for load in (1.0, 3.0)
        for seed in (0, 1)
    ]


def without_wall(row: dict) -> dict:
    """The row without its wall time, NaN as None (NaN != NaN, and a worker's NaN is its own object)."""
    return {
        k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items() if k != "sim_wall_s"
    }


def test_rows_do_not_depend_on_process_count_or_order() -> None:
    jobs = specs()
    serial = [r.row for r in parallel_map(run_row, jobs, n_jobs=1, progress=False)]
    pooled = [r.row for r in parallel_map(run_row, jobs[::-1], n_jobs=2, progress=False)][::-1]
    assert [without_wall(r) for r in serial] == [without_wall(r) for r in pooled]
    assert len({r["config_hash"] for r in serial}) == len(jobs)


def test_a_row_rebuilds_the_spec_that_reproduces_it() -> None:
    spec = specs()[1]
    row = run_row(spec).row
    text = {k: "" if isinstance(v, float) and math.isnan(v) else str(v) for k, v in row.items()}
    again = RunSpec.from_row(text)
    assert again == spec
    assert without_wall(run_row(again).row) == without_wall(row)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"backend": "engine"}, "backend"),
        ({"tp": "two"}, "column tp"),
        ({"serving": '{"no_such_option": 1}'}, "column serving"),
        ({"slo_spec": '{"name": "strict"}'}, "slo_spec"),
    ],
)
def test_a_malformed_row_names_its_column(change, message) -> None:
    row = {k: str(v) for k, v in run_row(specs()[0]).row.items()} | change
    with pytest.raises(ValueError, match=message):
        RunSpec.from_row(row)


def test_a_missing_column_is_named() -> None:
    row = {k: str(v) for k, v in run_row(specs()[0]).row.items()}
    del row["cost_model"]
    with pytest.raises(ValueError, match="'cost_model' is missing"):
        RunSpec.from_row(row)


@dataclass(frozen=True)
class Boom:
    label: str = "the third job"


def explode(job):
    if isinstance(job, Boom):
        raise RuntimeError("no luck")
    return job


def test_a_failing_job_is_named() -> None:
    with pytest.raises(JobError, match="the third job: RuntimeError: no luck"):
        parallel_map(explode, [1, 2, Boom()], n_jobs=1, progress=False)


def test_find_stall_picks_the_long_prompt_and_a_request_streaming_across_it() -> None:
    # request 0 streams; request 1 (12k tokens) arrives while it does; request 2 arrives after both
    trace = make_trace([0.0, 0.3, 30.0], [200, 12000, 100], [400, 2, 5], span=31.0)
    fcfs = make_sim(trace).run(PrefillFirst(whole_prompts=True))
    stall = find_stall(fcfs)
    assert (stall.long, stall.stream) == (1, 0)
    start, end = prefill_span(fcfs, stall.long)
    gaps = np.diff(fcfs.token_times[0])
    assert end - start > 0.5 * gaps.max(), "the stream's longest gap is the long prompt's prefill"
    assert find_stall(make_sim(make_trace([0.0], [12000], [3])).run(Sarathi(512))) is None


def test_a_tracker_failure_never_fails_the_evaluation(monkeypatch, tmp_path) -> None:
    import wandb

    def refuse(**kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(wandb, "init", refuse)
    assert upload(LoggerConfig(mode=TrackerMode.offline), {}, {}, [], tmp_path) is False
    assert upload(LoggerConfig(mode=TrackerMode.disabled), {}, {}, [], tmp_path) is False


def test_env_version_is_the_env_a_learned_policy_was_trained_in() -> None:
    import envs

    rows = {
        p: run_row(RunSpec(p, "synthetic_azure_conv", 1.0, 0, SETUP, window_s=10.0)).row
        for p in ("sarathi_512", "learned_cpu")
    }
    assert rows["sarathi_512"]["env_version"] == envs.ENV_ID
    assert rows["learned_cpu"]["env_version"] == envs.ENV_ID_V1  # trained in v1, run in v1
