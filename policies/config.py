"""The schema of ``train.py``'s configuration, registered in Hydra's ConfigStore as ``train_schema``.

The primary config ``conf/train.yaml`` starts from this schema, so every group YAML
(``hardware``, ``model``, ``workload``, ``slo``, ``algo``, ``logger``) and every
command-line override is checked against a dataclass before anything runs: an
unknown key, a wrong type or an unknown enum value fails in Hydra with the key's
full name, and a value out of range (:data:`RULES`) fails in :func:`to_train_config`
with a one-line :class:`~chunkgym.config.ConfigError`.  The serving specs are the
library's own dataclasses (not copies), so a config that composes is one the env accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from baselines.routers import router_names
from chunkgym.config import (
    AT_LEAST_ONE,
    LOAD_SCALE,
    SEED,
    TP,
    WINDOW_S,
    ConfigError,
    Rule,
    each,
    prefixed,
    schema,
    to_object,
)
from chunkgym.registration import ENV_ID_V5, ENV_ID_V7
from chunkgym.tracking import LoggerConfig
from envs.actions import NUM_LEVELS
from envs.serving.core import ServingConfig
from envs.serving.fleet import ONE_SERVER, FleetSpec
from envs.serving.metrics import SLOSpec, slo_names
from envs.serving.scheduling import Rule as AllocationRule
from envs.serving.setup import SERVING_RULES, SLO_RULES
from envs.serving.specs import HARDWARE_RULES, MODEL_RULES, HardwareSpec, ModelSpec
from envs.serving.workload import WorkloadSpec
from policies.constant import is_action_name
from policies.registry import is_policy_name, policy_names

TEACHERS = ("constant", "window_best", "period_best", "workload_best")
"""Behaviour-cloning teachers of ``algo.bc_teacher`` (policies/imitation.py)."""

SCHEMA_NAME = "train_schema"


class Choice(Enum):
    """An enum whose members read as their values, also inside interpolated strings (run dirs)."""

    def __str__(self) -> str:
        return str(self.value)


class AlgoName(Choice):
    maskable_ppo = "maskable_ppo"  # sb3-contrib MaskablePPO: samples only valid actions
    ppo = "ppo"  # SB3 PPO: ignores masks; the env maps invalid actions to equivalent valid ones


class VecEnvKind(Choice):
    dummy = "dummy"  # all envs in the training process (cheapest on few cores)
    subproc = "subproc"  # one process per env


class Schedule(Choice):
    constant = "constant"
    linear = "linear"  # decays to 0 at algo.total_timesteps


class Activation(Choice):
    tanh = "tanh"
    relu = "relu"


@dataclass
class EnvConfig:
    """Training episodes (see the env's docstring for each field); fields of v1 and newer say "v1+"."""

    id: str = "chunkgym/ChunkedPrefill-v4"  # the newest; or -v3 (no traffic features), -v2 (budget-level actions), -v1 (skip-ahead admission), -v0 (iteration steps, 16 features)
    workloads: list[str] = field(default_factory=list)  # v1+: more workloads to draw episodes from
    common_inputs: bool = False  # v1+: all envs replay the same (workload, window, load) per episode
    tp: int = 1
    cost_model: str = "calibrated"  # calibrated | roofline | path of a coefficient file
    load_scale: list[float] = field(default_factory=lambda: [1.0, 2.5])  # [low, high], uniform per episode
    # Per workload name, its own [low, high] in place of load_scale (e.g. around each one's capacity).
    workload_loads: dict[str, list[float]] = field(default_factory=dict)
    window_s: float | None = 60.0  # trace-seconds per training episode; None = the workload's window_s
    max_steps: int = 200_000
    reward_scale: float = 0.1
    slos: list[str] = field(
        default_factory=list
    )  # more conf/slo names: env i trains under [slo, *slos][i % n]


@dataclass
class AlgoConfig:
    """PPO-family hyperparameters (SB3 names); ``total_timesteps`` is the run's total, also on resume."""

    name: AlgoName = MISSING
    total_timesteps: int = 200_000  # 0: no RL, the imitation warm start (bc_steps > 0) is the policy
    n_envs: int = 8
    vec_env: VecEnvKind = VecEnvKind.dummy
    learning_rate: float = 3e-4
    lr_schedule: Schedule = Schedule.constant
    n_steps: int = 512  # per env and rollout
    batch_size: int = 256
    n_epochs: int = 10
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    net_arch: list[int] = field(default_factory=lambda: [64, 64])  # policy and value MLPs (separate)
    activation: Activation = Activation.tanh
    normalize_reward: bool = True
    clip_obs: float = 10.0
    # Behaviour-cloning warm start (policies/imitation.py) on bc_steps env steps before PPO (0 = off):
    # bc_teacher "constant" imitates the action bc_action = [budget level, rule]; "window_best" the best
    # of each episode's window in hindsight among constant actions (budget levels >= bc_action[0], every
    # rule; bc_action[0] = 9: no budget level) and the policies named in bc_policies (heuristics whose plans the action space expresses;
    # on v3 also constant actions by name, e.g. target_1_slack__shortest_first+skip: policies/constant.py);
    # "period_best" (v3) the same candidates, chosen again every bc_period_s seconds of the episode from the
    # state reached, by the hindsight oracle's rollout (each candidate for a period, then the first of them
    # until bc_horizon_s: policies/oracle.py), so labels follow the state within a window.
    # "workload_best" (v3 and later) one label per (workload, SLO) trained on: the candidate with the highest
    # mean attain90 capacity on the train split's windows bc_capacity_seeds (policies/imitation.py).
    bc_teacher: str = "constant"
    bc_action: list[int] = field(default_factory=lambda: [5, 1])
    bc_policies: list[str] = field(default_factory=list)
    bc_steps: int = 0
    bc_epochs: int = 10
    # DAgger rounds after the clone: bc_steps steps each, driven by the policy, labelled by the teacher
    # (per episode its window's best, as above), merged into the data and refitted (0 = plain cloning).
    bc_dagger_rounds: int = 0
    # window_best keeps its first candidate (v3: the first of bc_policies) unless another one's SLO attainment
    # on the window is higher by more than bc_margin (0: the best, ties to the first); period_best unless
    # another one's rollout score is higher by more than bc_margin x the requests the first one's rollout decides;
    # workload_best unless another one's capacity is higher by more than bc_margin x the first one's
    bc_margin: float = 0.0
    bc_capacity_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # workload_best: train windows
    bc_period_s: float = 10.0  # period_best: seconds a choice holds
    bc_horizon_s: float = 30.0  # period_best: seconds each candidate's rollout is scored over

    def __post_init__(self) -> None:
        if self.bc_period_s > self.bc_horizon_s:
            raise ValueError(
                f"algo.bc_period_s ({self.bc_period_s}) must be <= algo.bc_horizon_s ({self.bc_horizon_s})"
            )
        if self.total_timesteps == 0 and self.bc_steps == 0:
            raise ValueError("algo.total_timesteps=0 (imitation only) needs algo.bc_steps > 0")


@dataclass
class EvalConfig:
    """Deterministic evaluation on fixed windows of the workload's val split (never test)."""

    every_steps: int = 20_000
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    # A workload's 1x is 60% of Sarathi-512's capacity (conf/workload); at 2x every fixed budget misses the
    # 90%-within-SLO mark on azure_conv, so policies differ there (at 1.5x the good ones all meet ~100%).
    load_scale: float = 2.0
    window_s: float | None = None  # None = the workload's window_s
    baseline: str = "sarathi_512"  # a conf/policy name, evaluated once per run on the same windows
    workloads: list[str] = field(default_factory=list)  # more workloads whose val windows join the main one's
    select_by: str = "goodput_rps"  # the mean kept as "best": goodput_rps, weighted_goodput_rps (mixes) or slo_attainment (scale-free
    # across workloads whose rates differ 100x)


@dataclass
class CheckpointConfig:
    every_steps: int = 20_000
    keep: int = 3  # most recent checkpoints kept on disk


@dataclass
class TrainConfig:
    """Everything one training run needs; ``OmegaConf.to_object`` of the composed config."""

    hardware: HardwareSpec = MISSING
    model: ModelSpec = MISSING
    workload: WorkloadSpec = MISSING
    slo: SLOSpec = MISSING
    serving: ServingConfig = field(default_factory=ServingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algo: AlgoConfig = MISSING
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # The servers of an episode (docs/fleet.md): one for the budget envs (v0-v4); the routing env
    # (v5) routes among fleet.replicas servers (its agent is the router: fleet.router is unused).
    fleet: FleetSpec = field(default_factory=FleetSpec)
    logger: LoggerConfig = MISSING
    seed: int = 0
    data_root: str | None = None  # None = chunkgym.data_root() ($CHUNKGYM_DATA, else the user cache)
    resume: bool = True  # continue from the run folder's last checkpoint if there is one
    torch_threads: int = 1
    progress: bool = True


def register_configs() -> None:
    """Store the schema so that ``conf/train.yaml`` can list it first in its defaults."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=schema(TrainConfig))


def plain(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain JSON-able containers (enums as their names)."""
    return cast(
        dict[str, Any], OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    )  # of a DictConfig


def _load_pair(load: list[float]) -> bool:
    """A load range as the env reads it: [scale] or [low, high], low <= high, each a :data:`LOAD_SCALE`."""
    return len(load) in (1, 2) and all(LOAD_SCALE.test(x) for x in load) and load[0] <= load[-1]


SEEDS = Rule(lambda v: len(v) > 0 and each(SEED).test(v), f"a non-empty list of which each is {SEED.want}")


RULES: dict[str, Rule] = {
    **prefixed("hardware", HARDWARE_RULES),
    **prefixed("model", MODEL_RULES),
    **prefixed("slo", SLO_RULES),
    **prefixed("serving", SERVING_RULES),
    "seed": SEED,
    "env.tp": TP,
    "env.window_s": WINDOW_S,
    "env.load_scale": Rule(_load_pair, "[scale] or [low, high] with 0 < low <= high, each in [0.001, 1000]"),
    "env.workload_loads": Rule(
        lambda loads: all(_load_pair(v) for v in loads.values()),
        "a map of workload name to [scale] or [low, high] with 0 < low <= high, each in [0.001, 1000]",
    ),
    "env.slos": Rule(
        lambda names: all(n in slo_names() for n in names),
        f"a list of conf/slo names ({', '.join(slo_names())})",
    ),
    "algo.n_envs": AT_LEAST_ONE,
    "algo.n_steps": AT_LEAST_ONE,
    "algo.batch_size": AT_LEAST_ONE,
    "algo.total_timesteps": Rule(lambda v: v >= 0, "an integer >= 0 (0: imitation only)"),
    "algo.bc_steps": Rule(lambda v: v >= 0, "an integer >= 0 (0: no warm start)"),
    "algo.bc_dagger_rounds": Rule(lambda v: v >= 0, "an integer >= 0 (0: plain behaviour cloning)"),
    "algo.bc_teacher": Rule(lambda v: v in TEACHERS, f"one of {', '.join(TEACHERS)}"),
    "algo.bc_period_s": Rule(lambda v: v > 0, "a number of seconds > 0"),
    "algo.bc_horizon_s": Rule(lambda v: v > 0, "a number of seconds > 0 (>= algo.bc_period_s)"),
    "algo.bc_margin": Rule(lambda v: 0 <= v < 1, "a number in [0, 1): an SLO-attainment or capacity margin"),
    "algo.bc_capacity_seeds": SEEDS,
    "eval.seeds": SEEDS,
    "eval.load_scale": LOAD_SCALE,
    "eval.window_s": WINDOW_S,
    "eval.baseline": Rule(
        is_policy_name, f"a registered policy name ({', '.join(policy_names())}) or learned:PATH"
    ),
    "algo.bc_action": Rule(
        lambda v: len(v) == 2 and 0 <= v[0] <= NUM_LEVELS and 0 <= v[1] < len(AllocationRule),
        f"a [budget level 0..{NUM_LEVELS - 1} (window_best: {NUM_LEVELS} = none), rule 0..{len(AllocationRule) - 1}] pair",
    ),
    "algo.bc_policies": Rule(
        lambda names: all(is_policy_name(n) or is_action_name(n) for n in names),
        "a list of registered policy names, learned:PATH, or (v3) constant action names MODE__ALLOCATION",
    ),
}
"""Ranges checked before train.py creates its run folder (types are Hydra's)."""


def simulated_fleet(fleet: FleetSpec, roles: bool = False) -> FleetSpec:
    """The fleet checked for a tool that simulates it: routers preset by name, one server as
    :data:`~envs.serving.fleet.ONE_SERVER` (the router is ignored there, so one-server runs are those
    made before fleets), and prefill-decode disaggregation only where the tool simulates it
    (``roles``)."""
    for key in ("router", "decode_router"):
        name = getattr(fleet, key)
        if name not in router_names():
            raise ConfigError(f"fleet.{key}={name!r} is not a router; choose one of {router_names()}")
    if fleet.disaggregated and not roles:
        raise ConfigError(
            f"fleet.prefill={fleet.prefill} fleet.decode={fleet.decode}: prefill-decode disaggregation "
            "is not simulated by this tool; use fleet.replicas"
        )
    return fleet if fleet.servers > 1 else ONE_SERVER


def check_fleet(cfg: TrainConfig) -> None:
    """The fleet the run's env takes: the routing env (v5) routes among >= 2 servers; v7 plans the
    prefill pool of a disaggregated fleet, so it needs one; the other budget envs (v0-v4, v6) schedule
    one server, so a fleet there is refused before any work."""
    v7 = cfg.env.id == ENV_ID_V7
    fleet = simulated_fleet(cfg.fleet, roles=v7)
    if cfg.env.id == ENV_ID_V5:
        if fleet.servers < 2:
            raise ConfigError(
                f"fleet.replicas={cfg.fleet.replicas}: the routing env ({ENV_ID_V5}) needs >= 2"
            )
    elif v7:
        if not fleet.disaggregated:
            raise ConfigError(
                f"fleet.prefill={cfg.fleet.prefill}: env.id={ENV_ID_V7} plans the prefill pool of a "
                "disaggregated fleet; set fleet.prefill >= 1 and fleet.decode >= 1"
            )
    elif fleet.servers > 1:
        raise ConfigError(
            f"fleet.replicas={cfg.fleet.replicas}: env.id={cfg.env.id} simulates one server; "
            f"fleets train on {ENV_ID_V5} (+experiment=learned_router)"
        )


def run_config(dcfg: DictConfig, cfg: TrainConfig) -> dict[str, Any]:
    """The config a run records (config.yaml, its hash): :func:`plain`, a one-server fleet left out
    and ``fleet.layerwise`` left out while false, so that runs and run folders made before fleets
    (or before layer-wise KV streaming) keep their hash and resume."""
    config = plain(dcfg)
    if cfg.fleet.servers == 1:
        config.pop("fleet", None)
    elif not cfg.fleet.layerwise:
        config["fleet"].pop("layerwise", None)
    return config


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Instantiate the dataclasses (runs their validation, e.g. ``WorkloadSpec.__post_init__``),
    check :data:`RULES` and the fleet (:func:`check_fleet`)."""
    conf = to_object(cfg, TrainConfig, "", RULES)
    check_fleet(conf)
    return conf
