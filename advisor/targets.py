"""An operator's SLO: percentile targets with ``vllm bench serve``'s names, and when they hold.

A target is ``{ttft,itl,tpot,stall}_ms_p{50,90,95,99}``: TTFT, the pooled inter-token latency,
each request's time per output token, or each request's largest token gap (a pooled ITL
percentile hides a rare long stall, so ``stall`` is over requests). ``p99 <= X`` means at least
99% of the samples are at most X: the inverted-CDF percentile, with no interpolation, so a target
is a count (at most ``N - ceil(0.99 N)`` samples above X) that a run can prove early and a
reader can check by hand. A rejected request counts above every request-level target; the
percentiles reported use the same definition.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from envs.serving.metrics import RequestOutcomes

METRICS = ("ttft", "itl", "tpot", "stall")
PERCENTILES = (50, 90, 95, 99)
KEY = re.compile(r"^(ttft|itl|tpot|stall)_ms_p(\d+)$")
REQUEST_METRICS = ("ttft", "tpot", "stall")
"""One sample per request; ``itl`` pools every token gap of every request."""


@dataclass(frozen=True)
class Target:
    """``metric``'s ``percentile`` at most ``ms`` milliseconds."""

    metric: str
    percentile: int
    ms: float

    @property
    def key(self) -> str:
        return f"{self.metric}_ms_p{self.percentile}"

    @property
    def seconds(self) -> float:
        return self.ms / 1000.0

    def allowed_above(self, samples: int) -> int:
        """How many of ``samples`` may exceed the target: ``N - ceil(p N / 100)``, in integers."""
        return samples - (self.percentile * samples + 99) // 100


def parse_targets(values: Mapping[str, float | None], source: str = "slo") -> tuple[Target, ...]:
    """The targets set in ``values`` (keys as above, None = unset), in a fixed order.

    Raises ValueError naming the key for an unknown name, a percentile other than 50/90/95/99
    or a value that is not a positive number of milliseconds.
    """
    found = []
    for key, value in values.items():
        m = KEY.match(key)
        if not m or int(m.group(2)) not in PERCENTILES:
            names = ", ".join(f"{x}_ms_p{{{','.join(map(str, PERCENTILES))}}}" for x in METRICS)
            raise ValueError(f"{source}.{key}: unknown SLO key; valid: {names}, preset, attainment")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
            raise ValueError(f"{source}.{key}={value!r}: a target is a positive number of milliseconds")
        found.append(Target(m.group(1), int(m.group(2)), float(value)))
    return tuple(sorted(found, key=lambda t: (METRICS.index(t.metric), t.percentile)))


def samples(out: RequestOutcomes, metric: str) -> np.ndarray:
    """Seconds: one per request (inf for a rejected one) or, for ``itl``, every token gap."""
    if metric == "itl":
        return np.concatenate(out.gaps) if out.gaps else np.empty(0)
    values = {"ttft": out.ttft, "tpot": out.tpot, "stall": out.stall}[metric]
    return np.where(out.finished, values, math.inf)


def above(values: np.ndarray, target: Target) -> int:
    """Samples (seconds) over the target, compared in milliseconds as the report prints them."""
    return int(np.count_nonzero(values * 1000.0 > target.ms))


def holds(out: RequestOutcomes, targets: tuple[Target, ...]) -> bool:
    """Every target holds on a finished run (no samples: a request-level target fails, ITL holds)."""
    for t in targets:
        values = samples(out, t.metric)
        if t.metric in REQUEST_METRICS and not len(values):
            return False
        if above(values, t) > t.allowed_above(len(values)):
            return False
    return True


def percentile_ms(values: np.ndarray, percentile: int) -> float:
    """The inverted-CDF percentile in milliseconds (inf past a rejected request; NaN: no samples)."""
    if not len(values):
        return math.nan
    k = (percentile * len(values) + 99) // 100  # the k-th smallest sample, 1-based
    return float(np.partition(values, k - 1)[k - 1]) * 1000.0
