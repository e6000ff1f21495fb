"""A Hydra multirun sweep of train.py runs its jobs through the joblib launcher, one run folder each."""

import json

import pytest
from hydra import compose, initialize_config_dir

from chunkgym import REPO_ROOT
from envs import ENV_ID_V0, ENV_ID_V1
from policies.config import register_configs
from policies.exported import load_policy
from tests.test_train_cli import TINY, train


@pytest.mark.slow
def test_two_job_sweep_with_the_joblib_launcher(tmp_path):
    """Two jobs in parallel, one per env version (so v1 also trains and exports end to end)."""
    sweep = tmp_path / "sweep"
    env_ids = f"env.id={ENV_ID_V0},{ENV_ID_V1}"
    out = train(
        "-m", "hydra/launcher=local", "hydra.launcher.n_jobs=2", env_ids, *TINY, f"hydra.sweep.dir={sweep}"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in out.stdout + out.stderr
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name.split("__")[0] for p in jobs] == ["0", "1"]
    for job, env_id in zip(jobs, (ENV_ID_V0, ENV_ID_V1), strict=True):
        summary = json.loads((job / "summary.json").read_text())
        assert summary["timesteps"] == 256 and summary["run_dir"] == str(job)
        assert all((job / "export" / f"policy.{ext}").is_file() for ext in ("safetensors", "json", "pt2"))
        assert load_policy(job / "export").spec["env_id"] == env_id


@pytest.mark.parametrize(
    ("launcher", "target"),
    [
        ("local", "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"),
        ("slurm", "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"),
    ],
)
def test_shipped_launcher_configs_compose(launcher, target):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train", overrides=[f"hydra/launcher={launcher}", "+experiment=long"], return_hydra_config=True
        )
    assert cfg.hydra.launcher._target_ == target
    assert cfg.algo.total_timesteps == 1_000_000
