"""Training checkpoints without pickle: safetensors for every tensor, JSON for everything else.

A run folder may come from someone else, and SB3's own formats unpickle (``model.zip`` holds
cloudpickled objects; ``VecNormalize.save`` is a pickle), so resuming or exporting a received
run would run its code. A checkpoint folder here holds:

* ``policy.safetensors``: the SB3 policy's ``state_dict`` (actor, critic, feature extractor);
* ``optimizer.safetensors``: the optimizer's per-parameter state (Adam's moments and steps);
* ``vecnormalize.safetensors``: the observation and return running statistics (float64);
* ``checkpoint.json`` (written last): format and version, algorithm, step and update counters,
  the optimizer's hyperparameter groups, the normalisation settings and the recent episode
  statistics SB3 logs (``ep_info_buffer``, ``ep_success_buffer``).

Restoring fills a freshly built model and VecNormalize (built from the run's config, as a new
run would be), checking every name, shape and dtype first: a folder that does not fit raises
:class:`CheckpointError` naming the file and the problem. No hash is kept: one stored beside
the files it covers protects nothing.

A checkpoint folder lies in a run folder that may have been received: every file is read inside
its folder, as a regular file (no link), within a byte budget (:mod:`chunkgym.received`), the
folder itself must not be a link, a write never follows a link planted where it writes, and the
numbers that continue training (optimizer moments and steps, normalisation statistics and counts)
must be finite and their counts and steps non-negative.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.running_mean_std import RunningMeanStd
from stable_baselines3.common.vec_env import VecNormalize

from chunkgym.received import ReceivedFileError, inside, load_json, read_bytes, write_target

FORMAT = "chunkgym-checkpoint"
FORMAT_VERSION = 1
MANIFEST_FILE = "checkpoint.json"
POLICY_FILE = "policy.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
NORM_FILE = "vecnormalize.safetensors"
MAX_MANIFEST_BYTES = 1 << 20
MAX_TENSOR_BYTES = 1 << 30  # a safetensors file of a checkpoint; chunkgym's policies are a few MB
NORM_SETTINGS = ("norm_obs", "norm_reward", "clip_obs", "clip_reward", "gamma", "epsilon")


class CheckpointError(ReceivedFileError):
    """A checkpoint folder this code cannot restore: names the file and the problem (one line)."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")


@dataclass(frozen=True)
class NormStats:
    """What VecNormalize learns and is configured with: the observation and return statistics."""

    obs_mean: np.ndarray
    obs_var: np.ndarray
    obs_count: float
    ret_mean: np.ndarray
    ret_var: np.ndarray
    ret_count: float
    settings: dict[str, Any]

    @classmethod
    def of(cls, vecnorm: VecNormalize) -> NormStats:
        o, r = cast(RunningMeanStd, vecnorm.obs_rms), vecnorm.ret_rms  # a Box observation: one set of stats
        return cls(
            np.array(o.mean, dtype=np.float64),
            np.array(o.var, dtype=np.float64),
            float(o.count),
            np.array(r.mean, dtype=np.float64),
            np.array(r.var, dtype=np.float64),
            float(r.count),
            {k: getattr(vecnorm, k) for k in NORM_SETTINGS},
        )

    def apply(self, vecnorm: VecNormalize) -> None:
        """Continue ``vecnorm``'s statistics from these (settings must agree: they come from the config)."""
        for key, value in self.settings.items():
            if getattr(vecnorm, key) != value:
                raise ValueError(
                    f"VecNormalize {key}: checkpoint has {value!r}, the config {getattr(vecnorm, key)!r}"
                )
        o, r = cast(RunningMeanStd, vecnorm.obs_rms), vecnorm.ret_rms  # a Box observation: one set of stats
        o.mean, o.var, o.count = self.obs_mean.copy(), self.obs_var.copy(), self.obs_count
        r.mean, r.var, r.count = self.ret_mean.copy(), self.ret_var.copy(), self.ret_count

    def tensors(self) -> dict[str, torch.Tensor]:
        arrays = {
            "obs_mean": self.obs_mean,
            "obs_var": self.obs_var,
            "obs_count": np.float64(self.obs_count),
            "ret_mean": self.ret_mean,
            "ret_var": self.ret_var,
            "ret_count": np.float64(self.ret_count),
        }
        return {k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in arrays.items()}


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder's content, read and checked for form (not yet against a model)."""

    directory: Path
    manifest: dict[str, Any]
    policy: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    norm: NormStats

    @property
    def num_timesteps(self) -> int:
        return int(self.manifest["num_timesteps"])


# ---- writing -----------------------------------------------------------------------------
def write_checkpoint(
    model: OnPolicyAlgorithm, directory: Path, algo: str, folder: Path | None = None
) -> None:
    """``model`` (and its VecNormalize) into ``directory`` (inside the run folder ``folder``; default
    its parent), replacing it as a whole; a link planted at ``directory`` or its temporary twin is refused."""
    folder = directory.parent if folder is None else folder
    directory = write_target(directory, folder)
    tmp = write_target(directory.with_name(directory.name + ".tmp"), folder)
    shutil.rmtree(tmp, ignore_errors=True)  # a real folder: an earlier write that was cut short
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in model.policy.state_dict().items()}, tmp / POLICY_FILE)
    opt = model.policy.optimizer.state_dict()
    save_file(
        {
            f"{pid}.{key}": value.detach().contiguous()
            for pid, state in opt["state"].items()
            for key, value in state.items()
        },
        tmp / OPTIMIZER_FILE,
    )
    vecnorm = model.get_vec_normalize_env()
    assert vecnorm is not None, "chunkgym's models always train behind VecNormalize (training.normalised())"
    norm = NormStats.of(vecnorm)
    save_file(norm.tensors(), tmp / NORM_FILE)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "algo": algo,
        "num_timesteps": int(model.num_timesteps),
        "n_updates": int(model._n_updates),
        "optimizer_param_groups": [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}
            for group in opt["param_groups"]
        ],
        "vecnormalize": {k: (float(v) if isinstance(v, float) else v) for k, v in norm.settings.items()},
        "ep_info_buffer": [{k: float(v) for k, v in info.items()} for info in (model.ep_info_buffer or [])],
        "ep_success_buffer": [float(v) for v in (model.ep_success_buffer or [])],
    }
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(write_target(directory, folder), ignore_errors=True)  # checked again: just before
    tmp.rename(directory)


def is_checkpoint(directory: Path) -> bool:
    """A complete checkpoint folder (its manifest, written last, is there); a link is none."""
    manifest = directory / MANIFEST_FILE
    return not directory.is_symlink() and not manifest.is_symlink() and manifest.is_file()


# ---- reading -----------------------------------------------------------------------------
def read_manifest(directory: Path) -> dict[str, Any]:
    """``directory``'s checkpoint.json, read inside it within :data:`MAX_MANIFEST_BYTES`, of the format."""
    path = directory / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(path, "file not found (not a checkpoint folder, or an unfinished one)")
    manifest = load_json(path, directory, MAX_MANIFEST_BYTES)
    if not isinstance(manifest, dict) or (manifest.get("format"), manifest.get("format_version")) != (
        FORMAT,
        FORMAT_VERSION,
    ):
        got = (
            (manifest.get("format"), manifest.get("format_version"))
            if isinstance(manifest, dict)
            else manifest
        )
        raise CheckpointError(path, f"format is {got!r}; this code reads {FORMAT!r} version {FORMAT_VERSION}")
    for key in ("num_timesteps", "n_updates"):
        value = manifest.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(path, f"field {key!r} must be an integer >= 0, got {value!r}")
    return manifest


def read_checkpoint(directory: Path, algo: str, folder: Path | None = None) -> Checkpoint:
    """The checkpoint in ``directory`` (inside the run folder ``folder``, default its parent; of a
    run of ``algo``), its form checked; no model needed."""
    directory = inside(directory, directory.parent if folder is None else folder)
    if not directory.is_dir():
        raise CheckpointError(directory, "not a checkpoint folder")
    manifest = read_manifest(directory)
    path = directory / MANIFEST_FILE
    if manifest.get("algo") != algo:
        raise CheckpointError(path, f"field 'algo' is {manifest.get('algo')!r}, the run trains {algo!r}")
    if not isinstance(manifest.get("optimizer_param_groups"), list):
        raise CheckpointError(path, "field 'optimizer_param_groups' must be a list")
    settings = manifest.get("vecnormalize")
    if (
        not isinstance(settings, dict)
        or set(settings) != set(NORM_SETTINGS)
        or not all(isinstance(settings[k], bool) for k in NORM_SETTINGS[:2])
        or not all(_finite_number(settings[k]) and settings[k] >= 0 for k in NORM_SETTINGS[2:])
    ):
        raise CheckpointError(
            path,
            f"field 'vecnormalize' must hold {', '.join(NORM_SETTINGS[:2])} (booleans) and "
            f"{', '.join(NORM_SETTINGS[2:])} (numbers >= 0), got {str(settings)[:200]}",
        )
    infos = manifest.get("ep_info_buffer")
    if not isinstance(infos, list) or not all(
        isinstance(i, dict) and all(isinstance(v, int | float) for v in i.values()) for i in infos
    ):
        raise CheckpointError(path, "field 'ep_info_buffer' must be a list of objects of numbers")
    successes = manifest.get("ep_success_buffer")
    if not isinstance(successes, list) or not all(_finite_number(v) for v in successes):
        raise CheckpointError(path, "field 'ep_success_buffer' must be a list of numbers")
    norm = _tensors(directory / NORM_FILE)
    expected = {"obs_mean", "obs_var", "obs_count", "ret_mean", "ret_var", "ret_count"}
    if set(norm) != expected or any(
        t.dtype != torch.float64 or not torch.isfinite(t).all() for t in norm.values()
    ):
        raise CheckpointError(
            directory / NORM_FILE, f"expected finite float64 tensors {sorted(expected)}, got {sorted(norm)}"
        )
    negative = [k for k in ("obs_var", "obs_count", "ret_var", "ret_count") if (norm[k] < 0).any()]
    if negative:
        raise CheckpointError(
            directory / NORM_FILE, f"tensor(s) {negative} hold negative values (variances, counts)"
        )
    stats = NormStats(
        norm["obs_mean"].numpy(),
        norm["obs_var"].numpy(),
        float(norm["obs_count"]),
        norm["ret_mean"].numpy(),
        norm["ret_var"].numpy(),
        float(norm["ret_count"]),
        manifest["vecnormalize"],
    )
    optimizer = _tensors(directory / OPTIMIZER_FILE)
    for name, tensor in optimizer.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(directory / OPTIMIZER_FILE, f"tensor {name!r} holds non-finite values")
        if name.endswith(".step") and (tensor < 0).any():
            raise CheckpointError(directory / OPTIMIZER_FILE, f"tensor {name!r} is a negative step count")
    return Checkpoint(directory, manifest, _tensors(directory / POLICY_FILE), optimizer, stats)


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file in its checkpoint folder: a regular file within :data:`MAX_TENSOR_BYTES`,
    read once (the library checks the header's length and offsets before any tensor)."""
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(path, "file not found")
    data = read_bytes(path, MAX_TENSOR_BYTES, path.parent)
    try:
        return load(data)
    except (SafetensorError, ValueError, OSError) as exc:
        raise CheckpointError(
            path, f"unreadable safetensors file ({' '.join(str(exc).split())[:200]})"
        ) from None


# ---- restoring ---------------------------------------------------------------------------
def restore_policy(policy: torch.nn.Module, ckpt: Checkpoint) -> None:
    """Load the checkpoint's parameters into ``policy`` (same architecture: names, shapes, dtypes)."""
    _check_tensors(ckpt.directory / POLICY_FILE, ckpt.policy, policy.state_dict())
    policy.load_state_dict(ckpt.policy)


def restore(model: OnPolicyAlgorithm, ckpt: Checkpoint) -> None:
    """Continue ``model`` (freshly built from the run's config) and its VecNormalize from ``ckpt``."""
    restore_policy(model.policy, ckpt)
    optimizer = model.policy.optimizer
    current = optimizer.state_dict()
    path = ckpt.directory / MANIFEST_FILE
    groups = ckpt.manifest["optimizer_param_groups"]
    if len(groups) != len(current["param_groups"]) or any(
        not isinstance(g, dict) or set(g) != set(c) or not all(_fits(g[k], c[k]) for k in c)
        for g, c in zip(groups, current["param_groups"], strict=False)
    ):
        raise CheckpointError(path, "field 'optimizer_param_groups' does not fit this model's optimizer")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in ckpt.optimizer.items():
        pid, _, key = name.partition(".")
        if not pid.isdigit() or int(pid) >= len(params) or not key:
            raise CheckpointError(ckpt.directory / OPTIMIZER_FILE, f"tensor {name!r} names no parameter")
        if tensor.ndim and tensor.shape != params[int(pid)].shape:
            raise CheckpointError(
                ckpt.directory / OPTIMIZER_FILE,
                f"tensor {name!r} is {list(tensor.shape)}, its parameter {list(params[int(pid)].shape)}",
            )
        state.setdefault(int(pid), {})[key] = tensor
    optimizer.load_state_dict(
        {
            "state": state,
            "param_groups": [
                {k: (tuple(v) if isinstance(c[k], tuple) else v) for k, v in g.items()}
                for g, c in zip(groups, current["param_groups"], strict=True)
            ],
        }
    )
    shapes = (
        ckpt.norm.obs_mean.shape,
        ckpt.norm.obs_var.shape,
        ckpt.norm.ret_mean.shape,
        ckpt.norm.ret_var.shape,
    )
    if shapes != (model.observation_space.shape,) * 2 + ((),) * 2:
        raise CheckpointError(
            ckpt.directory / NORM_FILE,
            f"statistics of shapes {shapes}, the env observes {model.observation_space.shape}",
        )
    vecnorm = model.get_vec_normalize_env()
    assert vecnorm is not None, "chunkgym's models always train behind VecNormalize (training.normalised())"
    try:
        ckpt.norm.apply(vecnorm)
    except ValueError as exc:
        raise CheckpointError(path, str(exc)) from None
    model.num_timesteps = ckpt.num_timesteps
    model._n_updates = int(ckpt.manifest["n_updates"])
    model.ep_info_buffer = deque(ckpt.manifest["ep_info_buffer"], maxlen=model._stats_window_size)
    model.ep_success_buffer = deque(ckpt.manifest["ep_success_buffer"], maxlen=model._stats_window_size)


def _fits(value: Any, current: Any) -> bool:
    """A saved optimizer hyperparameter has the form of the fresh optimizer's (the same ``params``)."""
    if isinstance(current, bool) or current is None or isinstance(current, list):
        return value == current if isinstance(current, list) else type(value) is type(current)
    if isinstance(current, int | float):
        return _finite_number(value)
    if isinstance(current, tuple):
        return (
            isinstance(value, list) and len(value) == len(current) and all(_finite_number(v) for v in value)
        )
    return bool(value == current)


def _check_tensors(path: Path, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise CheckpointError(path, f"tensors do not fit the model: missing {missing}, unexpected {extra}")
    for name, w in want.items():
        g = got[name]
        if g.shape != w.shape or g.dtype != w.dtype:
            raise CheckpointError(
                path, f"tensor {name!r} is {g.dtype}{list(g.shape)}, the model has {w.dtype}{list(w.shape)}"
            )
        if g.is_floating_point() and not math.isfinite(float(g.abs().sum())):
            raise CheckpointError(path, f"tensor {name!r} holds NaN or infinite values")
