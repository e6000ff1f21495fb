"""train.py through Hydra: config validation, a tiny run resumed to a larger total, and the run folder."""

import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from chunkgym import REPO_ROOT
from chunkgym.config import ConfigError
from policies.checkpoint import read_checkpoint
from policies.config import TrainConfig, plain, register_configs, to_train_config
from policies.exported import load_policy
from policies.training import prepare_run_dir

# A tiny run that needs no data files and no calibration (what +experiment=smoke sets, smaller).
TINY = [
    "+experiment=smoke",
    "algo.total_timesteps=256",
    "algo.n_steps=64",
    "algo.batch_size=64",
    "algo.n_epochs=2",
    "algo.lr_schedule=linear",
    "eval.every_steps=100000",
    "eval.seeds=[0]",
    "checkpoint.every_steps=128",
    "logger.mode=disabled",
    "progress=false",
]


def train(*overrides: str, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def compose_train(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=overrides)


def test_default_config_composes_to_the_schema():
    cfg = to_train_config(compose_train([]))
    assert isinstance(cfg, TrainConfig)
    assert (cfg.hardware.name, cfg.model.name, cfg.workload.name, cfg.slo.name) == (
        "a100_80gb",
        "llama3_8b",
        "azure_conv",
        "strict",
    )
    assert cfg.algo.name.value == "maskable_ppo" and cfg.env.cost_model == "calibrated"
    spec = to_train_config(compose_train(["hardware=h100_80gb", "model.num_layers=2", "slo.ttft_factor=3"]))
    assert spec.hardware.name == "h100_80gb" and spec.model.num_layers == 2 and spec.slo.ttft_factor == 3.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.no_such_key=1", "Could not override 'algo.no_such_key'"),
        ("model.num_layerz=3", "Could not override 'model.num_layerz'"),
        ("algo.n_envs=two", "Value 'two' of type 'str' could not be converted to Integer"),
        ("hardware.peak_flops=fast", "could not be converted to Float"),
        ("algo.vec_env=threads", "Invalid value 'threads', expected one of [dummy, subproc]"),
        ("logger.mode=loud", "Invalid value 'loud', expected one of [auto, online, offline, disabled]"),
        ("algo=sac", "Could not find 'algo/sac'"),
        ("workload=nope", "Could not find 'workload/nope'"),
    ],
)
def test_wrong_overrides_fail_in_hydra(override, message):
    with pytest.raises((HydraException, OmegaConfBaseException)) as info:
        compose_train([override])
    text = str(info.value) + str(info.value.__cause__ or "")
    assert message in text


def test_keys_appended_with_plus_are_rejected_too():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['algo.no_such_key'\]"):
        to_train_config(compose_train(["+algo.no_such_key=1"]))


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("serving.max_num_seqs=0", "serving.max_num_seqs=0: must be an integer >= 1"),
        ("serving.lookahead=-1", "serving.lookahead=-1: must be an integer >= 1"),
        ("serving.block_size=0", "serving.block_size=0: must be an integer >= 1"),
        ("serving.max_model_len=-8", "serving.max_model_len=-8: must be an integer >= 0"),
        (
            "serving.activation_reserve_gib=-1",
            "serving.activation_reserve_gib=-1.0: must be a finite number >= 0",
        ),
        ("slo.tpot_multiplier=0", "slo.tpot_multiplier=0.0: must be a positive finite number"),
        ("slo.ttft_base_s=inf", "slo.ttft_base_s=inf: must be a positive finite number"),
        ("slo.ttft_factor=nan", "slo.ttft_factor=nan: must be a positive finite number"),
        ("algo.n_envs=0", "algo.n_envs=0: must be an integer >= 1"),
        ("algo.n_steps=0", "algo.n_steps=0: must be an integer >= 1"),
        ("algo.batch_size=-64", "algo.batch_size=-64: must be an integer >= 1"),
        ("algo.total_timesteps=-1", "algo.total_timesteps=-1: must be an integer >= 0 (0: imitation only)"),
        ("algo.bc_steps=-1", "algo.bc_steps=-1: must be an integer >= 0"),
        ("eval.seeds=[]", "eval.seeds=[]: must be a non-empty list"),
        (
            "env.load_scale=[3.0,1.0]",
            "env.load_scale=[3.0, 1.0]: must be [scale] or [low, high] with 0 < low",
        ),
        (
            "+env.workload_loads.azure_conv=[0.0,2.0]",
            "env.workload_loads={'azure_conv': [0.0, 2.0]}: must be a map of workload name to [scale] or",
        ),
        (
            "algo.bc_action=[5]",
            "algo.bc_action=[5]: must be a [budget level 0..8 (window_best: 9 = none), rule 0..3] pair",
        ),
        (
            "algo.bc_action=[10,0]",
            "algo.bc_action=[10, 0]: must be a [budget level 0..8 (window_best: 9 = none), rule 0..3] pair",
        ),
        ("eval.baseline=../../tmp/x", "eval.baseline='../../tmp/x': must be a registered policy name ("),
        (
            "algo.bc_policies=[fcfs,/tmp/x]",
            "algo.bc_policies=['fcfs', '/tmp/x']: must be a list of registered",
        ),
    ],
)
def test_a_value_out_of_range_is_named_in_one_line(override, line):
    with pytest.raises(ConfigError) as info:
        to_train_config(compose_train([override]))
    assert str(info.value).startswith(line) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("algo.n_envs=0", "train.py: error: algo.n_envs=0: must be an integer >= 1"),
        ("+unknown=1", "train.py: error: unknown config key(s) ['unknown']"),
        ("algo.n_envs=two", "train.py: error: Error merging override algo.n_envs=two: Value 'two'"),
    ],
)
def test_a_bad_override_stops_train_py_in_one_line_before_the_run_folder(tmp_path, override, line):
    run_dir = tmp_path / "run"
    out = train(override, f"hydra.run.dir={run_dir}")
    assert out.returncode != 0 and out.stderr.strip().startswith(line), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not run_dir.exists()


def test_wrong_override_stops_train_py_before_anything_runs(tmp_path):
    run_dir = tmp_path / "run"
    out = train("algo.no_such_key=1", f"hydra.run.dir={run_dir}")
    assert out.returncode != 0
    assert "Could not override 'algo.no_such_key'" in out.stderr
    assert not run_dir.exists()


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _obs_stats(checkpoint):
    """The observation statistics of a checkpoint (safetensors, never a pickle)."""
    return read_checkpoint(checkpoint, "maskable_ppo").norm


def _learning_rates(run_dir) -> dict[int, list[float]]:
    acc = EventAccumulator(str(run_dir / "tb")).Reload()
    out: dict[int, list[float]] = {}
    for event in acc.Scalars("train/learning_rate"):
        out.setdefault(event.step, []).append(event.value)
    return out


@pytest.mark.slow
def test_tiny_run_then_resume_to_a_larger_total(tmp_path):
    run_dir = tmp_path / "run"
    first = train(*TINY, f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = _last_json(first.stdout)
    assert summary["timesteps"] == 256 and summary["run_dir"] == str(run_dir)
    for key in ("best_val_goodput_rps", "sarathi_512_val_goodput_rps"):
        assert summary[key] >= 0
    for name in ("config.yaml", "env_spec.json", "evaluations.jsonl", "summary.json", "best/checkpoint.json"):
        assert (run_dir / name).is_file(), name
    assert not (run_dir / "wandb").exists(), "logger.mode=disabled must write no W&B files"
    first_ckpt = run_dir / "checkpoints" / f"step_{256:012d}"
    stats_1 = _obs_stats(first_ckpt)
    policy = load_policy(run_dir / "export")
    assert policy.spec["timesteps"] <= 256 and policy.spec["config_hash"] == summary["config_hash"]

    changed = plain(compose_train([*TINY, "algo.learning_rate=0.1"]))
    with pytest.raises(SystemExit, match=r"config changed: algo.learning_rate: 0.0003 -> 0.1"):
        prepare_run_dir(run_dir, changed, resume=True)

    second = train(*TINY, "algo.total_timesteps=512", f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = _last_json(second.stdout)
    assert resumed["timesteps"] == 512 and resumed["resumed_from_timesteps"] == 256
    assert resumed["config_hash"] == summary["config_hash"]  # total_timesteps is not part of the identity
    ckpt = run_dir / "checkpoints" / f"step_{512:012d}"
    assert read_checkpoint(ckpt, "maskable_ppo").num_timesteps == 512
    assert not list(run_dir.rglob("*.pkl")) and not list(run_dir.rglob("*.zip")), "no pickle is ever written"
    # normalisation statistics continue: 256 more steps plus one reset observation per env
    stats_2 = _obs_stats(ckpt)
    assert stats_2.obs_count == pytest.approx(stats_1.obs_count + 256 + 2)
    # the linear LR schedule continues over the new total (1 - 384/512 after the first resumed rollout),
    # it does not restart (which would give 1 - 128/256)
    lr0 = 3e-4
    resumed_rates = [v for step, vs in _learning_rates(run_dir).items() if step > 256 for v in vs]
    assert any(v == pytest.approx(lr0 * 0.25, rel=1e-5) for v in resumed_rates)
    assert not any(v == pytest.approx(lr0 * 0.5, rel=1e-5) for v in resumed_rates)
    history = [json.loads(line) for line in (run_dir / "evaluations.jsonl").read_text().splitlines()]
    assert [row["timesteps"] for row in history] == [256, 512]
    for name in ("policy.safetensors", "policy.json", "policy.pt2"):
        assert (run_dir / "export" / name).stat().st_size > 0


def test_evaluation_uses_fixed_val_windows_only():
    from envs.serving.workload import Workload
    from policies.training import ValWindows, serving_setup

    cfg = to_train_config(compose_train(["+experiment=smoke", "eval.seeds=[0,1]"]))
    workload = Workload(cfg.workload)
    windows = ValWindows(cfg, workload, serving_setup(cfg))
    for seed, trace in zip(cfg.eval.seeds, windows.traces, strict=True):
        val = workload.window("val", seed, cfg.eval.load_scale, cfg.eval.window_s)
        test = workload.window("test", seed, cfg.eval.load_scale, cfg.eval.window_s)
        assert trace.arrival_s.tolist() == val.arrival_s.tolist()
        assert trace.prompt_len.tolist() != test.prompt_len.tolist()


@pytest.mark.slow
def test_behaviour_cloning_warm_start_with_a_heuristic_teacher(tmp_path):
    """train.py with the shipped recipe's warm start, tiny: clone, evaluate at step 0, then PPO."""
    run_dir = tmp_path / "bc"
    bc = ["env.id=chunkgym/ChunkedPrefill-v1", "algo.bc_teacher=window_best", "algo.bc_action=[7,0]"]
    bc += ["algo.bc_policies=[adaptive_srpf]", "algo.bc_steps=256", "algo.bc_epochs=2"]
    proc = train(*TINY, *bc, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "behaviour cloning (window_best) on 256 samples" in (run_dir / "train.log").read_text()
    history = [json.loads(line) for line in (run_dir / "evaluations.jsonl").read_text().splitlines()]
    assert history[0]["timesteps"] == 0, "the cloned policy is evaluated before PPO starts"
    assert _last_json(proc.stdout)["timesteps"] == 256

    bad = train(
        *TINY,
        *bc[:-3],
        "algo.bc_policies=[no_such_policy]",
        "algo.bc_steps=64",
        f"hydra.run.dir={tmp_path / 'x'}",
    )
    assert bad.returncode != 0 and "no_such_policy" in bad.stderr
