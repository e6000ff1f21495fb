"""The speculative capacity search decides on exactly the sequential search's probes."""

import functools
import random
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.serving.capacity import (
    CapacityQuery,
    Probe,
    measure_capacities,
    measure_capacity,
    speculative_search,
)
from envs.serving.metrics import capacity_search
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.registry import make_policy


class FakeQuery:
    """Stands in for a CapacityQuery: only ``rel_tol`` and ``trace_at`` are used by the search."""

    def __init__(self, rel_tol: float) -> None:
        self.rel_tol = rel_tol

    def trace_at(self, scale: float) -> None:
        return None


class CountingPool(ThreadPoolExecutor):
    """A thread pool that records what it was asked to run."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.submitted: list[tuple[int, float]] = []

    def submit(self, fn, scale, trace):
        self.submitted.append((id(fn), scale))
        return super().submit(fn, scale, trace)


def _outcome(seed: int, boundary: float, noise: float, scale: float) -> bool:
    """Pass below ``boundary``, with outcomes flipped at random near it (not monotone)."""
    flip = random.Random(hash((seed, scale))).random() < noise
    return (scale <= boundary) != flip


def _probe(seed: int, boundary: float, noise: float, scale: float, trace: None) -> Probe:
    time.sleep(random.Random(hash((seed, scale, 1))).random() * 0.002)  # finish out of order
    return Probe(scale, _outcome(seed, boundary, noise, scale), False, 0, 0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 10**6), st.floats(0.001, 2000.0), st.sampled_from([0.0, 0.3])),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([0.01, 0.05, 0.3]),
    st.integers(2, 5),
    st.integers(0, 3),
)
def test_speculative_search_visits_the_sequential_probe_sequence(searches, rel_tol, width, ahead):
    runs = [functools.partial(_probe, *s) for s in searches]
    with CountingPool(width) as pool:
        found = speculative_search([FakeQuery(rel_tol)] * len(searches), runs, pool, width, ahead)
    assert len(pool.submitted) == len(set(pool.submitted))  # no probe runs twice
    for (seed, boundary, noise), (result, probes) in zip(searches, found, strict=True):
        reference = capacity_search(functools.partial(_outcome, seed, boundary, noise), rel_tol=rel_tol)
        assert result == reference  # scale, bracket and every (scale, outcome), in order
        assert {s for s, _ in reference.evaluations} <= set(probes)


class InFlightPool(CountingPool):
    """Also records how many submitted probes had not finished at each submission."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.pending: list[Future] = []
        self.in_flight: list[int] = []

    def submit(self, fn, scale, trace):
        self.pending = [f for f in self.pending if not f.done()]
        future = super().submit(fn, scale, trace)
        self.pending.append(future)
        self.in_flight.append(len(self.pending))
        return future


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.floats(0.001, 2000.0)), min_size=2, max_size=4),
    st.sampled_from([0.05, 0.3]),
)
def test_probes_queued_ahead_of_a_busy_worker_are_only_ones_the_searches_make(searches, rel_tol):
    # One worker, one probe queued behind it: only the searches' next probes, so none is speculative.
    runs = [functools.partial(_probe, seed, boundary, 0.0) for seed, boundary in searches]
    with InFlightPool(1) as pool:
        found = speculative_search([FakeQuery(rel_tol)] * len(searches), runs, pool, 1, ahead=1)
    for result, probes in found:
        assert set(probes) == {s for s, _ in result.evaluations}
    assert max(pool.in_flight) <= 2
    assert 2 in pool.in_flight  # a second search's next probe waited behind the first
    with InFlightPool(1) as pool:
        speculative_search([FakeQuery(rel_tol)] * len(searches), runs, pool, 1, ahead=0)
    assert max(pool.in_flight) == 1


@pytest.fixture(scope="module")
def azure_code():
    return ServingSetup.from_names(), load_workload("azure_code")


def test_fast_capacities_equal_the_reference_search_bit_for_bit(azure_code):
    setup, workload = azure_code
    queries = [
        CapacityQuery(setup, workload, functools.partial(make_policy, p), "attain90", "test", 0, rel_tol=0.05)
        for p in ("fcfs", "sarathi_512")
    ]
    reference = measure_capacities(queries, early_stop=False, parallel=1)
    with ProcessPoolExecutor(2) as pool:
        fast = measure_capacities(queries, early_stop=True, parallel=2, executor=pool)
    for ref, got in zip(reference, fast, strict=True):
        assert (got.scale, got.rps, got.result) == (ref.scale, ref.rps, ref.result)
        assert [p.passed for p in got.probes] == [ok for _, ok in ref.result.evaluations]
        assert not any(p.decided_early for p in ref.probes)
    assert any(p.decided_early for c in fast for p in c.probes)


def test_tbt_capacity_is_unchanged_with_the_mechanisms_on(azure_code):
    setup, workload = azure_code
    policy = functools.partial(make_policy, "sarathi_512")
    ref = measure_capacity(setup, workload, policy, "tbt", rel_tol=0.1, early_stop=False)
    fast = measure_capacity(setup, workload, policy, "tbt", rel_tol=0.1, parallel=2)
    assert fast.result == ref.result and not any(p.decided_early for p in fast.probes)


def test_bad_search_options_fail_before_any_work(azure_code):
    setup, workload = azure_code
    policy = functools.partial(make_policy, "fcfs")
    with pytest.raises(ValueError, match="parallel must be >= 1, got 0"):
        measure_capacity(setup, workload, policy, parallel=0)
    with pytest.raises(ValueError, match="rel_tol must be in"):
        measure_capacity(setup, workload, policy, rel_tol=1.5)
    with pytest.raises(ValueError, match="unknown capacity criterion 'p99'"):
        measure_capacity(setup, workload, policy, "p99")
