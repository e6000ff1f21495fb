"""A Hydra multirun sweep of train.py runs its jobs through the joblib launcher, one run folder each."""

import json

from tests.test_train_cli import TINY, train


def test_two_job_sweep_with_the_joblib_launcher(tmp_path):
    sweep = tmp_path / "sweep"
    out = train(
        "-m", "hydra/launcher=local", "hydra.launcher.n_jobs=2", "seed=0,1", *TINY, f"hydra.sweep.dir={sweep}"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in out.stdout + out.stderr
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name.split("__")[0] for p in jobs] == ["0", "1"]
    seeds = []
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["timesteps"] == 256 and summary["run_dir"] == str(job)
        assert all((job / "export" / f"policy.{ext}").is_file() for ext in ("safetensors", "json", "pt2"))
        seeds.append(json.loads(json.dumps(summary))["config_hash"])
    assert seeds[0] != seeds[1], "the seed is part of each job's config"
