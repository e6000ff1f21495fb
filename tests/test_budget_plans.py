"""Planning every budget level from one pass (:class:`BudgetPrefixes`) gives what planning each
from scratch gives (:func:`plan_budget`, :func:`plan_latency`), bit for bit, in generated serving
states: every rule, both admissions, prefix hits, KV pressure, slot limits; and ``adaptive`` makes
the same decisions, so its runs are identical with the one-pass planner on and off."""

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baselines import Adaptive, Sarathi
from envs.serving.budgets import BudgetPrefixes, EachBudget, budget_plans, one_pass_planning
from envs.serving.capacity import ProbeRun
from envs.serving.cost_model import CostModel
from envs.serving.levels import BUDGET_LEVELS, adaptive_level
from envs.serving.request import Request
from envs.serving.scheduling import Admission, Plan, Policy, Rule, ServingView, plan_budget, plan_latency
from envs.serving.shortcuts import NO_SHORTCUTS, Shortcuts
from tests.simtools import make_setup, make_sim, make_trace

UNIT = 32
COMBOS = [(rule, admission) for rule in Rule for admission in Admission]


@st.composite
def workloads(draw):
    """A short trace and an engine small enough that KV, slots and the lookahead all bind."""
    n = draw(st.integers(1, 24))
    gaps = draw(st.lists(st.floats(0.0, 0.3), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 3000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    shared = draw(st.integers(1, 4))  # requests i and j share a prefix when i % shared == j % shared
    hashes = [[(i % shared) * 10_000 + u for u in range(p // UNIT)] for i, p in enumerate(prompts)]
    prefix = draw(st.booleans())
    trace = make_trace(np.cumsum(gaps), prompts, outputs, *((hashes, UNIT) if prefix else (None, 0)))
    serving = {
        "num_blocks": draw(st.sampled_from([0, 40, 80, 300])),
        "max_num_seqs": draw(st.sampled_from([2, 3, 8, 256])),
        "lookahead": draw(st.sampled_from([1, 3, 64])),
    }
    budgets = {*draw(st.lists(st.integers(1, 20_000), min_size=1, max_size=6))}
    if draw(st.booleans()):  # else the largest budget may be small: its plan ends on the budget
        budgets |= {*BUDGET_LEVELS}
    return trace, serving, sorted(budgets), draw(st.integers(0, 2**32 - 1))


@dataclass
class _State:
    """A hand-drawn serving state with what the planner reads: any mix of running and new prompts
    (even ones with nothing left), any free KV and slots, not only states a run reaches."""

    queue: list[Request]
    lookahead: list[Request]
    num_decode: int
    decode_context: int
    num_prefilling: int
    free_blocks: int
    free_slots: int
    block_size: int
    cost_model: CostModel = field(repr=False)
    prefill_s_per_token: float = 1e-4

    def predict_latency(self, num_decode, decode_context, query_lens, computed_lens):
        return self.cost_model.iteration_time(num_decode, decode_context, query_lens, computed_lens)


COST_MODEL = make_setup().cost_model


@st.composite
def states(draw):
    bs = draw(st.sampled_from([1, 16, 32]))
    queue = []
    for i in range(draw(st.integers(0, 10))):
        req = Request(i, draw(st.floats(0.0, 10.0)), draw(st.integers(1, 6000)), 10)
        req.target = req.prompt_len + draw(st.sampled_from([0, 0, 37]))  # 37: a resumed request
        req.computed = draw(st.one_of(st.integers(0, req.target), st.just(req.target - 1)))
        req.running = draw(st.booleans())
        req.seq = draw(st.integers(-3, 20))  # preempted ones jump ahead; ties keep queue order
        req.deadline = draw(st.floats(0.0, 20.0))
        req.violated = draw(st.booleans())
        queue.append(req)
    num_decode = draw(st.sampled_from([0, 0, 1, 63, 64, 65, 300, 20_000]))
    return _State(
        queue,
        queue[: draw(st.integers(1, 10))],
        num_decode,
        num_decode * draw(st.integers(1, 4000)),
        sum(r.running for r in queue),
        draw(st.one_of(st.integers(0, 3), st.integers(0, 600))),
        draw(st.integers(0, 4)),
        bs,
        COST_MODEL,
    )


@settings(max_examples=400, deadline=None)
@given(
    state=states(),
    budgets=st.lists(st.integers(1, 25_000), min_size=1, max_size=8),
    target_s=st.sampled_from([0.0, 0.005, 0.02, 0.05, 0.2, 10.0]),
)
def test_one_pass_agrees_with_planning_each_budget_in_any_state(state, budgets, target_s):
    budgets = sorted({*budgets, *BUDGET_LEVELS}) if budgets[0] % 2 else sorted(budgets)
    for rule, admission in COMBOS:
        prefixes = BudgetPrefixes(state, budgets[-1], rule, admission)
        for budget in budgets:
            ref = plan_budget(state, budget, rule, admission=admission)
            assert _chunks(prefixes.plan(budget)) == _chunks(ref), (budget, rule, admission)
            assert prefixes.latency(budget) == plan_latency(state, ref), (budget, rule, admission)
        both = []
        for one_pass in (True, False):
            with one_pass_planning(one_pass):
                level, plan = adaptive_level(state, BUDGET_LEVELS, rule, target_s, admission)
            both.append((level, _chunks(plan)))
        assert both[0] == both[1], (rule, admission)


def _chunks(plan: Plan) -> tuple[bool, list[tuple[int, int]]]:
    return plan.decode, [(r.rid, n) for r, n in plan.chunks]


class _Checking(Policy):
    """At every iteration, plans every budget both ways for every rule and admission and checks
    they agree; then serves a random one of them, so runs visit many kinds of states."""

    def __init__(self, budgets: list[int], seed: int) -> None:
        self.budgets = budgets
        self.rng = random.Random(seed)
        self.checked = 0

    def plan(self, view: ServingView) -> Plan:
        for rule, admission in COMBOS:
            prefixes = BudgetPrefixes(view, self.budgets[-1], rule, admission)
            for budget in self.rng.sample(self.budgets, len(self.budgets)):  # any order: prices are memoised
                ref = plan_budget(view, budget, rule, admission=admission)
                assert prefixes.latency(budget) == plan_latency(view, ref), (budget, rule, admission)
                got = prefixes.plan(budget)
                assert _chunks(got) == _chunks(ref), (budget, rule, admission)
                assert all(a is b for (a, _), (b, _) in zip(got.chunks, ref.chunks, strict=True))
        self.checked += 1
        rule, admission = self.rng.choice(COMBOS)
        return plan_budget(view, self.rng.choice(self.budgets), rule, admission=admission)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=workloads())
def test_one_pass_plans_and_prices_every_budget_as_planning_each_does(case):
    trace, serving, budgets, seed = case
    sim = make_sim(trace, **serving)
    policy = _Checking(budgets, seed)
    sim.run(policy)
    assert policy.checked or len(sim.core.rejected) == len(trace)  # it planned, unless none fit


class _AdaptiveBothWays(Policy):
    """At every iteration, adaptive's choice with each planner, for every rule and admission and
    targets from tight to loose; serves one of them."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def plan(self, view: ServingView) -> Plan:
        choices = []
        for rule, admission in COMBOS:
            for target_s in (0.0, 0.01, 0.03, 0.1, 1.0):
                both = []
                for one_pass in (True, False):
                    with one_pass_planning(one_pass):
                        level, plan = adaptive_level(view, BUDGET_LEVELS, rule, target_s, admission)
                    both.append((level, _chunks(plan)))
                assert both[0] == both[1], (rule, admission, target_s)
                choices.append(plan)
        return self.rng.choice(choices)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=workloads())
def test_adaptive_chooses_the_same_level_and_plan_with_either_planner(case):
    trace, serving, _, seed = case
    make_sim(trace, **serving).run(_AdaptiveBothWays(seed))


class _Recording(Policy):
    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.seen: list[tuple[float, bool, list[tuple[int, int]]]] = []

    def reset(self, view: ServingView) -> None:
        self.inner.reset(view)

    def plan(self, view: ServingView) -> Plan:
        plan = self.inner.plan(view)
        self.seen.append((view.now, *_chunks(plan)))
        return plan


@pytest.mark.parametrize("rule", [r.name.lower() for r in Rule])
@pytest.mark.parametrize("admission", ["skip", "stop"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=workloads(), spend_slack=st.booleans(), fraction=st.sampled_from([0.2, 1.0]))
def test_adaptive_runs_are_identical_with_the_one_pass_planner_on_and_off(
    rule, admission, case, spend_slack, fraction
):
    trace, serving, _, _ = case
    runs = []
    for one_pass in (True, False):
        policy = _Recording(Adaptive(fraction, rule, spend_slack, admission=admission))
        sim = make_sim(trace, **serving)
        sim.core.shortcuts = Shortcuts(one_pass_budgets=one_pass)
        metrics = sim.run(policy).metrics
        metrics.pop("sim_wall_s")
        runs.append((policy.seen, [(r.status, r.violated, r.generated) for r in sim.core.requests], metrics))
    (seen_on, reqs_on, m_on), (seen_off, reqs_off, m_off) = runs
    assert seen_on == seen_off and reqs_on == reqs_off
    assert m_on.keys() == m_off.keys()
    assert all(a == b or (a != a and b != b) for a, b in zip(m_on.values(), m_off.values(), strict=True))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=workloads(),
    rule=st.sampled_from([r.name.lower() for r in Rule]),
    fraction=st.sampled_from([0.5, 1e4]),  # 1e4: every level fits, so the chosen one was priced
)
def test_a_plan_adaptive_priced_runs_for_the_price_the_clock_would_give_it(case, rule, fraction):
    trace, serving, _, _ = case
    sim = make_sim(trace, **serving)
    clock = sim.executor
    cost = sim.cost.iteration_time
    priced = []

    def execute(batch, start):
        if batch.latency is not None:
            shape = [q for _, q, _ in batch.chunks], [c for _, _, c in batch.chunks]
            priced.append(batch.latency == cost(batch.num_decode, batch.decode_context, *shape))
        return type(clock).execute(clock, batch, start)

    clock.execute = execute
    sim.run(Adaptive(fraction, rule))
    assert all(priced)
    assert priced or fraction < 1 or len(sim.core.rejected) == len(trace)  # unless no prompt was served
    with one_pass_planning(one_pass=False):
        assert adaptive_level(sim.view, BUDGET_LEVELS, Rule.FCFS, 0.1)[1].latency is None


def test_a_head_waiting_on_prefixes_pinned_behind_it_falls_back_to_skip_at_every_budget():
    # tests/test_admission.py's scenario: nothing runs and the STOP head waits only on prefix
    # blocks the prompt behind it pins, so plan_budget plans as SKIP; the one pass must too.
    hashes = [[1, 2], [7, 8, 9, 10, 11, 12], [1, 2, 3]]
    sim = make_sim(make_trace([0.0, 10.0, 10.0], [64, 170, 96], [1, 1, 1], hashes, UNIT), num_blocks=12)
    sim.run_until(Sarathi(512), stop=lambda: len(sim.core.queue) == 2)  # r1, r2 have arrived
    view = sim.view
    stop = plan_budget(view, 512, Rule.FCFS, admission=Admission.STOP)
    assert not view.num_decode and [r.rid for r, _ in stop.chunks] == [2]  # the fallback did plan
    prefixes = BudgetPrefixes(view, BUDGET_LEVELS[-1], Rule.FCFS, Admission.STOP)
    for budget in (1, 31, 32, 33, 512, BUDGET_LEVELS[-1]):
        ref = plan_budget(view, budget, Rule.FCFS, admission=Admission.STOP)
        assert _chunks(prefixes.plan(budget)) == _chunks(ref)
        assert prefixes.latency(budget) == plan_latency(view, ref)


def test_a_budget_above_the_one_planned_for_is_refused():
    sim = make_sim(make_trace([0.0], [100], [5]))
    sim.advance_to_work()
    with pytest.raises(ValueError, match="budget 1025 exceeds the 1024"):
        BudgetPrefixes(sim.view, 1024, Rule.FCFS, Admission.SKIP).plan(1025)


def test_the_one_pass_planner_is_the_default_and_one_pass_planning_restores_it():
    sim = make_sim(make_trace([0.0], [100], [5]))
    sim.advance_to_work()
    plans = lambda: budget_plans(sim.view, 1024, Rule.FCFS, Admission.SKIP)  # noqa: E731
    assert isinstance(plans(), BudgetPrefixes)
    with pytest.raises(RuntimeError), one_pass_planning(one_pass=False):
        assert isinstance(plans(), EachBudget)
        raise RuntimeError
    assert isinstance(plans(), BudgetPrefixes)


class _PlannerSeen(Policy):
    """Records which planner adaptive would get (a stand-in: probes build a fresh one each)."""

    kinds: list[type] = []

    def plan(self, view: ServingView) -> Plan:
        _PlannerSeen.kinds.append(type(budget_plans(view, 512, Rule.FCFS, Admission.SKIP)))
        return plan_budget(view, 512)


@pytest.mark.parametrize("shortcuts, kind", [(NO_SHORTCUTS, EachBudget), (Shortcuts(), BudgetPrefixes)])
def test_a_run_plans_budgets_as_its_cores_shortcuts_say(shortcuts, kind):
    """The loop takes the planning mode from the one switch, whatever the caller's context says."""
    _PlannerSeen.kinds = []
    sim = make_sim(make_trace([0.0, 0.1], [300, 200], [4, 4]))
    sim.core.shortcuts = shortcuts
    with one_pass_planning(kind is EachBudget):  # the opposite: the run's switch wins
        sim.run(_PlannerSeen())
    assert _PlannerSeen.kinds and set(_PlannerSeen.kinds) == {kind}


@pytest.mark.parametrize("early_stop, kind", [(False, EachBudget), (True, BudgetPrefixes)])
@pytest.mark.parametrize("criterion", ["attain90", "tbt"])
def test_the_reference_capacity_probe_plans_each_budget_and_the_fast_one_plans_in_one_pass(
    early_stop, kind, criterion
):
    _PlannerSeen.kinds = []
    ProbeRun(make_setup(), _PlannerSeen, criterion, early_stop)(
        1.0, make_trace([0.0, 0.1], [300, 200], [4, 4])
    )
    assert _PlannerSeen.kinds and set(_PlannerSeen.kinds) == {kind}
