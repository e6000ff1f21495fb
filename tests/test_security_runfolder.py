"""A received run or output folder: reads and writes stay inside it, links planted there are refused
with one line, deletion touches only the run's own checkpoints, and checkpoint numbers are checked."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

from chunkgym import REPO_ROOT
from chunkgym.io import (
    OutputFolderError,
    append_line,
    atomic_write_text,
    check_output_folder,
    folder_lock,
)
from chunkgym.received import ReceivedFileError
from chunkgym.tracking import TRACKING_FILE, wandb_run_id
from envs.serving.workload import Workload
from policies.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from policies.config import register_configs, to_train_config
from policies.training import (
    CHECKPOINT_DIR,
    HISTORY_FILE,
    Evaluator,
    checkpoints,
    make_vec_env,
    new_model,
    normalised,
    prepare_run_dir,
    save_checkpoint,
)

ALGO = "maskable_ppo"
OVERRIDES = [
    "+experiment=smoke",
    "algo.n_steps=64",
    "algo.batch_size=64",
    "algo.n_epochs=1",
    "logger.mode=disabled",
]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links not followed) and the SHA-256 of its bytes."""
    out = {}
    for parent, _, files in os.walk(root):
        for name in files:
            path = Path(parent) / name
            out[str(path)] = "link" if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def model():
    register_configs()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = to_train_config(compose("train", overrides=OVERRIDES))
    m = new_model(cfg, normalised(make_vec_env(cfg, Workload(cfg.workload, cfg.data_root)), cfg))
    m.learn(128)  # one update: the optimizer holds moments and steps
    return m


@pytest.fixture
def elsewhere(tmp_path):
    """A folder outside the run folder, with a file and another run's checkpoint, to watch."""
    other = tmp_path / "elsewhere"
    (other / "step_000000000064").mkdir(parents=True)
    (other / "secret.txt").write_text("do not touch\n")
    (other / "step_000000000064" / "checkpoint.json").write_text("{}")
    return other


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


# ---- links planted in a run folder ----------------------------------------------------------
def test_a_tracking_json_link_is_refused_and_its_target_unchanged(tmp_path, elsewhere):
    run = tmp_path / "run"
    run.mkdir()
    (run / TRACKING_FILE).symlink_to(elsewhere / "secret.txt")
    before = snapshot(elsewhere)
    with pytest.raises(ReceivedFileError) as info:
        wandb_run_id(run)
    assert "tracking.json" in one_line(info) and "symbolic link" in one_line(info)
    assert snapshot(elsewhere) == before


def test_a_checkpoints_link_to_another_run_is_refused_before_any_write_or_delete(model, tmp_path, elsewhere):
    run = tmp_path / "run"
    run.mkdir()
    (run / CHECKPOINT_DIR).symlink_to(elsewhere)
    before = snapshot(elsewhere)
    for action in (lambda: save_checkpoint(model, run, 1, ALGO), lambda: checkpoints(run)):
        with pytest.raises(ReceivedFileError) as info:
            action()
        assert "checkpoints" in one_line(info)
    assert snapshot(elsewhere) == before


def test_a_step_folder_link_is_refused_not_resumed(model, tmp_path, elsewhere):
    run = tmp_path / "run"
    write_checkpoint(model, elsewhere / "step_000000000128", ALGO)
    (run / CHECKPOINT_DIR).mkdir(parents=True)
    (run / CHECKPOINT_DIR / "step_000000000128").symlink_to(elsewhere / "step_000000000128")
    before = snapshot(elsewhere)
    with pytest.raises(CheckpointError, match="step_000000000128: is a link"):
        checkpoints(run)
    with pytest.raises(ReceivedFileError):  # and read directly: the folder is a link
        read_checkpoint(run / CHECKPOINT_DIR / "step_000000000128", ALGO, run)
    assert snapshot(elsewhere) == before


def test_evaluations_jsonl_and_best_links_are_refused(model, tmp_path, elsewhere):
    run = tmp_path / "run"
    run.mkdir()
    (run / HISTORY_FILE).symlink_to(elsewhere / "secret.txt")
    before = snapshot(elsewhere)
    with pytest.raises(ReceivedFileError) as info:
        append_line(run / HISTORY_FILE, "{}", run)
    assert HISTORY_FILE in one_line(info)
    with pytest.raises(ReceivedFileError):  # read on resume
        Evaluator(None, run, "unused", ALGO, True, "goodput_rps", resumed_from=0)
    (run / HISTORY_FILE).unlink()
    (run / "best").symlink_to(elsewhere / "step_000000000064")
    with pytest.raises(ReceivedFileError, match="best"):  # neither followed nor deleted
        Evaluator(None, run, "unused", ALGO, True, "goodput_rps", resumed_from=0)
    with pytest.raises(ReceivedFileError, match="best"):
        write_checkpoint(model, run / "best", ALGO, run)
    assert snapshot(elsewhere) == before


def test_a_tensor_file_link_or_a_sparse_giant_is_refused_before_it_is_read(model, tmp_path, elsewhere):
    run = tmp_path / "run"
    directory = run / "best"
    write_checkpoint(model, directory, ALGO, run)
    (elsewhere / "weights").write_bytes((directory / "policy.safetensors").read_bytes())
    (directory / "policy.safetensors").unlink()
    (directory / "policy.safetensors").symlink_to(elsewhere / "weights")
    with pytest.raises(ReceivedFileError, match="policy.safetensors: is a symbolic link"):
        read_checkpoint(directory, ALGO, run)
    (directory / "policy.safetensors").unlink()
    with open(directory / "policy.safetensors", "wb") as f:
        f.truncate(8 << 30)  # 8 GiB, no block on disk
    started = time.perf_counter()
    with pytest.raises(ReceivedFileError, match=r"policy.safetensors: 8589934592 bytes, over the limit"):
        read_checkpoint(directory, ALGO, run)
    assert time.perf_counter() - started < 2


def test_writes_replace_a_planted_temporary_link_instead_of_following_it(tmp_path, elsewhere):
    run = tmp_path / "run"
    run.mkdir()
    tmp = run / f".summary.{os.getpid()}.tmp.json"
    tmp.symlink_to(elsewhere / "secret.txt")
    before = snapshot(elsewhere)
    atomic_write_text(run / "summary.json", "{}\n", run)
    assert (run / "summary.json").read_text() == "{}\n" and not tmp.exists()
    (run / "config.json").symlink_to(elsewhere / "secret.txt")
    with pytest.raises(ReceivedFileError, match="config.json: is a symbolic link"):
        atomic_write_text(run / "config.json", "{}", run)
    assert snapshot(elsewhere) == before


def test_a_run_folder_config_is_read_as_plain_data(tmp_path, model):
    run = tmp_path / "run"
    save_checkpoint(model, run, 1, ALGO)
    (run / "config.yaml").write_text("a: &x [1, 2]\nb: *x\n")
    with pytest.raises(ReceivedFileError, match="config.yaml: uses a YAML anchor or alias"):
        prepare_run_dir(run, {"a": [1, 2], "b": [1, 2]}, resume=True)
    (run / "config.yaml").write_text("seed: ${oc.env:HOME}\nalgo: 5\n")  # a string, never resolved
    with pytest.raises(SystemExit, match=r"config changed: seed: '\$\{oc.env:HOME\}' -> 0"):
        prepare_run_dir(run, {"seed": 0, "algo": 5}, resume=True)


# ---- checkpoint steps and deletion -----------------------------------------------------------
@pytest.mark.parametrize("name", ["step_-5", "step_abc", "step_", "step_1e3"])
def test_a_step_folder_whose_name_is_no_step_count_is_refused(model, tmp_path, name):
    run = tmp_path / "run"
    save_checkpoint(model, run, 3, ALGO)
    shutil.copytree(run / CHECKPOINT_DIR / "step_000000000128", run / CHECKPOINT_DIR / name)
    with pytest.raises(CheckpointError, match=f"{name}: not a checkpoint folder name"):
        checkpoints(run)


def test_the_step_inside_the_manifest_must_match_the_folder_and_orders_them(model, tmp_path):
    run = tmp_path / "run"
    newest = save_checkpoint(model, run, 3, ALGO)  # step_000000000128
    older = run / CHECKPOINT_DIR / "step_9"
    shutil.copytree(newest, older)
    manifest = json.loads((older / "checkpoint.json").read_text())
    (older / "checkpoint.json").write_text(json.dumps({**manifest, "num_timesteps": 9}))
    assert checkpoints(run) == [older, newest], "by step, not by name ('step_9' > 'step_0...128' as text)"
    (older / "checkpoint.json").write_text(json.dumps({**manifest, "num_timesteps": 500}))
    with pytest.raises(
        CheckpointError,
        match=r"step_9/checkpoint.json: field 'num_timesteps' is 500, the folder's name says 9",
    ):
        checkpoints(run)


def test_keep_deletes_only_the_runs_own_step_folders(model, tmp_path, elsewhere):
    run = tmp_path / "run"
    save_checkpoint(model, run, 1, ALGO)
    root = run / CHECKPOINT_DIR
    (root / "notes").mkdir()
    (root / "notes" / "mine.txt").write_text("keep me")
    (root / "step_000000000050").mkdir()  # no manifest: unfinished, not ours to judge
    (root / "step_000000000050" / "partial").write_text("x")
    mine = snapshot(root / "notes") | snapshot(root / "step_000000000050")
    model.num_timesteps += 64
    kept = save_checkpoint(model, run, 1, ALGO)
    assert checkpoints(run) == [kept] and not (root / "step_000000000128").exists()
    assert snapshot(root / "notes") | snapshot(root / "step_000000000050") == mine


def test_optimizer_and_normalisation_state_must_be_finite_and_counts_non_negative(model, tmp_path):
    run = tmp_path / "run"
    directory = save_checkpoint(model, run, 1, ALGO)
    optimizer = load_file(directory / "optimizer.safetensors")
    step = next(k for k in optimizer if k.endswith(".step"))
    moment = next(k for k in optimizer if k.endswith(".exp_avg"))
    norm = load_file(directory / "vecnormalize.safetensors")
    cases = [
        ("optimizer.safetensors", optimizer, step, -1.0, "negative step count"),
        ("optimizer.safetensors", optimizer, moment, float("nan"), "non-finite"),
        ("vecnormalize.safetensors", norm, "obs_count", -3.0, "negative values"),
        ("vecnormalize.safetensors", norm, "obs_var", -1.0, "negative values"),
    ]
    for name, tensors, key, value, message in cases:
        bad = dict(tensors)
        bad[key] = torch.full_like(tensors[key], value)
        save_file(bad, directory / name)
        with pytest.raises(CheckpointError, match=message) as info:
            read_checkpoint(directory, ALGO, run)
        assert name in one_line(info) and key in one_line(info) or name in one_line(info)
        save_file(tensors, directory / name)
    read_checkpoint(directory, ALGO, run)  # restored: clean again


def test_evaluations_jsonl_rows_are_checked_with_their_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for text, message in [
        ('{"timesteps": 1, "goodput_rps": 1.0}\n[' * 1 + "[" * 100 + "\n", "line 2: nested deeper than"),
        ('{"timesteps": -4, "goodput_rps": 1.0}\n', "line 1: field 'timesteps' must be an integer >= 0"),
        ('{"timesteps": 4, "goodput_rps": "fast"}\n', "line 1: field 'goodput_rps' must be a number"),
        ('{"timesteps": 4}\n', "line 1: field 'goodput_rps' must be a number"),
        ('{"timesteps": 1' + "0" * 5000 + ', "goodput_rps": 1}\n', "line 1: not a readable JSON document"),
    ]:
        (run / HISTORY_FILE).write_text(text)
        with pytest.raises(ReceivedFileError, match=message) as info:
            Evaluator(None, run, "unused", ALGO, True, "goodput_rps", resumed_from=0)
        assert str(run / HISTORY_FILE) in one_line(info)


# ---- output folders ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "folder",
    [
        "/",
        "/etc",
        "/etc/chunkgym",
        "/usr/local/out",
        "/var",
        "/proc/self",
        "~",
        "conf/policy",
        "policies/x",
        "envs",
        ".git/hooks",
        "docs/out",
    ],  # fmt: skip
)
def test_an_output_folder_may_not_be_a_system_or_source_folder(folder, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(OutputFolderError) as info:
        check_output_folder(folder)
    assert one_line(info).startswith(f"output_dir={folder}: resolves to")


@pytest.mark.parametrize("folder", ["outputs/x", "reports/x", "policies/artifacts/x", "/tmp/x", "/var/tmp/x"])
def test_outputs_reports_artifacts_and_temporary_folders_are_fine(folder, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert check_output_folder(folder) == Path(folder).resolve()


def test_a_link_into_the_source_tree_is_followed_then_refused(tmp_path):
    (tmp_path / "out").symlink_to(REPO_ROOT / "conf")
    with pytest.raises(OutputFolderError, match="inside the checkout's source folder conf/"):
        folder_lock(tmp_path / "out", "evaluate.py").__enter__()


def test_a_planted_lock_file_link_is_refused(tmp_path, elsewhere):
    (tmp_path / ".chunkgym.lock").symlink_to(elsewhere / "secret.txt")
    before = snapshot(elsewhere)
    with pytest.raises(ReceivedFileError, match="chunkgym.lock"):
        with folder_lock(tmp_path, "evaluate.py"):
            pass
    assert snapshot(elsewhere) == before


# ---- train.py end to end ------------------------------------------------------------------------
TINY = ["+experiment=smoke", "algo.total_timesteps=128", "algo.n_steps=64", "algo.batch_size=64",
        "algo.n_epochs=1", "eval.every_steps=100000", "eval.seeds=[0]", "progress=false"]  # fmt: skip


def train(run: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline"}  # the default: W&B on, offline without a key
    cmd = [sys.executable, "train.py", *TINY, *extra, f"hydra.run.dir={run}"]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.slow
def test_train_into_a_folder_with_a_planted_tracking_link_fails_in_one_line(tmp_path, elsewhere):
    run = tmp_path / "run"
    run.mkdir()
    (run / TRACKING_FILE).symlink_to(elsewhere / "secret.txt")
    before = snapshot(elsewhere)
    started = time.perf_counter()
    out = train(run, "logger.mode=offline")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(f"train.py: error: {run / TRACKING_FILE}: is a symbolic link")
    )
    assert snapshot(elsewhere) == before and time.perf_counter() - started < 120


@pytest.mark.slow
def test_train_resuming_bad_checkpoints_fails_in_one_line(tmp_path):
    run = tmp_path / "run"
    (run / CHECKPOINT_DIR / "step_-5").mkdir(parents=True)
    out = train(run, "logger.mode=disabled")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"train.py: error: {run / CHECKPOINT_DIR / 'step_-5'}: not a checkpoint folder name (step_<N>, N a step count)"
    )
