"""bench/constant_actions.py: a heuristic's constant action has the heuristic's capacity."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

from chunkgym import REPO_ROOT
from envs.serving.capacity import measure_capacity
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.registry import make_policy

TOOL = ["bench/constant_actions.py", "workloads=[synthetic_azure_conv]", "seeds=[1]", "parallel=1"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *TOOL, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip


def test_adaptive_srpfs_constant_action_has_its_capacity_and_the_best_is_marked():
    done = _run("actions=[target_1__shortest_first+skip,budget_512__fcfs+stop]", "split=val")
    assert done.returncode == 0, done.stderr
    table = json.loads(done.stdout.strip().splitlines()[-1])["capacity"]["synthetic_azure_conv"]
    setup, workload = ServingSetup.from_names(), load_workload("synthetic_azure_conv")
    for action, name in [
        ("target_1__shortest_first+skip", "adaptive_srpf"),
        ("budget_512__fcfs+stop", "sarathi_512"),
    ]:
        assert (
            table[action]
            == measure_capacity(
                setup, workload, functools.partial(make_policy, name), "attain90", "val", 1
            ).scale
        )
    best = max(table, key=table.__getitem__)
    assert any(line.startswith(best) and line.rstrip().endswith("*") for line in done.stdout.splitlines())


def test_a_bad_action_name_is_one_line_listing_the_modes():
    done = _run("actions=[target_3__fcfs+stop]")
    assert done.returncode != 0
    assert (
        done.stderr.strip().splitlines() == [done.stderr.strip().splitlines()[0]]
        and "must be a non-empty list of v3 action names MODE__ALLOCATION (modes budget_64" in done.stderr
    )
