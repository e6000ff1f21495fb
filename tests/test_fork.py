"""Simulator forks (the hindsight oracle's snapshots): a fork continues exactly as the run it was
taken from, running it leaves that run untouched, and the oracle's choices are those of an
oracle that re-simulates every candidate from the start of the trace."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baselines import Sarathi
from envs.serving.scheduling import Rule
from envs.serving.setup import ServingSetup
from envs.serving.simulator import Simulator
from envs.serving.workload import load_workload
from policies.oracle import oracle_run
from tests.simtools import make_setup, make_trace

UNIT = 32  # prefix-cache unit tokens of the generated traces


@st.composite
def forked_runs(draw):
    n = draw(st.integers(1, 30))
    gaps = draw(st.lists(st.floats(0.0, 0.5), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 4000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    shared = draw(st.lists(st.booleans(), min_size=n, max_size=n))  # a shared prefix, or its own
    hashes = [
        [(0 if s else i + 1) * 10_000 + u for u in range(p // UNIT)]
        for i, (s, p) in enumerate(zip(shared, prompts, strict=True))
    ]
    blocks = draw(st.sampled_from([0, 80, 200]))  # small caches: preemptions and rejections
    budget = draw(st.sampled_from([128, 512, 4096]))
    rule = draw(st.sampled_from(["FCFS", "SHORTEST_FIRST", "SLACK_DOOMED_LAST"]))
    at = draw(st.floats(0.0, 1.0))  # fork time, as a share of the arrivals' span
    # prefix hits only with a roomy cache: on a tiny one the core can run out of requests to
    # preempt (a known core bug, outside what this test is about)
    trace = make_trace(np.cumsum(gaps), prompts, outputs, *((None, 0) if blocks else (hashes, UNIT)))
    return trace, blocks, budget, rule, at


def _state(sim: Simulator) -> tuple:
    core = sim.core
    times = {rid: t.tolist() for rid, t in core.token_times.items()}
    log = {name: column.tolist() for name, column in sim.log.arrays().items()}
    counters = (core.now, core.n_good, core.n_bad, core.preemptions, core.latency_ewma, core.kv.used)
    return times, log, counters, [(r.status, r.violated, r.generated) for r in core.requests]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forked_runs())
def test_a_fork_continues_as_the_run_and_leaves_it_untouched(case):
    trace, blocks, budget, rule, at = case
    setup = make_setup(num_blocks=blocks)
    whole = setup.simulator(trace)
    whole.run_until(Sarathi(budget, rule))
    sim = setup.simulator(trace)
    sim.run_until(Sarathi(budget, rule), until_s=at * float(trace.arrival_s[-1]))
    twin = sim.fork()
    twin.run_until(Sarathi(budget, rule))  # the twin first: the original must not feel it
    assert _state(twin) == _state(whole)
    sim.run_until(Sarathi(budget, rule))
    assert _state(sim) == _state(whole)


def run_until(sim: Simulator, action: tuple[int, Rule], until: float) -> bool:
    """Serve with the constant action (budget, rule) until the clock passes ``until``."""
    return sim.run_until(Sarathi(action[0], action[1].name), until_s=until)


def _from_the_start(setup, trace, base, candidates, period_s, horizon_s):
    """The oracle's choices, every candidate's rollout re-simulated from the start of the trace
    (the committed choices so far replayed, then the candidate), with no fork at all."""
    choices: list[tuple[float, int, int]] = []

    def replayed() -> Simulator | None:
        sim = setup.simulator(trace)
        for start, budget, rule in choices:
            sim.advance_to_work()
            run_until(sim, (budget, Rule(rule)), start + period_s)
        return sim if sim.advance_to_work() else None

    while (sim := replayed()) is not None:
        start = sim.core.now
        best, best_score = base, None
        for action in candidates:
            rollout = replayed()
            assert rollout is not None and rollout.core.now == start
            if run_until(rollout, action, start + period_s):
                run_until(rollout, base, start + horizon_s)
            score = rollout.core.n_good - rollout.core.n_bad
            if best_score is None or score > best_score:
                best, best_score = action, score
        choices.append((start, best[0], int(best[1])))
    return choices


def test_the_oracles_snapshots_choose_as_simulating_from_the_start():
    setup = ServingSetup.from_names(cost_model="roofline")
    trace = load_workload("synthetic_azure_conv").window("val", 0, 3.0, 16.0)
    base, budgets, rules, period_s, horizon_s = (
        (512, Rule.FCFS),
        (256, 2048),
        (Rule.FCFS, Rule.SHORTEST_FIRST),
        2.0,
        5.0,
    )
    result, choices = oracle_run(setup.simulator(trace), base, budgets, rules, period_s, horizon_s)
    candidates = [base] + [(b, r) for b in budgets for r in rules]
    assert choices == _from_the_start(setup, trace, base, candidates, period_s, horizon_s)
    assert len({c[1:] for c in choices}) > 1  # the choice changes: the rollouts differ
    assert result.metrics["finished"] + result.metrics["rejected"] == len(trace)


def test_the_causal_oracle_chooses_from_the_arrived_requests_alone():
    """Two traces that differ only after 6 s (there every prompt is one token): without foresight
    the choices before 6 s are the same on both; with it they differ (the rollouts see the change)."""
    setup = ServingSetup.from_names(cost_model="roofline")
    trace = load_workload("synthetic_azure_conv").window("val", 0, 3.0, 16.0)
    split = 6.0
    other = dataclasses.replace(trace, prompt_len=np.where(trace.arrival_s > split, 1, trace.prompt_len))
    args = ((512, Rule.FCFS), (256, 2048), (Rule.FCFS, Rule.SHORTEST_FIRST), 2.0, 5.0)

    def early_choices(t, foresight: bool) -> list[tuple[float, int, int]]:
        result, choices = oracle_run(setup.simulator(t), *args, foresight=foresight)
        assert result.metrics["finished"] + result.metrics["rejected"] == len(t)  # every request served
        return [c for c in choices if c[0] < split]

    assert early_choices(trace, False) == early_choices(other, False)
    assert early_choices(trace, True) != early_choices(other, True)


@pytest.mark.parametrize("keep_log", [True, False])
def test_a_fork_shares_the_finished_history_and_copies_the_live_state(keep_log):
    rng = np.random.default_rng(8)
    trace = make_trace(np.sort(rng.uniform(0, 20, 60)), rng.integers(1, 3000, 60), rng.integers(1, 200, 60))
    sim = make_setup().simulator(trace)
    sim.run_until(Sarathi(512), until_s=10.0)
    twin = sim.fork(keep_log=keep_log)
    core, copy = sim.core, twin.core
    assert core.finished and all(a is b for a, b in zip(core.finished, copy.finished, strict=True))
    assert copy.finished is not core.finished and copy.decode.end is not core.decode.end
    live = [r for r in core.requests if r not in core.finished and r not in core.rejected]
    assert live and not any(a is b for a, b in zip(core.requests, copy.requests, strict=True) if a in live)
    assert (len(twin.log) == len(sim.log)) == keep_log


def test_a_fork_without_foresight_serves_the_arrived_requests_alone():
    rng = np.random.default_rng(9)  # 20 req/s: prompts still wait at 10 s
    trace = make_trace(
        np.sort(rng.uniform(0, 20, 400)), rng.integers(1, 3000, 400), rng.integers(1, 200, 400)
    )
    sim = make_setup().simulator(trace)
    sim.run_until(Sarathi(512), until_s=10.0)
    arrived = sim.core.next_arrival
    assert 0 < arrived < len(trace)
    twin = sim.fork(foresight=False)
    assert [r.rid for r in twin.core.requests] == [r.rid for r in sim.core.requests[:arrived]]
    queued = {id(r) for r in twin.core.queue}  # the queue holds the copies, not the originals
    assert queued and queued <= {id(r) for r in twin.core.requests}
    twin.run_until(Sarathi(512))
    assert len(twin.core.finished) + len(twin.core.rejected) == arrived  # every arrived request ended
    assert sim.core.next_arrival == arrived and len(sim.core.requests) == len(trace)  # the run untouched
