"""backend=ray: the same jobs on a Ray cluster (a local head on loopback, started here) give the local results."""

from __future__ import annotations

import csv
import functools
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkgym import REPO_ROOT
from chunkgym.backends import (
    ADDRESS_ENV_VAR,
    LOOPBACK_ENV_VAR,
    RayExecutor,
    _run_task,
    check_backend,
    executor,
    worker_env,
)
from chunkgym.parallel import JobError, parallel_map
from envs.serving.capacity import CapacityQuery, measure_capacities
from envs.serving.metrics import load_slo
from leaderboard.runs import SetupKey, cached_workload
from policies.registry import make_policy

os.environ.setdefault(LOOPBACK_ENV_VAR, "0")  # before Ray's first import: its servers on 127.0.0.1 only
ray = pytest.importorskip("ray")

TINY_GRID = (
    "policies=[fcfs,sarathi_512]",
    "workloads=[synthetic_azure_conv]",
    "load_scales=[1.0]",
    "seeds=[0]",
    "cost_model=roofline",
    "window_s=10",
    "capacity=true",
    "capacity_criteria=[attain90]",
    "capacity_rel_tol=0.2",
    "plots=false",
    "progress=false",
    "n_jobs=2",
)
WALL_COLUMNS = {"sim_wall_s"}  # the only column allowed to differ between two runs


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    """A two-CPU Ray head on 127.0.0.1 in this process (its own temp folder); its GCS address."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    temp = tempfile.mkdtemp(prefix="rayt")  # short: Ray's socket paths must fit in 107 bytes
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=200 * 1024**2,
        _temp_dir=temp,
        runtime_env={"env_vars": worker_env()},
        configure_logging=False,
    )
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:"), address
    try:
        yield address
    finally:
        ray.shutdown()


def evaluate(*args: str, address: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (ADDRESS_ENV_VAR, "RAY_AUTH_MODE")}
    env.update({ADDRESS_ENV_VAR: address} if address else {})  # the tool finds the head's token itself
    return subprocess.run(
        [sys.executable, "evaluate.py", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def without_wall(table: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in WALL_COLUMNS} for row in table]


@pytest.mark.slow
def test_the_grid_on_ray_writes_the_local_results_and_each_validates_the_other(head, tmp_path) -> None:
    local = evaluate(*TINY_GRID, f"output_dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stderr[-3000:]
    on_ray = evaluate(*TINY_GRID, "backend=ray", f"output_dir={tmp_path / 'ray'}", address=head)
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    assert f"joined the Ray cluster at {head}" in on_ray.stdout
    for name in ("results.csv", "buckets.csv", "capacity.csv"):
        assert without_wall(rows(tmp_path / "ray" / name)) == without_wall(rows(tmp_path / "local" / name)), (
            name
        )
    capacities = rows(tmp_path / "ray" / "capacity.csv")
    assert all(float(r["capacity_attain90_scale"]) > 0 for r in capacities)
    check = evaluate(f"validate={tmp_path / 'ray' / 'results.csv'}", "progress=false")
    assert check.returncode == 0 and "all 2 rows reproduce" in check.stdout, check.stderr[-2000:]
    back = evaluate(
        f"validate={tmp_path / 'local' / 'results.csv'}", "backend=ray", "progress=false", address=head
    )
    assert back.returncode == 0 and "all 2 rows reproduce" in back.stdout, back.stderr[-2000:]


@pytest.mark.slow
def test_the_speculative_capacity_search_on_ray_finds_the_sequential_bracket(head) -> None:
    query = CapacityQuery(
        SetupKey.create("llama3_8b", "a100_80gb", 1, load_slo("strict"), "roofline").build(),
        cached_workload("synthetic_azure_conv"),
        functools.partial(make_policy, "sarathi_512"),
        window_s=10.0,
        rel_tol=0.1,
    )
    reference = measure_capacities([query], early_stop=False, parallel=1)
    with executor("ray", 3) as pool:  # on the head's connection
        assert isinstance(pool, RayExecutor)
        found = measure_capacities([query], early_stop=False, parallel=3, executor=pool)
    assert found[0].result == reference[0].result
    assert found[0].probes == reference[0].probes
    assert found[0].rps == reference[0].rps > 0


@pytest.mark.slow
def test_ray_results_come_back_in_job_order_and_a_failure_names_its_job(head) -> None:
    # a builtin: Ray workers import functions by name, and this test module is not a package
    assert parallel_map(math.sqrt, [64, 36, 16, 4], n_jobs=2, progress=False, backend="ray") == [8, 6, 4, 2]
    with pytest.raises(JobError, match="^-1: ValueError: math domain error"):
        parallel_map(math.sqrt, [4, -1], progress=False, backend="ray")


def test_a_worker_importing_another_checkout_is_refused() -> None:
    assert _run_task(str(REPO_ROOT), math.sqrt, 4) == 2.0
    with pytest.raises(RuntimeError, match=r"imports chunkgym from .*, not the driver's /elsewhere"):
        _run_task("/elsewhere", math.sqrt, 4)


def test_an_unknown_backend_fails_before_any_work(tmp_path) -> None:
    with pytest.raises(ValueError, match="backend must be one of local, ray, got 'spark'"):
        check_backend("spark")
    proc = evaluate(*TINY_GRID, "backend=spark", f"output_dir={tmp_path / 'out'}")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "evaluate.py: error: backend='spark': must be one of local, ray"
    ]
    assert not (tmp_path / "out").exists()
