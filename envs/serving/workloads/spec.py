"""``WorkloadSpec``: one ``conf/workload/NAME.yaml``, and the Hydra schema of the ``workload`` group."""

from __future__ import annotations

import math
from dataclasses import dataclass

FORMATS = ("azure", "mooncake", "lengths", "servegen", "synthetic")
ARRIVAL_PROCESSES = ("poisson", "gamma")


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
        if self.format != "synthetic" and not self.path:
            raise ValueError(f"{where}: format {self.format!r} needs a path to its data file")
