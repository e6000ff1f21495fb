"""A ``file:`` trace used whole: seeds run only where they change the arrivals."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import chunkgym
from envs.serving.workload import load_workload


def azure_file(path: Path) -> Path:
    rows = [
        (f"2023-11-16 18:15:{10 + i // 4:02d}.{(i % 4) * 25:02d}00000", 200 + 50 * (i % 5), 20)
        for i in range(40)
    ]
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},{p},{o}\n" for t, p, o in rows)
    )
    return path


def lengths_file(path: Path) -> Path:
    path.write_text(
        "num_prefill_tokens,num_decode_tokens\n" + "".join(f"{100 + i},{10 + i}\n" for i in range(40))
    )
    return path


def test_only_generated_or_jittered_arrivals_depend_on_the_seed(tmp_path) -> None:
    timed = load_workload(f"file:{azure_file(tmp_path / 'a.csv')}")
    assert not timed.seeded_arrivals
    assert np.array_equal(timed.split("all", 0).arrival_s, timed.split("all", 1).arrival_s)
    generated = load_workload(f"file:{lengths_file(tmp_path / 'l.csv')}")
    assert generated.seeded_arrivals
    assert not np.array_equal(generated.split("all", 0).arrival_s, generated.split("all", 1).arrival_s)


@pytest.mark.slow
def test_evaluate_runs_one_seed_of_an_unseeded_file_and_says_so(tmp_path) -> None:
    timed, generated = f"file:{azure_file(tmp_path / 'a.csv')}", f"file:{lengths_file(tmp_path / 'l.csv')}"
    proc = subprocess.run(
        [
            sys.executable,
            "evaluate.py",
            "policies=[fcfs]",
            f"workloads=[{timed},{generated}]",
            "load_scales=[1.0]",
        ]
        + [
            "seeds=[0,1,2]",
            "cost_model=roofline",
            "plots=false",
            "progress=false",
            f"output_dir={tmp_path / 'o'}",
        ],
        cwd=chunkgym.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with (tmp_path / "o" / "results.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["seed"] for r in rows if r["workload"] == timed) == ["0"]
    assert sorted(r["seed"] for r in rows if r["workload"] == generated) == ["0", "1", "2"]
    assert (
        f"{timed} is used whole and its arrivals do not depend on the seed: seed 0 only"
        in proc.stdout + proc.stderr
    )
