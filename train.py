"""Train a token-budget scheduling policy on ``chunkgym/ChunkedPrefill-v0``.

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

import json
import logging
import time
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from stable_baselines3.common.callbacks import CallbackList

from chunkgym.data import exit_on
from chunkgym.provenance import config_hash, git_commit
from envs.serving.workload import TraceError, Workload
from policies import imitation, training
from policies.config import plain, register_configs, to_train_config
from policies.export import write_export
from policies.registry import make_policy
from policies.tracking import close_logger, make_logger

log = logging.getLogger("train")
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@exit_on("train.py", TraceError)  # a missing or bad trace file: one line naming it and the fetch command
def main(dcfg: DictConfig) -> None:
    started = time.perf_counter()
    # ---- config and run folder ------------------------------------------------------------
    cfg = to_train_config(dcfg)
    config = plain(dcfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    torch.set_num_threads(cfg.torch_threads)
    previous = training.prepare_run_dir(run_dir, config, cfg.resume)  # checkpoints to resume from
    chash, commit = config_hash(training.identity(config)), git_commit()
    workload = Workload(cfg.workload, cfg.data_root)
    setup = training.serving_setup(cfg)
    spec = training.env_spec(cfg, setup)
    (run_dir / "env_spec.json").write_text(json.dumps(spec, indent=2) + "\n")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{cfg.workload.name}__{cfg.algo.name.value}__{cfg.seed}__{stamp}"
    logger = make_logger(
        cfg.logger, run_dir, name, {**config, "git_commit": commit, "config_hash": chash, "env_spec": spec}
    )

    # ---- envs --------------------------------------------------------------------------------
    stats = previous[-1] / training.VECNORM_FILE if previous else None
    first_step = training.checkpoint_steps(previous[-1]) if previous else 0
    venv = training.normalised(training.make_vec_env(cfg, workload, first_step), cfg, stats)

    # ---- model -------------------------------------------------------------------------------
    model = training.load_model(cfg, previous[-1], venv) if previous else training.new_model(cfg, venv)
    model.set_logger(logger)
    start_steps = model.num_timesteps
    if previous:
        log.info("resuming %s from step %d to %d", run_dir, start_steps, cfg.algo.total_timesteps)
    elif cfg.algo.bc_steps:  # optional warm start: imitate a teacher first
        a = cfg.algo
        data = imitation.collect(venv, a.bc_teacher, *a.bc_action, a.bc_steps, a.gamma, a.bc_policies)
        fit = imitation.clone(model, data, a.bc_epochs, a.batch_size, training.is_masked(cfg))
        log.info(
            "behaviour cloning (%s) on %d samples: %.1f%% agreement",
            a.bc_teacher,
            fit["samples"],
            100 * fit["agreement"],
        )

    # ---- callbacks: val evaluation (best model kept), checkpoints, progress ------------------
    windows = training.ValWindows(cfg, workload, setup)
    evaluate = training.Evaluator(windows, run_dir, cfg.env.id, training.is_masked(cfg), cfg.eval.select_by)
    keep = cfg.checkpoint.keep
    callbacks = CallbackList(
        [
            training.ProgressBar(cfg.algo.total_timesteps, cfg.progress),
            training.ServingStats(),
            training.Every(cfg.eval.every_steps, evaluate),
            training.Every(cfg.checkpoint.every_steps, lambda m: training.save_checkpoint(m, run_dir, keep)),
        ]
    )

    if cfg.algo.bc_steps and not previous:
        evaluate(model)  # the warm-started policy competes for "best" too

    # ---- learn (algo.total_timesteps is the run's total, also when resuming) ------------------
    learn_started = time.perf_counter()
    remaining = cfg.algo.total_timesteps - model.num_timesteps
    if remaining > 0:
        model.learn(remaining, callback=callbacks, reset_num_timesteps=False, log_interval=1)
    learn_s = time.perf_counter() - learn_started
    if evaluate.last_timesteps != model.num_timesteps:
        evaluate(model)
    if not previous or model.num_timesteps > start_steps:
        training.save_checkpoint(model, run_dir, keep)

    # ---- export the best policy ---------------------------------------------------------------
    best = evaluate.best
    provenance = {
        "algo": cfg.algo.name.value,
        "workload": cfg.workload.name,
        "timesteps": best["timesteps"],
        "val_goodput_rps": best["goodput_rps"],
        "config_hash": chash,
        "git_commit": commit,
    }
    export_dir = run_dir / "export"
    write_export(training.best_policy_net(cfg, run_dir), cfg.env.id, export_dir, provenance)
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
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    close_logger(logger, summary)
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
    main()
