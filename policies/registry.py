"""Resolve a policy name to a fresh :class:`~envs.serving.scheduling.Policy`.

Names: a file in ``conf/policy/`` (``fcfs``, ``sarathi_512``, ...), ``learned:PATH``
(an exported policy directory), or ``learned`` (the artefact shipped in this repo).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from chunkgym import REPO_ROOT, resolve_path
from envs.serving.scheduling import Policy
from envs.serving.specs import CONF_DIR

POLICY_DIR = CONF_DIR / "policy"
SHIPPED_LEARNED = REPO_ROOT / "policies" / "artifacts" / "learned"


def policy_names() -> list[str]:
    names = sorted(p.stem for p in POLICY_DIR.glob("*.yaml"))
    return names + (["learned"] if SHIPPED_LEARNED.is_dir() else [])


def make_policy(name: str) -> Policy:
    """A new policy object for ``name``; unknown names fail with the list of valid ones."""
    if name == "learned" or name.startswith("learned:"):
        path = SHIPPED_LEARNED if name == "learned" else resolve_path(name.split(":", 1)[1])
        if not Path(path).is_dir():
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
