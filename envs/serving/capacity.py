"""Capacity of a policy on a workload: the shared load-scale search run on the simulator.

Two definitions (see :mod:`envs.serving.metrics`): ``attain90`` (DistServe: the highest
load at which >= 90% of requests meet their SLO) and ``tbt`` (Sarathi-Serve: the highest
load at which P99 TBT <= the TPOT bound and the median scheduling delay <= 2 s).  The
window (requests and their order) is fixed by the seed; load scaling only compresses
its arrival times, so every probe serves the same requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from envs.serving.metrics import CapacityResult, attain90, capacity_search, tbt_criterion
from envs.serving.scheduling import Policy
from envs.serving.setup import ServingSetup
from envs.serving.workload import Workload

CRITERIA = ("attain90", "tbt")


@dataclass(frozen=True)
class Capacity:
    """A capacity in load scale and in requests per second, with the search's bracket."""

    criterion: str
    scale: float
    rps: float
    result: CapacityResult


def measure_capacity(
    setup: ServingSetup,
    workload: Workload,
    make_policy: Callable[[], Policy],
    criterion: str = "attain90",
    split: str = "test",
    seed: int = 0,
    window_s: float | None = None,
    rel_tol: float = 0.01,
    whole_split: bool = False,
) -> Capacity:
    """Search the load scale for ``criterion`` on one window (or the whole split).

    ``make_policy`` builds a fresh policy per probe, so stateful policies start clean.
    ``rps`` is the request rate at the found scale: requests / span of the scaled window.
    """
    if criterion not in CRITERIA:
        raise ValueError(f"unknown capacity criterion {criterion!r}; valid: {', '.join(CRITERIA)}")

    def trace_at(scale: float):
        if whole_split:
            return workload.split(split, seed, scale)
        return workload.window(split, seed, scale, window_s)

    def passes(scale: float) -> bool:
        metrics = setup.simulator(trace_at(scale)).run(make_policy()).metrics
        if criterion == "attain90":
            return attain90(metrics)
        return tbt_criterion(metrics, setup.slo.tpot_s)

    result = capacity_search(passes, rel_tol=rel_tol)
    rps = 0.0
    if result.scale > 0:
        trace = trace_at(result.scale)
        rps = len(trace) / trace.span_s
    return Capacity(criterion, result.scale, rps, result)
