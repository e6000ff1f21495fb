"""Batch slots that never bind change nothing, and the advisor's fast search shares probes between
candidates that differ in ``max_num_seqs`` alone only where that holds (advisor.search.slot_twins)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings

from advise import Plan
from advisor.search import Found, TodayProbe, at_rate, search
from baselines import VllmV1
from envs.serving.loop import SimResult
from envs.serving.metrics import RequestOutcomes
from envs.serving.scheduling import Policy
from tests.simtools import make_setup, make_trace, same_run, write_azure
from tests.test_advise import HARDWARE, MAX_LEN, MODEL, SLO_ARGS, plan_for, probe_cases, small_requests

WIDE = 64  # batch slots and lookahead above any run's requests present below


VLLM_CASES = probe_cases().filter(lambda case: case[2].policy is None)
"""test_advise's probe traces with each of the advisor's candidates that is vLLM's own scheduler."""


def serve(trace, blocks: int, policy: Policy, slots: int) -> tuple[SimResult, int]:
    setup = make_setup(
        MODEL, HARDWARE, num_blocks=blocks, max_model_len=MAX_LEN, max_num_seqs=slots, lookahead=slots
    )
    sim = setup.simulator(trace)
    return sim.run(policy), sim.core.peak_present


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VLLM_CASES)
def test_slots_above_the_most_requests_present_serve_exactly_as_more_slots_do(case):
    """The claim the twins' sharing rests on: a run whose requests present (queued, decoding or
    landed) peak at P is the same, token for token and iteration for iteration, under P + 1 batch
    slots and lookahead as under many more."""
    trace, blocks, candidate = case
    wide, peak = serve(trace, blocks, candidate.build_policy(), WIDE)
    assert peak < WIDE, "the wide run's slots never bound"
    tight, tight_peak = serve(trace, blocks, candidate.build_policy(), peak + 1)
    assert tight_peak == peak
    assert same_run(wide, tight)
    assert wide.iterations.keys() == tight.iterations.keys()
    assert all(np.array_equal(wide.iterations[k], tight.iterations[k]) for k in wide.iterations)
    event(f"peak present {'>' if peak > 4 else '<='} 4")


def test_the_peak_counts_every_request_present_at_once():
    """Not vacuous: ten requests at once are ten present, whatever the slots let run."""
    trace = make_trace(np.zeros(10), [500] * 10, [20] * 10)
    _, peak = serve(trace, 0, VllmV1(max_num_batched_tokens=2048), 4)
    assert peak == 10


def test_outcomes_sent_between_processes_come_back_bit_for_bit():
    """RequestOutcomes pickles its token gaps as one array: every field, every gap, the same."""
    trace = make_trace(np.linspace(0, 2, 30), np.arange(1, 31) * 90, [1, 2, 30] * 10)
    run, _ = serve(trace, 0, VllmV1(max_num_batched_tokens=512), WIDE)
    for out in (run.outcomes, run.outcomes.subset(np.zeros(30, dtype=bool))):
        back = pickle.loads(pickle.dumps(out))
        assert isinstance(back, RequestOutcomes) and len(back.gaps) == len(out.gaps)
        for a, b in zip(out.gaps, back.gaps, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        for key, value in vars(out).items():
            if key != "gaps":
                other = getattr(back, key)
                same = (
                    np.array_equal(value, other, equal_nan=value.dtype.kind == "f")
                    if isinstance(value, np.ndarray)
                    else value == other
                )
                assert same, key


# ---- the fast search ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> Path:
    return write_azure(tmp_path_factory.mktemp("twins") / "small.csv", *small_requests())


def searched(plan: Plan, which: list[int]) -> list[Found]:
    return search(
        [plan.setups[i] for i in which],
        [plan.candidates[i] for i in which],
        plan.traffic,
        plan.criterion,
        0.02,
        n_jobs=1,
        fleet=plan.fleet,
        today=True,
    )


@pytest.mark.parametrize("seqs", [256, 2], ids=["never-binding", "binding"])
def test_twins_take_their_leaders_probes_only_where_those_runs_are_theirs(small_trace, seqs):
    """Each larger-slot twin of the current settings gets the capacity, probe verdicts and run at
    today's rate it gets when searched alone; at 256 slots (never reached) every one of its probes
    is its leader's, at 2 slots (reached) some are its own."""
    plan = plan_for(f"trace={small_trace}", *SLO_ARGS, f"current.max_num_seqs={seqs}")
    twins = [
        i for i, c in enumerate(plan.candidates) if c.family == "max_num_seqs" and c.knobs.max_num_seqs > seqs
    ]
    assert len(twins) >= 2
    together = searched(plan, list(range(len(plan.candidates))))
    own_runs = 0
    for i in twins:
        (alone,) = searched(plan, [i])
        assert together[i].result == alone.result
        assert [p.passed for p in together[i].probes] == [p.passed for p in alone.probes]
        assert isinstance(together[i].probes[0], TodayProbe)
        expected = at_rate(plan.setups[i], plan.candidates[i], plan.traffic, recorded=False).outcomes
        today = together[i].today
        assert today is not None
        got = today.outcomes
        assert all(
            np.array_equal(getattr(got, k), getattr(expected, k), equal_nan=True)
            for k in ("ttft", "tpot", "stall")
        )
        own_runs += sum(p.seconds > 0 for p in together[i].probes)
    if seqs == 256:
        assert own_runs == 0
    else:
        assert own_runs > 0
