"""The plugin's settings, from vLLM's ``additional_config`` and ``CHUNKGYM_*`` environment variables.

``vllm serve MODEL --scheduler-cls engine.vllm_backend.scheduler.ChunkgymScheduler
--additional-config '{"chunkgym": {"policy": "sarathi_512", "slo": "strict", "cost": NAME}}'``:
keys given there win over the environment (``CHUNKGYM_POLICY``, ``CHUNKGYM_SLO``,
``CHUNKGYM_COST``, ``CHUNKGYM_LOOKAHEAD``), which is for launchers that cannot pass JSON.
Everything is checked when the engine starts, with one-line errors naming the key and value;
:func:`check_server` runs the same checks on a server's flags before vLLM loads the model
(``python -m engine.vllm_backend.serve``).  The policy name goes through
:func:`policies.registry.make_policy` (presets and exported policies only: nothing is unpickled,
no name becomes code).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkgym import resolve_path
from chunkgym.config import AT_LEAST_ONE, ConfigError, from_mapping
from envs.serving.cost_model import COST_DIR, CostModel, RooflineCostModel, read_cost_file
from envs.serving.metrics import SLO, load_slo
from envs.serving.scheduling import Policy
from policies.registry import NAME_PATTERN, check_policy_name, make_policy

SECTION = "chunkgym"
ENV_VARS = {
    "policy": "CHUNKGYM_POLICY",
    "slo": "CHUNKGYM_SLO",
    "cost": "CHUNKGYM_COST",
    "lookahead": "CHUNKGYM_LOOKAHEAD",
}
SCHEDULER_MODULE = "engine.vllm_backend.scheduler"
SCHEDULER = f"{SCHEDULER_MODULE}.ChunkgymScheduler"
"""What ``--scheduler-cls`` names to run a chunkgym policy."""
DEFAULT_COST = "cpu__engine_small__tp1"
"""The cost file used when none is named: the SLO bounds and the slack rules' estimates scale
with it, so name the profile of the engine being served (``conf/cost/``)."""


@dataclass
class PluginConfig:
    """What the scheduler needs to run a policy: its name, the SLO recipe, the cost file."""

    policy: str = ""
    slo: str = "strict"
    cost: str = DEFAULT_COST  # a conf/cost/ name (no .yaml) or a coefficient file path
    lookahead: int = 64  # queued prompts the allocation rules may reorder (the simulator's default)
    # Read each request's SLO class from its vLLM ``priority`` (the conf/slo_class whose ``priority`` it
    # is: 0 interactive, 1 standard, 2 batch; any other: the run's SLO) and its tenant from
    # ``SamplingParams.extra_args["tenant"]`` (the OpenAI API's ``vllm_xargs``); off: one tenant, one SLO.
    tenants: bool = False


@dataclass
class Plugin:
    """The loaded settings: a fresh policy, the resolved SLO and the cost model."""

    policy: Policy
    slo: SLO
    cost_model: CostModel
    lookahead: int
    tenants: bool = False


def plugin_config(additional_config: Any, environ: Mapping[str, str] = os.environ) -> PluginConfig:
    """The settings from ``additional_config[SECTION]`` over the ``CHUNKGYM_*`` variables."""
    source = f"vLLM additional_config[{SECTION!r}]"
    extra = additional_config if additional_config is not None else {}
    section = extra.get(SECTION, {}) if isinstance(extra, Mapping) else extra
    if not isinstance(section, Mapping):
        raise ConfigError(f"{source}: expected a mapping of chunkgym settings, got {section!r}")
    data: dict[str, Any] = {key: environ[var] for key, var in ENV_VARS.items() if environ.get(var)}
    data.update(section)
    conf = from_mapping(PluginConfig, data, source, rules={"lookahead": AT_LEAST_ONE})
    if not conf.policy:
        raise ConfigError(
            f"{source}: no policy named: set {{{SECTION!r}: {{'policy': NAME}}}} or ${ENV_VARS['policy']}"
        )
    try:
        check_policy_name(conf.policy)
    except ValueError as exc:
        raise ConfigError(f"{source}: policy={conf.policy!r}: {exc}") from None
    return conf


def cost_path(name: str) -> Path:
    """``conf/cost/NAME.yaml`` for a plain name, else the path itself (relative to the repo root)."""
    return COST_DIR / f"{name}.yaml" if NAME_PATTERN.fullmatch(name) else resolve_path(name)


def load_plugin(conf: PluginConfig) -> Plugin:
    """Build the policy, the cost model and the SLO bounds it resolves to."""
    path = cost_path(conf.cost)
    try:
        data = read_cost_file(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"chunkgym cost={conf.cost!r}: {exc}") from None
    cost_model = RooflineCostModel(data["params"], f"{path.stem}: {data['source']}")
    try:
        slo = load_slo(conf.slo).resolve(cost_model)
        policy = make_policy(conf.policy)
    except ValueError as exc:
        raise ConfigError(f"chunkgym: {exc}") from None
    return Plugin(policy, slo, cost_model, conf.lookahead, conf.tenants)


def check_server(
    scheduler_cls: object,
    additional_config: Any,
    scheduling_policy: str = "fcfs",
    environ: Mapping[str, str] = os.environ,
) -> Plugin | None:
    """The plug-in a server's flags would load, checked now; None when they name no chunkgym scheduler.

    vLLM imports ``--scheduler-cls`` and builds it only after the model's weights are loaded, so a
    bad setting would surface there, inside the engine core's tracebacks; this runs the scheduler's
    own checks (:func:`plugin_config`, :func:`load_plugin`, the fcfs queue) on the flags instead.
    A ``chunkgym`` section without the plug-in is refused too: no policy would run.  A scheduler
    class from another module is not this plug-in's to check.
    """
    named = isinstance(scheduler_cls, str) and scheduler_cls.startswith(f"{SCHEDULER_MODULE}.")
    if not named:
        if scheduler_cls is None and isinstance(additional_config, Mapping) and SECTION in additional_config:
            raise ConfigError(
                f"vLLM additional_config[{SECTION!r}] is set but no --scheduler-cls: "
                f"add --scheduler-cls {SCHEDULER} to run its policy"
            )
        return None
    if scheduling_policy != "fcfs":
        raise ConfigError(
            f"--scheduling-policy {scheduling_policy}: chunkgym's scheduler orders the waiting queue itself "
            "(run vLLM with --scheduling-policy fcfs)"
        )
    return load_plugin(plugin_config(additional_config, environ))
