"""Turn a trained SB3 policy and its VecNormalize statistics into an export directory.

Writes ``policy.safetensors``, ``policy.pt2`` and, last, ``policy.json`` (which holds
the other files' SHA-256), as :mod:`policies.exported` documents and reads; each file is
written atomically (a killed export never leaves a half-written file under its name).  The
network is copied layer by layer into :class:`~policies.exported.PolicyNet`; only
MLP policies (SB3's ``MlpPolicy`` on a flat Box observation) are supported.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

import torch
from gymnasium import spaces
from safetensors.torch import save_file
from stable_baselines3.common.policies import ActorCriticPolicy
from torch import nn

from chunkgym.io import atomic_path, atomic_write_text
from policies.checkpoint import NormStats
from policies.exported import (
    ACTIVATIONS,
    FORMAT,
    FORMAT_VERSION,
    PROGRAM_FILE,
    SPEC_FILE,
    WEIGHTS_FILE,
    ExportedPolicy,
    PolicyNet,
    check_values,
    env_contract,
    export_program,
    sha256_of,
)


def policy_net(policy: ActorCriticPolicy, norm: NormStats, masked: bool) -> PolicyNet:
    """A :class:`PolicyNet` computing ``policy``'s deterministic actions on raw observations.

    ``norm``: the VecNormalize statistics the policy was trained behind (:class:`NormStats`).
    """
    linears = [m for m in policy.mlp_extractor.policy_net if isinstance(m, nn.Linear)]
    acts = {type(m) for m in policy.mlp_extractor.policy_net if not isinstance(m, nn.Linear)}
    names = [name for name, cls in ACTIVATIONS.items() if {cls} == acts]
    if not norm.settings["norm_obs"]:
        raise ValueError("the VecNormalize wrapper must normalise observations (norm_obs=True)")
    if not linears or not names or not isinstance(policy.action_net, nn.Linear):
        raise ValueError(f"only MLP policies with one of {sorted(ACTIVATIONS)} can be exported, got {policy}")
    sizes = [linears[0].in_features] + [m.out_features for m in linears]
    nvec = cast(spaces.MultiDiscrete, policy.action_space).nvec  # chunkgym's action space
    net = PolicyNet(sizes, nvec.tolist(), names[0], masked)
    src = [*linears, policy.action_net]
    dst = [m for m in net.body if isinstance(m, nn.Linear)] + [net.head]
    with torch.no_grad():
        for a, b in zip(src, dst, strict=True):
            b.weight.copy_(a.weight)
            b.bias.copy_(a.bias)
        net.obs_mean.copy_(torch.as_tensor(norm.obs_mean))
        net.obs_var.copy_(torch.as_tensor(norm.obs_var))
        net.obs_epsilon.fill_(norm.settings["epsilon"])
        net.obs_clip.fill_(norm.settings["clip_obs"])
    return net.eval()


def policy_spec(net: PolicyNet, env_id: str, provenance: dict[str, Any]) -> dict[str, Any]:
    """The ``policy.json`` content for ``net`` trained on ``env_id``, without the file hashes."""
    state = net.state_dict()
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **env_contract(env_id),
        "network": {
            "sizes": [net.body[0].in_features]
            + [m.out_features for m in net.body if isinstance(m, nn.Linear)],
            "activation": next(n for n, c in ACTIVATIONS.items() if isinstance(net.body[1], c)),
            "masked": net.masked,
        },
        "normalisation": {
            "obs_mean": state["obs_mean"].tolist(),
            "obs_var": state["obs_var"].tolist(),
            "obs_epsilon": float(state["obs_epsilon"]),
            "obs_clip": float(state["obs_clip"]),
        },
        "signature": "forward(obs: float32[N, F], mask: bool[N, sum(nvec)]) -> int64[N, len(nvec)]",
        **provenance,
    }


def in_memory_policy(net: PolicyNet, env_id: str) -> ExportedPolicy:
    """The scheduler that the export of ``net`` would load as (used for evaluation during training)."""
    return ExportedPolicy(net, policy_spec(net, env_id, {}))


def write_export(
    net: PolicyNet, env_id: str, directory: str | Path, provenance: dict[str, Any]
) -> dict[str, Any]:
    """Write the three artefacts of ``net`` (trained on ``env_id``) into ``directory``; returns policy.json."""
    directory = Path(directory)
    check_values(directory / WEIGHTS_FILE, net.state_dict())  # never write what load_policy refuses
    directory.mkdir(parents=True, exist_ok=True)
    spec = policy_spec(net, env_id, provenance)
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp)
    with atomic_path(directory / PROGRAM_FILE) as tmp:
        torch.export.save(export_program(net), tmp)
    spec["files"] = {name: sha256_of(directory / name) for name in (WEIGHTS_FILE, PROGRAM_FILE)}
    spec["exported_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    atomic_write_text(directory / SPEC_FILE, json.dumps(spec, indent=2) + "\n")
    return spec
