"""Outputs are whole or absent, one evaluate.py writes a folder at a time, and its workers die with it."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import evaluate as evaluate_py
from chunkgym import REPO_ROOT
from chunkgym.io import FolderLockedError, atomic_path, atomic_write_text, folder_lock

GRID = [
    "policies=[fcfs,sarathi_512,sarathi_1024]",
    "workloads=[synthetic_azure_conv]",
    "load_scales=[1.0,2.0,4.0]",
    "cost_model=roofline",
    "progress=false",
    "plots=false",
]


def run_evaluate(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "evaluate.py", *args], cwd=REPO_ROOT, text=True, **kwargs)


# ---- atomic writes ---------------------------------------------------------------------------
def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "results.csv"
    atomic_write_text(target, "complete\n")
    with pytest.raises(OSError, match="No space left"):
        with atomic_path(target) as tmp:
            tmp.write_text("half a ro")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_text() == "complete\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]


def test_evaluate_out_of_space_mid_results_leaves_no_results_csv(tmp_path, monkeypatch):
    """evaluate.py's own writer: a write that dies half-way leaves nothing ``results=`` could render."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "evaluate", overrides=[*GRID, "load_scales=[1.0]", "seeds=[0]", "n_jobs=1", "window_s=15"]
        )
    conf = OmegaConf.to_object(cfg)
    real = evaluate_py.write_csv

    def full_disk(rows, path):
        real(rows, path)
        Path(path).write_text(Path(path).read_text()[:50])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evaluate_py, "write_csv", full_disk)
    with pytest.raises(OSError, match="No space left"):
        evaluate_py.evaluate(conf, evaluate_py.grid_of(conf), tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---- one writer per output folder ----------------------------------------------------------------
def test_the_folder_lock_is_exclusive_and_released_on_exit(tmp_path):
    with folder_lock(tmp_path, "evaluate.py"):
        with pytest.raises(
            FolderLockedError,
            match=rf"{tmp_path} is in use by another evaluate.py run \(evaluate.py, pid {os.getpid()}\)",
        ):
            with folder_lock(tmp_path, "evaluate.py"):
                pass
    with folder_lock(tmp_path, "evaluate.py"):  # free again
        pass


@pytest.mark.slow
def test_a_second_evaluate_into_the_same_output_dir_fails_at_once(tmp_path):
    out = tmp_path / "out"
    with folder_lock(out, "evaluate.py"):
        started = time.perf_counter()
        proc = run_evaluate(
            *GRID, "seeds=[0]", f"output_dir={out}", stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and "is in use by another evaluate.py run" in err, err[-2000:]
        assert not (out / "results.csv").exists()
        # the arguments are checked first: a bad one is reported as such, lock or not
        bad = run_evaluate(
            *GRID, "seeds=[0]", "load_scales=[-1.0]", f"output_dir={out}", stderr=subprocess.PIPE
        )
        _, err = bad.communicate(timeout=120)
        assert bad.returncode == 2 and "load_scales must be positive" in err, err[-2000:]
    assert time.perf_counter() - started < 120


# ---- killing evaluate.py ends its workers ---------------------------------------------------------
def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killing_evaluate_ends_its_worker_processes(tmp_path, sig):
    log = (tmp_path / "log").open("w")
    proc = run_evaluate(
        *GRID, "seeds=[0,1,2,3,4,5,6,7]", "n_jobs=2", f"output_dir={tmp_path / 'out'}", stdout=log, stderr=log
    )
    deadline = time.monotonic() + 90
    workers: set[int] = set()
    while time.monotonic() < deadline and len(workers) < 2:
        workers = {c for c in _children(proc.pid) if "loky" in Path(f"/proc/{c}/cmdline").read_text()}
        time.sleep(0.2)
    assert len(workers) >= 2, "evaluate.py started no worker processes"
    time.sleep(1.0)  # the workers are running jobs now
    helpers = _children(proc.pid) | workers
    proc.send_signal(sig)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in helpers):
        time.sleep(0.2)
    left = [p for p in helpers if _alive(p)]
    for p in left:  # never leave them behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"worker processes outlived evaluate.py: {left}"
    assert not (tmp_path / "out" / "results.csv").exists()
