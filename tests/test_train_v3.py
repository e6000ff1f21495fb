"""train.py's additions for ChunkedPrefill-v3: training under several SLOs, DAgger rounds, the recipe."""

from __future__ import annotations

import json

import pytest

from baselines import Sarathi
from chunkgym.config import ConfigError
from policies.config import to_train_config
from policies.training import ValWindows, make_vec_env, serving_setup, training_slos
from tests.test_train_cli import TINY, _last_json, compose_train, train

V3 = ["env.id=chunkgym/ChunkedPrefill-v3", "algo.bc_teacher=window_best", "algo.bc_action=[8,0]"]


def test_env_slos_alternate_over_the_envs_and_the_val_windows_run_under_each():
    from envs.serving.workload import Workload

    cfg = to_train_config(compose_train(["+experiment=smoke", "env.slos=[relaxed]", "algo.n_envs=3"]))
    assert [s.name for s in training_slos(cfg)] == ["strict", "relaxed"]
    venv = make_vec_env(cfg, Workload(cfg.workload))
    bounds = [e.unwrapped.setup.slo.tpot_s for e in venv.envs]
    assert bounds[0] == bounds[2] < bounds[1]
    windows = ValWindows(cfg, Workload(cfg.workload), serving_setup(cfg))
    assert [s.slo.name for s in windows.setups] == ["strict", "relaxed"]
    runs: list[str] = []

    class Spy(Sarathi):
        def reset(self, view) -> None:
            runs.append(view.slo.name)

    windows.evaluate(Spy)
    assert runs == ["strict"] * len(windows.traces) + ["relaxed"] * len(windows.traces)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "env.slos=[tight]",
            "env.slos=['tight']: must be a list of conf/slo names (relaxed, strict, tpot_tight, ttft_tight)",
        ),
        ("algo.bc_dagger_rounds=-1", "algo.bc_dagger_rounds=-1: must be an integer >= 0"),
        ("algo.total_timesteps=0", "algo.total_timesteps=0 (imitation only) needs algo.bc_steps > 0"),
    ],
)
def test_bad_v3_training_values_are_named_in_one_line(override, line):
    with pytest.raises(ConfigError) as info:
        to_train_config(compose_train([override]))
    assert str(info.value).startswith(line) and "\n" not in str(info.value)


def test_the_learned_recipe_composes_to_v4_with_workload_labels_and_dagger():
    cfg = to_train_config(compose_train(["+experiment=learned"]))
    assert cfg.env.id == "chunkgym/ChunkedPrefill-v4" and cfg.algo.bc_dagger_rounds >= 1
    assert cfg.algo.bc_teacher == "workload_best" and cfg.algo.bc_policies[0] == "adaptive_srpf"
    held_out = {"azure_conv", "sharegpt_poisson", "mooncake_synth"}
    assert not held_out & {cfg.workload.name, *cfg.env.workloads, *cfg.eval.workloads}


@pytest.mark.slow
def test_a_tiny_v3_run_clones_runs_dagger_and_exports_a_v3_policy(tmp_path):
    run_dir = tmp_path / "v3"
    bc = [*V3, "algo.bc_policies=[adaptive_srpf]", "algo.bc_steps=256", "algo.bc_epochs=2"]
    proc = train(*TINY, *bc, "algo.bc_dagger_rounds=1", "env.slos=[relaxed]", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "DAgger round 1:" in log and "refit on 512 samples" in log
    spec = json.loads((run_dir / "export" / "policy.json").read_text())
    assert spec["env_id"] == "chunkgym/ChunkedPrefill-v3" and spec["nvec"] == [17, 8]
    assert _last_json(proc.stdout)["val_windows"]["slos"] == ["strict", "relaxed"]


@pytest.mark.slow
def test_total_timesteps_0_exports_the_imitated_policy_without_rl(tmp_path):
    run_dir = tmp_path / "bc_only"
    bc = [
        *V3,
        "algo.bc_policies=[target_2_slack__shortest_first+skip]",
        "algo.bc_steps=256",
        "algo.bc_epochs=2",
    ]
    proc = train(*TINY, *bc, "algo.total_timesteps=0", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _last_json(proc.stdout)
    assert summary["timesteps"] == 0 and summary["best_val_timesteps"] == 0
    assert (run_dir / "export" / "policy.json").is_file()
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_000000000000"]


def test_a_tiny_v4_run_labels_each_workload_by_capacity_and_exports_a_v4_policy(tmp_path):
    run_dir = tmp_path / "v4"
    bc = [
        "env.id=chunkgym/ChunkedPrefill-v4",
        "algo.bc_teacher=workload_best",
        "algo.bc_action=[9,0]",
        "algo.bc_policies=[adaptive_srpf,target_2_slack__shortest_first+skip]",
        "algo.bc_capacity_seeds=[0]",
        "algo.bc_steps=256",
        "algo.bc_epochs=2",
        "algo.total_timesteps=0",
    ]
    proc = train(*TINY, *bc, "algo.bc_dagger_rounds=1", "env.slos=[relaxed]", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((run_dir / "teacher_labels.json").read_text())
    assert {(r["workload"], r["slo"]) for r in rows} == {
        ("synthetic_azure_conv", s) for s in ("strict", "relaxed")
    }
    for row in rows:  # margin 0: the label is the candidate with the highest capacity
        assert row["capacity"][row["name"]] == max(row["capacity"].values())
    assert "DAgger round 1:" in (run_dir / "train.log").read_text()
    spec = json.loads((run_dir / "export" / "policy.json").read_text())
    assert spec["env_id"] == "chunkgym/ChunkedPrefill-v4" and len(spec["feature_names"]) == 33
