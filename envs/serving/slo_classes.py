"""SLO classes (``conf/slo_class/NAME.yaml``): per-request TTFT/TPOT bounds, a weight and a priority.

A request of a tenant-labelled trace names its class (``Trace.slo_class``); a request without
one is judged by the run's SLO (``conf/slo``), which stays the run-level recipe.  A class's bounds
use the same recipe as a run's SLO (:class:`~envs.serving.metrics.SLOSpec`), so they scale with the
model and hardware the same way; :meth:`SLOClass.slo_spec` hands them to the code that resolves
SLOs.  The weight is the class's relative importance: the weighted fairness metrics and ``wvtc``
entitle a tenant to service in proportion to it, and weighted goodput counts a met request
``weight`` times (docs/tenants.md).  The priority is vLLM's per-request ``priority`` for the class
(lower is served first under ``--scheduling-policy priority``): the ``priority`` baseline orders by
it and the vLLM plug-in maps a request's priority back to its class.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import yaml

from chunkgym.config import POSITIVE, Rule, from_mapping
from envs.serving.cost_model import CostModel
from envs.serving.metrics import SLO, SLOSpec
from envs.serving.specs import CONF_DIR

SLO_CLASS_DIR = CONF_DIR / "slo_class"
RULES: dict[str, Rule] = {
    key: POSITIVE for key in ("tpot_multiplier", "stall_factor", "ttft_base_s", "ttft_factor", "weight")
}
RULES["priority"] = Rule(
    lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1000, "an integer in [0, 1000]"
)


@dataclass(frozen=True)
class SLOClass:
    """One class: the bounds recipe of :class:`SLOSpec`, a positive weight and vLLM's priority."""

    name: str
    tpot_multiplier: float
    ttft_base_s: float
    ttft_factor: float
    weight: float
    priority: int
    stall_factor: float = 5.0

    def slo_spec(self) -> SLOSpec:
        """The class's bounds as an SLO recipe, resolved like a run's SLO."""
        return SLOSpec(
            name=self.name,
            tpot_multiplier=self.tpot_multiplier,
            ttft_base_s=self.ttft_base_s,
            ttft_factor=self.ttft_factor,
            stall_factor=self.stall_factor,
        )


def slo_class_names() -> list[str]:
    """Names of the classes in ``conf/slo_class``."""
    return sorted(p.stem for p in SLO_CLASS_DIR.glob("*.yaml"))


def load_slo_class(name: str) -> SLOClass:
    """The class ``conf/slo_class/NAME.yaml``; an unknown name raises with the valid ones."""
    path = SLO_CLASS_DIR / f"{name}.yaml"
    if name not in slo_class_names():
        raise ValueError(f"unknown slo_class {name!r}; valid names: {', '.join(slo_class_names())}")
    spec = from_mapping(SLOClass, yaml.safe_load(path.read_text()), str(path), RULES)
    if spec.name != name:
        raise ValueError(f"{path}: field 'name' is {spec.name!r}, expected the file's name {name!r}")
    return spec


@dataclass(frozen=True)
class ClassBounds:
    """A class resolved on one server's cost model: what the core stamps on the class's requests."""

    slo: SLO
    weight: float
    priority: int


def resolve_classes(names: Iterable[str], cost_model: CostModel) -> dict[str, ClassBounds]:
    """Each named class (``conf/slo_class``) resolved on ``cost_model``, by name."""
    out = {}
    for name in sorted(set(names)):
        cls = load_slo_class(name)
        out[name] = ClassBounds(cls.slo_spec().resolve(cost_model), cls.weight, cls.priority)
    return out
