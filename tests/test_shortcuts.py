"""The core's shortcuts (cheaper SLO verdicts, deferred stretch bookkeeping, chunk stretches run
without the policy) change no result: runs with them on and off agree bit for bit, iteration by
iteration, over generated workloads, policies and run segments."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baselines import Adaptive, Sarathi
from envs.serving.decode_group import DecodeGroup
from envs.serving.loop import CountStop
from envs.serving.metrics import tpot_of
from envs.serving.shortcuts import NO_SHORTCUTS, PROBE_SHORTCUTS, Shortcuts
from envs.serving.simulator import CostModelClock, Simulator
from tests.simtools import make_setup, make_trace

UNIT = 32


@st.composite
def runs(draw):
    n = draw(st.integers(1, 30))
    gaps = draw(st.lists(st.floats(0.0, 0.5), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 4000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))  # long: numpy stretches
    blocks = draw(st.sampled_from([0, 50, 80, 200]))  # small caches: preemptions, resumed requests
    hashes = [[(i % 3) * 10_000 + u for u in range(p // UNIT)] for i, p in enumerate(prompts)]
    rule = draw(st.sampled_from(["FCFS", "SHORTEST_FIRST", "SLACK_DOOMED_LAST"]))
    if draw(st.booleans()):
        policy = (Sarathi, draw(st.sampled_from([128, 512, 4096, 16384])), rule)
    else:  # targets of 15-74 ms: 256-2048-token levels for these prompts; spend_slack never follows
        policy = (Adaptive, draw(st.sampled_from([0.2, 0.3, 1.0])), rule.lower(), draw(st.booleans()))
    segment_s = draw(st.sampled_from([math.inf, 0.05, 0.3]))  # run_until's until_s, as the oracle's periods
    trace = make_trace(np.cumsum(gaps), prompts, outputs, *((None, 0) if blocks else (hashes, UNIT)))
    return trace, blocks, policy, segment_s


def _run(
    trace, blocks: int, policy: tuple, segment_s: float, shortcuts: Shortcuts
) -> tuple[Simulator, list[tuple]]:
    sim = make_setup(num_blocks=blocks).simulator(trace)
    core = sim.core
    core.shortcuts = shortcuts
    seen: list[tuple] = []

    def record() -> bool:  # after every iteration or stretch: what the policy and the rewards see
        seen.append(
            (core.now, core.n_good, core.n_bad, core.n_credited, core.n_uncredited, core.min_tpot_slack())
        )
        return False

    make, *args = policy
    served = make(*args)
    end = segment_s
    while sim.run_until(served, stop=record, until_s=end):
        end += segment_s
    return sim, seen


def _kv_counts(core) -> tuple[int, int, int, int]:
    kv = core.kv
    return kv.free, kv.empty, kv.private, kv.evictions


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a.values(), b.values(), strict=True)
    )


STOPS_ALIKE = dataclasses.replace(NO_SHORTCUTS, fast_forward=True)
"""The reference path, but a decode-only stretch still runs between two ``stop()`` calls, as on the
fast path, so both runs are asked at the same states (tests/test_simulator.py checks the
fast-forward itself, iteration by iteration)."""


@pytest.mark.parametrize("shortcuts", [Shortcuts(), PROBE_SHORTCUTS], ids=["default", "probe"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=runs())
def test_runs_with_and_without_shortcuts_agree_at_every_iteration(shortcuts, case):
    (on, seen_on), (off, seen_off) = (_run(*case, shortcuts=shortcuts), _run(*case, STOPS_ALIKE))
    recorded = on.log.records
    assert recorded is not shortcuts.unlogged  # a probe's stretches count no KV per iteration
    assert seen_on == seen_off
    c_on, c_off = on.core, off.core
    assert _kv_counts(c_on) == _kv_counts(c_off)
    assert [(r.status, r.violated, r.credited, r.generated) for r in c_on.requests] == [
        (r.status, r.violated, r.credited, r.generated) for r in c_off.requests
    ]
    assert (c_on.latency_ewma, c_on.last_latency, c_on.decode.slack_base) == (
        c_off.latency_ewma,
        c_off.last_latency,
        c_off.decode.slack_base,
    )
    assert list(c_on.token_times) == list(c_off.token_times)  # the same finish order
    assert all(np.array_equal(c_on.token_times[k], t) for k, t in c_off.token_times.items())
    if recorded:
        assert _same(on.result().metrics | {"sim_wall_s": 0.0}, off.result().metrics | {"sim_wall_s": 0.0})


@pytest.mark.parametrize(
    "policy", [(Sarathi, 512, "FCFS"), (Adaptive, 0.3, "fcfs"), (Adaptive, 0.3, "shortest_first")]
)
def test_chunk_stretches_run_long_prompts_without_asking_the_policy(policy):
    # Eight 12k-token prompts arriving together, with streams decoding: every prompt is served
    # in chunks; only its first chunks, its last and the ones around an arrival are planned.
    trace = make_trace(
        [0.0, 0.0, *np.linspace(0.5, 3.0, 8)], [300, 300, *[12_000] * 8], [400, 400, *[50] * 8]
    )
    runs = {}
    for shortcuts in (Shortcuts(), NO_SHORTCUTS):
        counted = _counted(*policy)
        sim = make_setup().simulator(trace)
        sim.core.shortcuts = shortcuts
        result = sim.run(counted)
        runs[shortcuts.chunk_stretches] = counted.plans, result
    (planned, on), (every, off) = runs[True], runs[False]
    assert planned < every / 4
    assert _same(on.metrics | {"sim_wall_s": 0.0}, off.metrics | {"sim_wall_s": 0.0})
    assert all(np.array_equal(on.iterations[k], off.iterations[k]) for k in off.iterations)


def _counted(make, *args):
    """A ``make(*args)`` policy that counts its ``plan`` calls in ``plans`` (``follow`` is its own)."""

    class Counted(make):
        plans = 0

        def plan(self, view):
            self.plans += 1
            return super().plan(view)

    return Counted(*args)


def test_a_long_wait_after_a_preemption_misses_the_stall_bound_though_tpot_is_met():
    # Request 1 is preempted (50 KV blocks) and resumes more than 3x the stall bound after its
    # last token, while its TPOT stays within bound: only its resume gap says it misses.
    trace = make_trace(
        [0.014, 0.038, 0.087, 0.135, 0.172, 0.199],
        [556, 177, 439, 109, 204, 582],
        [197, 230, 152, 90, 198, 268],
    )
    for shortcuts in (Shortcuts(), NO_SHORTCUTS):
        sim, _ = _run(trace, 50, (Sarathi, 512, "FCFS"), math.inf, shortcuts)
        core, req = sim.core, sim.core.requests[1]
        times = core.token_times[req.rid]
        assert req.preemptions and req.resume_gap > core.slo.stall_s
        assert tpot_of(times) <= core.slo.tpot_s and times[0] - req.arrival <= req.ttft_bound
        assert req.violated
        assert int(sim.result().outcomes.good.sum()) == core.n_good


def test_shortcuts_are_set_before_the_run_starts():
    sim = make_setup().simulator(make_trace([0.0, 0.1], [100, 100], [5, 5]))
    sim.core.shortcuts = NO_SHORTCUTS
    sim.run_until(Sarathi(512, "FCFS"), until_s=0.05)
    with pytest.raises(ValueError, match="set before a run starts"):
        sim.core.shortcuts = Shortcuts()


def test_a_followed_adaptive_level_is_priced_again_once_a_decode_leaves():
    # Streams finishing one by one while 12k-token prompts are served in chunks: with fewer
    # decodes, the level above the followed one can fit again (at 0.3 x TPOT here it does), so the
    # follower's "still over the target" holds only while the decode count is the one it was
    # priced at.
    n = 24
    trace = make_trace(
        [*np.linspace(0, 0.2, n), *np.linspace(1.0, 3.0, 6)],
        [3000] * n + [12_000] * 6,
        [*np.linspace(30, 600, n).astype(int), *[20] * 6],
    )
    for fraction in (0.25, 0.3, 0.4):
        iterations = []
        for shortcuts in (Shortcuts(), NO_SHORTCUTS):
            sim = make_setup().simulator(trace)
            sim.core.shortcuts = shortcuts
            iterations.append(sim.run(Adaptive(fraction, "fcfs")).iterations)
        on, off = iterations
        assert all(np.array_equal(on[k], off[k]) for k in off), fraction


@st.composite
def segment_runs(draw):
    """Runs whose chunk stretches are long and often cut: long prompts, arrivals close together,
    shared prefixes in small caches (evictions, preemptions), budgets whose iterations stall."""
    n = draw(st.integers(2, 30))
    gaps = draw(st.lists(st.floats(0.0, 0.3), min_size=n, max_size=n))
    prompt = st.one_of(st.integers(1, 3000), st.integers(3000, 60_000))
    prompts = draw(st.lists(prompt, min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    blocks = draw(st.sampled_from([0, 150, 400, 800, 4000]))
    hashes = [[(i % 3) * 10_000 + u for u in range(p // UNIT)] for i, p in enumerate(prompts)]
    rule = draw(st.sampled_from(["FCFS", "SHORTEST_FIRST"]))
    if draw(st.booleans()):
        policy = (Sarathi, draw(st.sampled_from([128, 256, 512, 2048, 8192, 16384])), rule)
    else:
        policy = (Adaptive, draw(st.sampled_from([0.2, 0.3, 0.6, 1.0, 3.0])), rule.lower())
    segment_s = draw(st.sampled_from([math.inf, 0.05, 0.3]))
    cached = draw(st.booleans())
    trace = make_trace(np.cumsum(gaps), prompts, outputs, *((hashes, UNIT) if cached else (None, 0)))
    stall_scale = draw(st.sampled_from([1.0, 0.25]))  # a tight stall bound: segments cut at stalls
    return trace, blocks, policy, segment_s, stall_scale


def _segmented(
    trace,
    blocks: int,
    policy: tuple,
    segment_s: float,
    stall_scale: float,
    good: int,
    bad: int,
    segments: bool,
):
    """A run with ``CountStop(good, bad)`` until it holds, then to the end, in ``segment_s`` pieces,
    under the strict SLO with its stall bound times ``stall_scale``; the states it stopped at: where
    and when the stop held."""
    setup = make_setup(num_blocks=blocks)
    setup = dataclasses.replace(
        setup, slo=dataclasses.replace(setup.slo, stall_s=setup.slo.stall_s * stall_scale)
    )
    sim = setup.simulator(trace)
    core = sim.core
    core.shortcuts = Shortcuts(segments=segments)
    make, *args = policy
    served = make(*args)
    stop: CountStop | None = CountStop(core, good, bad)
    seen, end = [], segment_s
    while sim.run_until(served, stop=stop, until_s=end):
        seen.append((core.now, core.n_good, core.n_bad, core.decode.clock, stop is not None and stop()))
        if stop is not None and stop():
            stop = None
        if core.now >= end:
            end += segment_s
    return sim, seen


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=segment_runs(), good=st.integers(1, 30), bad=st.integers(1, 30))
def test_chunk_stretches_run_in_segments_reach_the_state_of_iteration_by_iteration_runs(case, good, bad):
    """With a count stop (asked once per segment) or none, a stretch run a segment at a time books the
    same iterations, stops where the stop first holds, and ends in the same state, KV cache included."""
    (on, seen_on), (off, seen_off) = (_segmented(*case, good, bad, segments=s) for s in (True, False))
    assert seen_on == seen_off
    log_on, log_off = on.log.arrays(), off.log.arrays()
    assert all(np.array_equal(log_on[k], log_off[k]) for k in log_off)
    c_on, c_off = on.core, off.core
    assert [(r.status, r.violated, r.credited, r.generated, r.prefix_units) for r in c_on.requests] == [
        (r.status, r.violated, r.credited, r.generated, r.prefix_units) for r in c_off.requests
    ]
    assert _kv_counts(c_on) == _kv_counts(c_off)
    assert list(c_on.kv._refs.items()) == list(c_off.kv._refs.items())
    assert list(c_on.kv._evictable) == list(c_off.kv._evictable)
    assert (c_on.latency_ewma, c_on.decode.slack_base) == (c_off.latency_ewma, c_off.decode.slack_base)
    assert all(np.array_equal(c_on.token_times[k], t) for k, t in c_off.token_times.items())


@pytest.mark.parametrize(
    "policy", [(Sarathi, 512, "FCFS"), (Adaptive, 0.3, "fcfs"), (Adaptive, 0.3, "shortest_first")]
)
def test_most_of_a_long_prompts_chunks_run_in_segments(policy, monkeypatch):
    # The trace of test_chunk_stretches_run_long_prompts_without_asking_the_policy, with a count stop
    # that never holds: the segments book most chunk iterations, and the same ones as one by one.
    trace = make_trace(
        [0.0, 0.0, *np.linspace(0.5, 3.0, 8)], [300, 300, *[12_000] * 8], [400, 400, *[50] * 8]
    )
    in_segments = 0
    run_segment = CostModelClock.run_segment

    def counted(self, core, log, *args):
        nonlocal in_segments
        before = len(log)
        ran = run_segment(self, core, log, *args)
        in_segments += len(log) - before
        return ran

    monkeypatch.setattr(CostModelClock, "run_segment", counted)
    runs = {}
    for segments in (True, False):
        sim = make_setup().simulator(trace)
        sim.core.shortcuts = Shortcuts(segments=segments)
        make, *args = policy
        sim.run_until(make(*args), stop=CountStop(sim.core, len(trace) + 1, len(trace) + 1))
        runs[segments] = sim.log.arrays()
    assert all(np.array_equal(runs[True][k], runs[False][k]) for k in runs[False])
    assert in_segments > 0.6 * np.count_nonzero(runs[True]["prefill_tokens"]), "most chunk iterations"


def test_a_segment_ends_where_its_iterations_grow_past_the_stall_bound():
    # One stream decodes while a 60k-token prompt is prefilled in 2k chunks, each longer than the one
    # before (attention over the prompt so far); the stall bound lies between the first chunk's
    # iteration and the last one's, so the stream misses it mid-stretch, in both runs at the same
    # iteration, which a count stop for one miss finds.
    trace = make_trace([0.0, 0.5], [100, 60_000], [3000, 5])
    setup = make_setup()
    cost = setup.cost_model
    first, last = (cost.iteration_time(1, 100 + 50, (2047,), (c,)) for c in (2047, 55_000))
    slo = dataclasses.replace(setup.slo, stall_s=(first + last) / 2, tpot_s=10.0)
    stopped = []
    for segments in (True, False):
        sim = dataclasses.replace(setup, slo=slo).simulator(trace)
        core = sim.core
        core.shortcuts = Shortcuts(segments=segments)
        assert sim.run_until(Sarathi(2048), stop=CountStop(core, 2, 1))
        stream, prompt = core.requests
        assert stream.violated and 0 < prompt.computed < prompt.prompt_len, "missed mid-stretch"
        stopped.append((core.now, core.decode.clock, prompt.computed, sim.log.arrays()["latency"].tolist()))
    assert stopped[0] == stopped[1]


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 32).flatmap(lambda bs: st.lists(st.integers(0, 5), min_size=bs, max_size=bs)),
    st.integers(0, 10_000),
    st.integers(0, 200),
)
def test_blocks_over_sums_block_need_over_the_stretch(phase, clock, count):
    """The shortcut's KV count for an uncounted decode stretch (whole rounds of ``bs`` iterations,
    then a run of residues wrapping past 0) is the per-iteration count's sum."""
    group = DecodeGroup(len(phase), tpot_s=0.05)
    group.phase, group.n = phase, sum(phase)
    assert group.blocks_over(clock, count) == sum(group.block_need(c) for c in range(clock, clock + count))
