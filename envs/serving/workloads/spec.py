"""``WorkloadSpec``: one ``conf/workload/NAME.yaml``, and the Hydra schema of the ``workload`` group."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from envs.serving.workloads.trace import class_problem, label_problem

FORMATS = ("azure", "mooncake", "lengths", "servegen", "synthetic", "mix")
ARRIVAL_PROCESSES = ("poisson", "gamma")


@dataclass
class TenantSpec:
    """One tenant of a mix: its requests come from ``source`` (a workload name or ``file:PATH``),
    at ``share`` of the mix's request rate (shares are relative: 10, 1, 1 gives 10/12, 1/12, 1/12),
    labelled ``name`` and judged by the SLO class ``slo_class`` (``conf/slo_class``)."""

    name: str
    source: str
    share: float
    slo_class: str


@dataclass
class WorkloadSpec:
    """Where a workload's requests come from and how its windows are cut and scaled.

    ``rate_scale`` multiplies the arrival rate so that ``load_scale=1.0`` is a moderate load;
    ``window_s`` is one evaluation/training window in trace seconds (before rate scaling).
    ``arrival_process``, ``base_rate`` and ``burstiness_cv`` shape the generated arrivals of
    length-only files (``base_rate`` > 0 also overrides the fitted rate of ``synthetic``);
    ``slot_jitter_s`` spreads timestamps quantised to slots (Mooncake conversation: 3 s)
    uniformly over their slot. ``allow_synthetic`` lets the Azure-conv fit stand in when the
    data file is absent. ``length_scale`` divides every prompt and output length (small models
    on a CPU replay the same arrival pattern with lighter requests; see ``Trace.scale_lengths``).

    Format ``mix`` composes ``tenants`` (docs/tenants.md): ``base_rate`` is then the mix's request
    rate in requests per trace second, which each tenant's share divides; ``path`` stays empty.
    """

    name: str
    format: str
    path: str = ""
    rate_scale: float = 1.0
    window_s: float = 300.0
    arrival_process: str = "poisson"
    base_rate: float = 0.0
    burstiness_cv: float = 1.0
    slot_jitter_s: float = 0.0
    allow_synthetic: bool = False
    length_scale: float = 1.0
    tenants: list[TenantSpec] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        """Ranges (types are checked by :func:`chunkgym.config.from_mapping` and by Hydra)."""
        where = f"workload {self.name!r}"
        if self.format not in FORMATS:
            raise ValueError(f"{where}: unknown format {self.format!r}; valid formats: {', '.join(FORMATS)}")
        if self.arrival_process not in ARRIVAL_PROCESSES:
            raise ValueError(
                f"{where}: unknown arrival_process {self.arrival_process!r}; "
                f"valid: {', '.join(ARRIVAL_PROCESSES)}"
            )
        for field, low_ok in (
            ("rate_scale", False),
            ("window_s", False),
            ("length_scale", False),
            ("burstiness_cv", False),
            ("base_rate", True),
            ("slot_jitter_s", True),
        ):
            value = getattr(self, field)
            if not (math.isfinite(value) and (value > 0 or (low_ok and value == 0))):
                bound = ">= 0" if low_ok else "> 0"
                raise ValueError(f"{where}: {field} must be a finite number {bound}, got {value!r}")
        if self.format == "lengths" and self.base_rate <= 0:
            raise ValueError(f"{where}: format 'lengths' needs base_rate > 0 (requests/s of the arrivals)")
        if self.format == "mix":
            self._check_mix(where)
        elif self.tenants:
            raise ValueError(f"{where}: tenants are for format 'mix' only, not {self.format!r}")
        elif self.format != "synthetic" and not self.path:
            raise ValueError(f"{where}: format {self.format!r} needs a path to its data file")

    def _check_mix(self, where: str) -> None:
        if not self.tenants:
            raise ValueError(f"{where}: format 'mix' needs a non-empty tenants list")
        if self.path:
            raise ValueError(f"{where}: format 'mix' reads its tenants' sources, not a path ({self.path!r})")
        if self.base_rate <= 0:
            raise ValueError(f"{where}: format 'mix' needs base_rate > 0 (requests/s of the whole mix)")
        seen: set[str] = set()
        for i, tenant in enumerate(self.tenants):
            at = f"{where}: tenants[{i}]"
            problem = label_problem(tenant.name) or (
                f"name {tenant.name!r} repeats" if tenant.name in seen else None
            )
            if problem:
                raise ValueError(f"{at}.name: {problem}")
            seen.add(tenant.name)
            if problem := label_problem(tenant.slo_class) or class_problem(tenant.slo_class):
                raise ValueError(f"{at}.slo_class: {problem}")
            if not (math.isfinite(tenant.share) and tenant.share > 0):
                raise ValueError(f"{at}.share: must be a finite number > 0, got {tenant.share!r}")
            if not tenant.source:
                raise ValueError(f"{at}.source: empty; expected a workload name or file:PATH")
