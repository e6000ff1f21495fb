"""The simulator on small hand-made traces: token accounting, stalls, KV pressure, prefix reuse."""

import numpy as np
import pytest

from baselines import Adaptive, PrefillFirst, Sarathi
from envs.serving import simulator
from envs.serving.scheduling import Plan, Policy, Rule, plan_budget
from envs.serving.shortcuts import Shortcuts
from tests.simtools import make_setup, make_sim, make_trace

STEPPED = Shortcuts(fast_forward=False, chunk_stretches=False)
"""Every iteration planned and booked one at a time, decode-only ones too."""


def test_lone_request_ttft_is_its_prefill_and_tokens_are_exact():
    trace = make_trace([0.5], [1000], [5])
    sim = make_sim(trace)
    res = sim.run(Sarathi(4096))
    times = res.token_times[0]
    assert len(times) == 5
    assert times[0] - 0.5 == pytest.approx(sim.cost.prefill_time_alone(1000))
    # each decode iteration attends to the prompt plus the tokens so far
    expected = [sim.cost.iteration_time(1, 1000 + k, (), ()) for k in range(1, 5)]
    assert np.diff(times) == pytest.approx(expected)
    assert res.metrics["finished"] == 1 and res.metrics["iterations"] == 5


def test_fcfs_stalls_decodes_for_a_whole_prefill_and_sarathi_does_not():
    # request 0 streams 400 tokens; a 12k-token prompt arrives while it streams
    trace = make_trace([0.0, 0.3], [200, 12000], [400, 2], span=1.0)
    fcfs = make_sim(trace).run(PrefillFirst(whole_prompts=True))
    sarathi_sim = make_sim(trace)
    sarathi = sarathi_sim.run(Sarathi(512))
    prefill = sarathi_sim.cost.prefill_time_alone(12000)
    assert fcfs.outcomes.stall[0] >= prefill
    assert sarathi.outcomes.stall[0] < prefill / 10
    assert sarathi.outcomes.ttft[1] > fcfs.outcomes.ttft[1]  # chunking costs the long prompt TTFT


def test_decodes_count_against_the_budget():
    trace = make_trace(np.zeros(100), [20] * 100, [500] * 100)
    sim = make_sim(trace)
    sim.run(Sarathi(64))
    log = sim.log.arrays()
    assert np.all(log["decode_tokens"] + log["prefill_tokens"] <= np.maximum(64, log["decode_tokens"]))
    assert np.any((log["decode_tokens"] >= 64) & (log["prefill_tokens"] == 0))


@pytest.mark.parametrize("policy", [Sarathi(256), Sarathi(2048, rule="shortest_first"), PrefillFirst()])
def test_fast_forward_gives_identical_results(policy):
    rng = np.random.default_rng(3)
    n = 60
    trace = make_trace(np.sort(rng.uniform(0, 5, n)), rng.integers(1, 3000, n), rng.integers(1, 300, n))
    a = make_sim(trace).run(policy)
    stepped = make_sim(trace)
    stepped.core.shortcuts = STEPPED
    b = stepped.run(policy)
    assert a.token_times.keys() == b.token_times.keys()
    for rid, t in a.token_times.items():
        np.testing.assert_array_equal(t, b.token_times[rid])
    for key in ("goodput_rps", "tbt_p99_s", "ttft_p99_s", "iterations", "kv_util_mean"):
        assert a.metrics[key] == b.metrics[key]


@pytest.mark.parametrize("stretch_min", [1, 10**9], ids=["numpy", "python"])
@pytest.mark.parametrize("num_blocks", [0, 120], ids=["roomy", "kv_bound"])
def test_fast_forwarded_stretches_are_bit_identical_to_single_steps(monkeypatch, stretch_min, num_blocks):
    """Long decode-only stretches cut by arrivals, finishes and KV shortage, on either path of
    the fast-forward: every logged column and every token time equal the step-by-step run's."""
    monkeypatch.setattr(simulator, "STRETCH_MIN", stretch_min)
    rng = np.random.default_rng(11)
    n = 40
    trace = make_trace(np.sort(rng.uniform(0, 60, n)), rng.integers(16, 800, n), rng.integers(50, 2000, n))
    runs = []
    for fast in (True, False):
        sim = make_sim(trace, num_blocks=num_blocks)
        if not fast:
            sim.core.shortcuts = STEPPED
        runs.append((sim.run(Sarathi(512)), sim))
    (a, sim_a), (b, sim_b) = runs
    assert a.metrics["iterations"] > 1000
    for name in a.iterations:
        np.testing.assert_array_equal(a.iterations[name], b.iterations[name])
    assert a.token_times.keys() == b.token_times.keys()
    for rid, t in a.token_times.items():
        np.testing.assert_array_equal(t, b.token_times[rid])
    for key in ("latency_ewma", "last_latency", "now", "preemptions"):
        assert getattr(sim_a.core, key) == getattr(sim_b.core, key)
    assert sim_a.core.decode.slack_base == sim_b.core.decode.slack_base


def test_a_fork_that_keeps_the_log_logs_into_its_own_copy():
    rng = np.random.default_rng(4)
    n = 30
    trace = make_trace(np.sort(rng.uniform(0, 5, n)), rng.integers(1, 2000, n), rng.integers(1, 200, n))
    whole = make_sim(trace).run(Sarathi(512))
    sim = make_sim(trace)
    sim.run_until(Sarathi(512), until_s=2.0)
    before = len(sim.log)
    twin = sim.fork(keep_log=True)
    twin.run_until(Sarathi(512))
    assert len(sim.log) == before < len(twin.log)
    for name, column in twin.log.arrays().items():
        np.testing.assert_array_equal(column, whole.iterations[name])


def test_same_trace_and_policy_give_identical_runs():
    rng = np.random.default_rng(5)
    trace = make_trace(np.sort(rng.uniform(0, 3, 40)), rng.integers(1, 5000, 40), rng.integers(1, 200, 40))
    a, b = (make_sim(trace).run(Sarathi(512)) for _ in range(2))
    for rid in a.token_times:
        np.testing.assert_array_equal(a.token_times[rid], b.token_times[rid])
    np.testing.assert_array_equal(a.iterations["latency"], b.iterations["latency"])


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    trace = make_trace([0.0, 0.1, 0.2], [100, 4000, 2000], [10, 200, 10])
    sim = make_sim(trace, model="llama2_7b", num_blocks=100)  # 1,600 tokens of KV, 4,096 of context
    res = sim.run(Sarathi(512))
    assert "max_model_len" in res.outcomes.reject_reason[1]
    assert "KV blocks" in res.outcomes.reject_reason[2]
    assert res.outcomes.finished.tolist() == [True, False, False]
    assert res.metrics["rejected"] == 2


def test_kv_pressure_preempts_and_recomputes_without_losing_tokens():
    rng = np.random.default_rng(11)
    n = 30
    trace = make_trace(np.sort(rng.uniform(0, 0.5, n)), rng.integers(100, 600, n), rng.integers(50, 300, n))
    sim = make_sim(trace, num_blocks=120)
    res = sim.run(Sarathi(1024))
    assert res.metrics["preemptions"] > 0
    for rid, times in res.token_times.items():
        assert len(times) == trace.output_len[rid] and np.all(np.diff(times) > 0)
    sim.core.kv.check()
    assert sim.core.kv.used == 0


def test_prefix_cache_serves_a_shared_prefix():
    # two requests share their first three 32-token units; the second arrives after the first's prefill
    trace = make_trace([0.0, 1.0], [100, 110], [3, 3], hashes=[[1, 2, 3, 4], [1, 2, 3, 9]], unit=32)
    sim = make_sim(trace)
    res = sim.run(Sarathi(512))
    assert res.outcomes.prefix_hit.tolist() == [0, 96]
    assert res.metrics["prefix_hit_rate"] == pytest.approx(96 / 210)
    sim.core.kv.check()


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    trace = make_trace([0.0, 1.0], [64, 64], [2, 2], hashes=[[1, 2], [1, 2]], unit=32)
    res = make_sim(trace).run(Sarathi(512))
    assert res.outcomes.prefix_hit.tolist() == [0, 32]


def test_prompts_pinning_cached_prefixes_cannot_deadlock_the_queue():
    """Two waiting prompts pin cached prefixes so that one free block is left: each could compute a
    token in it, but neither is admitted (vLLM admits a prompt only with room for its whole remainder).
    The core must free memory (the newest prompt's pinned prefix) rather than plan nothing forever."""
    unit = 32
    trace = make_trace(
        [0.0, 2.0, 10.0, 10.0],
        [32, 128, 150, 60],  # the last two re-use the first two's cached units
        [1, 2, 2, 2],
        hashes=[[9], [1, 2, 3, 4], [1, 2, 3, 4, 5], [9, 10]],
        unit=unit,
    )
    sim = make_sim(trace, num_blocks=11)
    res = sim.run(Sarathi(512))
    assert res.metrics["finished"] == 4 and res.metrics["rejected"] == 0
    assert res.outcomes.prefix_hit.tolist()[2] == 4 * unit, "the older prompt keeps its prefix"
    sim.core.kv.check()


def test_partial_prefills_whose_kv_is_all_cached_prefix_cannot_deadlock_the_core():
    """Four prompts whose prefixes are all cached start together and fill the cache, each one token
    short (204 blocks needed, 200 held). Preempting one frees nothing (it re-pins its cached prefix
    when queued again), so the core must release that prefix too instead of preempting everyone."""
    prompts = [1, 1, 129, 385, 385, 2305]
    hashes = [[(i + 1) * 10000 + u for u in range(p // 32)] for i, p in enumerate(prompts)]
    hashes[2] = [30000 + u for u in range(4)]
    trace = make_trace(np.zeros(6), prompts, [1] * 6, hashes, 32)
    sim = make_sim(trace, num_blocks=200)
    res = sim.run(Sarathi(128, "SLACK_DOOMED_LAST"))
    assert res.metrics["finished"] == 6 and res.metrics["rejected"] == 0
    sim.core.kv.check()


def test_whole_prompt_fcfs_evicts_a_waiting_prompts_pinned_prefix_instead_of_stalling():
    """A 900-token prompt leaves its prefix cached; at t=0.3 an unrelated 801-token prompt (51 of the
    60 blocks) queues ahead of a 400-token one that pins 24 cached blocks. FCFS waits for the head's
    whole prompt and nothing runs: the core evicts the pinned prefix (vLLM's free-block eviction)."""
    prompts = [900, 801, 400]
    hashes = [
        [owner * 10000 + u for u in range(p // 32)] for owner, p in zip([1, 0, 1], prompts, strict=True)
    ]
    trace = make_trace(np.array([0.0, 0.3, 0.3]), prompts, [2, 2, 1], hashes, 32)
    sim = make_sim(trace, num_blocks=60)
    res = sim.run(PrefillFirst(whole_prompts=True))
    assert res.metrics["finished"] == 3 and res.metrics["rejected"] == 0
    first = [res.token_times[rid][0] for rid in range(3)]
    assert first[0] < first[1] < first[2]  # arrival order: the head ran first, the evicted one after
    sim.core.kv.check()


class _Bad(Policy):
    def __init__(self, make):
        self.make = make

    def plan(self, view):
        return self.make(view)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda v: Plan(decode=False), "empty plan"),
        (lambda v: Plan(False, [(v.queue[0], 10**6)]), "tokens"),
        (lambda v: Plan(False, [(v.queue[0], 1), (v.queue[0], 1)]), "distinct"),
    ],
)
def test_invalid_plans_fail_clearly(make, message):
    sim = make_sim(make_trace([0.0], [100], [2]))
    with pytest.raises(ValueError, match=message):
        sim.run(_Bad(make))


def test_rules_order_the_prefill_share():
    trace = make_trace([0.0, 0.0, 0.0], [3000, 100, 2000], [2, 2, 2])
    sim = make_sim(trace)
    sim.advance_to_work()
    view = sim.view
    first = {rule: plan_budget(view, 256, rule).chunks[0][0].rid for rule in Rule}
    assert first[Rule.FCFS] == 0 and first[Rule.SHORTEST_FIRST] == 1


def test_setup_rejects_unknown_names():
    with pytest.raises(ValueError, match="llama3_8b"):
        make_setup(model="gpt5")
    with pytest.raises(ValueError, match="h100_80gb"):
        make_setup(hardware="tpu")


def test_a_run_cut_by_a_horizon_and_a_predicate_resumes_into_the_uninterrupted_run():
    """``run_until`` stops between iterations: at the clock horizon (before admitting arrivals)
    or when the predicate holds (on the state the policy sees next); resuming changes nothing."""
    rng = np.random.default_rng(7)
    n = 50
    trace = make_trace(np.sort(rng.uniform(0, 4, n)), rng.integers(1, 3000, n), rng.integers(1, 200, n))
    want = make_sim(trace).run(Sarathi(512))
    sim = make_sim(trace)
    policy = Sarathi(512)
    assert sim.run_until(policy, until_s=1.0)
    assert 1.0 <= sim.core.now < 1.0 + want.iterations["latency"].max()
    core = sim.core
    seen: list[int] = []
    assert sim.run_until(policy, stop=lambda: seen.append(core.n_good) or core.n_good >= 10)
    assert len(seen) > 1 and seen[-1] == core.n_good >= 10 > max(seen[:-1]), (
        "stops at the first state that holds"
    )
    assert not sim.run_until(policy), "False once the trace is done"
    got = sim.result()
    for rid, t in want.token_times.items():
        np.testing.assert_array_equal(t, got.token_times[rid])
    np.testing.assert_array_equal(want.iterations["latency"], got.iterations["latency"])
    early = make_sim(trace)
    cut = early.run(Sarathi(512), stop=lambda: early.core.n_bad + early.core.n_good >= n // 2)
    assert cut.metrics["iterations"] < want.metrics["iterations"] and cut.metrics["requests"] == n
    np.testing.assert_array_equal(
        cut.iterations["latency"], want.iterations["latency"][: len(cut.iterations["latency"])]
    )


@pytest.mark.parametrize("make_policy", [lambda: Sarathi(512), Adaptive], ids=["sarathi", "adaptive"])
@pytest.mark.parametrize("stretch_min", [1, 10**9], ids=["numpy", "python"])
def test_a_clock_at_twice_the_time_serves_a_trace_at_half_the_rate_in_exactly_twice_the_time(
    monkeypatch, stretch_min, make_policy
):
    # Doubling is exact in binary floating point: with arrivals twice as far apart and every
    # iteration twice the model's price, a schedule that depends on no measured time (Sarathi's;
    # Adaptive's, planned on the model's prices, which its plans carry to the clock) runs the same
    # batches at exactly twice the times, on every path that prices an iteration.
    monkeypatch.setattr(simulator, "STRETCH_MIN", stretch_min)
    rng = np.random.default_rng(5)
    n = 40
    arrivals = np.sort(rng.uniform(0, 4, n))
    prompts, outputs = rng.integers(1, 3000, n), rng.integers(1, 200, n)
    base = make_sim(make_trace(arrivals, prompts, outputs)).run(make_policy())
    doubled_trace = make_trace(2 * arrivals, prompts, outputs, span=2 * (float(arrivals[-1]) + 1.0))
    doubled = make_setup().simulator(doubled_trace, time_scale=2.0).run(make_policy())
    for key in ("decode_tokens", "prefill_tokens", "prefill_seqs", "kv_used"):
        np.testing.assert_array_equal(doubled.iterations[key], base.iterations[key])
    np.testing.assert_array_equal(doubled.iterations["latency"], 2 * base.iterations["latency"])
    np.testing.assert_array_equal(doubled.iterations["start"], 2 * base.iterations["start"])
    assert doubled.token_times.keys() == base.token_times.keys()
    for rid, t in base.token_times.items():
        np.testing.assert_array_equal(doubled.token_times[rid], 2 * t)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_a_clock_time_scale_must_be_positive_and_finite(scale):
    with pytest.raises(ValueError, match="time_scale must be a finite number > 0"):
        make_setup().simulator(make_trace([0.0], [10], [2]), time_scale=scale)
