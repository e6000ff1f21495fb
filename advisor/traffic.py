"""The operator's traffic as one workload whose rate can be scaled: a trace file, a named workload,
or the histograms of a running vLLM's ``/metrics``.

Load scale 1 is the traffic as given (or at ``rate=`` requests per second when the operator names
the rate), so a capacity in load-scale multiples is the headroom over today's traffic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from advisor.prometheus import metrics_workload, read_metrics
from envs.serving.workload import FILE_PREFIX, Workload, load_workload
from envs.serving.workloads.trace import Trace

SPLIT = "all"
"""The advisor serves the whole trace, not a window of one split: it is the operator's traffic."""


@dataclass(frozen=True)
class Traffic:
    """``workload``'s whole trace at ``base_scale`` times its own rate is load scale 1."""

    workload: Workload
    label: str
    seed: int = 0
    base_scale: float = 1.0
    fields_used: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = field(default=())

    def trace_at(self, scale: float) -> Trace:
        return self.workload.split(SPLIT, self.seed, self.base_scale * scale)

    def rate_at(self, scale: float) -> float:
        """Requests per second of the trace at ``scale``."""
        trace = self.trace_at(scale)
        return len(trace) / trace.span_s


def traffic_from(
    trace: str | None,
    workload: str | None,
    metrics: list[str] | None,
    rate: float | None,
    interval_s: float | None,
    arrival_cv: float,
    duration_s: float,
    seed: int,
) -> Traffic:
    """The one traffic source named (exactly one of ``trace``, ``workload``, ``metrics``), checked.

    Raises ValueError naming the key for no source or several, and for a bad rate, file or name.
    """
    named = {"trace": trace, "workload": workload, "metrics": metrics or None}
    given = [k for k, v in named.items() if v]
    if len(given) != 1:
        raise ValueError(
            f"name the traffic with exactly one of trace=PATH, workload=NAME, metrics=PATH "
            f"(or metrics=[A,B]); got {', '.join(given) or 'none'}"
        )
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate={rate!r}: requests per second, a positive number")
    if not (arrival_cv > 0 and math.isfinite(arrival_cv)):
        raise ValueError(f"arrival_cv={arrival_cv!r}: a positive number (1: Poisson)")
    if metrics:
        scraped = read_metrics(metrics, rate=rate, arrival_cv=arrival_cv, interval_s=interval_s)
        source = metrics_workload(scraped, duration_s=duration_s, seed=seed)
        label = f"vLLM /metrics ({', '.join(metrics)})"
        return Traffic(source, label, seed, 1.0, tuple(scraped.fields_used), tuple(scraped.assumptions))
    if trace:
        base = Traffic(
            load_workload(f"{FILE_PREFIX}{trace}"),
            f"trace {trace}",
            seed,
            fields_used=("arrival times (generated for a length-only file)", "prompt and output lengths"),
        )
    else:
        assert workload is not None
        base = Traffic(
            load_workload(workload),
            f"workload {workload}",
            seed,
            fields_used=(f"conf/workload/{workload}.yaml: the trace it names, at its 1x load (rate_scale)",),
        )
    if rate is None:
        return base
    scale = rate / base.rate_at(1.0)
    note = f"arrivals rescaled to rate={rate:g} req/s (the trace's own rate x {scale:.4g})"
    return dataclasses.replace(base, base_scale=scale, assumptions=(note,))
