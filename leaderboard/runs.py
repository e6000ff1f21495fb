"""One leaderboard row: its trace, its serving setup, its policy, and the simulation that fills it.

A :class:`RunSpec` is everything a row's numbers depend on besides the code and the trace files.
Its inputs are written into the row itself, so ``evaluate.py validate=`` rebuilds the spec from
the row (:meth:`RunSpec.from_row`) and reruns it. Workloads and serving setups are cached per
process, so each parallel worker parses a trace file once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml

import envs
from baselines.routers import make_router
from chunkgym.config import LOAD_SCALE, SEED, TP, WINDOW_S, from_mapping
from chunkgym.provenance import config_hash, git_commit
from chunkgym.received import parse_json
from envs.serving.capacity import measure_capacity
from envs.serving.core import ServingConfig
from envs.serving.fleet import ONE_SERVER, FleetSpec
from envs.serving.loop import SimResult
from envs.serving.metrics import SLOSpec, bucket_summaries
from envs.serving.setup import ServingSetup, serving_config
from envs.serving.specs import load_hardware, load_model
from envs.serving.tenancy import class_weights, fairness_summary, group_rows, trace_classes, trace_tenants
from envs.serving.workload import FILE_PREFIX, Trace, Workload, WorkloadSpec, load_workload
from leaderboard.cells import (
    FLEET_KEY,
    NO_PATHS,
    AllowedPaths,
    as_float,
    check_cost_model,
    check_hardware,
    check_model,
    check_number,
    check_workload,
    fleet_columns,
    fleet_label,
    row_fleet,
    shown,
)
from policies.registry import check_policy_name, make_policy, policy_env_id, preset_path

BACKEND = "sim"
TEST_SPLIT = "test"
REPORT_SPLITS = ("test", "val")
"""The splits evaluate.py may run on: test to report, val to select (train is the learner's)."""
TRANSFER_COLUMNS = (
    "handovers", "kv_transfer_s_mean", "decode_admission_wait_s_mean", "ttft_transfer_share",
    "first_decode_gap_transfer_share",
)  # fmt: skip
"""A disaggregated fleet's KV hand-over metrics (:meth:`DisaggregatedFleet.result`); NaN on other rows."""
POOL_SIZES = ("prefill_servers", "decode_servers")
"""A disaggregated fleet's metrics that the row's ``fleet_prefill`` and ``fleet_decode`` already hold."""
FLEET_COLUMNS = (*FLEET_KEY, "load_imbalance", "goodput_per_gpu", *TRANSFER_COLUMNS)
"""Columns of the fleet a row was served by (rows made before fleets, or before disaggregation, lack
some: one server, colocated)."""
TBT_PROBS = np.concatenate([np.linspace(0.0, 0.9, 91), 1.0 - np.logspace(-1, -5, 81)[1:], [1.0]])
"""Probabilities at which a row keeps its pooled token-gap quantiles (dense in the tail) for the CDF plot."""


@dataclass(frozen=True)
class SetupKey:
    """A run's serving setup by name, hashable (``serving``: canonical JSON of ServingConfig); :meth:`build` makes it."""

    model: str
    hardware: str
    tp: int
    slo: SLOSpec
    cost_model: str
    serving: str

    @classmethod
    def create(
        cls,
        model: str,
        hardware: str,
        tp: int,
        slo: SLOSpec,
        cost_model: str,
        serving: ServingConfig | Mapping[str, Any] | None = None,
    ) -> SetupKey:
        config = serving_config(dict(serving) if isinstance(serving, Mapping) else serving)
        return cls(
            model, hardware, tp, slo, cost_model, json.dumps(dataclasses.asdict(config), sort_keys=True)
        )

    def build(self) -> ServingSetup:
        """The serving setup (cached per process); fails on unknown names or a missing cost model."""
        return _serving_setup(self)


@functools.lru_cache(maxsize=8)
def _serving_setup(setup: SetupKey) -> ServingSetup:
    return ServingSetup.from_specs(
        load_model(setup.model),
        load_hardware(setup.hardware),
        setup.tp,
        setup.slo,
        setup.cost_model,
        json.loads(setup.serving),
    )


@functools.lru_cache(maxsize=32)
def cached_workload(name: str) -> Workload:
    """``load_workload(name)``, once per process."""
    return load_workload(name)


@dataclass(frozen=True)
class RunSpec:
    """One row: ``policy`` on ``workload``'s ``data_split`` (a ``file:`` trace whole) at ``load_scale``.

    ``seed`` picks the window (or the arrivals of a length-only file); ``window_s`` overrides
    the workload's own window length (ignored for ``file:`` workloads, which are used whole).
    ``data_split`` is ``test`` for reporting; ``val`` serves model selection.
    """

    policy: str
    workload: str
    load_scale: float
    seed: int
    setup: SetupKey
    window_s: float | None = None
    data_split: str = TEST_SPLIT
    fleet: FleetSpec = ONE_SERVER

    @property
    def whole_file(self) -> bool:
        return self.workload.startswith(FILE_PREFIX)

    @property
    def split(self) -> str:
        return "all" if self.whole_file else self.data_split

    @property
    def label(self) -> str:
        on = f" {fleet_label(self.fleet)}" if self.fleet.servers > 1 else ""
        return f"{self.policy}{on} on {self.workload} at load {self.load_scale:g}, seed {self.seed}"

    def effective_window_s(self) -> float:
        """The window length used, in trace seconds; NaN for a whole file."""
        if self.whole_file:
            return math.nan
        return cached_workload(self.workload).spec.window_s if self.window_s is None else float(self.window_s)

    def trace(self) -> Trace:
        if self.whole_file:
            return cached_workload(self.workload).split("all", self.seed, self.load_scale)
        return cached_workload(self.workload).window(
            self.data_split, self.seed, self.load_scale, self.window_s
        )

    def config_hash(self) -> str:
        """Hash of everything the row's numbers depend on except the code and the trace files' contents."""
        built = self.setup.build()
        policy_conf = preset_path(self.policy)
        # A fleet of one server is the single-server run: its hash stays that of the rows made before fleets.
        fleet = {"fleet": _fleet_fields(self.fleet)} if self.fleet.servers > 1 else {}
        return config_hash(
            {
                **fleet,
                "policy": yaml.safe_load(policy_conf.read_text()) if policy_conf else self.policy,
                "workload": _spec_fields(cached_workload(self.workload).spec),
                "load_scale": self.load_scale,
                "seed": self.seed,
                "split": self.split,
                "window_s": self.effective_window_s(),
                "model": dataclasses.asdict(built.model),
                "hardware": dataclasses.asdict(built.hardware),
                "tp": self.setup.tp,
                "slo": dataclasses.asdict(self.setup.slo),
                "cost_model": [self.setup.cost_model, getattr(built.cost_model, "params", None)],
                "serving": self.setup.serving,
            }
        )

    @classmethod
    def from_row(cls, row: Mapping[str, Any], allowed: AllowedPaths = NO_PATHS) -> RunSpec:
        """The spec a results row was produced by (values as read back from CSV or JSON).

        Every column is checked as :func:`evaluate.grid_of` checks the options it came from, and
        no file is opened: names must be ``conf`` names, and a path in ``cost_model`` or a
        ``file:`` workload must be one of ``allowed`` (:mod:`leaderboard.cells`).  Raises
        ValueError (one line) naming the column that is missing or malformed.
        """

        def get(column: str) -> Any:
            if column not in row:
                raise ValueError(f"column {column!r} is missing")
            return row[column]

        def mapping(column: str) -> dict[str, Any]:
            value = get(column)
            text = value if isinstance(value, str) else json.dumps(value)
            parsed = parse_json(text, f"column {column}")
            if not isinstance(parsed, dict):
                raise ValueError(f"column {column}: {shown(value)} is not a JSON object")
            if "${" in text:  # OmegaConf would resolve it (``${oc.env:...}`` reads the environment)
                raise ValueError(f"column {column}: {shown(value)} holds an interpolation; rows hold values")
            return parsed

        def named(column: str, check: Callable[[Any], str]) -> str:
            try:
                return check(get(column))
            except ValueError as exc:
                raise ValueError(f"column {column}: {exc}") from None

        if get("backend") != BACKEND:
            raise ValueError(f"column backend: {shown(row['backend'])} rows cannot be rerun by the simulator")
        policy = named("policy", check_policy_name)
        slo = from_mapping(SLOSpec, mapping("slo_spec"), source="column slo_spec")
        setup_names = (
            named("model", check_model),
            named("hardware", check_hardware),
            check_number("tp", get("tp"), TP, integer=True),
            slo,
            named("cost_model", functools.partial(check_cost_model, allowed=allowed)),
        )
        serving = mapping("serving")
        try:
            setup = SetupKey.create(*setup_names, serving)
        except ValueError as exc:
            raise ValueError(f"column serving: {exc}") from None
        window = _window(row.get("window_s"))
        split = get("split")
        data_split = TEST_SPLIT if split == "all" else split
        if data_split not in REPORT_SPLITS:
            raise ValueError(f"column split: {shown(split)} is not one of {', '.join(REPORT_SPLITS)}, all")
        return cls(
            policy,
            named("workload", functools.partial(check_workload, allowed=allowed)),
            check_number("load_scale", get("load_scale"), LOAD_SCALE),
            check_number("seed", get("seed"), SEED, integer=True),
            setup,
            window,
            data_split,
            row_fleet(row),
        )

    @property
    def key(self) -> tuple[Any, ...]:
        """The row's :data:`~leaderboard.cells.ROW_KEY`."""
        fleet = fleet_columns(self.fleet).values()
        return (BACKEND, self.policy, self.workload, self.load_scale, self.seed, *fleet)


def _spec_fields(spec: WorkloadSpec) -> dict[str, Any]:
    """A workload spec's fields for the hash; a workload without tenants hashes as it did before
    mixes existed (its rows' ``config_hash`` stays, so ``validate=`` passes on them)."""
    fields = dataclasses.asdict(spec)
    if not fields["tenants"]:
        del fields["tenants"]
    return fields


def _fleet_fields(fleet: FleetSpec) -> dict[str, Any]:
    """A fleet's fields for the hash; a fleet that does not stream KV layer by layer hashes as it did
    before ``layerwise`` existed (its rows' ``config_hash`` stays, so ``validate=`` passes on them)."""
    fields = dataclasses.asdict(fleet)
    if not fields["layerwise"]:
        del fields["layerwise"]
    return fields


def _window(value: Any) -> float | None:
    """A row's ``window_s``: empty, null or NaN (a file used whole) is None, else seconds within WINDOW_S."""
    number = None if value in (None, "") else as_float(value)
    if value in (None, "") or (number is not None and math.isnan(number)):
        return None
    window: float = check_number("window_s", value, WINDOW_S)
    return window


@dataclass
class RowResult:
    """A simulated row: its results columns, its prompt-length buckets, its token-gap quantiles and
    its per tenant, class and class-bucket rows (``tenants.csv``)."""

    row: dict[str, Any]
    buckets: list[dict[str, Any]]
    tbt_quantiles: np.ndarray
    tenants: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def simulate(spec: RunSpec) -> tuple[Trace, SimResult]:
    """Run ``spec``'s policy (a fresh one) on its trace: on one server, or on every server of its
    fleet (both pools of a disaggregated one: decode servers only ever see decodes)."""
    trace = spec.trace()
    setup = spec.setup.build()
    if spec.fleet.servers > 1:
        policy = functools.partial(make_policy, spec.policy)
        decode_router = make_router(spec.fleet.decode_router) if spec.fleet.disaggregated else None
        return trace, setup.fleet_for(
            trace, spec.fleet, policy, make_router(spec.fleet.router), decode_router, spec.seed
        ).run()
    return trace, setup.simulator(trace).run(make_policy(spec.policy))


def run_row(spec: RunSpec) -> RowResult:
    """Simulate ``spec`` and lay its results out as the leaderboard's columns."""
    trace, result = simulate(spec)
    return result_row(spec, trace, result)


def result_row(spec: RunSpec, trace: Trace, result: SimResult, backend: str = BACKEND) -> RowResult:
    """``result`` of serving ``trace`` under ``spec`` as the leaderboard's columns.

    Shared by the simulator's rows and the real engine's (``backend="engine"``, :mod:`engine.replay`),
    so both have the same columns computed by the same code.
    """
    setup = spec.setup.build()
    n = len(result.outcomes.arrival)
    tenants, classes = trace_tenants(trace), trace_classes(trace, spec.setup.slo.name)
    token_times = [result.token_times.get(i) for i in range(n)]
    keys = {
        "policy": spec.policy,
        "workload": spec.workload,
        "load_scale": spec.load_scale,
        "seed": spec.seed,
    }
    row = {
        **keys,
        "backend": backend,
        "hardware": spec.setup.hardware,
        "model": spec.setup.model,
        "tp": spec.setup.tp,
        "slo": spec.setup.slo.name,
        "cost_model": spec.setup.cost_model,
        "split": spec.split,
        "window_s": spec.effective_window_s(),
        "source": trace.source,
        "offset_s": trace.offset_s,
        "span_s": trace.span_s,
        **{k: v for k, v in result.metrics.items() if k not in POOL_SIZES and k not in TRANSFER_COLUMNS},
        **fleet_columns(spec.fleet),
        "load_imbalance": result.metrics.get("load_imbalance", 1.0),
        "goodput_per_gpu": result.metrics["goodput_rps"] / (spec.fleet.servers * spec.setup.tp),
        **{c: result.metrics.get(c, math.nan) for c in TRANSFER_COLUMNS},
        **fairness_summary(result.outcomes, tenants, token_times, trace.span_s, class_weights(trace)),
        "slo_tpot_s": setup.slo.tpot_s,
        "slo_stall_s": setup.slo.stall_s,
        "cost_model_source": setup.cost_model.description,
        "slo_spec": json.dumps(dataclasses.asdict(spec.setup.slo), sort_keys=True),
        "serving": spec.setup.serving,
        "env_version": policy_env_id(spec.policy, envs.ENV_ID),
        "config_hash": spec.config_hash(),
        "git_commit": git_commit(),
    }
    buckets = [{**keys, **bucket} for bucket in bucket_summaries(result.outcomes)]
    gaps = np.concatenate(result.outcomes.gaps) if result.outcomes.gaps else np.empty(0)
    quantiles = np.quantile(gaps, TBT_PROBS) if len(gaps) else np.full(len(TBT_PROBS), np.nan)
    by_tenant = [{**keys, **r} for r in group_rows(result.outcomes, tenants, classes, trace.span_s)]
    return RowResult(row, buckets, quantiles, by_tenant)


@dataclass(frozen=True)
class CapacityJob:
    """One capacity search: ``spec``'s policy, workload and seed (its load scale is searched)."""

    spec: RunSpec
    criterion: str
    rel_tol: float = 0.01
    early_stop: bool = True  # capacity probes stop once decided (same capacities, less work)

    @property
    def label(self) -> str:
        s = self.spec
        return f"{self.criterion} capacity of {s.policy} on {s.workload}, seed {s.seed}"


def run_capacity(job: CapacityJob) -> tuple[float, float]:
    """(load scale, requests/s) at capacity, from the shared search in :mod:`envs.serving.capacity`."""
    s = job.spec
    capacity = measure_capacity(
        s.setup.build(),
        cached_workload(s.workload),
        functools.partial(make_policy, s.policy),
        criterion=job.criterion,
        split=s.split,
        seed=s.seed,
        window_s=s.window_s,
        rel_tol=job.rel_tol,
        whole_split=s.whole_file,
        early_stop=job.early_stop,
        fleet=s.fleet,
        make_router=functools.partial(make_router, s.fleet.router),
        make_decode_router=functools.partial(make_router, s.fleet.decode_router)
        if s.fleet.disaggregated
        else None,
    )
    return capacity.scale, capacity.rps
