"""No file a user may have received (results, policy folders, run folders, presets) can run code.

Each test plants a payload that would write a marker file if anything executed it, feeds it to a
load path, and asserts the marker never appears; where the payload is a pickle, the test then
unpickles it itself to prove the payload is live (so the test could fail).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from chunkgym import REPO_ROOT
from envs import ENV_ID_V0 as ENV_ID
from envs.actions import NVEC
from envs.chunked_prefill import version_of
from leaderboard.runs import RunSpec
from policies import imitation, registry
from policies.checkpoint import CheckpointError, read_checkpoint
from policies.export import write_export
from policies.exported import PolicyNet, load_program, sha256_of
from policies.registry import make_policy
from policies.training import prepare_run_dir


class Payload:
    """Unpickling this writes ``marker`` (what a malicious pickle in a shared folder would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def pickled(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def assert_live_then_clean(data: bytes, marker: Path) -> None:
    """The payload really writes the marker when unpickled (this test's own, deliberate load)."""
    assert not marker.exists(), "the code under test ran the payload"
    pickle.loads(data)
    assert marker.exists()
    marker.unlink()


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "MARKER"


def evil_yaml(path: Path, marker: Path) -> Path:
    """A Hydra-style preset whose ``_target_`` would write the marker (Path.write_text)."""
    path.write_text(yaml.safe_dump({"_target_": "pathlib.Path.write_text", "self": str(marker), "data": "x"}))
    return path


# ---- policy names -----------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["absolute", "dotdot"])
def test_a_policy_name_is_never_turned_into_a_yaml_path(tmp_path, marker, style):
    payload = evil_yaml(tmp_path / "evil.yaml", marker)
    name = (
        str(payload.with_suffix(""))
        if style == "absolute"
        else os.path.relpath(payload.with_suffix(""), registry.POLICY_DIR)
    )
    with pytest.raises(ValueError, match=r"unknown policy .*valid names: adaptive"):
        make_policy(name)
    with pytest.raises(ValueError, match="unknown policy"):
        imitation.collect(None, "window_best", 0, 0, 1, 0.99, [name])  # algo.bc_policies
    assert not marker.exists()


def test_a_results_row_naming_a_path_as_policy_is_refused(tmp_path, marker):
    payload = evil_yaml(tmp_path / "evil.yaml", marker)
    row = {"backend": "sim", "policy": os.path.relpath(payload.with_suffix(""), registry.POLICY_DIR)}
    with pytest.raises(ValueError, match="column policy: unknown policy"):
        RunSpec.from_row(row)
    assert not marker.exists()


def test_evaluate_validate_with_a_planted_policy_column_runs_nothing(tmp_path, marker):
    payload = evil_yaml(tmp_path / "evil.yaml", marker)
    results = tmp_path / "results.csv"
    name = os.path.relpath(payload.with_suffix(""), registry.POLICY_DIR)
    results.write_text(
        "policy,workload,load_scale,seed,backend,slo_spec,model,hardware,tp,cost_model,serving,split\n"
        f'{name},synthetic_azure_conv,1.0,0,sim,"{{}}",llama3_8b,a100_80gb,1,roofline,"{{}}",test\n'
    )
    proc = subprocess.run(
        [
            sys.executable,
            "evaluate.py",
            f"validate={results}",
            "progress=false",
            f"hydra.run.dir={tmp_path / 'o'}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown policy" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


def test_a_preset_may_only_build_policy_classes_of_this_repo(tmp_path, marker, monkeypatch):
    monkeypatch.setattr(registry, "POLICY_DIR", tmp_path)
    evil_yaml(tmp_path / "foreign.yaml", marker)
    (tmp_path / "nested.yaml").write_text(
        yaml.safe_dump(
            {
                "_target_": "baselines.Sarathi",
                "budget": {"_target_": "pathlib.Path.write_text", "self": str(marker)},
            }
        )
    )
    (tmp_path / "notpolicy.yaml").write_text(
        yaml.safe_dump({"_target_": "envs.serving.workload.load_workload"})
    )
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump({"_target_": "baselines.Sarathi", "budget": 256}))
    with pytest.raises(
        ValueError, match=r"foreign.yaml: '_target_' 'pathlib.Path.write_text' is not a class of this"
    ):
        make_policy("foreign")
    with pytest.raises(
        ValueError, match=r"nested.yaml: argument 'budget' of baselines.Sarathi: only plain values"
    ):
        make_policy("nested")
    with pytest.raises(
        ValueError, match=r"notpolicy.yaml: '_target_' 'envs.serving.workload.load_workload' is not a Policy"
    ):
        make_policy("notpolicy")
    assert make_policy("ok").budget == 256
    assert not marker.exists()


# ---- exported policies: policy.pt2 ---------------------------------------------------------------
@pytest.fixture
def export_dir(tmp_path) -> Path:
    torch.manual_seed(0)
    directory = tmp_path / "export"
    write_export(PolicyNet([len(version_of(ENV_ID).feature_names), 8], NVEC), ENV_ID, directory, {})
    return directory


def test_a_planted_policy_pt2_is_never_unpickled(export_dir, marker, monkeypatch):
    """The attacker controls the folder, hash included: a rehashed pickle in policy.pt2."""
    data = pickled(marker)
    (export_dir / "policy.pt2").write_bytes(data)
    spec = json.loads((export_dir / "policy.json").read_text())
    spec["files"]["policy.pt2"] = sha256_of(export_dir / "policy.pt2")
    (export_dir / "policy.json").write_text(json.dumps(spec))

    def forbidden(*args, **kwargs):
        raise AssertionError("a loader unpickled")

    for target in (torch.export, torch):
        monkeypatch.setattr(target, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    load_program(export_dir)
    make_policy(f"learned:{export_dir}")
    monkeypatch.undo()
    assert_live_then_clean(data, marker)


# ---- run folders: resume and best/ ---------------------------------------------------------------
def test_a_run_folder_with_sb3_pickles_is_refused_before_anything_loads(tmp_path, marker):
    run_dir = tmp_path / "run"
    data = pickled(marker)
    for folder in ("checkpoints/step_000000000256", "best"):
        (run_dir / folder).mkdir(parents=True)
        (run_dir / folder / "vecnormalize.pkl").write_bytes(data)
        (run_dir / folder / "model.zip").write_bytes(data)
    with pytest.raises(SystemExit, match=r"SB3's pickle format .* never loads"):
        prepare_run_dir(run_dir, {"seed": 0}, resume=True)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "train.py", "+experiment=smoke", "logger.mode=disabled", f"hydra.run.dir={run_dir}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0 and "pickle format" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()
    assert_live_then_clean(data, marker)


def test_pickles_under_checkpoint_names_are_never_unpickled(tmp_path, marker):
    """A folder in the new format whose tensor files are pickles: read_checkpoint fails, runs nothing."""
    ckpt = tmp_path / "step_000000000256"
    ckpt.mkdir()
    data = pickled(marker)
    for name in ("policy.safetensors", "optimizer.safetensors", "vecnormalize.safetensors"):
        (ckpt / name).write_bytes(data)
    manifest = {
        "format": "chunkgym-checkpoint",
        "format_version": 1,
        "algo": "maskable_ppo",
        "num_timesteps": 256,
        "n_updates": 4,
        "optimizer_param_groups": [],
        "vecnormalize": {"norm_obs": True, "norm_reward": False, "clip_obs": 10.0}
        | {"clip_reward": 10.0, "gamma": 0.99, "epsilon": 1e-8},
        "ep_info_buffer": [],
        "ep_success_buffer": [],
    }
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"vecnormalize.safetensors: unreadable safetensors file"):
        read_checkpoint(ckpt, "maskable_ppo")
    shutil.rmtree(ckpt)
    assert not marker.exists()
    assert_live_then_clean(data, marker)
