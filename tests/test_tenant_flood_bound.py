"""bench/tenant_flood_bound.py: the unfair bounds lift the interactive tenants above VTC, and the flood is what holds them down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.tenant_flood_bound import without_tenant
from chunkgym import REPO_ROOT
from envs.serving.workload import load_workload

TOOL = ["bench/tenant_flood_bound.py", "seeds=[0]", "window_s=60"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *TOOL, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the last stdout line, the file) of one short run."""
    out = tmp_path_factory.mktemp("bound") / "result.json"
    done = _run(f"out={out}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


def test_every_policy_and_bound_is_reported_with_and_without_the_flood(report):
    line, full = report
    names = {"sarathi_512", "vtc", "bound_light_fcfs", "bound_light_edf", "bound_light_overtake"}
    assert set(line["mws"]) == set(line["jain"]) == set(line["no_flood_min_interactive_attainment"]) == names
    assert line["best_bound"] in names and line["best_bound_min_interactive_attainment"] == max(
        line["min_interactive_attainment"][b]
        for b in ("bound_light_fcfs", "bound_light_edf", "bound_light_overtake")
    )
    assert full["interactive_tenants"] == ["chat_a", "chat_b"]
    vtc = full["policies"]["vtc"]
    assert "flood" in vtc["flood"]["mean"]["tenants"] and "flood" not in vtc["no_flood"]["mean"]["tenants"]
    for key in ("ttft_met", "tpot_met", "stall_met", "attainment"):
        assert 0 <= vtc["flood"]["per_seed"]["0"]["tenants"]["chat_a"][key] <= 1


def test_the_most_generous_bound_serves_the_interactive_tenants_at_least_as_well_as_vtc(report):
    line, _ = report
    att = line["min_interactive_attainment"]
    assert att["bound_light_overtake"] >= att["vtc"]
    assert att["vtc"] > att["sarathi_512"]  # a fair order beats FCFS under the flood


def test_dropping_the_flood_raises_vtcs_interactive_attainment(report):
    line, full = report
    assert line["no_flood_min_interactive_attainment"]["vtc"] > line["min_interactive_attainment"]["vtc"]
    vtc = full["policies"]["vtc"]
    assert vtc["no_flood"]["mean"]["iteration_mean_s"] < vtc["flood"]["mean"]["iteration_mean_s"]


@pytest.mark.parametrize(
    ("arg", "says"),
    [("load_scale=-1", "load_scale"), ("flood=nobody", "no tenant 'nobody' in mix_flood")],
)
def test_a_bad_argument_fails_in_one_line(arg, says, tmp_path: Path):
    done = _run(arg, f"out={tmp_path / 'r.json'}")
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr
    assert not (tmp_path / "r.json").exists()


def test_without_tenant_keeps_the_other_requests_as_they_were():
    trace = load_workload("mix_flood").window("test", 0, 1.0, 30.0)
    cut = without_tenant(trace, "flood")
    keep = np.array([t != "flood" for t in trace.tenants()])
    assert "flood" not in cut.tenants() and len(cut) == int(keep.sum()) < len(trace)
    assert np.array_equal(cut.arrival_s, trace.arrival_s[keep]) and cut.span_s == trace.span_s
    assert cut.slo_class == tuple(np.asarray(trace.slo_class)[keep].tolist())
