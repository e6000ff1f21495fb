"""The SLO and metric definitions, checked against values computed by hand."""

import math

import numpy as np
import pytest

from envs.serving.metrics import (
    SLO,
    RequestOutcomes,
    bucket_summaries,
    capacity_search,
    load_slo,
    request_summary,
    slo_names,
    stall_of,
)

SLO_T = SLO("t", tpot_s=0.1, stall_s=0.3, ttft_base_s=1.0, ttft_factor=2.0, reference_decode_s=0.02)


def three_requests() -> RequestOutcomes:
    # A: 4 tokens; TTFT 0.5, TPOT 0.5/3 = 0.1667 > 0.1 -> misses.  Gaps 0.1, 0.1, 0.3.
    # B: 1 token; TTFT 1.4 <= bound max(1, 2 * 1.0) = 2.0; a 1-token output meets TPOT -> meets.
    # C: 3 tokens; TTFT 0.6, TPOT 0.05, stall 0.05 -> meets.
    return RequestOutcomes.from_token_times(
        arrival=[0.0, 0.1, 0.2],
        prompt_len=[100, 2000, 5000],
        output_len=[4, 1, 3],
        token_times=[np.array([0.5, 0.6, 0.7, 1.0]), np.array([1.5]), np.array([0.8, 0.85, 0.9])],
        first_scheduled=[0.2, 1.0, 0.3],
        ttft_bound=[SLO_T.ttft_bound(0.2), SLO_T.ttft_bound(1.0), SLO_T.ttft_bound(0.3)],
        slo=SLO_T,
    )


def test_per_request_definitions_by_hand():
    out = three_requests()
    assert out.ttft == pytest.approx([0.5, 1.4, 0.6])
    assert out.tpot == pytest.approx([0.5 / 3, 0.0, 0.05])
    assert out.stall == pytest.approx([0.3, 0.0, 0.05])
    assert out.sched_delay == pytest.approx([0.2, 0.9, 0.1])
    assert out.ttft_bound == pytest.approx([1.0, 2.0, 1.0])
    assert out.good.tolist() == [False, True, True]


def test_system_metrics_by_hand():
    s = request_summary(three_requests(), span_s=2.0)
    assert s["requests"] == 3 and s["finished"] == 3 and s["rejected"] == 0
    assert s["goodput_rps"] == pytest.approx(1.0)  # 2 good requests / 2 s of arrivals
    assert s["slo_attainment"] == pytest.approx(2 / 3)
    assert s["ttft_p50_s"] == pytest.approx(0.6)
    assert s["tpot_p50_s"] == pytest.approx((0.5 / 3 + 0.05) / 2)  # only multi-token outputs
    # TBT pools every gap of every request: 0.05, 0.05, 0.1, 0.1, 0.3
    assert s["tbt_p50_s"] == pytest.approx(0.1)
    assert s["tbt_p99_s"] == pytest.approx(0.1 + 0.96 * 0.2)
    assert s["max_tbt_s"] == pytest.approx(0.3)
    assert s["sched_delay_p50_s"] == pytest.approx(0.2)


def test_vectorised_metrics_equal_the_definitions_exactly():
    """Stalls in one pass and percentiles in one partition give the one-by-one numbers, bit for bit."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 12))
        lens = rng.choice([0, 1, 2, 3, 9], size=n)  # 0: rejected
        times = [
            None if k == 0 else np.cumsum(np.round(rng.random(k), int(rng.integers(1, 4)))) for k in lens
        ]
        arrival = [0.0] * n
        out = RequestOutcomes.from_token_times(
            arrival, [10] * n, [max(int(k), 1) for k in lens], times, arrival, [1.0] * n, SLO_T
        )
        fin = [i for i in range(n) if lens[i]]
        assert out.stall[fin].tolist() == [stall_of(times[i]) for i in fin]
        gaps = np.concatenate(out.gaps)
        s = request_summary(out, span_s=1.0)
        if len(gaps):
            assert [s[f"tbt_p{q}_s"] for q in (50, 95, 99)] == [
                float(np.percentile(gaps, q)) for q in (50, 95, 99)
            ]
            ms = gaps * 1e3
            assert (s["itl_ms_mean"], s["itl_ms_median"], s["itl_ms_std"], s["itl_ms_p99"]) == (
                float(np.mean(ms)),
                float(np.median(ms)),
                float(np.std(ms)),
                float(np.percentile(ms, 99)),
            )
        ttft = out.ttft[out.finished]
        assert s["ttft_p95_s"] == float(np.percentile(ttft, 95)) if len(ttft) else math.isnan(s["ttft_p95_s"])


def test_stall_bound_alone_fails_a_request():
    out = RequestOutcomes.from_token_times(
        [0.0], [10], [3], [np.array([0.1, 0.15, 0.5])], [0.0], [1.0], SLO_T
    )  # TPOT 0.2 fails too; make TPOT pass with a long tail instead:
    assert not out.good[0]
    out = RequestOutcomes.from_token_times(
        [0.0], [10], [6], [np.array([0.1, 0.11, 0.12, 0.13, 0.14, 0.45])], [0.0], [1.0], SLO_T
    )
    assert out.tpot[0] <= SLO_T.tpot_s and out.stall[0] > SLO_T.stall_s and not out.good[0]


def test_rejected_requests_count_against_attainment():
    out = RequestOutcomes.from_token_times(
        [0.0, 0.5],
        [10, 10**6],
        [2, 2],
        [np.array([0.1, 0.15]), None],
        [0.0, -1.0],
        [1.0, 1.0],
        SLO_T,
        reject_reason=["", "too long"],
    )
    s = request_summary(out, span_s=1.0)
    assert s["rejected"] == 1 and s["finished"] == 1 and s["slo_attainment"] == 0.5
    assert math.isnan(out.ttft[1]) and not out.good[1]


def test_buckets_split_by_raw_prompt_length():
    rows = {r["bucket"]: r for r in bucket_summaries(three_requests())}
    assert rows["[0,1k)"]["requests"] == 1 and rows["[0,1k)"]["slo_attainment"] == 0.0
    assert rows["[1k,4k)"]["requests"] == 1 and rows["[4k,16k)"]["requests"] == 1
    assert rows["[64k,inf)"]["requests"] == 0
    assert rows["[4k,16k)"]["tbt_p50_s"] == pytest.approx(0.05)


def test_slo_resolution_follows_sarathis_rule():
    from tests.simtools import make_setup

    setup = make_setup()
    ref = float(setup.cost_model.decode_times(32, np.array([32 * 4096]))[0])
    strict = load_slo("strict").resolve(setup.cost_model)
    relaxed = load_slo("relaxed").resolve(setup.cost_model)
    assert strict.tpot_s == pytest.approx(5 * ref) and relaxed.tpot_s == pytest.approx(25 * ref)
    assert strict.stall_s == pytest.approx(5 * strict.tpot_s)
    assert strict.ttft_bound(0.01) == strict.ttft_base_s  # short prompts: the base
    assert strict.ttft_bound(10.0) == pytest.approx(10.0 * strict.ttft_factor)  # long ones scale


def test_unknown_slo_lists_valid_names():
    with pytest.raises(ValueError, match="strict"):
        load_slo("nope")
    assert {"strict", "relaxed"} <= set(slo_names())


@pytest.mark.parametrize("boundary", [0.003, 0.7, 1.0, 3.3, 100.0])
def test_capacity_search_brackets_the_boundary(boundary):
    res = capacity_search(lambda s: s <= boundary, rel_tol=0.01)
    lo, hi = res.bracket
    assert lo <= boundary < hi or (res.scale == 0 and boundary < res.bracket[1])
    if res.scale:
        assert (hi - lo) / lo <= 0.01 and res.scale == lo
        assert all(ok == (s <= boundary) for s, ok in res.evaluations)


def test_capacity_search_reports_zero_when_lowest_load_fails():
    res = capacity_search(lambda s: False, min_scale=1 / 8)
    assert res.scale == 0.0 and res.bracket[0] == 0.0


def test_vllm_named_metrics_by_hand():
    s = request_summary(three_requests(), span_s=2.0)
    # TTFT 0.5, 1.4, 0.6 s; E2EL: 1.0 - 0.0, 1.5 - 0.1, 0.9 - 0.2
    assert s["ttft_ms_mean"] == pytest.approx(2500 / 3)
    assert s["ttft_ms_median"] == pytest.approx(600.0)
    assert s["ttft_ms_std"] == pytest.approx(np.std([500.0, 1400.0, 600.0]))
    assert s["e2el_ms_mean"] == pytest.approx((1000 + 1400 + 700) / 3)
    assert s["e2el_ms_p99"] == pytest.approx(1000 + 0.98 * 400)
    assert s["tpot_ms_median"] == pytest.approx(1e3 * (0.5 / 3 + 0.05) / 2)  # multi-token outputs only
    assert s["itl_ms_mean"] == pytest.approx(1e3 * (0.05 + 0.05 + 0.1 + 0.1 + 0.3) / 5)
    assert s["itl_ms_p99"] == pytest.approx(1e3 * s["tbt_p99_s"])
    # the last token (1.5 s) comes before the window ends (2 s): the duration is the window
    assert s["duration_s"] == 2.0 and s["request_throughput"] == pytest.approx(1.5)
    assert s["request_goodput"] == pytest.approx(s["goodput_rps"]) and s[
        "output_throughput"
    ] == pytest.approx(4.0)
    late = request_summary(three_requests(), span_s=1.0)  # now the last token ends the run
    assert late["duration_s"] == pytest.approx(1.5) and late["request_goodput"] == pytest.approx(2 / 1.5)
