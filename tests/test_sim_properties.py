"""Simulator invariants over generated workloads, random valid actions and both admission rules (hypothesis)."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.actions import ACTIONS_V0, NUM_LEVELS, NUM_RULES, ActionSpec
from envs.serving.request import Status
from envs.serving.scheduling import Admission
from tests.simtools import make_sim, make_trace


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 16))
    gaps = draw(st.lists(st.floats(0.0, 0.5), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 3000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    shared = draw(st.booleans())
    hashes = None
    if shared:  # requests draw their units from a small pool, so prefixes repeat
        hashes = [[draw(st.integers(0, 3)) * 100 + k for k in range(-(-p // 64))] for p in prompts]
    blocks = draw(st.sampled_from([0, 60, 150, 400]))  # 0 = the real capacity; small ones force preemption
    actions = draw(
        st.lists(
            st.tuples(st.integers(0, NUM_LEVELS - 1), st.integers(0, NUM_RULES - 1)), min_size=1, max_size=50
        )
    )
    admission = draw(st.sampled_from(list(Admission)))
    return np.cumsum(gaps), prompts, outputs, hashes, blocks, actions, admission


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_invariants_hold_after_every_iteration(w):
    arrivals, prompts, outputs, hashes, blocks, actions, admission = w
    spec = ActionSpec(ACTIONS_V0.rules, admission)
    trace = make_trace(arrivals, prompts, outputs, hashes=hashes, unit=64 if hashes else 0)
    sim = make_sim(trace, num_blocks=blocks)
    core = sim.core
    last_now = -1.0
    step = 0
    while sim.advance_to_work():
        view = sim.view
        level, rule = actions[step % len(actions)]
        mask = spec.mask(view)
        assert mask[:NUM_LEVELS].any() and mask[NUM_LEVELS:].any()
        sim.step(spec.plan(view, level, rule))
        step += 1
        core.kv.check()
        assert core.kv.used + core.kv.free == core.kv.total
        assert core.now >= last_now
        last_now = core.now
        for r in core.requests:
            assert r.computed <= r.target and r.generated <= r.output_len
            assert r.computed <= r.prompt_len + r.generated
        assert step < 100_000
    res = sim.result()
    for r in core.requests:
        assert r.status in (Status.FINISHED, Status.REJECTED)
        if r.status is Status.REJECTED:
            assert r.reject_reason
        else:
            times = res.token_times[r.rid]
            assert len(times) == r.output_len and r.generated == r.output_len
            assert np.all(np.diff(times) >= 0) and times[0] >= r.arrival
    assert core.n_good + core.n_bad == len(trace)
    assert int(res.outcomes.good.sum()) == core.n_good
    assert core.kv.used == 0
