"""Early stop of capacity probes: a probe stopped early reports the pass/fail of the full run."""

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from baselines import PrefillFirst, Sarathi
from envs.serving.capacity import ProbeRun
from envs.serving.early import Attain90Stop
from envs.serving.metrics import attain90
from tests.simtools import make_setup, make_trace

UNIT = 32  # prefix-cache unit tokens of the generated traces with hash ids


@given(st.integers(1, 3000), st.data())
def test_thresholds_prove_the_outcome_of_every_completion(n, data):
    stop = Attain90Stop.for_requests(n)
    good = data.draw(st.integers(0, n))
    bad = data.draw(st.integers(0, n - good))
    finals = {attain90({"slo_attainment": g / n}) for g in (good, n - bad)}  # the extremes of [good, n - bad]
    if good >= stop.good:
        assert finals == {True}
    if bad >= stop.bad:
        assert finals == {False}
    # the thresholds are the tightest: one request fewer proves nothing
    assert not attain90({"slo_attainment": (stop.good - 1) / n})
    assert attain90({"slo_attainment": (n - stop.bad + 1) / n})


@st.composite
def probes(draw):
    n = draw(st.integers(0, 40))  # 0: an empty window, a fail known before the run
    gaps = draw(st.lists(st.floats(0.0, 0.3), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 6000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 80), min_size=n, max_size=n))
    blocks = draw(st.sampled_from([0, 60, 150, 400]))  # small caches force preemption and rejections
    policy = draw(st.sampled_from(["sarathi_256", "sarathi_2048", "fcfs"]))
    # prefix-cache hits: each request's units come from one of two shared prefixes or its own
    owners = draw(st.lists(st.sampled_from([0, 1, None]), min_size=n, max_size=n))
    hashes = [
        [(i + 2 if o is None else o) * 10_000 + u for u in range(p // UNIT)]
        for i, (o, p) in enumerate(zip(owners, prompts, strict=True))
    ]
    return (
        np.cumsum(gaps),
        prompts,
        outputs,
        blocks,
        policy,
        draw(st.booleans()) and hashes,
    )


def _policy(name: str):
    if name == "fcfs":
        return PrefillFirst(whole_prompts=True)
    return Sarathi(int(name.split("_")[1]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(probes())
def test_a_probe_stopped_early_reports_the_full_runs_outcome(case):
    arrivals, prompts, outputs, blocks, policy, hashes = case
    trace = make_trace(arrivals, prompts, outputs, hashes or None, UNIT if hashes else 0)
    setup = make_setup(num_blocks=blocks)
    full = setup.simulator(trace).run(_policy(policy))
    reference = ProbeRun(setup, lambda: _policy(policy), "attain90", early_stop=False)(1.0, trace)
    fast = ProbeRun(setup, lambda: _policy(policy), "attain90", early_stop=True)(1.0, trace)
    assert reference.passed == attain90(full.metrics) and not reference.decided_early
    assert fast.passed == reference.passed
    event(f"decided early: {fast.decided_early}, passed: {fast.passed}")
    assert fast.requests == reference.requests == len(trace)
    assert reference.requests_decided == len(trace)
    if fast.decided_early:
        assert fast.requests_decided <= len(trace)
    else:
        assert fast.requests_decided == len(trace)


def test_an_overloaded_probe_stops_early_and_the_result_says_partial():
    # 200 long prompts at once: most miss their TTFT, so the fail is known long before the end
    trace = make_trace(np.zeros(200), [8000] * 200, [50] * 200)
    setup = make_setup()
    stop = Attain90Stop.for_requests(len(trace))
    sim = setup.simulator(trace)
    result = sim.run(Sarathi(512), stop=stop.watching(sim.core))
    assert result.stopped and not stop.passed(sim.core)
    assert sim.core.n_bad >= stop.bad and sim.core.n_good + sim.core.n_bad < len(trace)
    full = setup.simulator(trace).run(Sarathi(512))
    assert not full.stopped and not attain90(full.metrics)
    assert len(result.iterations["latency"]) < len(full.iterations["latency"])


def test_tbt_probes_run_to_the_end():
    trace = make_trace(np.zeros(50), [8000] * 50, [20] * 50)
    setup = make_setup()
    probe = ProbeRun(setup, lambda: Sarathi(512), "tbt", early_stop=True)(1.0, trace)
    assert not probe.decided_early and probe.requests_decided == len(trace)
