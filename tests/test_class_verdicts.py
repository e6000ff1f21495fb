"""Per-request SLO classes in the serving core: each request is judged by its class's bounds, the
verdicts the core counts while it runs are the ones the outcomes compute from the token times, and
the fast paths change none of them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baselines import Sarathi
from envs.serving.shortcuts import NO_SHORTCUTS, Shortcuts
from envs.serving.slo_classes import load_slo_class, resolve_classes
from tests.simtools import make_setup, make_trace

CLASSES = ("interactive", "standard", "batch")


def _labelled(trace, classes):
    return dataclasses.replace(trace, slo_class=tuple(classes), tenant=tuple(f"t_{c}" for c in classes))


def _run(trace, budget=512, shortcuts=None, **serving):
    sim = make_setup(**serving).simulator(trace)
    if shortcuts is not None:
        sim.core.shortcuts = shortcuts
    return sim, sim.run(Sarathi(budget))


def test_each_request_carries_its_class_bounds_weight_and_priority():
    trace = _labelled(make_trace([0.0, 0.0, 0.0], [2000, 2000, 2000], [4, 4, 4]), CLASSES)
    sim, _ = _run(trace)
    resolved = resolve_classes(CLASSES, sim.core.cost_model)
    alone = sim.core.cost_model.prefill_time_alone(2000)
    for req, name in zip(sim.core.requests, CLASSES, strict=True):
        cls, spec = resolved[name], load_slo_class(name)
        assert (req.slo_class, req.tenant) == (name, f"t_{name}")
        assert req.ttft_bound == cls.slo.ttft_bound(alone)
        assert (req.tpot_bound, req.stall_bound) == (cls.slo.tpot_s, cls.slo.stall_s)
        assert (req.weight, req.priority) == (spec.weight, spec.priority)
    bounds = [r.tpot_bound for r in sim.core.requests]
    assert bounds[0] < bounds[1] < bounds[2]  # interactive is tighter than standard, batch looser
    assert sim.core.stall_floor == min(r.stall_bound for r in sim.core.requests)


def test_an_all_standard_trace_is_judged_as_the_strict_run_it_copies():
    """``standard``'s bounds are the run-level ``strict`` recipe: labels change no verdict or time."""
    rng = np.random.default_rng(3)
    n = 40
    trace = make_trace(np.sort(rng.uniform(0, 4, n)), rng.integers(100, 6000, n), rng.integers(1, 200, n))
    _, plain = _run(trace)
    _, labelled = _run(_labelled(trace, ["standard"] * n))
    assert np.array_equal(plain.outcomes.good, labelled.outcomes.good)
    assert plain.metrics["slo_attainment"] == labelled.metrics["slo_attainment"]
    assert np.array_equal(plain.outcomes.ttft, labelled.outcomes.ttft, equal_nan=True)


def test_the_same_schedule_meets_a_loose_class_and_misses_a_tight_one():
    """One long prompt stalls a stream: the tokens are the same whatever the labels (FCFS order does
    not read them), the verdicts follow each request's class."""
    trace = make_trace([0.0, 0.0, 0.05], [64, 64, 30000], [400, 400, 2])
    times = None
    verdicts = {}
    for name in ("interactive", "batch"):
        sim, result = _run(_labelled(trace, [name] * 3), budget=32768)
        if times is None:
            times = sim.core.token_times
        assert all(np.array_equal(times[k], sim.core.token_times[k]) for k in times)
        verdicts[name] = result.outcomes.good
    assert verdicts["batch"].sum() > verdicts["interactive"].sum()


@st.composite
def mixed_runs(draw):
    n = draw(st.integers(1, 25))
    gaps = draw(st.lists(st.floats(0.0, 0.4), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 9000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    classes = draw(st.lists(st.sampled_from(CLASSES), min_size=n, max_size=n))
    budget = draw(st.sampled_from([64, 512, 4096]))
    blocks = draw(st.sampled_from([0, 600]))  # 0: sized from the GPU; 600: preemptions
    return np.cumsum(gaps), prompts, outputs, classes, budget, blocks


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mixed_runs())
def test_counted_verdicts_are_the_outcomes_and_the_fast_paths_keep_them(case):
    arrivals, prompts, outputs, classes, budget, blocks = case
    trace = _labelled(make_trace(arrivals, prompts, outputs), classes)
    runs = {}
    for shortcuts in (Shortcuts(), NO_SHORTCUTS):
        sim, result = _run(trace, budget, shortcuts, num_blocks=blocks, max_model_len=16384)
        out = result.outcomes
        assert sim.core.n_good == int(out.good.sum())
        assert sim.core.n_bad == len(out.good) - int(out.good.sum())
        runs[shortcuts.fast_forward] = out
    assert np.array_equal(runs[True].good, runs[False].good)
    assert np.array_equal(runs[True].stall, runs[False].stall, equal_nan=True)


@pytest.mark.parametrize("name", CLASSES)
def test_a_request_meets_its_class_exactly_when_its_times_are_within_the_class_bounds(name):
    rng = np.random.default_rng(11)
    n = 30
    trace = make_trace(np.sort(rng.uniform(0, 2, n)), rng.integers(100, 8000, n), rng.integers(1, 100, n))
    sim, result = _run(_labelled(trace, [name] * n))
    out = result.outcomes
    cls = resolve_classes([name], sim.core.cost_model)[name].slo
    expected = (
        out.finished & (out.ttft <= out.ttft_bound) & (out.tpot <= cls.tpot_s) & (out.stall <= cls.stall_s)
    )
    assert np.array_equal(out.good, expected)
