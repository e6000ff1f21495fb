"""Assemble a serving setup (model, hardware, cost model, SLO, engine settings) from names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from envs.serving.core import ServingConfig
from envs.serving.cost_model import CostModel, RooflineCostModel, roofline_params
from envs.serving.metrics import SLO, SLOSpec, load_slo
from envs.serving.simulator import Simulator
from envs.serving.specs import HardwareSpec, ModelSpec, load_hardware, load_model
from envs.serving.workloads.trace import Trace

DEFAULT_MODEL = "llama3_8b"
DEFAULT_HARDWARE = "a100_80gb"


def make_cost_model(model: ModelSpec, hardware: HardwareSpec, tp: int, kind: str) -> CostModel:
    """``kind``: "calibrated" (fitted file in conf/cost), "roofline" (datasheet v0) or a file path."""
    if kind == "roofline":
        return RooflineCostModel(roofline_params(model, hardware, tp), "roofline v0 (uncalibrated)")
    from envs.serving.cost_model import load_cost_model

    if kind == "calibrated":
        return load_cost_model(model, hardware, tp)
    return load_cost_model(model, hardware, tp, path=kind)


def serving_config(overrides: dict[str, Any] | ServingConfig | None) -> ServingConfig:
    if isinstance(overrides, ServingConfig):
        return overrides
    names = {f.name for f in dataclasses.fields(ServingConfig)}
    unknown = sorted(set(overrides or {}) - names)
    if unknown:
        raise ValueError(f"unknown serving option(s) {unknown}; valid: {sorted(names)}")
    return ServingConfig(**(overrides or {}))


@dataclass(frozen=True)
class ServingSetup:
    """Everything but the trace and the policy that a run needs."""

    model: ModelSpec
    hardware: HardwareSpec
    tp: int
    cost_model: CostModel
    slo: SLO
    config: ServingConfig = field(default_factory=ServingConfig)
    cost_model_kind: str = "calibrated"

    @classmethod
    def from_names(
        cls,
        model: str = DEFAULT_MODEL,
        hardware: str = DEFAULT_HARDWARE,
        tp: int = 1,
        slo: str = "strict",
        cost_model: str = "calibrated",
        serving: dict[str, Any] | ServingConfig | None = None,
    ) -> ServingSetup:
        return cls.from_specs(
            load_model(model), load_hardware(hardware), tp, load_slo(slo), cost_model, serving
        )

    @classmethod
    def from_specs(
        cls,
        model: ModelSpec,
        hardware: HardwareSpec,
        tp: int = 1,
        slo: SLOSpec | None = None,
        cost_model: str = "calibrated",
        serving: dict[str, Any] | ServingConfig | None = None,
    ) -> ServingSetup:
        """Like :meth:`from_names`, from spec objects (e.g. Hydra-composed, possibly overridden)."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        cm = make_cost_model(model, hardware, tp, cost_model)
        slo = slo or load_slo("strict")
        return cls(model, hardware, tp, cm, slo.resolve(cm), serving_config(serving), cost_model)

    def simulator(self, trace: Trace) -> Simulator:
        return Simulator(trace, self.model, self.hardware, self.cost_model, self.slo, self.config, self.tp)
