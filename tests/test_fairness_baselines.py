"""The fairness and SLO-class baselines (baselines/fairness.py: ``Vtc``, ``Wvtc``, ``Edf``) and vLLM's
priority scheduling (``VllmV1(scheduling_policy="priority")``) on small hand-built traces with tenants
and classes, and VTC's service bound as a property of generated backlogged runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baselines import Edf, Sarathi, VllmV1, Vtc, Wvtc
from envs.serving.request import Request
from envs.serving.scheduling import Plan, Policy, Preemption, ServingView
from envs.serving.shortcuts import NO_SHORTCUTS, Shortcuts
from envs.serving.simulator import Simulator
from envs.serving.tenancy import W_IN, W_OUT, intersection, merged, pair_gap, service_events, tenant_codes
from envs.serving.workloads.trace import Trace
from policies.registry import make_policy
from tests.simtools import make_sim, make_trace


def labelled(arrivals, prompts, outputs, tenants=None, classes=None) -> Trace:
    return dataclasses.replace(
        make_trace(arrivals, prompts, outputs),
        tenant=None if tenants is None else tuple(tenants),
        slo_class=None if classes is None else tuple(classes),
    )


class Recorder(Policy):
    """``inner``'s plans, recorded as (rid, tokens) lists (no ``follow``: asked every iteration)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.preemption = inner.preemption
        self.plans: list[tuple[bool, list[tuple[int, int]]]] = []

    def reset(self, view: ServingView) -> None:
        self.inner.reset(view)

    def plan(self, view: ServingView) -> Plan:
        plan = self.inner.plan(view)
        self.plans.append((plan.decode, [(r.rid, n) for r, n in plan.chunks]))
        return plan


def recorded(trace: Trace, policy: Policy, **serving) -> tuple[Recorder, Simulator]:
    sim = make_sim(trace, **serving)
    sim.core.shortcuts = NO_SHORTCUTS
    rec = Recorder(policy)
    sim.run(rec)
    return rec, sim


def start_order(sim: Simulator) -> list[int]:
    """Request ids in the order they were first scheduled (ties: by id)."""
    reqs = sim.core.requests
    return sorted((r.rid for r in reqs), key=lambda i: (reqs[i].first_scheduled, i))


# ---- construction and presets --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("preset", "cls", "name"),
    [("vtc", Vtc, "vtc_512"), ("wvtc", Wvtc, "wvtc_512"), ("edf", Edf, "edf_512")],
)
def test_presets_build_the_policies(preset, cls, name):
    policy = make_policy(preset)
    assert type(policy) is cls and policy.name == preset and policy.budget == 512  # results name presets
    assert cls().name == name


def test_the_priority_preset_is_vllm_v1_at_its_default_budget_under_priority():
    policy = make_policy("priority")
    assert isinstance(policy, VllmV1) and policy.max_num_batched_tokens == 8192
    assert policy.scheduling_policy == "priority" and policy.preemption is Preemption.LOWEST_PRIORITY
    assert VllmV1(scheduling_policy="priority").name == "vllm_v1_8192_priority"
    assert VllmV1().preemption is Preemption.LATEST_STARTED and VllmV1().name == "vllm_v1_8192"


@pytest.mark.parametrize("bad", ["fifo", "PRIORITY", "", 1])
def test_an_unknown_scheduling_policy_is_refused(bad):
    with pytest.raises(ValueError, match=r"^scheduling_policy must be one of fcfs, priority, got "):
        VllmV1(scheduling_policy=bad)


@pytest.mark.parametrize("cls", [Vtc, Wvtc, Edf])
def test_a_budget_below_one_token_is_refused(cls):
    with pytest.raises(ValueError, match="budget"):
        cls(0)


# ---- VTC ---------------------------------------------------------------------------------------------
@st.composite
def one_tenant_traces(draw) -> Trace:
    n = draw(st.integers(2, 25))
    gaps = draw(st.lists(st.floats(0.0, 0.2), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(20, 3000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    return make_trace(np.cumsum(gaps), prompts, outputs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=one_tenant_traces(), budget=st.sampled_from([256, 512, 2048]), small_kv=st.booleans())
def test_vtc_with_one_tenant_plans_what_sarathi_plans(trace, budget, small_kv):
    serving = {"num_blocks": 400} if small_kv else {}  # 6,400 tokens: preemptions
    vtc, _ = recorded(trace, Vtc(budget), **serving)
    fcfs, _ = recorded(trace, Sarathi(budget), **serving)
    assert vtc.plans == fcfs.plans


def test_vtc_serves_a_light_tenant_ahead_of_a_flood_that_fcfs_serves_first():
    # A flood of 40 prompts at t=0, a light tenant's 4 prompts just after: FCFS serves the flood first.
    n_flood = 40
    arrivals = [0.0] * n_flood + [0.01, 0.02, 0.03, 0.04]
    tenants = ["flood"] * n_flood + ["light"] * 4
    trace = labelled(arrivals, [1000] * len(arrivals), [20] * len(arrivals), tenants)
    delays = {}
    for policy in (Vtc(512), Sarathi(512)):
        out = make_sim(trace).run(policy).outcomes
        delays[policy.name] = out.sched_delay[n_flood:]
    assert delays["vtc_512"].max() < 0.5
    assert delays["sarathi_512"].min() > 5 * delays["vtc_512"].max()


def test_one_plan_shares_its_budget_between_tenants():
    # Short prompts, ten of each tenant's at t=0: one plan starts several, and each pick raises its
    # tenant's counter provisionally, so the tenants alternate within the plan.
    tenants = ["A"] * 10 + ["B"] * 10
    trace = labelled([0.0] * 20, [50] * 20, [5] * 20, tenants)
    rec, _ = recorded(trace, Vtc(512))
    first = next(chunks for _, chunks in rec.plans if chunks)
    assert len(first) == 11  # 512 tokens: ten whole prompts and 12 tokens of an eleventh
    assert [tenants[rid] for rid, _ in first] == ["A", "B"] * 5 + ["A"]


def test_a_tenant_that_was_idle_banks_no_credit():
    # A is backlogged from t=0; B's burst arrives at t=2 with a counter of 0 unless it is lifted to A's:
    # lifted, A keeps getting prompts while B's burst waits; without the lift B would take every start
    # until its counter caught up with A's two seconds of service.
    arrivals = [0.0] * 200 + [2.0] * 20
    tenants = ["A"] * 200 + ["B"] * 20  # A's last prompt starts after 3 s
    trace = labelled(arrivals, [500] * 220, [10] * 220, tenants)
    rec, sim = recorded(trace, Vtc(512))
    after = [i for i in start_order(sim) if sim.core.requests[i].first_scheduled >= 2.0]
    firsts = [tenants[i] for i in after[:10]]
    assert firsts.count("A") >= 3 and firsts.count("B") >= 3, firsts


def _service(prompts, outputs, tenants, t) -> float:
    return sum(W_IN * p + W_OUT * o for p, o, u in zip(prompts, outputs, tenants, strict=True) if u == t)


def test_vtc_charges_each_tenant_its_service():
    # Every request arrives at once (no lift moves a counter) and finishes: each counter is its tenant's
    # whole service, 1 per prompt token and 2 per output token.
    prompts = [3000, 200, 1500, 800, 2500, 100]
    outputs = [50, 300, 40, 200, 30, 250]
    tenants = ["A", "B", "A", "B", "A", "B"]
    policy = Vtc(512)
    sim = make_sim(labelled([0.0] * 6, prompts, outputs, tenants))
    sim.run(policy)
    policy.charge(sim.view)  # the outputs of the decode-only iterations after the last plan
    assert policy.counter == {t: _service(prompts, outputs, tenants, t) for t in ("A", "B")}


def test_vtc_charges_a_prefix_hit_once_and_no_recompute():
    # One tenant (its counter is never lifted), a small KV cache (preemptions recompute) and prompts
    # sharing a cached prefix: still charged each prompt token once and each output token once.
    prompts = [1536, 2048, 1024, 1536]
    outputs = [300, 200, 250, 100]
    hashes = [[1, 2, 3], [1, 2, 3, 4], [5, 6], [1, 2, 7]]
    trace = make_trace([0.0, 0.0, 0.3, 0.5], prompts, outputs, hashes=hashes, unit=512)
    policy = Vtc(512)
    sim = make_sim(trace, num_blocks=330)
    result = sim.run(policy)
    assert result.outcomes.preemptions.sum() > 0 and result.outcomes.prefix_hit.sum() > 0
    policy.charge(sim.view)
    assert policy.counter == {"default": _service(prompts, outputs, ["default"] * 4, "default")}


def test_wvtc_with_equal_weights_plans_what_vtc_plans():
    rng = np.random.default_rng(3)
    n = 60
    arrivals = np.sort(rng.uniform(0, 2.0, n))
    tenants = rng.choice(["A", "B", "C"], n)
    prompts, outputs = rng.integers(20, 2500, n), rng.integers(1, 80, n)
    for classes in (None, ["standard"] * n):
        trace = labelled(arrivals, prompts, outputs, tenants, classes)
        assert recorded(trace, Wvtc(512))[0].plans == recorded(trace, Vtc(512))[0].plans


def _service_ratio(policy: Policy, trace: Trace, t_end: float) -> float:
    """Service of tenant "hi" over tenant "lo" up to ``t_end`` (both backlogged throughout)."""
    result = make_sim(trace).run(policy)
    n = len(trace)
    _, codes = tenant_codes(trace.tenant)
    service = service_events(result.outcomes, codes, [result.token_times.get(i) for i in range(n)])
    upto = service.time <= t_end
    got = np.bincount(service.tenant[upto], weights=service.amount[upto], minlength=2)
    return float(got[0] / got[1])  # codes: "hi" < "lo"


def test_wvtc_shares_service_by_class_weight():
    # Two tenants with equal requests, both backlogged: VTC splits service evenly, WVTC 3:1 by the
    # interactive and batch classes' weights.
    n = 160
    tenants = ["hi", "lo"] * (n // 2)
    classes = ["interactive", "batch"] * (n // 2)
    trace = labelled([0.0] * n, [600] * n, [20] * n, tenants, classes)
    assert _service_ratio(Vtc(512), trace, 1.0) == pytest.approx(1.0, abs=0.25)
    assert _service_ratio(Wvtc(512), trace, 1.0) == pytest.approx(3.0, abs=0.6)


# ---- VTC's bound ---------------------------------------------------------------------------------
def waiting_gap(trace: Trace, result) -> float:
    """The largest service gap between two tenants over an interval throughout which both have a
    prompt waiting (each request waits over [arrival, first scheduled]): VTC's backlog, where its
    bound holds.  ``max_service_gap``'s backlog runs to a request's last token, and while a tenant's
    last prompts decode with none of it waiting, the other gets every new start."""
    out = result.outcomes
    _, codes = tenant_codes(trace.tenant)
    service = service_events(out, codes, [result.token_times.get(i) for i in range(len(out.arrival))])
    waits = [
        merged(out.arrival[codes == k], (out.arrival + out.sched_delay)[codes == k])
        for k in range(codes.max() + 1)
    ]
    gap = 0.0
    for f in range(len(waits)):
        for g in range(f + 1, len(waits)):
            pick = (service.tenant == f) | (service.tenant == g)
            net = np.where(service.tenant[pick] == f, service.amount[pick], -service.amount[pick])
            gap = max(gap, pair_gap(service.time[pick], net, intersection(waits[f], waits[g])))
    return gap


def vtc_bound(trace: Trace, budget: int) -> float:
    """2 U (VTC's Theorem: U the largest request's service) plus one iteration's prefill at each end
    of the interval, 2 W_IN B: a plan hands out up to B prompt tokens by provisional counters before
    the real counters see them, and the measure books a prompt whole at its first chunk where the
    counter books it chunk by chunk."""
    u = float((W_IN * trace.prompt_len + W_OUT * trace.output_len).max())
    return 2 * u + 2 * W_IN * budget


@st.composite
def backlogged_traces(draw) -> Trace:
    """Two or three tenants, each with 8 to 25 requests arriving within 50 ms, lengths per tenant."""
    k = draw(st.integers(2, 3))
    tenants: list[str] = []
    prompts: list[int] = []
    outputs: list[int] = []
    for i in range(k):
        n = draw(st.integers(8, 25))
        top_prompt = draw(st.sampled_from([64, 400, 2000]))
        top_output = draw(st.sampled_from([4, 64, 200]))
        tenants += [f"t{i}"] * n
        prompts += draw(st.lists(st.integers(16, top_prompt), min_size=n, max_size=n))
        outputs += draw(st.lists(st.integers(1, top_output), min_size=n, max_size=n))
    order = draw(st.permutations(range(len(tenants))))
    arrivals = sorted(draw(st.lists(st.floats(0.0, 0.05), min_size=len(order), max_size=len(order))))
    return labelled(
        arrivals, [prompts[i] for i in order], [outputs[i] for i in order], [tenants[i] for i in order]
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=backlogged_traces(), budget=st.sampled_from([256, 512, 1024]))
def test_vtc_keeps_backlogged_tenants_within_its_bound(trace, budget):
    assert waiting_gap(trace, make_sim(trace).run(Vtc(budget))) <= vtc_bound(trace, budget)


def test_fcfs_breaks_the_bound_that_vtc_keeps():
    # The bound is no formality: tenant A's 30 prompts come first, B's right after; FCFS serves A's
    # all before any of B's, VTC alternates.
    n = 30
    trace = labelled([0.0] * n + [0.001] * n, [800] * 2 * n, [20] * 2 * n, ["A"] * n + ["B"] * n)
    bound = vtc_bound(trace, 512)
    assert waiting_gap(trace, make_sim(trace).run(Sarathi(512))) > 3 * bound
    assert waiting_gap(trace, make_sim(trace).run(Vtc(512))) <= bound


# ---- EDF -----------------------------------------------------------------------------------------------
def test_edf_starts_prompts_by_ttft_deadline_across_classes():
    # Batch prompts arrive first, interactive ones after; every prompt fills the budget, so one starts
    # per iteration, in deadline order under EDF (the interactive ones first), arrival order under FCFS.
    classes = ["batch", "standard", "batch", "interactive", "standard", "interactive"]
    arrivals = [0.0] * 6
    trace = labelled(arrivals, [512] * 6, [4] * 6, classes=classes)
    _, sim = recorded(trace, Edf(512))
    reqs = sim.core.requests
    by_deadline = sorted(range(6), key=lambda i: (reqs[i].deadline, i))
    assert start_order(sim) == by_deadline
    assert [classes[i] for i in by_deadline[:2]] == ["interactive", "interactive"]
    _, fcfs = recorded(trace, Sarathi(512))
    assert start_order(fcfs) == list(range(6))


def test_edf_lets_a_prompt_mid_prefill_finish_first():
    # A batch prompt already mid-prefill when an interactive one arrives keeps its chunks.
    trace = labelled([0.0, 0.001], [4000, 300], [4, 4], classes=["batch", "interactive"])
    rec, _ = recorded(trace, Edf(512))
    firsts = [chunks[0][0] for _, chunks in rec.plans if chunks]
    assert firsts[: 4000 // 512] == [0] * (4000 // 512)


def test_edf_reads_past_the_lookahead():
    # 20 batch prompts queued before one interactive prompt, lookahead 4: EDF still starts it next.
    classes = ["batch"] * 20 + ["interactive"]
    trace = labelled([0.0] * 20 + [0.001], [512] * 21, [4] * 21, classes=classes)
    _, sim = recorded(trace, Edf(512), lookahead=4)
    assert start_order(sim)[1] == 20


# ---- vLLM's priority scheduling ----------------------------------------------------------------------
def test_priority_starts_prompts_by_priority_then_arrival():
    classes = ["batch", "standard", "batch", "interactive", "standard", "interactive", "batch"]
    trace = labelled([0.0] * 7, [300] * 7, [4] * 7, classes=classes)
    _, sim = recorded(trace, VllmV1(300, scheduling_policy="priority"))
    reqs = sim.core.requests
    assert start_order(sim) == sorted(range(7), key=lambda i: (reqs[i].priority, reqs[i].arrival, i))
    assert [reqs[i].priority for i in start_order(sim)] == [0, 0, 1, 1, 2, 2, 2]
    _, fcfs = recorded(trace, VllmV1(300))
    assert start_order(fcfs) == list(range(7))


def _preempted(policy: Policy) -> list[int]:
    # A batch request starts first, an interactive one just after; their outputs outgrow 60 blocks
    # (960 tokens) together: one is preempted.
    trace = labelled([0.0, 0.001], [200, 200], [600, 600], classes=["batch", "interactive"])
    return make_sim(trace, num_blocks=60).run(policy).outcomes.preemptions.tolist()


def test_priority_preempts_the_lowest_priority_where_fcfs_preempts_the_latest_started():
    assert _preempted(VllmV1(512, scheduling_policy="priority"))[0] > 0  # the batch one
    assert _preempted(VllmV1(512, scheduling_policy="priority"))[1] == 0
    assert _preempted(VllmV1(512))[1] > 0 and _preempted(VllmV1(512))[0] == 0  # the interactive one


def test_priority_without_classes_or_preemptions_plans_what_fcfs_plans():
    rng = np.random.default_rng(5)
    n = 50
    trace = make_trace(np.sort(rng.uniform(0, 2, n)), rng.integers(20, 6000, n), rng.integers(1, 50, n))
    prio, _ = recorded(trace, VllmV1(1024, scheduling_policy="priority"))
    fcfs, _ = recorded(trace, VllmV1(1024))
    assert prio.plans == fcfs.plans


@pytest.mark.parametrize("threshold", [0, 700])
def test_priority_runs_with_and_without_chunk_stretches_agree(threshold):
    rng = np.random.default_rng(7)
    n = 30
    classes = rng.choice(["interactive", "standard", "batch"], n).tolist()
    trace = labelled(
        np.sort(rng.uniform(0, 3, n)), rng.integers(100, 12_000, n), rng.integers(1, 80, n), classes=classes
    )
    runs = []
    for shortcuts in (Shortcuts(), NO_SHORTCUTS):
        sim = make_sim(trace)
        sim.core.shortcuts = shortcuts
        runs.append(sim.run(VllmV1(2048, threshold, scheduling_policy="priority")))
    on, off = runs
    assert all(np.array_equal(on.token_times[k], t) for k, t in off.token_times.items())
    assert np.array_equal(on.outcomes.sched_delay, off.outcomes.sched_delay)


def test_requests_read_their_class_priority_and_weight():
    trace = labelled(
        [0.0, 0.0, 0.0, 0.0], [50] * 4, [2] * 4, classes=["interactive", "standard", "batch", "batch"]
    )
    sim = make_sim(trace)
    sim.run(Vtc())
    got = [(r.priority, r.weight) for r in sim.core.requests]
    assert got == [(0, 3.0), (1, 2.0), (2, 1.0), (2, 1.0)]
    assert isinstance(sim.core.requests[0], Request)
