"""Fairness between tenants and SLO classes: the metrics of docs/tenants.md, as pure functions.

Inputs are a run's :class:`~envs.serving.metrics.RequestOutcomes`, each request's tenant and SLO
class (arrays in request order) and the finished requests' token times.

**Service** (VTC, Sheng et al., OSDI'24): a tenant's service is its weighted tokens,
``W_IN * prompt tokens + W_OUT * output tokens`` (VTC's defaults 1 and 2).  A request's whole
prompt is served when it is first scheduled (when VTC's counter charges it) and each output token
when it is emitted, so a request's service events are ``(first scheduled, W_IN * prompt)`` and
``(t_i, W_OUT)`` for each token time.  Only finished requests' events are known (a run that stops
early leaves its unfinished requests' partial service out).  Class weights do not multiply service:
service is what a tenant received; weighting it is a scheduler's choice (``wvtc``), not the measure.

**Backlogged**: a tenant is backlogged at ``t`` when one of its requests has arrived and not
finished: each request spans the closed interval [arrival, last token] (to the end of the run
when admitted but unfinished; a rejected request never waits, so it backlogs nothing).

**max_service_gap**: over every pair of tenants and every interval [t1, t2] throughout which both
are backlogged, the largest ``|service_f(t1, t2) - service_g(t1, t2)|``, events at t1 and t2
included.  Exact: the pair's common backlogged time is a union of disjoint intervals; within one,
the net service ``f - g`` summed over the events at or before each event time is a step sequence
P (P = 0 before the first), and the largest gap over its sub-intervals is ``max P - min P``.
Cost: O(E log E) per pair for E events of the two tenants, so O(T * E log E) for T tenants.

**Window**: the trace's arrival window [0, span_s].  A tenant's demand is the service all its
window's requests ask for (rejected ones included); the service delivered in the window is every
event up to span_s.  **Fair shares** split the delivered service by water-filling (max-min
fairness, :func:`water_fill`) over the demands: each tenant gets ``min(demand, level)`` with the
level set so the shares sum to the delivered service.  **jain_maxmin** is Jain's index of each
tenant's delivered service over its fair share (1: every tenant got its max-min share).  A tenant
**stays within its fair share** when its demand is at most the level (the water-filling did not
cap it: every tenant does when the window's demand was all served);
**min_within_share_attainment** is the lowest SLO attainment among those tenants, NaN when none
qualifies (every tenant asked for more than the level).  A lone tenant is always within its share
(the whole server; nobody can take it), so a one-tenant run's value is its SLO attainment.

**weighted_goodput_rps**: requests that met their SLO per second of the window, each counted its
class's weight times (1 without a class): the goodput a scheduler that values classes maximises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from envs.serving.metrics import BUCKET_EDGES, BUCKET_LABELS, RequestOutcomes, request_summary
from envs.serving.slo_classes import load_slo_class
from envs.serving.workloads.trace import Trace

W_IN = 1.0
"""Service per prompt token (VTC's default)."""
W_OUT = 2.0
"""Service per output token (VTC's default)."""
GROUPS = ("tenant", "class", "class_bucket")
"""``tenants.csv``'s ``group``: per tenant, per SLO class, per class and prompt-length bucket."""
FAIRNESS_COLUMNS = (
    "tenants",
    "max_service_gap",
    "jain_maxmin",
    "min_within_share_attainment",
    "weighted_goodput_rps",
)
"""The results row's fairness columns (:func:`fairness_summary`)."""


@dataclass(frozen=True)
class Service:
    """Every service event of a run, time-sorted: the request and its tenant (a code) and the weighted tokens."""

    request: np.ndarray
    tenant: np.ndarray
    time: np.ndarray
    amount: np.ndarray


def trace_tenants(trace: Trace) -> np.ndarray:
    """Each request's tenant (trace order; :data:`~envs.serving.workloads.trace.DEFAULT_TENANT` without one)."""
    return np.asarray(trace.tenants(), dtype=str)


def class_weights(trace: Trace) -> np.ndarray:
    """Each request's SLO-class weight (trace order): its class's ``weight``, 1 without a class."""
    if trace.slo_class is None:
        return np.ones(len(trace.arrival_s))
    weight = {name: load_slo_class(name).weight for name in set(trace.slo_class)}
    return np.array([weight[c] for c in trace.slo_class], dtype=np.float64)


def trace_classes(trace: Trace, run_class: str) -> np.ndarray:
    """Each request's SLO class (trace order): the trace's ``slo_class``, ``run_class`` (the run's SLO) without one."""
    classes = trace.slo_class if trace.slo_class is not None else (run_class,) * len(trace.arrival_s)
    return np.asarray(classes, dtype=str)


def tenant_codes(names: Sequence[str] | np.ndarray) -> tuple[list[str], np.ndarray]:
    """(sorted distinct names, each request's index into them)."""
    distinct, codes = np.unique(np.asarray(names, dtype=str), return_inverse=True)
    return [str(n) for n in distinct], codes.astype(np.int64)


def demand(out: RequestOutcomes, w_in: float = W_IN, w_out: float = W_OUT) -> np.ndarray:
    """Each request's weighted tokens: the service it asks for."""
    return w_in * out.prompt_len.astype(np.float64) + w_out * out.output_len.astype(np.float64)


def service_events(
    out: RequestOutcomes,
    codes: np.ndarray,
    token_times: Sequence[np.ndarray | None],
    w_in: float = W_IN,
    w_out: float = W_OUT,
) -> Service:
    """The finished requests' prompt (at first scheduling) and output-token events (module docstring)."""
    fin = np.flatnonzero(out.finished)
    out_times = [np.asarray(token_times[i], dtype=np.float64) for i in fin.tolist()]
    lens = np.array([len(t) for t in out_times], dtype=np.int64)
    req = np.concatenate([fin, np.repeat(fin, lens)])
    time = np.concatenate([out.arrival[fin] + out.sched_delay[fin], *out_times])
    amount = np.concatenate([w_in * out.prompt_len[fin].astype(np.float64), np.full(int(lens.sum()), w_out)])
    order = np.argsort(time, kind="stable")
    return Service(req[order], codes[req[order]], time[order], amount[order])


def backlog_intervals(
    out: RequestOutcomes, token_times: Sequence[np.ndarray | None]
) -> tuple[np.ndarray, np.ndarray]:
    """Each request's backlogged span (start, end): [arrival, last token]; unfinished: to infinity;
    rejected: empty (end before start)."""
    start = out.arrival.astype(np.float64)
    end = np.full(len(start), math.inf)
    for i in np.flatnonzero(out.finished).tolist():
        end[i] = np.asarray(token_times[i])[-1]
    rejected = np.array([bool(r) for r in out.reject_reason], dtype=bool)
    end[rejected & ~out.finished] = -math.inf
    return start, end


def merged(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of closed intervals [start, end] (empty ones dropped) as disjoint sorted intervals."""
    keep = end >= start
    start, end = start[keep], end[keep]
    if not len(start):
        return start, end
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    new = np.flatnonzero(np.concatenate([[True], start[1:] > reach[:-1]]))
    return start[new], np.maximum.reduceat(end, new)


def intersection(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """The intersection of two unions of disjoint sorted closed intervals, the same way."""
    (sa, ea), (sb, eb) = a, b
    lo = np.searchsorted(eb, sa, "left")
    hi = np.searchsorted(sb, ea, "right")
    counts = np.maximum(hi - lo, 0)
    i = np.repeat(np.arange(len(sa)), counts)
    j = lo[i] + np.arange(len(i)) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.maximum(sa[i], sb[j]), np.minimum(ea[i], eb[j])


def pair_gap(times: np.ndarray, net: np.ndarray, common: tuple[np.ndarray, np.ndarray]) -> float:
    """The largest |sum of ``net`` over the events in [t1, t2]| over [t1, t2] inside one of ``common``'s intervals.

    ``times`` sorted; ``net``: one tenant's service minus the other's per event.
    """
    starts, ends = common
    seg = np.searchsorted(starts, times, "right") - 1
    inside = seg >= 0
    inside[inside] = times[inside] <= ends[seg[inside]]
    if not inside.any():
        return 0.0
    times, net, seg = times[inside], net[inside], seg[inside]
    moments, at = np.unique(times, return_inverse=True)
    step = np.bincount(at, weights=net, minlength=len(moments))
    seg = seg[np.searchsorted(times, moments, "left")]
    total = np.cumsum(step)
    first = np.flatnonzero(np.concatenate([[True], seg[1:] != seg[:-1]]))
    before = np.concatenate([[0.0], total])[first]
    level = total - np.repeat(before, np.diff(np.append(first, len(total))))
    high = np.maximum(np.maximum.reduceat(level, first), 0.0)
    low = np.minimum(np.minimum.reduceat(level, first), 0.0)
    return float((high - low).max())


def max_service_gap(
    out: RequestOutcomes, codes: np.ndarray, token_times: Sequence[np.ndarray | None], service: Service
) -> float:
    """VTC's service gap (module docstring): 0 for one tenant or when no two are ever backlogged together."""
    start, end = backlog_intervals(out, token_times)
    n = int(codes.max()) + 1 if len(codes) else 0
    spans = [merged(start[codes == k], end[codes == k]) for k in range(n)]
    gap = 0.0
    for f in range(n):
        for g in range(f + 1, n):
            common = intersection(spans[f], spans[g])
            pick = (service.tenant == f) | (service.tenant == g)
            net = np.where(service.tenant[pick] == f, service.amount[pick], -service.amount[pick])
            gap = max(gap, pair_gap(service.time[pick], net, common))
    return gap


def service_over_time(service: Service, n_tenants: int, grid: np.ndarray) -> np.ndarray:
    """Each tenant's cumulative service at each time of ``grid`` (rows: tenants), VTC's figure."""
    curves = np.zeros((n_tenants, len(grid)))
    for k in range(n_tenants):
        mine = service.tenant == k
        total = np.concatenate([[0.0], np.cumsum(service.amount[mine])])
        curves[k] = total[np.searchsorted(service.time[mine], grid, "right")]
    return curves


def water_fill(demands: np.ndarray, capacity: float) -> tuple[np.ndarray, float]:
    """Max-min fair shares of ``capacity`` over ``demands`` and the water level (inf when every
    demand fits): each share is ``min(demand, level)``, and the shares sum to ``min(capacity, total demand)``."""
    d = np.asarray(demands, dtype=np.float64)
    if capacity >= d.sum():
        return d.copy(), math.inf
    left, n, level = float(capacity), len(d), math.inf
    for rank, i in enumerate(np.argsort(d, kind="stable")):
        level = left / (n - rank)
        if d[i] > level:
            break
        left -= float(d[i])
    return np.minimum(d, level), level


def jain(x: np.ndarray) -> float:
    """Jain's fairness index ``(sum x)^2 / (n * sum x^2)``: in (0, 1] for non-negative x not all 0, else NaN."""
    x = np.asarray(x, dtype=np.float64)
    top = float(x.max()) if len(x) else 0.0
    if not top > 0:
        return math.nan
    x = x / top  # the index is scale-free; this keeps tiny values' squares from underflowing to 0
    return float(np.sum(x)) ** 2 / (len(x) * float(np.sum(x * x)))


def fairness_summary(
    out: RequestOutcomes,
    tenants: Sequence[str] | np.ndarray,
    token_times: Sequence[np.ndarray | None],
    span_s: float,
    weights: np.ndarray | None = None,
) -> dict[str, float]:
    """The results row's :data:`FAIRNESS_COLUMNS` (module docstring); ``weights``: each request's
    class weight (:func:`class_weights`), 1 each if None."""
    names, codes = tenant_codes(tenants)
    n = len(names)
    service = service_events(out, codes, token_times)
    windowed = service.time <= span_s
    delivered = np.bincount(service.tenant[windowed], weights=service.amount[windowed], minlength=n)
    asked = np.bincount(codes[out.arrival <= span_s], weights=demand(out)[out.arrival <= span_s], minlength=n)
    shares, level = water_fill(asked, float(delivered.sum()))
    fair = shares > 0
    within = [k for k in range(n) if asked[k] <= level or n == 1]  # a lone tenant's share is the server
    attainment = [float(out.good[codes == k].mean()) for k in within]
    return {
        "tenants": n,
        "max_service_gap": max_service_gap(out, codes, token_times, service),
        "jain_maxmin": jain(delivered[fair] / shares[fair]) if fair.any() else math.nan,
        "min_within_share_attainment": min(attainment) if attainment else math.nan,
        "weighted_goodput_rps": (
            float(out.good.sum() if weights is None else weights[out.good].sum()) / span_s
            if span_s > 0
            else math.nan
        ),
    }


def group_row(group: str, name: str, out: RequestOutcomes, span_s: float) -> dict[str, float | str]:
    """One ``tenants.csv`` row: ``out`` (a group's requests) summarised as the run's own metrics are."""
    s = request_summary(out, span_s)
    return {
        "group": group,
        "name": name,
        "requests": s["requests"],
        "attainment": s["slo_attainment"],
        "goodput_rps": s["goodput_rps"],
        **{k: s[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "max_sched_delay_s")},
    }


def group_rows(
    out: RequestOutcomes,
    tenants: Sequence[str] | np.ndarray,
    classes: Sequence[str] | np.ndarray,
    span_s: float,
) -> list[dict[str, float | str]]:
    """Per tenant, per class, and per class and prompt-length bucket (non-empty ones, name
    ``CLASS:BUCKET``, the buckets of :func:`~envs.serving.metrics.bucket_summaries`): starvation shows
    as a bucket's ``max_sched_delay_s``."""
    tenant_a, class_a = np.asarray(tenants, dtype=str), np.asarray(classes, dtype=str)
    tenant_names, class_names = (tenant_codes(a)[0] for a in (tenant_a, class_a))
    rows = [group_row("tenant", t, out.subset(tenant_a == t), span_s) for t in tenant_names]
    rows += [group_row("class", c, out.subset(class_a == c), span_s) for c in class_names]
    edges = (*BUCKET_EDGES, np.inf)
    for c in class_names:
        for label, lo, hi in zip(BUCKET_LABELS, edges[:-1], edges[1:], strict=True):
            mask = (class_a == c) & (out.prompt_len >= lo) & (out.prompt_len < hi)
            if mask.any():
                rows.append(group_row("class_bucket", f"{c}:{label}", out.subset(mask), span_s))
    return rows
