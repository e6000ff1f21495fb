"""Train a scheduling policy on ``chunkgym/ChunkedPrefill-v4`` (the default ``env.id``; v0-v3 too).

    python train.py                                   # defaults: conf/train.yaml
    python train.py algo=ppo workload=azure_code seed=1 algo.total_timesteps=200000
    python train.py +experiment=smoke                 # a named recipe from conf/experiment
    python train.py hydra.run.dir=DIR                 # again on DIR: resumes to algo.total_timesteps
    python train.py -m seed=0,1,2 hydra/launcher=local    # a parallel sweep (docs/training.md)

Reads top to bottom: config -> envs -> model -> callbacks -> learn -> export -> summary.
The run folder (``hydra.run.dir``) ends up holding ``config.yaml``, ``env_spec.json``,
``checkpoints/``, ``evaluations.jsonl``, ``best/``, ``export/policy.{safetensors,json,pt2}``
and ``summary.json``; the last stdout line is the summary as one JSON object.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from stable_baselines3.common.callbacks import CallbackList

from chunkgym import REPO_ROOT
from chunkgym.cli import one_line_errors, precheck
from chunkgym.io import atomic_write_text, check_output_folder, lock_for_process
from chunkgym.provenance import config_hash, git_commit
from chunkgym.received import write_target
from chunkgym.registration import ENV_ID_V5
from chunkgym.tracking import TrainingTracker
from envs.serving.workload import TraceError, Workload
from policies import imitation, router_training, training
from policies.config import RULES, TrainConfig, check_fleet, register_configs, run_config, to_train_config
from policies.export import write_export
from policies.registry import make_policy

log = logging.getLogger("train")
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@one_line_errors(TraceError, tool="train.py")  # bad input (config, trace, run folder): one line, exit 2
def main(dcfg: DictConfig) -> None:
    started = time.perf_counter()
    # ---- config and run folder ------------------------------------------------------------
    cfg = to_train_config(dcfg)  # a value out of range: one line naming the key, before any work
    config = run_config(dcfg, cfg)
    hydra_cfg = HydraConfig.get()
    run_dir = check_output_folder(hydra_cfg.runtime.output_dir, "hydra.run.dir")  # -m jobs too
    lock_for_process(run_dir, "train.py")  # one train.py per run folder (precheck took it for a single run)
    torch.set_num_threads(cfg.torch_threads)
    if cfg.env.id == ENV_ID_V5:  # the routing env: a learned router (policies/router_training.py)
        print(json.dumps(router_training.train(cfg, config, run_dir)), flush=True)
        return
    previous = training.prepare_run_dir(run_dir, config, cfg.resume)  # checkpoints to resume from
    chash, commit = config_hash(training.identity(config)), git_commit()
    workload = Workload(cfg.workload, cfg.data_root)
    setup = training.serving_setup(cfg)
    spec = training.env_spec(cfg, setup)
    atomic_write_text(run_dir / "env_spec.json", json.dumps(spec, indent=2) + "\n", run_dir)
    exp = cfg.logger.name or f"{cfg.workload.name}_{cfg.algo.name.value}"
    name = f"{cfg.env.id}__{exp}__{cfg.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    sweep = Path(hydra_cfg.sweep.dir).name if hydra_cfg.mode == RunMode.MULTIRUN else None
    tracker = TrainingTracker(
        cfg.logger,
        run_dir,
        name,
        {**config, "git_commit": commit, "config_hash": chash, "env_spec": spec},
        cfg.logger.group or sweep,
    )

    # ---- envs --------------------------------------------------------------------------------
    first_step = training.checkpoint_steps(previous[-1]) if previous else 0
    venv = training.normalised(training.make_vec_env(cfg, workload, first_step), cfg)

    # ---- model -------------------------------------------------------------------------------
    model = training.load_model(cfg, previous[-1], venv) if previous else training.new_model(cfg, venv)
    model.set_logger(tracker.logger)
    start_steps = model.num_timesteps
    if previous:
        log.info("resuming %s from step %d to %d", run_dir, start_steps, cfg.algo.total_timesteps)
    elif cfg.algo.bc_steps:  # optional warm start: imitate a teacher first
        a = cfg.algo
        level, rule = a.bc_action
        labels = None
        if a.bc_teacher == "workload_best":  # one label per (workload, SLO): capacity searches, once
            table = imitation.workload_best(venv, level, a.bc_policies, a.bc_capacity_seeds, a.bc_margin)
            rows = [{"workload": w, "slo": slo, **row} for (w, slo), row in table.items()]
            atomic_write_text(run_dir / "teacher_labels.json", json.dumps(rows, indent=2) + "\n", run_dir)
            labels = {key: row["action"] for key, row in table.items()}
        teach = functools.partial(  # one teacher rollout; with student=, DAgger's
            imitation.collect,
            venv,
            a.bc_teacher,
            level,
            rule,
            a.bc_steps,
            a.gamma,
            a.bc_policies,
            margin=a.bc_margin,
            period_s=a.bc_period_s,
            horizon_s=a.bc_horizon_s,
            labels=labels,
        )
        data = teach()
        masked = training.is_masked(cfg)
        fit = imitation.clone(model, data, a.bc_epochs, a.batch_size, masked)
        log.info(
            "behaviour cloning (%s) on %d samples: %.1f%% agreement",
            a.bc_teacher,
            fit["samples"],
            100 * fit["agreement"],
        )
        for round_ in range(a.bc_dagger_rounds):  # DAgger: label the states the policy itself reaches
            own = teach(student=model)
            on_policy = imitation.agreement(model, own, masked)
            data = imitation.merge(data, own)
            fit = imitation.clone(model, data, a.bc_epochs, a.batch_size, masked)
            log.info(
                "DAgger round %d: %.1f%% agreement on the policy's own states; refit on %d samples: %.1f%%",
                round_ + 1,
                100 * on_policy,
                fit["samples"],
                100 * fit["agreement"],
            )

    # ---- callbacks: val evaluation (best model kept), checkpoints (progress: SB3's bar) -------
    windows = training.ValWindows(cfg, workload, setup)
    algo, keep = cfg.algo.name.value, cfg.checkpoint.keep
    evaluate = training.Evaluator(
        windows,
        run_dir,
        cfg.env.id,
        algo,
        training.is_masked(cfg),
        cfg.eval.select_by,
        first_step if previous else None,
    )
    callbacks = CallbackList(
        [
            training.ServingStats(),
            training.Every(cfg.eval.every_steps, evaluate),
            training.CheckpointEvery(cfg.checkpoint.every_steps, run_dir, keep, algo),
        ]
    )

    if (cfg.algo.bc_steps and not previous) or (previous and evaluate.best is None):
        evaluate(model)  # the warm-started (or resumed) policy competes for "best" too

    # ---- learn (algo.total_timesteps is the run's total, also when resuming) ------------------
    learn_started = time.perf_counter()
    remaining = cfg.algo.total_timesteps - model.num_timesteps
    if remaining > 0:
        model.learn(
            remaining,
            callback=callbacks,
            reset_num_timesteps=False,
            log_interval=1,
            progress_bar=cfg.progress,
        )
    learn_s = time.perf_counter() - learn_started
    if evaluate.last_timesteps != model.num_timesteps:
        evaluate(model)
    if not previous or model.num_timesteps > start_steps:
        training.save_checkpoint(model, run_dir, keep, algo)

    # ---- export the best policy ---------------------------------------------------------------
    best = evaluate.best
    assert best is not None, "the last evaluation above has set it, if no earlier one did"
    provenance = {
        "algo": cfg.algo.name.value,
        "workload": cfg.workload.name,
        "timesteps": best["timesteps"],
        "val_goodput_rps": best["goodput_rps"],
        "config_hash": chash,
        "git_commit": commit,
    }
    export_dir = write_target(run_dir / "export", run_dir)  # not a link to elsewhere
    write_export(training.best_policy_net(cfg, run_dir, model), cfg.env.id, export_dir, provenance)
    tracker.log_model(export_dir, provenance)
    venv.close()

    # ---- summary: the trained policy beside the baseline on the same val windows -------------
    baseline = windows.evaluate(lambda: make_policy(cfg.eval.baseline))
    summary = {
        "run_dir": str(run_dir),
        "timesteps": int(model.num_timesteps),
        "best_val_goodput_rps": best["goodput_rps"],
        "best_val_timesteps": best["timesteps"],
        "best_val_slo_attainment": best["slo_attainment"],
        f"{cfg.eval.baseline}_val_goodput_rps": baseline["goodput_rps"],
        f"{cfg.eval.baseline}_val_slo_attainment": baseline["slo_attainment"],
        "val_windows": spec["val_windows"],
        "resumed_from_timesteps": start_steps if previous else None,
        "learn_s": round(learn_s, 2),
        "steps_per_s": round((model.num_timesteps - start_steps) / learn_s, 1) if learn_s > 0 else None,
        "wall_s": round(time.perf_counter() - started, 2),
        "export_dir": str(export_dir),
        "config_hash": chash,
        "git_commit": commit,
    }
    atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n", run_dir)
    tracker.close(summary)
    log.info(
        "val goodput (%d windows, load %.2f): trained policy %.3f rps, %s %.3f rps",
        len(windows.traces),
        cfg.eval.load_scale,
        best["goodput_rps"],
        cfg.eval.baseline,
        baseline["goodput_rps"],
    )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    precheck(
        str(REPO_ROOT / "conf"), "train", TrainConfig, RULES, check_fleet
    )  # bad overrides: one line, no run folder
    main()
