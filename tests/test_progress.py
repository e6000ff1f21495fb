"""Long jobs say how far they are; an empty window is named instead of reported as NaN."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import chunkgym
from chunkgym.progress import Progress
from engine import replay
from envs.serving.workload import load_workload


def test_progress_prints_the_first_step_then_at_most_once_per_interval() -> None:
    now = [0.0]
    lines: list[str] = []
    p = Progress("bc", total=100, every_s=10.0, say=lines.append, clock=lambda: now[0])
    for step in range(100):
        now[0] = step * 0.5  # 50 s in all
        p.update(step, "steps")
    p.finish(100, "steps")
    assert lines[0] == "bc: 0/100 steps (0 s)"
    assert len(lines) == 1 + 4 + 1  # the first, one per 10 s after it, the end
    assert lines[-1] == "bc: 100/100 steps (50 s)"


def test_an_empty_window_logs_one_warning(caplog) -> None:
    w = load_workload("azure_code")  # the test split has gaps of minutes between bursts
    with caplog.at_level(logging.WARNING):
        assert len(w.window("test", 0, window_s=20.0)) == 0
    (record,) = caplog.records
    assert "'azure_code': the test window for seed 0 (window_s 20) holds no requests" in record.getMessage()


def test_replay_refuses_an_empty_window_before_running() -> None:
    conf = replay.load_config(["workload=azure_code", "window_s=20", "seed=0"])
    with pytest.raises(ValueError, match=r"'azure_code'.*seed 0 \(window_s=20.0.*holds no requests"):
        replay.check(conf)


def test_replay_cli_exits_nonzero_with_one_line_for_an_empty_window(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.replay",
            "workload=azure_code",
            "window_s=20",
            f"output_dir={tmp_path}",
        ],
        cwd=chunkgym.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "nan" not in proc.stdout
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("python -m engine.replay: error: workload 'azure_code'")
    )
    assert not (tmp_path / "results.csv").exists()


def test_the_engine_clock_reports_trace_time_as_it_goes() -> None:
    lines: list[str] = []
    clock = replay.ProgressClock("sleep", Progress("p [engine]", 5, every_s=0.0, say=lines.append))
    clock.start()
    clock.sleep_until(0.02)
    clock.now()
    assert lines and lines[-1].startswith("p [engine]: 0/5 s of the trace served in real time")
