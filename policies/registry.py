"""Resolve a policy name to a fresh :class:`~envs.serving.scheduling.Policy`.

Names: a file in ``conf/policy/`` (``fcfs``, ``sarathi_512``, ...), ``learned:PATH``
(an exported policy directory), or the name of an artefact shipped in ``policies/artifacts/``
(``learned``: the simulator policy for GPU serving; ``learned_cpu``: the one trained for the
CPU engine).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from chunkgym import REPO_ROOT, resolve_path
from envs.serving.scheduling import Policy
from envs.serving.specs import CONF_DIR

POLICY_DIR = CONF_DIR / "policy"
ARTIFACTS_DIR = REPO_ROOT / "policies" / "artifacts"
SHIPPED_LEARNED = ARTIFACTS_DIR / "learned"


def shipped_names() -> list[str]:
    """Exported policies shipped with the repo: each folder of ``policies/artifacts/`` with a manifest."""
    return sorted(p.parent.name for p in ARTIFACTS_DIR.glob("*/policy.json"))


def policy_names() -> list[str]:
    return sorted(p.stem for p in POLICY_DIR.glob("*.yaml")) + shipped_names()


def exported_dir(name: str) -> Path | None:
    """The export directory ``name`` stands for (a shipped artefact or ``learned:PATH``), else None."""
    if name in shipped_names():
        return ARTIFACTS_DIR / name
    if name.startswith("learned:"):
        return Path(resolve_path(name.split(":", 1)[1]))
    return None


def policy_env_id(name: str, default: str) -> str:
    """The env an exported policy was trained in (its manifest's ``env_id``); ``default`` otherwise."""
    directory = exported_dir(name)
    if directory is None or not (directory / "policy.json").is_file():
        return default
    return str(json.loads((directory / "policy.json").read_text())["env_id"])


def make_policy(name: str) -> Policy:
    """A new policy object for ``name``; unknown names fail with the list of valid ones."""
    path = exported_dir(name)
    if path is not None:
        if not path.is_dir():
            raise ValueError(f"policy {name!r}: no exported policy directory at {path}")
        from policies.exported import load_policy

        policy = load_policy(path)
    else:
        conf = POLICY_DIR / f"{name}.yaml"
        if not conf.is_file():
            raise ValueError(
                f"unknown policy {name!r}; valid names: {', '.join(policy_names())}, or learned:PATH"
            )
        from hydra.utils import instantiate

        policy = instantiate(yaml.safe_load(conf.read_text()))
    policy.name = name
    return policy
