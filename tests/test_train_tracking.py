"""Tracking: W&B offline runs hold config, scalars and the exported policy; a failing tracker never stops training."""

import logging

import pytest

import envs
from chunkgym import tracking
from chunkgym.tracking import LoggerConfig, TrackerMode
from tests.test_train_cli import TINY, train


@pytest.mark.slow
def test_wandb_offline_run_holds_config_and_scalars(tmp_path):
    run_dir = tmp_path / "run"
    out = train(*TINY, "logger.mode=offline", "logger.tags=[unit]", f"hydra.run.dir={run_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    logs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    data = logs[0].read_bytes()
    # the run name is {env_id}__{exp}__{seed}__{time}; the exported policy folder is a model artefact
    assert f"{envs.ENV_ID}__synthetic_azure_conv_maskable_ppo__0__".encode() in data
    assert b"policy.safetensors" in data and b"policy-" in data
    # W&B's binary log stores keys and JSON-encoded values as plain bytes
    for key in (b"eval/goodput_rps", b"eval/ttft_p99_s", b"eval/tbt_p99_s", b"train/learning_rate"):
        assert key in data, key
    for config in (
        b"total_timesteps",
        b"synthetic_azure_conv",
        b"git_commit",
        b"env_spec",
        b"best_val_goodput_rps",
    ):
        assert config in data, config
    assert (run_dir / "tb").is_dir()


@pytest.mark.parametrize(
    ("mode", "env", "expected"),
    [
        (TrackerMode.auto, {}, "offline"),
        (TrackerMode.auto, {"WANDB_API_KEY": "x" * 40}, "online"),
        (TrackerMode.auto, {"WANDB_MODE": "disabled", "WANDB_API_KEY": "x" * 40}, "disabled"),
        (TrackerMode.offline, {"WANDB_API_KEY": "x" * 40}, "offline"),
        (TrackerMode.disabled, {}, "disabled"),
    ],
)
def test_mode_resolution(monkeypatch, mode, env, expected):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert tracking.resolve_mode(mode) == expected


class Exploding(tracking.KVWriter):
    def __init__(self):
        self.calls = 0

    def write(self, key_values, key_excluded, step=0):
        self.calls += 1
        raise ConnectionError("network down")

    def close(self):
        raise OSError("disk full")


def test_a_failing_tracker_is_switched_off_with_one_warning(caplog):
    inner = Exploding()
    guarded = tracking.Guarded("wandb", lambda: inner)
    with caplog.at_level(logging.WARNING, logger="chunkgym.tracking"):
        for step in range(3):
            guarded.write({"a": 1.0}, {"a": None}, step)
        guarded.close()
    assert inner.calls == 1 and guarded.inner is None
    assert len(caplog.records) == 1 and "network down" in caplog.text


def test_a_tracker_failing_to_start_leaves_the_other_outputs(monkeypatch, tmp_path, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("wandb.init timed out")

    monkeypatch.setattr(tracking, "start_wandb", refuse)
    with caplog.at_level(logging.WARNING, logger="chunkgym.tracking"):
        tracker = tracking.TrainingTracker(LoggerConfig(mode=TrackerMode.offline), tmp_path, "name", {})
    assert tracker.run is None
    tracker.logger.record("eval/goodput_rps", 1.5)
    tracker.logger.dump(step=10)
    tracker.log_model(tmp_path, {})
    tracker.close({"best_val_goodput_rps": 1.5})
    assert "wandb.init timed out" in caplog.text
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def _run_record(**fields) -> bytes:
    """How W&B's run log stores one field of the run record (protobuf), to find it in the file."""
    from wandb.proto import wandb_internal_pb2 as pb

    return pb.RunRecord(**fields).SerializeToString()


@pytest.mark.slow
def test_a_sweep_shares_one_wandb_group_named_after_its_folder(tmp_path):
    sweep = tmp_path / "sweep_20260101-000000"
    out = train(
        "-m",
        *TINY,
        "logger.mode=offline",
        "seed=5",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=job",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (log,) = (sweep / "job" / "wandb").glob("offline-run-*/run-*.wandb")
    data = log.read_bytes()
    assert _run_record(run_group=sweep.name) in data
    assert _run_record(job_type="train") in data


def test_a_single_run_has_no_group_unless_given(monkeypatch, tmp_path):
    import wandb

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or None)
    tracking.TrainingTracker(LoggerConfig(mode=TrackerMode.offline), tmp_path, "n", {})
    tracking.TrainingTracker(LoggerConfig(mode=TrackerMode.offline), tmp_path, "n", {}, group="g")
    assert [c["group"] for c in calls] == [None, "g"]
    assert all(c["sync_tensorboard"] and c["name"] == "n" for c in calls)
