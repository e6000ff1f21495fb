"""Building blocks of train.py: envs, models, val evaluation, callbacks, checkpoints, run folder.

Checkpoints (``checkpoints/step_<N>/``, ``best/``) are in the pickle-free format of
:mod:`policies.checkpoint`; resuming and exporting read only that format, never SB3's
pickled ``model.zip``/``vecnormalize.pkl``.

A run folder may have been received (resumed, exported): every path derived from it stays inside
it and is read as a regular file within a budget (:mod:`chunkgym.received`), a write never follows
a link planted there, and ``checkpoint.keep`` deletes only real ``step_<N>`` folders whose
manifest says step N; the newest checkpoint is the one of the highest such N.

Evaluation runs the policy exactly as it will be shipped: the current SB3 weights and
VecNormalize statistics are converted to :class:`~policies.exported.PolicyNet` and
served through :class:`~policies.exported.ExportedPolicy` by the simulator on fixed
windows of the workload's **val** split (the test split belongs to the leaderboard).
The goodput of a run is the mean of the windows' ``goodput_rps``
(:func:`envs.serving.metrics.request_summary`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import gymnasium as gym
import numpy as np
import yaml
from sb3_contrib import MaskablePPO
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.utils import LinearSchedule
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv, VecNormalize
from torch import nn

from baselines.routers import make_router
from chunkgym.cli import InputExit
from chunkgym.io import append_line, atomic_write_text
from chunkgym.received import ReceivedFileError, load_yaml, parse_json, read_text, write_target
from envs import ENV_ID_V1
from envs.chunked_prefill import version_of
from envs.disaggregated_prefill import DECODE_POLICY
from envs.features import FEATURES_V6
from envs.serving.loop import SimResult
from envs.serving.metrics import SLOSpec, load_slo
from envs.serving.scheduling import Policy
from envs.serving.setup import ServingSetup
from envs.serving.tenancy import class_weights
from envs.serving.workload import Workload
from envs.serving.workloads.trace import Trace
from policies import registry
from policies.checkpoint import (
    CheckpointError,
    NormStats,
    is_checkpoint,
    read_checkpoint,
    read_manifest,
    restore,
    restore_policy,
    write_checkpoint,
)
from policies.config import Activation, AlgoName, Schedule, TrainConfig, VecEnvKind
from policies.export import in_memory_policy, policy_net
from policies.exported import PolicyNet, env_contract

log = logging.getLogger(__name__)

ALGOS: dict[AlgoName, type[PPO] | type[MaskablePPO]] = {AlgoName.maskable_ppo: MaskablePPO, AlgoName.ppo: PPO}
ACTIVATION_FNS: dict[Activation, type[nn.Module]] = {Activation.tanh: nn.Tanh, Activation.relu: nn.ReLU}
EVAL_METRICS = (
    "goodput_rps",
    "weighted_goodput_rps",
    "slo_attainment",
    "ttft_p50_s",
    "ttft_p99_s",
    "tbt_p99_s",
    "tpot_p99_s",
    "max_tbt_s",
)
"""Serving metrics of each val evaluation (means over the windows)."""
CHECKPOINT_DIR = "checkpoints"
BEST_DIR = "best"
LEGACY_FILES = ("model.zip", "vecnormalize.pkl")
"""SB3's pickled checkpoint files, written by earlier versions and never loaded (SECURITY.md)."""
HISTORY_FILE = "evaluations.jsonl"
MAX_HISTORY_BYTES = 64 << 20  # evaluations.jsonl: ~300 bytes a row, 200,000 evaluations
CONFIG_FILE = "config.yaml"
STEP_NAME = re.compile(r"step_(\d{1,18})")  # checkpoints/step_<N>: what save_checkpoint names them
# Keys that may change when a run is resumed; every other key must match the run folder's config.
RESUMABLE_CHANGES = ("algo.total_timesteps", "logger", "checkpoint", "eval.every_steps", "resume", "progress")


# ---- serving setup and envs ----------------------------------------------------------------
def serving_setup(cfg: TrainConfig, slo: SLOSpec | None = None) -> ServingSetup:
    """The serving setup of the run, under ``slo`` (default: the run's ``slo`` group)."""
    return ServingSetup.from_specs(
        cfg.model, cfg.hardware, cfg.env.tp, slo or cfg.slo, cfg.env.cost_model, cfg.serving
    )


def training_slos(cfg: TrainConfig) -> list[SLOSpec]:
    """The SLOs episodes and val windows run under: the ``slo`` group, then ``env.slos``."""
    return [cfg.slo, *(load_slo(name) for name in cfg.env.slos)]


def env_kwargs(cfg: TrainConfig, workload: Workload, start_steps: int = 0) -> dict[str, Any]:
    """Arguments of the ``env.id`` env for training episodes (train split).

    v1 and newer draw each episode's workload from ``workload`` plus ``env.workloads``; with
    ``env.common_inputs`` every env replays the same inputs per episode index, from a
    seed that moves on when a run resumes at ``start_steps``.  v7 serves the run's ``fleet``.
    """
    e = cfg.env
    version = version_of(e.id)  # fails early, naming the registered envs, on an unknown id
    inputs: dict[str, Any]
    if version.number >= 1:
        extra = [Workload.from_name(name, cfg.data_root) for name in e.workloads]
        inputs = {
            "workloads": [workload, *extra],
            "input_seed": cfg.seed + start_steps if e.common_inputs else None,
        }
    elif e.workloads or e.common_inputs:
        raise ValueError(f"env.workloads and env.common_inputs need env.id={ENV_ID_V1} or newer, not {e.id}")
    else:
        inputs = {"workload": workload}
    return {
        **inputs,
        "split": "train",
        "model": cfg.model,
        "hardware": cfg.hardware,
        "tp": cfg.env.tp,
        "slo": cfg.slo,
        "cost_model": cfg.env.cost_model,
        "load_scale": tuple(cfg.env.load_scale),
        "workload_loads": {name: tuple(load) for name, load in cfg.env.workload_loads.items()},
        "window_s": cfg.env.window_s,
        "max_steps": cfg.env.max_steps,
        "reward_scale": cfg.env.reward_scale,
        "serving": dataclasses.asdict(cfg.serving),
        **({"fleet": cfg.fleet} if version.disaggregated else {}),  # v7: whose prefill pool it plans
    }


def make_env(env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    """One training env; Monitor owns ``info["episode"]``, the env's metrics are in ``info["serving"]``."""
    return Monitor(gym.make(env_id, **kwargs))


def make_vec_env(cfg: TrainConfig, workload: Workload, start_steps: int = 0) -> VecEnv:
    """``algo.n_envs`` training envs in one process (dummy) or one process each (subproc)."""
    kwargs = env_kwargs(cfg, workload, start_steps)
    slos = training_slos(cfg)  # env i trains under slos[i % len(slos)]
    fns: list[Callable[[], gym.Env]] = [
        functools.partial(make_env, cfg.env.id, {**kwargs, "slo": slos[i % len(slos)]})
        for i in range(cfg.algo.n_envs)
    ]
    return DummyVecEnv(fns) if cfg.algo.vec_env is VecEnvKind.dummy else SubprocVecEnv(fns)


def normalised(venv: VecEnv, cfg: TrainConfig) -> VecNormalize:
    """Observation (and optionally reward) normalisation; a resumed run restores its statistics."""
    a = cfg.algo
    return VecNormalize(
        venv, norm_obs=True, norm_reward=a.normalize_reward, clip_obs=a.clip_obs, gamma=a.gamma
    )


# ---- model -------------------------------------------------------------------------------
def new_model(cfg: TrainConfig, venv: VecNormalize) -> OnPolicyAlgorithm:
    a = cfg.algo
    lr = a.learning_rate if a.lr_schedule is Schedule.constant else LinearSchedule(a.learning_rate, 0.0, 1.0)
    return ALGOS[a.name](
        "MlpPolicy",
        venv,
        learning_rate=lr,
        n_steps=a.n_steps,
        batch_size=a.batch_size,
        n_epochs=a.n_epochs,
        gamma=a.gamma,
        gae_lambda=a.gae_lambda,
        clip_range=a.clip_range,
        ent_coef=a.ent_coef,
        vf_coef=a.vf_coef,
        max_grad_norm=a.max_grad_norm,
        target_kl=a.target_kl,
        policy_kwargs={
            "net_arch": {"pi": list(a.net_arch), "vf": list(a.net_arch)},
            "activation_fn": ACTIVATION_FNS[a.activation],
        },
        seed=cfg.seed,
        device="cpu",
        verbose=0,
    )


def load_model(cfg: TrainConfig, checkpoint: Path, venv: VecNormalize) -> OnPolicyAlgorithm:
    """The run's model continued from ``checkpoint``: built from the config as a new run would be,
    then its parameters, optimizer state, counters and normalisation restored; envs reseeded past it."""
    model = new_model(cfg, venv)
    restore(model, read_checkpoint(checkpoint, cfg.algo.name.value, checkpoint.parent))
    model.set_random_seed(cfg.seed + model.num_timesteps)
    return model


def is_masked(cfg: TrainConfig) -> bool:
    return cfg.algo.name is AlgoName.maskable_ppo


def best_policy_net(cfg: TrainConfig, run_dir: Path, model: OnPolicyAlgorithm) -> PolicyNet:
    """The best val policy of the run (``run_dir/best``), loaded into a new policy shaped like ``model``'s."""
    best = read_checkpoint(run_dir / BEST_DIR, cfg.algo.name.value, run_dir)
    policy = cast(  # PPO's MlpPolicy
        ActorCriticPolicy,
        model.policy_class(
            model.observation_space, model.action_space, model.lr_schedule, **model.policy_kwargs
        ),
    )
    restore_policy(policy, best)
    return policy_net(policy, best.norm, is_masked(cfg))


# ---- evaluation on val windows --------------------------------------------------------------
class ValWindows:
    """Fixed windows of the val split (one per seed), the same for every evaluation of a run, each
    served under ``setup`` and under the run's ``env.slos`` too."""

    def __init__(self, cfg: TrainConfig, workload: Workload, setup: ServingSetup) -> None:
        e = cfg.eval
        if e.select_by not in EVAL_METRICS:
            raise ValueError(f"eval.select_by must be one of {EVAL_METRICS}, got {e.select_by!r}")
        self.setups = [setup, *(serving_setup(cfg, slo) for slo in training_slos(cfg)[1:])]
        self.fleet = cfg.fleet if version_of(cfg.env.id).disaggregated else None  # v7: on its prefill pool
        self.traces: list[Trace] = []
        for w in [workload, *(Workload.from_name(name, cfg.data_root) for name in e.workloads)]:
            for seed in e.seeds:
                trace = w.window("val", seed, e.load_scale, e.window_s)
                if not len(trace):
                    raise ValueError(
                        f"val window of {w.spec.name!r} for eval seed {seed} is empty; pick other eval.seeds"
                    )
                self.traces.append(trace)

    def evaluate(self, make_policy: Callable[[], Policy]) -> dict[str, float]:
        """Mean over the windows of each of :data:`EVAL_METRICS` (NaNs skipped)."""
        runs = []
        for s in self.setups:
            for t in self.traces:
                result = self._run(s, t, make_policy)
                good = class_weights(t)[result.outcomes.good].sum()
                runs.append({**result.metrics, "weighted_goodput_rps": float(good) / t.span_s})
        out = {}
        for key in EVAL_METRICS:
            values = [r[key] for r in runs if not math.isnan(r[key])]
            out[key] = float(np.mean(values)) if values else math.nan
        return out

    def _run(self, setup: ServingSetup, trace: Trace, make_policy: Callable[[], Policy]) -> SimResult:
        """``trace`` served by one server of ``setup`` with ``make_policy()``, or (v7) by the run's
        disaggregated fleet with it on every prefill server and the env's decode policy on the rest."""
        spec = self.fleet
        if spec is None:
            return setup.simulator(trace).run(make_policy())
        fleet = setup.fleet_for(
            trace,
            spec,
            make_policy,
            make_router(spec.router),
            make_router(spec.decode_router),
            make_decode_policy=lambda: registry.make_policy(DECODE_POLICY),
        )
        return fleet.run()


class Evaluator:
    """Evaluates the current policy on the val windows; keeps the best in ``run_dir/best``.

    A run resumed from the checkpoint at step ``resumed_from`` first drops the evaluation rows
    newer than it (a killed run may have evaluated past its last checkpoint), and the best
    policy too if it is one of those: :attr:`best` is then None until the next evaluation.
    """

    def __init__(
        self,
        windows: ValWindows,
        run_dir: Path,
        env_id: str,
        algo: str,
        masked: bool,
        select_by: str,
        resumed_from: int | None = None,
    ) -> None:
        self.windows = windows
        self.select_by = select_by
        self.run_dir = run_dir
        self.env_id = env_id
        self.algo = algo
        self.masked = masked
        self.history = run_dir / HISTORY_FILE
        self.best: dict[str, Any] | None = None
        self.last_timesteps = -1
        if resumed_from is not None:
            self._continue(resumed_from)

    def _continue(self, resumed_from: int) -> None:
        text = read_text(self.history, MAX_HISTORY_BYTES, self.run_dir) if _exists(self.history) else ""
        complete = text[: text.rfind("\n") + 1]  # a run killed mid-append leaves a partial last line
        lines = enumerate(complete.splitlines(), 1)
        rows = [_history_row(line, self.history, n, self.select_by) for n, line in lines if line.strip()]
        best_dir = self.run_dir / BEST_DIR
        write_target(best_dir, self.run_dir)  # a link there is refused, never followed nor deleted
        best_step = (
            read_checkpoint(best_dir, self.algo, self.run_dir).num_timesteps
            if is_checkpoint(best_dir)
            else None
        )
        kept = [r for r in rows if r["timesteps"] <= resumed_from]
        matching = [r for r in kept if r["timesteps"] == best_step]
        if matching:
            self.best = matching[-1]
        else:  # the best policy is newer than the checkpoint (or gone): the next evaluation starts over
            shutil.rmtree(best_dir, ignore_errors=True)
            kept = [r for r in kept if r["timesteps"] < resumed_from]  # re-evaluated, identically
        if len(kept) < len(rows) or len(complete) < len(text):
            log.warning(
                "resuming from step %d: dropped %d evaluation row(s) newer than the checkpoint%s",
                resumed_from,
                len(rows) - len(kept),
                "" if matching else ", and the best policy (newer too)",
            )
            atomic_write_text(self.history, "".join(json.dumps(r) + "\n" for r in kept), self.run_dir)
        self.last_timesteps = kept[-1]["timesteps"] if kept else -1

    def __call__(self, model: OnPolicyAlgorithm) -> dict[str, Any]:
        vecnorm = model.get_vec_normalize_env()
        assert vecnorm is not None, "chunkgym's models always train behind VecNormalize (normalised())"
        net = policy_net(model.policy, NormStats.of(vecnorm), self.masked)
        policy = in_memory_policy(net, self.env_id)
        row: dict[str, Any] = {"timesteps": int(model.num_timesteps), **self.windows.evaluate(lambda: policy)}
        append_line(self.history, json.dumps(row), self.run_dir)
        self.last_timesteps = row["timesteps"]
        key = self.select_by
        improved = self.best is None or row[key] > self.best[key]
        if improved:
            write_checkpoint(model, self.run_dir / BEST_DIR, self.algo, self.run_dir)
            self.best = row
        assert self.best is not None, "set above at the first evaluation"
        for key in EVAL_METRICS:
            model.logger.record(f"eval/{key}", row[key])
        model.logger.record("eval/best_goodput_rps", self.best["goodput_rps"])
        model.logger.dump(step=model.num_timesteps)
        log.info(
            "step %d: val goodput %.3f rps, SLO attainment %.3f%s",
            row["timesteps"],
            row["goodput_rps"],
            row["slo_attainment"],
            " (best so far)" if improved else "",
        )
        return row


# ---- callbacks -----------------------------------------------------------------------------
class Every(BaseCallback):
    """Calls ``fn(model)`` each time the step counter passes a multiple of ``every``.

    It fires at the start of a rollout, i.e. right after a PPO update, so the model
    it sees (and a checkpoint it writes) has trained on every step it has counted.
    SB3's CheckpointCallback fires mid-rollout, whose collected steps a resume would lose.
    """

    def __init__(self, every: int, fn: Callable[[OnPolicyAlgorithm], Any]) -> None:
        super().__init__()
        self.every = max(1, int(every))
        self.fn = fn
        self.next = 0

    def _init_callback(self) -> None:
        self.next = (self.model.num_timesteps // self.every + 1) * self.every

    def _on_rollout_start(self) -> None:
        if self.model.num_timesteps >= self.next:
            self.fn(cast(OnPolicyAlgorithm, self.model))  # what fn was given for: PPO or MaskablePPO
            self.next = (self.model.num_timesteps // self.every + 1) * self.every

    def _on_step(self) -> bool:
        return True


class CheckpointEvery(Every):
    """Writes ``checkpoints/step_<N>/`` in the pickle-free format every ``every`` steps, keeping ``keep``."""

    def __init__(self, every: int, run_dir: Path, keep: int, algo: str) -> None:
        super().__init__(every, lambda model: save_checkpoint(model, run_dir, keep, algo))


class ServingStats(BaseCallback):
    """Logs the mean goodput and SLO attainment of the training episodes finished in each rollout."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    def _on_step(self) -> bool:
        for info in self.locals["infos"]:
            if "serving" in info:
                self.rows.append(info["serving"])
        return True

    def _on_rollout_end(self) -> None:
        if self.rows:
            for key in ("goodput_rps", "slo_attainment"):
                self.logger.record(f"rollout/{key}", float(np.mean([r[key] for r in self.rows])))
            self.rows.clear()


# ---- checkpoints and run folder -------------------------------------------------------------
def _exists(path: Path) -> bool:
    """``path`` is there (a dangling link too: it is refused where it is read, not taken as absent)."""
    return path.exists() or path.is_symlink()


def _history_row(line: str, path: Path, number: int, select_by: str) -> dict[str, Any]:
    """One row of evaluations.jsonl, checked: an object whose ``timesteps`` is an integer >= 0 and
    whose metrics (:data:`EVAL_METRICS`; ``select_by`` must be there) are numbers."""
    where = f"{path} line {number}"
    row = parse_json(line, where)
    if not isinstance(row, dict):
        raise ReceivedFileError(f"{where}: expected an object, got {type(row).__name__}")
    steps = row.get("timesteps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ReceivedFileError(f"{where}: field 'timesteps' must be an integer >= 0, got {steps!r}")
    for key in EVAL_METRICS:
        value = row.get(key)
        if (key in row or key == select_by) and (
            not isinstance(value, int | float) or isinstance(value, bool)
        ):
            raise ReceivedFileError(f"{where}: field {key!r} must be a number, got {value!r}")
    return row


def save_checkpoint(model: OnPolicyAlgorithm, run_dir: Path, keep: int, algo: str) -> Path:
    """``checkpoints/step_<N>/`` (:mod:`policies.checkpoint`); older ones beyond ``keep`` removed
    (only the run's own: :func:`checkpoints`)."""
    root = _checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"step_{model.num_timesteps:012d}"
    write_checkpoint(model, path, algo, run_dir)
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)  # a real folder inside checkpoints/: rmtree follows no link inside it
    return path


def _checkpoint_root(run_dir: Path) -> Path:
    """``run_dir/checkpoints``: inside the run folder and not a link (a link would send writes and
    deletions to another run's folder)."""
    root = write_target(run_dir / CHECKPOINT_DIR, run_dir)
    if root.exists() and not root.is_dir():
        raise ReceivedFileError(f"{root}: is not a folder")
    return root


def checkpoint_steps(checkpoint: Path) -> int:
    """The step count a checkpoint folder (``step_<N>``) was saved at (its manifest agrees: :func:`checkpoints`)."""
    match = STEP_NAME.fullmatch(checkpoint.name)
    if match is None:
        raise CheckpointError(checkpoint, "not a checkpoint folder name (step_<N>, N a step count)")
    return int(match.group(1))


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first by step.

    Each is a real folder ``checkpoints/step_<N>`` whose manifest says step N; unfinished ones
    (``.tmp``, or no manifest yet) are skipped; a link, or a ``step_`` name that is no step count
    (``step_-5``), is refused with one line.
    """
    root = _checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in os.scandir(root):
        path = Path(entry.path)
        if not entry.name.startswith("step_") or entry.name.endswith(".tmp"):
            continue
        if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            raise CheckpointError(path, "is a link or a file; a checkpoint is a folder inside the run folder")
        step = checkpoint_steps(path)
        if not is_checkpoint(path):
            continue
        saved = read_manifest(path)["num_timesteps"]
        if saved != step:
            raise CheckpointError(
                path / "checkpoint.json", f"field 'num_timesteps' is {saved}, the folder's name says {step}"
            )
        found.append((step, path))
    return [path for _, path in sorted(found)]


def legacy_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint files of SB3's pickle format in ``run_dir`` (written before the safetensors format);
    the walk follows no link out of the run folder."""
    found = []
    for parent, _, files in os.walk(run_dir):  # followlinks=False
        if Path(parent) != run_dir:
            found += [Path(parent) / name for name in files if name in LEGACY_FILES]
    return sorted(found)


def prepare_run_dir(run_dir: Path, config: dict[str, Any], resume: bool) -> list[Path]:
    """The run folder's checkpoints (to resume from) after checking that ``config`` may continue them;
    then writes ``config`` as the folder's ``config.yaml``."""
    legacy = legacy_checkpoints(run_dir)
    if legacy:
        raise InputExit(
            f"{run_dir} holds checkpoints in SB3's pickle format ({legacy[0]}), which this version never "
            "loads (loading a pickle can run code, SECURITY.md); start a new run in another hydra.run.dir"
        )
    found = checkpoints(run_dir)
    saved = run_dir / CONFIG_FILE
    if found and not resume:
        raise InputExit(f"{run_dir} already holds checkpoints; pass resume=true or another hydra.run.dir")
    if found:
        old = load_yaml(saved, run_dir)  # plain data: no aliases, no interpolation resolved
        if not isinstance(old, dict):
            raise ReceivedFileError(f"{saved}: expected a mapping of config keys, got {type(old).__name__}")
        changed = config_differences(identity(old), identity(config))
        if changed:
            raise InputExit(f"cannot resume {run_dir}: config changed: {'; '.join(changed)}")
    atomic_write_text(saved, yaml.safe_dump(config, sort_keys=False), run_dir)
    return found


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the keys a resumed run may change: what the config hash covers.

    A run folder's config.yaml may hold any YAML: values JSON lacks (dates) become strings, and a
    key's parent that is no mapping is left alone, so that the comparison names the difference.
    """
    out = json.loads(json.dumps(config, default=str))
    for dotted in RESUMABLE_CHANGES:
        *parents, last = dotted.split(".")
        node = out
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    return out


def config_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def env_spec(cfg: TrainConfig, setup: ServingSetup) -> dict[str, Any]:
    """What the policy was trained on: env id and version, spaces, reward, serving setup, episodes."""
    slo = setup.slo
    contract = env_contract(cfg.env.id)
    described = dict(FEATURES_V6)  # each version's features extend the one before
    return {
        "env_id": cfg.env.id,
        "env_version": contract["env_version"],
        "observation": {
            "shape": [len(contract["feature_names"])],
            "low": -1.0,
            "high": 1.0,
            "feature_set": contract["feature_set"],
            "features": [{"name": n, "description": described.get(n, "")} for n in contract["feature_names"]],
        },
        "action": {k: contract[k] for k in ("nvec", *version_of(cfg.env.id).actions.describe())},
        "reward": "+1 per request meeting its SLO, -1 per request missing it, times reward_scale",
        "reward_scale": cfg.env.reward_scale,
        "setup": {
            "model": cfg.model.name,
            "hardware": cfg.hardware.name,
            "tp": cfg.env.tp,
            "cost_model": cfg.env.cost_model,
            "cost_model_description": str(
                getattr(setup.cost_model, "description", type(setup.cost_model).__name__)
            ),
            "slo": dataclasses.asdict(slo),
            "serving": dataclasses.asdict(cfg.serving),
        },
        "train_episodes": {
            "workloads": [cfg.workload.name, *cfg.env.workloads],
            "common_inputs": cfg.env.common_inputs,
            "split": "train",
            "load_scale": list(cfg.env.load_scale),
            "workload_loads": {name: list(load) for name, load in cfg.env.workload_loads.items()},
            "window_s": cfg.env.window_s if cfg.env.window_s is not None else cfg.workload.window_s,
            "slos": [slo.name for slo in training_slos(cfg)],
        },
        "val_windows": {
            "split": "val",
            "workloads": [cfg.workload.name, *cfg.eval.workloads],
            "select_by": cfg.eval.select_by,
            "slos": [slo.name for slo in training_slos(cfg)],
            "seeds": list(cfg.eval.seeds),
            "load_scale": cfg.eval.load_scale,
            "window_s": cfg.eval.window_s if cfg.eval.window_s is not None else cfg.workload.window_s,
        },
    }
