"""Fairness metrics between tenants (envs/serving/tenancy.py): properties, a brute-force check of the
service gap, docs/tenants.md's worked example, and the leaderboard's wiring."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.serving.metrics import SLO, RequestOutcomes, load_slo, request_summary
from envs.serving.tenancy import (
    FAIRNESS_COLUMNS,
    fairness_summary,
    group_rows,
    jain,
    max_service_gap,
    service_events,
    service_over_time,
    tenant_codes,
    water_fill,
)
from leaderboard.runs import RunSpec, SetupKey, run_row
from leaderboard.validate import compare

SLO_ = SLO("test", tpot_s=2.0, stall_s=10.0, ttft_base_s=1.5, ttft_factor=0.0, reference_decode_s=0.1)


@dataclass
class Run:
    out: RequestOutcomes
    tenants: list[str]
    times: list[np.ndarray | None]


def outcomes(
    arrival: list[float],
    prompt: list[int],
    times: list[np.ndarray | None],
    scheduled: list[float],
    rejected: list[bool] | None = None,
) -> RequestOutcomes:
    n = len(arrival)
    return RequestOutcomes.from_token_times(
        arrival,
        prompt,
        [len(t) if t is not None else 1 for t in times],
        times,
        scheduled,
        [SLO_.ttft_base_s] * n,
        SLO_,
        reject_reason=["kv" if r else "" for r in (rejected or [False] * n)],
    )


@st.composite
def runs(draw: st.DrawFn, max_tenants: int = 3) -> Run:
    """Small runs on a grid of quarter seconds (so times coincide often), some requests rejected."""
    n = draw(st.integers(1, 8))
    quarter = st.integers(0, 16).map(lambda q: q / 4)
    arrival = sorted(draw(st.lists(quarter, min_size=n, max_size=n)))
    tenants = draw(st.lists(st.sampled_from("ABC"[:max_tenants]), min_size=n, max_size=n))
    prompt = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    rejected = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    times: list[np.ndarray | None] = []
    scheduled = []
    for a, r in zip(arrival, rejected, strict=True):
        wait = draw(quarter)
        steps = draw(st.lists(st.integers(1, 4).map(lambda q: q / 4), min_size=1, max_size=4))
        scheduled.append(a + wait)
        times.append(None if r else a + wait + np.cumsum(steps))
    return Run(outcomes(arrival, prompt, times, scheduled, rejected), tenants, times)


# ---- the worked example of docs/tenants.md ---------------------------------------------------
def test_the_worked_example_of_the_docs() -> None:
    """Tenant A: prompt 1 at 0, tokens at 1 and 3; tenant B: prompt 8 arriving at 0.5, scheduled
    at 2, tokens at 2.5 and 4; window 2.5 s (docs/tenants.md, "Fairness metrics")."""
    times = [np.array([1.0, 3.0]), np.array([2.5, 4.0])]
    out = outcomes([0.0, 0.5], [1, 8], times, [0.0, 2.0])
    assert out.good.tolist() == [True, False]  # TTFT 1 and 2 against a bound of 1.5
    got = fairness_summary(out, ["A", "B"], times, span_s=2.5)
    assert got["tenants"] == 2
    assert got["max_service_gap"] == 10.0  # over [1.5, 2.5]: A 0, B 8 + 2
    shares, level = water_fill(np.array([5.0, 12.0]), 13.0)  # demands: 1 + 2 * 2, 8 + 2 * 2
    assert shares.tolist() == [5.0, 8.0] and level == 8.0
    assert got["jain_maxmin"] == pytest.approx((0.6 + 1.25) ** 2 / (2 * (0.6**2 + 1.25**2)))
    assert got["min_within_share_attainment"] == 1.0  # A alone is within its share
    assert got["weighted_goodput_rps"] == 1 / 2.5  # A met its SLO; no classes: weight 1
    weighted = fairness_summary(out, ["A", "B"], times, span_s=2.5, weights=np.array([3.0, 1.0]))
    assert weighted["weighted_goodput_rps"] == 3 / 2.5  # A as an interactive request counts 3 times


# ---- properties ------------------------------------------------------------------------------
@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=20).filter(lambda x: sum(x) > 0))
def test_jain_lies_in_0_1(x: list[float]) -> None:
    assert 0 < jain(np.array(x)) <= 1 + 1e-12


@given(st.floats(1e-3, 1e6), st.integers(1, 20))
def test_jain_is_1_for_equal_shares(value: float, n: int) -> None:
    assert jain(np.full(n, value)) == pytest.approx(1.0)


def test_jain_of_nothing_served_is_nan() -> None:
    assert math.isnan(jain(np.zeros(3)))


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=20), st.floats(0, 1))
def test_water_filling_delivers_the_capacity_and_never_more_than_a_demand(
    demands: list[float], fraction: float
) -> None:
    d = np.array(demands)
    capacity = fraction * 1.2 * d.sum()
    shares, level = water_fill(d, capacity)
    assert shares.sum() == pytest.approx(min(capacity, d.sum()), rel=1e-9, abs=1e-6)
    assert (shares <= d).all() and (shares >= 0).all()
    capped = d > level
    assert np.allclose(shares[capped], level)  # max-min: every capped tenant gets the same


def brute_gap(run: Run) -> float:
    """The service gap by its definition: every [t1, t2] between candidate times inside both tenants'
    backlog (checked by sampling the interval densely between candidate times), events summed."""
    out = run.out
    names, codes = tenant_codes(run.tenants)
    service = service_events(out, codes, run.times)
    spans = []
    for i in range(len(out.arrival)):
        if out.finished[i]:
            spans.append((codes[i], out.arrival[i], float(run.times[i][-1])))  # type: ignore[index]
        elif not out.reject_reason[i]:
            spans.append((codes[i], out.arrival[i], math.inf))
    edges = sorted({t for _, a, e in spans for t in (a, e) if t < math.inf} | set(service.time.tolist()))

    def backlogged(k: int, t: float) -> bool:
        return any(c == k and a <= t <= e for c, a, e in spans)

    def throughout(k: int, t1: float, t2: float) -> bool:
        inner = [t1, t2, *(x for x in edges if t1 < x < t2)]
        mids = [(x + y) / 2 for x, y in zip(sorted(inner), sorted(inner)[1:], strict=False)]
        return all(backlogged(k, t) for t in [*inner, *mids])

    best = 0.0
    for f in range(len(names)):
        for g in range(f + 1, len(names)):
            for i, t1 in enumerate(edges):
                for t2 in edges[i:]:
                    if throughout(f, t1, t2) and throughout(g, t1, t2):
                        inside = (service.time >= t1) & (service.time <= t2)
                        net = np.where(service.tenant == f, service.amount, 0.0) - np.where(
                            service.tenant == g, service.amount, 0.0
                        )
                        best = max(best, abs(float(net[inside].sum())))
    return best


@settings(max_examples=60, deadline=None)
@given(runs())
def test_the_service_gap_is_the_largest_gap_over_co_backlogged_intervals(run: Run) -> None:
    _, codes = tenant_codes(run.tenants)
    service = service_events(run.out, codes, run.times)
    assert max_service_gap(run.out, codes, run.times, service) == brute_gap(run)


@given(runs())
def test_the_service_gap_is_0_for_one_tenant_and_symmetric(run: Run) -> None:
    one = fairness_summary(run.out, ["solo"] * len(run.tenants), run.times, span_s=4.0)
    assert one["max_service_gap"] == 0.0 and one["tenants"] == 1
    renamed = [{"A": "C", "C": "A"}.get(t, t) for t in run.tenants]  # reverses the pair order of A and C
    a = fairness_summary(run.out, run.tenants, run.times, span_s=4.0)
    b = fairness_summary(run.out, renamed, run.times, span_s=4.0)
    assert a["max_service_gap"] == b["max_service_gap"]


@given(runs())
def test_per_tenant_attainment_aggregates_to_the_runs(run: Run) -> None:
    rows = [r for r in group_rows(run.out, run.tenants, run.tenants, 4.0) if r["group"] == "tenant"]
    total = sum(float(r["requests"]) * float(r["attainment"]) for r in rows)
    assert sum(float(r["requests"]) for r in rows) == len(run.tenants)
    assert total / len(run.tenants) == pytest.approx(request_summary(run.out, 4.0)["slo_attainment"])


@given(runs())
def test_service_over_time_ends_at_each_tenants_total(run: Run) -> None:
    names, codes = tenant_codes(run.tenants)
    service = service_events(run.out, codes, run.times)
    curves = service_over_time(service, len(names), np.array([-1.0, 100.0]))
    assert (curves[:, 0] == 0).all()
    totals = np.bincount(service.tenant, weights=service.amount, minlength=len(names))
    assert curves[:, 1].tolist() == totals.tolist()


@given(runs())
def test_a_lone_tenant_is_within_its_share(run: Run) -> None:
    got = fairness_summary(run.out, ["solo"] * len(run.tenants), run.times, span_s=2.0)
    assert got["min_within_share_attainment"] == float(run.out.good.mean())
    _, codes = tenant_codes(run.tenants)
    served = (service_events(run.out, codes, run.times).time <= 2.0).any()
    assert got["jain_maxmin"] == 1.0 if served else math.isnan(got["jain_maxmin"])


def test_a_tenant_asking_more_than_the_level_is_not_within_its_share() -> None:
    """B asks 12, the level is 8 (the worked example); alone, A's miss decides the metric."""
    times = [np.array([1.0, 3.0]), np.array([2.5, 4.0])]
    out = outcomes([0.0, 0.5], [1, 8], times, [0.0, 2.0])
    out.good[:] = [False, True]
    assert fairness_summary(out, ["A", "B"], times, span_s=2.5)["min_within_share_attainment"] == 0.0


# ---- wiring ----------------------------------------------------------------------------------
SETUP = SetupKey.create("llama3_8b", "a100_80gb", 1, load_slo("strict"), "roofline")


def test_a_single_tenant_run_has_its_own_metrics_as_its_tenant_and_class_rows() -> None:
    result = run_row(RunSpec("sarathi_512", "synthetic_azure_conv", 2.0, 0, SETUP, window_s=10.0))
    row = result.row
    assert row["tenants"] == 1 and row["max_service_gap"] == 0.0
    mine = {r["group"]: r for r in result.tenants if r["group"] in ("tenant", "class")}
    assert mine["tenant"]["name"] == "default" and mine["class"]["name"] == "strict"
    for r in mine.values():
        assert r["requests"] == row["requests"] and r["attainment"] == row["slo_attainment"]
        assert r["goodput_rps"] == row["goodput_rps"]
        for column in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "max_sched_delay_s"):
            assert r[column] == row[column]
    buckets = [r for r in result.tenants if r["group"] == "class_bucket"]
    assert sum(r["requests"] for r in buckets) == row["requests"]
    assert max(r["max_sched_delay_s"] for r in buckets) == row["max_sched_delay_s"]


def test_a_results_row_without_the_fairness_columns_still_validates() -> None:
    fresh = {"goodput_rps": 1.5, **dict.fromkeys(FAIRNESS_COLUMNS, 0.0)}
    assert compare({"goodput_rps": 1.5}, fresh, "row 1") == []
    assert compare({"goodput_rps": 1.5, "max_service_gap": 3.0}, fresh, "row 1") == [
        "row 1, column max_service_gap: expected 3.0, got 0.0"
    ]
