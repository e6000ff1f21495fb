"""The pickle-free checkpoint format: exact round trip, deterministic resume, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

from chunkgym import REPO_ROOT
from envs.serving.workload import Workload
from policies.checkpoint import CheckpointError, read_checkpoint, restore, write_checkpoint
from policies.config import register_configs, to_train_config
from policies.training import HISTORY_FILE, Evaluator, load_model, make_vec_env, new_model, normalised
from tests.mutations import mutated_folders

OVERRIDES = [
    "+experiment=smoke",
    "algo.n_steps=64",
    "algo.batch_size=64",
    "algo.n_epochs=2",
    "logger.mode=disabled",
]
ALGO = "maskable_ppo"


@pytest.fixture(scope="module")
def cfg():
    register_configs()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return to_train_config(compose("train", overrides=OVERRIDES))


def _model(cfg, start_steps: int = 0):
    venv = normalised(make_vec_env(cfg, Workload(cfg.workload, cfg.data_root), start_steps), cfg)
    return new_model(cfg, venv)


@pytest.fixture(scope="module")
def trained(cfg, tmp_path_factory):
    model = _model(cfg)
    model.learn(256)
    directory = tmp_path_factory.mktemp("ckpt") / "step_000000000256"
    write_checkpoint(model, directory, ALGO)
    return model, directory


def _flat_optimizer(model) -> dict[str, torch.Tensor]:
    state = model.policy.optimizer.state_dict()["state"]
    return {f"{i}.{k}": v for i, s in state.items() for k, v in s.items()}


@pytest.mark.slow
def test_round_trip_restores_every_piece_of_training_state(cfg, trained):
    model, directory = trained
    assert sorted(p.name for p in directory.iterdir()) == [
        "checkpoint.json",
        "optimizer.safetensors",
        "policy.safetensors",
        "vecnormalize.safetensors",
    ]
    restored = load_model(cfg, directory, _model(cfg, 256).get_env())
    for name, tensor in model.policy.state_dict().items():
        assert torch.equal(tensor, restored.policy.state_dict()[name]), name
    a, b = _flat_optimizer(model), _flat_optimizer(restored)
    assert a.keys() == b.keys() and len(a) > 0 and all(torch.equal(a[k], b[k]) for k in a)
    groups = restored.policy.optimizer.state_dict()["param_groups"]
    assert groups == model.policy.optimizer.state_dict()["param_groups"]
    v1, v2 = model.get_vec_normalize_env(), restored.get_vec_normalize_env()
    np.testing.assert_array_equal(v1.obs_rms.mean, v2.obs_rms.mean)
    np.testing.assert_array_equal(v1.obs_rms.var, v2.obs_rms.var)
    assert v1.obs_rms.count == v2.obs_rms.count and v1.ret_rms.count == v2.ret_rms.count
    assert (
        (restored.num_timesteps, restored._n_updates) == (model.num_timesteps, model._n_updates) == (256, 4)
    )
    assert list(restored.ep_info_buffer) == [
        {k: float(v) for k, v in i.items()} for i in model.ep_info_buffer
    ]


def test_resuming_twice_from_one_checkpoint_trains_identically(cfg, trained):
    _, directory = trained
    runs = []
    for _ in range(2):
        model = load_model(cfg, directory, _model(cfg, 256).get_env())
        model.learn(128, reset_num_timesteps=False)
        runs.append(model.policy.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not torch.equal(runs[0]["action_net.weight"], trained[0].policy.state_dict()["action_net.weight"])


def _broken(directory: Path, tmp_path: Path) -> Path:
    copy = tmp_path / directory.name
    shutil.copytree(directory, copy)
    return copy


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("format_version", 2, "format is .* this code reads 'chunkgym-checkpoint' version 1"),
        ("algo", "ppo", "field 'algo' is 'ppo', the run trains 'maskable_ppo'"),
        ("num_timesteps", True, "field 'num_timesteps' must be an integer >= 0, got True"),
        ("num_timesteps", -1, "field 'num_timesteps' must be an integer >= 0"),
        ("vecnormalize", {"norm_obs": "yes"}, "field 'vecnormalize' must hold norm_obs"),
        ("ep_info_buffer", "x", "field 'ep_info_buffer' must be a list"),
    ],
)
def test_bad_manifest_fields_name_file_and_field(trained, tmp_path, key, value, message):
    copy = _broken(trained[1], tmp_path)
    manifest = json.loads((copy / "checkpoint.json").read_text())
    manifest[key] = value
    (copy / "checkpoint.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"checkpoint.json: {message}"):
        read_checkpoint(copy, ALGO)


def test_tensors_that_do_not_fit_the_model_are_refused(cfg, trained, tmp_path):
    copy = _broken(trained[1], tmp_path)
    tensors = load_file(copy / "policy.safetensors")
    tensors["action_net.weight"] = torch.zeros(3, 3)
    save_file(tensors, copy / "policy.safetensors")
    with pytest.raises(
        CheckpointError, match=r"policy.safetensors: tensor 'action_net.weight' is torch.float32\[3, 3\]"
    ):
        load_model(cfg, copy, _model(cfg, 256).get_env())
    copy = _broken(trained[1], tmp_path / "b")
    norm = load_file(copy / "vecnormalize.safetensors")
    norm["obs_mean"][0] = float("nan")
    save_file(norm, copy / "vecnormalize.safetensors")
    with pytest.raises(CheckpointError, match=r"vecnormalize.safetensors: expected finite float64 tensors"):
        read_checkpoint(copy, ALGO)
    (copy / "checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint.json: file not found"):
        read_checkpoint(copy, ALGO)


def _history(run_dir: Path, steps: list[int]) -> None:
    rows = [{"timesteps": s, "goodput_rps": float(s)} for s in steps]
    (run_dir / HISTORY_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"timesteps": 5')


def test_resume_drops_evaluation_rows_newer_than_its_checkpoint(trained, tmp_path):
    """Rows past the checkpoint (and a partial last line) go; best/ stays when it is not newer."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(trained[1], run_dir / "best")  # best at step 256
    _history(run_dir, [128, 256, 384, 512])
    evaluator = Evaluator(None, run_dir, "unused", ALGO, True, "goodput_rps", resumed_from=384)
    assert [json.loads(line)["timesteps"] for line in (run_dir / HISTORY_FILE).read_text().splitlines()] == [
        128,
        256,
        384,
    ]
    assert evaluator.best["timesteps"] == 256 and evaluator.last_timesteps == 384


def test_resume_forgets_a_best_policy_newer_than_its_checkpoint(trained, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(trained[1], run_dir / "best")  # best at step 256, but the run resumes from 128
    _history(run_dir, [64, 128, 256])
    evaluator = Evaluator(None, run_dir, "unused", ALGO, True, "goodput_rps", resumed_from=128)
    assert evaluator.best is None and not (run_dir / "best").exists()
    # the checkpoint's own row goes too: train.py re-evaluates the checkpoint (same numbers) as the new best
    assert [json.loads(line)["timesteps"] for line in (run_dir / HISTORY_FILE).read_text().splitlines()] == [
        64
    ]
    assert evaluator.last_timesteps == 64


WRONG_VALUES = [None, True, 0, -1, 1e308, 2**70, "x", [], {}, [None], {"a": 1}, [{"params": "x"}], [1.5]]


def test_every_manifest_field_set_to_a_wrong_value_gives_a_checkpoint_error(cfg, trained, tmp_path):
    """Each field (optimizer groups and settings too) x 13 wrong values: CheckpointError or a clean load."""
    model = _model(cfg, 256)
    cases, crashes = 0, []
    others = ("policy.safetensors", "optimizer.safetensors", "vecnormalize.safetensors")
    for path, value, directory in mutated_folders(
        trained[1], "checkpoint.json", others, WRONG_VALUES, tmp_path
    ):
        cases += 1
        try:
            restore(model, read_checkpoint(directory, ALGO))
        except CheckpointError:
            pass
        except Exception as exc:  # noqa: BLE001 - the point is to catch any other kind
            crashes.append((path, value, repr(exc)))
    assert cases > 300 and not crashes, crashes[:5]
