"""TrafficStats (what a server has seen of its workload) and the v4 features that read it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines import Sarathi
from envs.features import FEATURE_NAMES_V3, FEATURE_NAMES_V4, features_v3, features_v4
from envs.serving.traffic import LENGTH_EWMA_ALPHA, RATE_TAU_S, TrafficStats
from envs.serving.workload import window_stats
from tests.simtools import make_sim, make_trace

WARMUP = round(1 / LENGTH_EWMA_ALPHA)


@given(st.lists(st.integers(1, 200_000), min_size=1, max_size=WARMUP))
def test_prompt_statistics_are_the_plain_mean_and_spread_until_the_ewma_takes_over(lengths):
    stats = TrafficStats()
    for i, n in enumerate(lengths):
        stats.arrive(float(i), n)
    logs = np.log1p(lengths)
    assert stats.prompt_log_mean == pytest.approx(logs.mean(), abs=1e-9)
    assert stats.prompt_log_std == pytest.approx(logs.std(), abs=1e-6)


@settings(max_examples=50)
@given(st.lists(st.integers(1, 200_000), min_size=1, max_size=400), st.integers(0, 16_384))
def test_length_statistics_stay_within_what_was_seen(lengths, output):
    stats = TrafficStats()
    for i, n in enumerate(lengths):
        stats.arrive(float(i), n)
        stats.finish(output)
    logs = np.log1p(lengths)
    assert logs.min() - 1e-9 <= stats.prompt_log_mean <= logs.max() + 1e-9
    assert 0.0 <= stats.prompt_log_std <= (logs.max() - logs.min()) / 2 + 1e-9
    assert stats.output_log_mean == pytest.approx(math.log1p(output))


def test_old_samples_fade_at_the_ewma_rate():
    stats = TrafficStats()
    for i in range(WARMUP):
        stats.arrive(float(i), 100)
    for i in range(WARMUP, 3 * WARMUP):
        stats.arrive(float(i), 10_000)
    remaining = (1 - LENGTH_EWMA_ALPHA) ** (2 * WARMUP)  # weight left on the first WARMUP prompts
    expected = remaining * math.log1p(100) + (1 - remaining) * math.log1p(10_000)
    assert stats.prompt_log_mean == pytest.approx(expected)


def test_the_rate_decays_between_arrivals_and_counts_each_one():
    stats = TrafficStats()
    for t in (0.0, 1.0, 2.0):
        stats.arrive(t, 10)
    expected = sum(math.exp(-(5.0 - t) / RATE_TAU_S) for t in (0.0, 1.0, 2.0)) / RATE_TAU_S
    assert stats.rate(5.0) == pytest.approx(expected)
    assert stats.rate(5.0 + 10 * RATE_TAU_S) < stats.rate(5.0) / 1000


def test_the_core_records_every_arrival_and_every_finish():
    rng = np.random.default_rng(3)
    n = 60
    prompts, outputs = rng.integers(20, 4000, n), rng.integers(1, 60, n)
    sim = make_sim(make_trace(np.cumsum(rng.exponential(0.05, n)), prompts, outputs), num_blocks=600)
    sim.run(Sarathi(512))
    traffic = sim.core.traffic
    assert traffic.arrivals == n and traffic.finishes == n
    expected = TrafficStats()
    for p in prompts:
        expected.arrive(0.0, int(p))
    assert traffic.prompt_log_mean == pytest.approx(expected.prompt_log_mean)
    assert traffic.prompt_log_std == pytest.approx(expected.prompt_log_std)
    ends = TrafficStats()
    for req in sim.core.finished:  # in finish order
        ends.finish(req.output_len)
    assert traffic.output_log_mean == pytest.approx(ends.output_log_mean)


def test_v4_is_v3_plus_the_traffic_features_and_they_tell_workloads_apart():
    assert FEATURE_NAMES_V4[: len(FEATURE_NAMES_V3)] == FEATURE_NAMES_V3
    assert FEATURE_NAMES_V4[len(FEATURE_NAMES_V3) :] == (
        "prompt_log_mean",
        "prompt_log_spread",
        "output_log_mean",
    )
    observed = {}
    for name, prompt, output in (
        ("long_prompts_short_answers", 3000, 20),
        ("short_prompts_long_answers", 60, 900),
    ):
        n = 40
        sim = make_sim(make_trace(np.arange(n) * 0.2, [prompt] * n, [output] * n), num_blocks=2000)
        sim.run(Sarathi(512))
        obs = features_v4(sim.view)
        assert obs.shape == (len(FEATURE_NAMES_V4),) and np.all(np.abs(obs) <= 1)
        np.testing.assert_array_equal(obs[: len(FEATURE_NAMES_V3)], features_v3(sim.view))
        observed[name] = obs[len(FEATURE_NAMES_V3) :]
    long_p, short_p = observed["long_prompts_short_answers"], observed["short_prompts_long_answers"]
    assert long_p[0] > short_p[0] and long_p[2] < short_p[2]
    assert long_p[1] == short_p[1] == 0.0  # one prompt length: no spread


def test_window_stats_tell_poisson_from_bursty_arrivals_and_measure_the_prompt_spread():
    rng = np.random.default_rng(0)
    poisson = make_trace(np.cumsum(rng.exponential(0.1, 4000)), [1000] * 4000, [10] * 4000)
    gaps = np.where(np.arange(4000) % 40 == 0, 4.0, 0.001)  # bursts of 40 every 4 s
    bursty = make_trace(np.cumsum(gaps), np.where(np.arange(4000) % 2, 100, 10_000), [10] * 4000)
    calm, bursts = window_stats(poisson), window_stats(bursty)
    assert calm["interarrival_cv"] == pytest.approx(1.0, abs=0.05) and bursts["interarrival_cv"] > 5
    assert calm["prompt_log_std"] == pytest.approx(0.0, abs=1e-12)
    assert bursts["prompt_log_std"] == pytest.approx((math.log1p(10_000) - math.log1p(100)) / 2)
