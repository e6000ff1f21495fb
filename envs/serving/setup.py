"""Assemble a serving setup (model, hardware, cost model, SLO, engine settings) from names."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chunkgym.config import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Rule, check, from_mapping
from envs.serving.core import ServingConfig
from envs.serving.cost_model import CostModel, RooflineCostModel, roofline_params
from envs.serving.disaggregation import DisaggregatedFleet
from envs.serving.engine_overhead import DEFAULT_ENGINE_OVERHEAD
from envs.serving.fleet import Fleet, FleetSpec
from envs.serving.kv_transfer import LinkSpec, load_link
from envs.serving.metrics import SLO, SLOSpec, load_slo
from envs.serving.routing import Router
from envs.serving.scheduling import Policy
from envs.serving.simulator import Simulator
from envs.serving.specs import HardwareSpec, ModelSpec, load_hardware, load_model
from envs.serving.workloads.trace import Trace

DEFAULT_MODEL = "llama3_8b"
DEFAULT_HARDWARE = "a100_80gb"
PROFILE_NAME = re.compile(r"[a-z0-9_]+")


def split_cost_model(kind: str) -> tuple[str, str]:
    """``"calibrated:<profile>"`` (or ``"<file>.yaml:<profile>"``) -> the cost model and the engine
    overhead profile's name; a bare kind takes :data:`DEFAULT_ENGINE_OVERHEAD`."""
    base, sep, profile = kind.rpartition(":")
    if (
        sep
        and PROFILE_NAME.fullmatch(profile)
        and (base in ("calibrated", "roofline") or base.endswith((".yaml", ".yml")))
    ):
        return base, profile
    return kind, DEFAULT_ENGINE_OVERHEAD


def make_cost_model(model: ModelSpec, hardware: HardwareSpec, tp: int, kind: str) -> CostModel:
    """``kind``: "calibrated" (fitted file in conf/cost), "roofline" (datasheet v0) or a file path,
    each but the roofline optionally followed by ``:<engine overhead profile>`` (conf/engine_overhead)."""
    if kind == "roofline":
        return RooflineCostModel(roofline_params(model, hardware, tp), "roofline v0 (uncalibrated)")
    from envs.serving.cost_model import load_cost_model

    base, overhead = split_cost_model(kind)
    if base == "roofline":
        raise ValueError(
            f"cost_model={kind!r}: the roofline v0 carries its own nominal overhead; an engine overhead "
            f"profile applies to calibrated files (cost_model=calibrated:{overhead})"
        )
    if base == "calibrated":
        return load_cost_model(model, hardware, tp, engine_overhead=overhead)
    return load_cost_model(model, hardware, tp, path=base, engine_overhead=overhead)


SERVING_RULES: dict[str, Rule] = {
    "block_size": AT_LEAST_ONE,
    "max_num_seqs": AT_LEAST_ONE,
    "max_model_len": Rule(lambda v: v >= 0, "an integer >= 0 (0: the model's max context)"),
    "activation_reserve_gib": NON_NEGATIVE,
    "lookahead": AT_LEAST_ONE,
    "num_blocks": Rule(lambda v: v >= 0, "an integer >= 0 (0: from memory)"),
}
SLO_RULES: dict[str, Rule] = {
    "tpot_multiplier": POSITIVE,
    "ttft_base_s": POSITIVE,
    "ttft_factor": POSITIVE,
    "stall_factor": POSITIVE,
    "reference_batch": AT_LEAST_ONE,
    "reference_context": AT_LEAST_ONE,
}
"""Ranges of ``serving.*`` and ``slo.*``, checked by every tool before it runs anything."""


def serving_config(overrides: dict[str, Any] | ServingConfig | None) -> ServingConfig:
    """Engine settings from a mapping of overrides (or as given), each checked against its range."""
    if not isinstance(overrides, ServingConfig):
        overrides = from_mapping(ServingConfig, overrides or {}, "serving")
    check(overrides, SERVING_RULES, "", at="serving")
    return overrides


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
        slo = slo or load_slo("strict")
        check(slo, SLO_RULES, "", at="slo")
        cm = make_cost_model(model, hardware, tp, cost_model)
        return cls(model, hardware, tp, cm, slo.resolve(cm), serving_config(serving), cost_model)

    def fleet(
        self,
        trace: Trace,
        replicas: int,
        make_policy: Callable[[], Policy],
        router: Router,
        seed: int = 0,
    ) -> Fleet:
        """``replicas`` simulated servers of this setup, each scheduling with its own ``make_policy()``,
        behind ``router``, serving ``trace``."""
        servers = [self._server(trace) for _ in range(replicas)]
        return Fleet(trace, servers, [make_policy() for _ in range(replicas)], router, seed)

    def fleet_for(
        self,
        trace: Trace,
        spec: FleetSpec,
        make_policy: Callable[[], Policy],
        router: Router,
        decode_router: Router | None = None,
        seed: int = 0,
        **disaggregation: Any,
    ) -> Fleet | DisaggregatedFleet:
        """The fleet ``spec`` names: ``spec.replicas`` colocated servers (:meth:`fleet`, today's
        fleet, whatever ``decode_router``), or with ``spec.prefill`` > 0 a disaggregated fleet
        (:meth:`disaggregated_fleet`, which takes ``disaggregation``'s keywords; ``layerwise`` is
        ``spec.layerwise`` unless one of them names it), so every tool that builds from a spec
        streams KV as the spec says."""
        if not spec.disaggregated:
            return self.fleet(trace, spec.replicas, make_policy, router, seed)
        if decode_router is None:
            raise ValueError(f"fleet.prefill={spec.prefill}: a disaggregated fleet needs a decode router")
        return self.disaggregated_fleet(
            trace,
            spec.prefill,
            spec.decode,
            make_policy,
            router,
            decode_router,
            spec.link,
            seed,
            **{"layerwise": spec.layerwise, **disaggregation},
        )

    def disaggregated_fleet(
        self,
        trace: Trace,
        prefill: int,
        decode: int,
        make_policy: Callable[[], Policy],
        router: Router,
        decode_router: Router,
        link: str | LinkSpec = "nvlink",
        seed: int = 0,
        decode_setup: ServingSetup | None = None,
        make_decode_policy: Callable[[], Policy] | None = None,
        layerwise: bool = False,
    ) -> DisaggregatedFleet:
        """``prefill`` simulated prefill servers of this setup behind ``router`` and ``decode`` decode
        servers of ``decode_setup`` (default: this one; another GPU or cost model per pool) behind
        ``decode_router``, joined by ``link`` (a ``conf/link`` name or a spec), each server scheduling
        with its own ``make_policy()`` (the decode pool's: ``make_decode_policy()``, default the same).
        The requests' SLO bounds are set on admission to a prefill server, from this setup's SLO."""
        dec = decode_setup or self
        spec = link if isinstance(link, LinkSpec) else load_link(link)
        return DisaggregatedFleet(
            trace,
            [self._server(trace) for _ in range(prefill)],
            [dec._server(trace) for _ in range(decode)],
            [make_policy() for _ in range(prefill)],
            [(make_decode_policy or make_policy)() for _ in range(decode)],
            router,
            decode_router,
            spec,
            self.model,
            self.tp,
            layerwise,
            seed,
            dec.tp,
        )

    def _server(self, trace: Trace) -> Simulator:
        """An empty simulated server of this setup (a fleet's router submits its requests)."""
        return Simulator(
            trace,
            self.model,
            self.hardware,
            self.cost_model,
            self.slo,
            self.config,
            self.tp,
            serve_trace=False,
        )

    def simulator(self, trace: Trace, time_scale: float = 1.0) -> Simulator:
        """A simulator serving ``trace``; ``time_scale``: see :class:`~envs.serving.simulator.CostModelClock`."""
        return Simulator(
            trace, self.model, self.hardware, self.cost_model, self.slo, self.config, self.tp, time_scale
        )
