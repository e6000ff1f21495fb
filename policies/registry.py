"""Resolve a policy name to a fresh :class:`~envs.serving.scheduling.Policy`.

Names: a preset in ``conf/policy/`` (``fcfs``, ``sarathi_512``, ...), ``learned:PATH``
(an exported policy directory: JSON + safetensors only), or the name of an artefact shipped
in ``policies/artifacts/`` (``learned``: the simulator policy for GPU serving, on ``ChunkedPrefill-v4``
(latency-target actions, traffic features); ``learned_v2``: one on v2's budget levels;
``learned_cpu``: the one trained for the CPU engine; ``learned_vllm``: for vLLM on CPU; both on v1;
``learned_tenants``: for many tenants and SLO classes, on v6).

Names arrive from files a user may have received from someone else (the ``policy`` column of
a results file, a run's config), so nothing else is accepted: a name is never turned into a
path, and a preset may only construct a :class:`Policy` class of this repository's packages,
with plain values as arguments (SECURITY.md).
"""

from __future__ import annotations

import copy
import functools
import importlib
import re
from pathlib import Path
from typing import Any, TypeGuard

import yaml

from chunkgym import OWN_PACKAGES, REPO_ROOT, resolve_path
from envs.serving.scheduling import Policy
from envs.serving.specs import CONF_DIR

POLICY_DIR = CONF_DIR / "policy"
ARTIFACTS_DIR = REPO_ROOT / "policies" / "artifacts"
SHIPPED_LEARNED = ARTIFACTS_DIR / "learned"
LEARNED_PREFIX = "learned:"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
"""Preset and artefact names: no dots or slashes, so a name can never leave its folder."""
SHOWN_CHARS = 80


def shipped_names() -> list[str]:
    """Exported policies shipped with the repo: each folder of ``policies/artifacts/`` with a manifest."""
    return sorted(p.parent.name for p in ARTIFACTS_DIR.glob("*/policy.json") if _plain_name(p.parent.name))


def preset_names() -> list[str]:
    return sorted(p.stem for p in POLICY_DIR.glob("*.yaml") if _plain_name(p.stem))


def policy_names() -> list[str]:
    return preset_names() + shipped_names()


def _plain_name(name: str) -> bool:
    return NAME_PATTERN.fullmatch(name) is not None


def _unknown(name: object) -> ValueError:
    shown = repr(name)  # a received cell may be a megabyte long: the line stays short
    shown = shown if len(shown) <= SHOWN_CHARS else f"{shown[:SHOWN_CHARS]}..."
    return ValueError(
        f"unknown policy {shown}; valid names: {', '.join(policy_names())}, or {LEARNED_PREFIX}PATH"
    )


def exported_dir(name: str) -> Path | None:
    """The export directory ``name`` stands for (a shipped artefact or ``learned:PATH``), else None."""
    if name in shipped_names():
        return ARTIFACTS_DIR / name
    if name.startswith(LEARNED_PREFIX):
        return Path(resolve_path(name.removeprefix(LEARNED_PREFIX)))
    return None


def preset_path(name: str) -> Path | None:
    """``conf/policy/<name>.yaml`` if ``name`` is a registered preset, else None (never another path)."""
    return POLICY_DIR / f"{name}.yaml" if isinstance(name, str) and name in preset_names() else None


def is_policy_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` is a preset, a shipped artefact or ``learned:PATH`` (the only names accepted)."""
    return isinstance(name, str) and (
        preset_path(name) is not None or name in shipped_names() or name.startswith(LEARNED_PREFIX)
    )


def check_policy_name(name: object) -> str:
    """``name`` if :func:`is_policy_name`; else a ValueError listing the valid names."""
    if not is_policy_name(name):
        raise _unknown(name)
    return name


def policy_env_id(name: str, default: str) -> str:
    """The env an exported policy was trained in (its manifest's ``env_id``); ``default`` otherwise."""
    directory = exported_dir(name)
    if directory is None:
        return default
    from policies.exported import read_spec  # torch: only for exported policies

    return str(read_spec(directory)["env_id"])


def preset_policy(path: Path) -> Policy:
    """The policy a preset file describes: ``_target_`` (a Policy class of this repo) + plain arguments."""
    try:
        stat = path.stat()
        conf = copy.deepcopy(_parsed_yaml(path, stat.st_mtime_ns, stat.st_size))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read the policy preset ({exc})") from None
    if not isinstance(conf, dict) or not isinstance(conf.get("_target_"), str):
        raise ValueError(f"{path}: a policy preset is a mapping with a '_target_' class name")
    target = conf.pop("_target_")
    cls = _policy_class(path, target)
    for key, value in conf.items():
        if not isinstance(key, str) or key.startswith("_") or not _plain_value(value):
            raise ValueError(
                f"{path}: argument {key!r} of {target}: only plain values (numbers, strings, booleans, "
                f"lists of them) are allowed, got {value!r}"
            )
    try:
        return cls(**conf)
    except (TypeError, ValueError) as exc:  # an unknown argument, or a value out of range
        raise ValueError(f"{path}: {target}: {exc}") from None


@functools.lru_cache(maxsize=256)
def _parsed_yaml(path: Path, mtime_ns: int, size: int) -> Any:
    """A YAML file's contents, parsed once per version of the file: a capacity search makes a
    policy for every probe, and parsing its preset each time showed in short probes' profiles."""
    return yaml.safe_load(path.read_text())


def _policy_class(path: Path, target: str) -> type[Policy]:
    module_name, _, attr = target.rpartition(".")
    if module_name.split(".")[0] not in OWN_PACKAGES or not attr:
        raise ValueError(
            f"{path}: '_target_' {target!r} is not a class of this repository "
            f"(packages {', '.join(OWN_PACKAGES)})"
        )
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{path}: '_target_' {target!r} cannot be imported ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"{path}: '_target_' {target!r} is not a Policy class")
    return cls


def _plain_value(value: Any) -> bool:
    if isinstance(value, list):
        return all(_plain_value(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def make_policy(name: str) -> Policy:
    """A new policy object for ``name``; unknown names fail with the list of valid ones."""
    name = check_policy_name(name)
    path = exported_dir(name)
    if path is not None:
        if not path.is_dir():
            raise ValueError(f"policy {name!r}: no exported policy directory at {path}")
        from policies.exported import load_policy

        policy: Policy = load_policy(path)
    else:
        policy = preset_policy(POLICY_DIR / f"{name}.yaml")
    policy.name = name
    return policy
