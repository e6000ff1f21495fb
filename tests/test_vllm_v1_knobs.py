"""vLLM V1's scheduling knobs as a chunkgym policy (``baselines.VllmV1``): each knob's effect in
hand-built states, every plan of generated runs against a transcription of vLLM's ``schedule()``
loop, the neutral setting against ``Sarathi`` with ``stop`` admission, and chunk stretches that
change nothing.  tests/test_vllm_knobs.py checks the same plans against vLLM itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baselines import Sarathi, VllmV1
from envs.serving.core import ServingCore
from envs.serving.scheduling import Plan, Policy, ServingView
from envs.serving.shortcuts import NO_SHORTCUTS, Shortcuts
from policies.registry import make_policy
from tests.simtools import make_sim, make_trace


def _chunks(plan: Plan) -> list[tuple[int, int]]:
    return [(r.rid, n) for r, n in plan.chunks]


def _at_start(prompts, outputs=None, **serving):
    """A simulator with every prompt queued at t=0, and its view; it plans every iteration, decode-only
    ones too, so :func:`_after` stops at the first iteration boundary past its time."""
    outputs = outputs if outputs is not None else [5] * len(prompts)
    sim = make_sim(make_trace([0.0] * len(prompts), prompts, outputs), **serving)
    sim.core.shortcuts = NO_SHORTCUTS
    sim.advance_to_work()
    return sim, sim.view


def _after(sim, policy: Policy, until_s: float) -> ServingView:
    """The view once ``policy`` has served up to ``until_s`` (the next iteration's state)."""
    sim.run_until(policy, until_s=until_s)
    sim.advance_to_work()
    return sim.view


# ---- the constructor and vLLM's refusals ----------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"long_prefill_token_threshold": True}, "long_prefill_token_threshold"),
        ({"long_prefill_token_threshold_adaptive": "yes"}, "long_prefill_token_threshold_adaptive"),
        ({"enable_chunked_prefill": 1}, "enable_chunked_prefill"),
        ({"max_num_active_seqs": 0}, "max_num_active_seqs"),
    ],
)
def test_each_bad_value_is_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be .*, got ") as err:
        VllmV1(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("policy", "serving", "message"),
    [
        (
            VllmV1(128),
            {"max_num_seqs": 256},
            r"max_num_batched_tokens \(128\) must be >= max_num_seqs \(256\)",
        ),
        (VllmV1(max_num_active_seqs=9), {"max_num_seqs": 8}, r"max_num_active_seqs \(9\) cannot be greater"),
        (
            VllmV1(8192, 5000),
            {"max_model_len": 4096},
            r"long_prefill_token_threshold \(5000\) cannot be greater",
        ),
        (VllmV1(2048, enable_chunked_prefill=False), {"max_model_len": 4096}, r"smaller than max_model_len"),
    ],
)
def test_settings_vllm_refuses_to_start_with_are_refused_at_reset(policy, serving, message):
    sim = make_sim(make_trace([0.0], [100], [2]), **serving)
    with pytest.raises(ValueError, match=message):
        sim.run(policy)


def test_names_say_the_knobs():
    assert VllmV1().name == "vllm_v1_8192"
    assert VllmV1(512, 64, True, False, 4).name == "vllm_v1_512_lpt64a_nochunk_active4"


# ---- each knob in hand-built states ---------------------------------------------------------------
def test_the_threshold_caps_every_prompts_chunk():
    _, view = _at_start([1000, 500, 40])
    assert _chunks(VllmV1(512, 128).plan(view)) == [(0, 128), (1, 128), (2, 40)]
    assert _chunks(VllmV1(512).plan(view)) == [(0, 512)]


def test_the_threshold_is_not_applied_to_a_request_alone():
    _, view = _at_start([1000])
    assert _chunks(VllmV1(512, 128).plan(view)) == [(0, 512)]


def test_the_threshold_caps_a_running_prompt_while_another_request_decodes():
    # r0 (40 tokens) decodes while r1 (5000) is mid-prefill: two requests, so r1's chunk is capped;
    # once r0 has finished (10 tokens), r1 is alone and takes the budget.
    sim, _ = _at_start([40, 5000], [10, 2])
    policy = VllmV1(512, 100)
    view = _after(sim, policy, 1e-9)
    assert view.num_decode == 1 and [(r.rid, r.running) for r in view.queue] == [(1, True)]
    plan = policy.plan(view)
    assert plan.decode and _chunks(plan) == [(1, 100)]
    while view.num_decode:
        view = _after(sim, policy, sim.core.now + 1e-9)
    assert sim.core.requests[1].computed == 1000 and _chunks(policy.plan(view)) == [(1, 512)]


def test_the_adaptive_floor_is_the_fair_share_of_the_budget():
    _, three = _at_start([1000] * 3)
    assert _chunks(VllmV1(512, 64).plan(three)) == [(0, 64), (1, 64), (2, 64)]
    assert _chunks(VllmV1(512, 64, True).plan(three)) == [(0, 170), (1, 170), (2, 170)]  # 512 // 3
    _, ten = _at_start([1000] * 10)  # 512 // 10 = 51 < 64: the threshold stands
    assert _chunks(VllmV1(512, 64, True).plan(ten)) == [(i, 64) for i in range(8)]
    assert VllmV1(512, 0, True).chunk_cap(three) == 0  # adaptive without a threshold: no cap


def test_without_chunking_a_prompt_that_does_not_fit_ends_admission():
    # 900 fits the 1024 tokens; 300 does not fit the 124 left, so it and the 100 behind it wait
    # (vLLM breaks, it does not skip).  With chunking, 300 gets the rest.
    _, view = _at_start([900, 300, 100], max_model_len=1024)
    assert _chunks(VllmV1(1024, enable_chunked_prefill=False).plan(view)) == [(0, 900)]
    assert _chunks(VllmV1(1024).plan(view)) == [(0, 900), (1, 124)]


def test_without_chunking_the_threshold_is_applied_before_the_fit():
    # vLLM caps a waiting prompt's tokens first, then checks they fit: capped prompts start in pieces.
    _, view = _at_start([900, 300, 100], max_model_len=1024)
    plan = VllmV1(1024, 200, enable_chunked_prefill=False).plan(view)
    assert _chunks(plan) == [(0, 200), (1, 200), (2, 100)]


def test_the_active_cap_limits_the_requests_running():
    sim, view = _at_start([50] * 5, [20] * 5, max_num_seqs=8)
    policy = VllmV1(512, max_num_active_seqs=2)
    assert _chunks(policy.plan(view)) == [(0, 50), (1, 50)]
    view = _after(sim, policy, 1e-9)  # r0 and r1 decode: no room to start another
    assert view.num_decode == 2 and view.free_slots == 6
    plan = policy.plan(view)
    assert plan.decode and plan.chunks == []
    assert _chunks(VllmV1(512).plan(view)) == [(2, 50), (3, 50), (4, 50)]


# ---- every plan of generated runs against vLLM's loop -----------------------------------------------
def vllm_schedule(core: ServingCore, knobs: dict) -> dict[int, int]:
    """Tokens per request id in the next step, as ``Scheduler.schedule()`` (vLLM 0.32) computes
    them, transcribed: running requests in running (admission) order, each ``min(what it needs,
    cap, budget left)``, then waiting ones in FCFS order until one cannot start.  KV is never
    short in the runs it is used on, so KV allocation is left out."""
    budget = knobs["max_num_batched_tokens"]
    running = sorted(
        [*core.decode.members.values(), *(r for r in core.queue if r.running)], key=lambda r: r.start_order
    )
    waiting = sorted((r for r in core.queue if not r.running), key=lambda r: r.seq)
    n = len(running) + len(waiting)
    cap = knobs["long_prefill_token_threshold"] if n > 1 else 0
    if cap and knobs["long_prefill_token_threshold_adaptive"]:
        cap = max(cap, budget // n)
    left, out = budget, {}
    for req in running:
        if left <= 0:
            break
        tokens = 1 if req.rid in core.decode.members else req.target - req.computed
        if 0 < cap < tokens:
            tokens = cap
        out[req.rid] = min(tokens, left)
        left -= out[req.rid]
    active = knobs["max_num_active_seqs"] or core.config.max_num_seqs
    num_running = len(running)
    for req in waiting:
        if left <= 0 or num_running >= active:
            break
        tokens = req.target - req.computed
        if 0 < cap < tokens:
            tokens = cap
        if not knobs["enable_chunked_prefill"] and tokens > left:
            break
        out[req.rid] = min(tokens, left)
        left -= out[req.rid]
        num_running += 1
    return out


class AgainstVllm(Policy):
    """Serves with ``VllmV1(**knobs)``, checking each plan against :func:`vllm_schedule` first."""

    def __init__(self, knobs: dict) -> None:
        self.knobs = knobs
        self.inner = VllmV1(**knobs)
        self.checked = 0

    def reset(self, view: ServingView) -> None:
        self.inner.reset(view)

    def plan(self, view: ServingView) -> Plan:
        assert isinstance(view, ServingCore)
        plan = self.inner.plan(view)
        tokens = dict.fromkeys(view.decode.members, 1) if plan.decode else {}
        tokens.update((r.rid, n) for r, n in plan.chunks)
        assert tokens == vllm_schedule(view, self.knobs)
        self.checked += 1
        return plan


@st.composite
def knob_runs(draw):
    n = draw(st.integers(1, 25))
    gaps = draw(st.lists(st.floats(0.0, 0.2), min_size=n, max_size=n))
    prompts = draw(st.lists(st.one_of(st.integers(1, 300), st.integers(300, 4000)), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    budget = draw(st.sampled_from([256, 512, 2048, 8192]))
    chunked = draw(st.booleans())
    seqs = draw(st.sampled_from([2, 8, 256]))
    knobs = {
        "max_num_batched_tokens": budget,
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 16, 64, 200, 1000])),
        "long_prefill_token_threshold_adaptive": draw(st.booleans()),
        "enable_chunked_prefill": chunked,
        "max_num_active_seqs": draw(st.sampled_from([None, 1, 2, seqs])),
    }
    if knobs["max_num_active_seqs"] is not None:
        knobs["max_num_active_seqs"] = min(knobs["max_num_active_seqs"], seqs)
    # vLLM's own limits: the budget covers max_num_seqs, and without chunking max_model_len
    serving = {"max_num_seqs": min(seqs, budget), "lookahead": 1000}
    max_len = budget if not chunked else 8192
    serving["max_model_len"] = max_len
    knobs["long_prefill_token_threshold"] = min(knobs["long_prefill_token_threshold"], max_len)
    prompts = [min(p, max_len - o) for p, o in zip(prompts, outputs, strict=True)]  # none rejected
    return make_trace(np.cumsum(gaps), prompts, outputs), serving, knobs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=knob_runs())
def test_every_plan_is_what_vllms_schedule_loop_gives(case):
    """KV never runs short and the lookahead never binds here: the model differences the policy's
    docstring names are out of play, so every plan must be vLLM's, decodes included."""
    trace, serving, knobs = case
    sim = make_sim(trace, **serving)
    sim.core.shortcuts = NO_SHORTCUTS  # every iteration planned, so every plan is checked
    checking = AgainstVllm(knobs)
    result = sim.run(checking)
    assert sim.core.preemptions == 0
    assert checking.checked >= 1
    assert result.metrics["finished"] == len(trace.prompt_len)


# ---- neutral knobs are Sarathi with stop admission ------------------------------------------------
class AgainstSarathi(Policy):
    """Serves with ``VllmV1(budget)``, checking each plan against ``Sarathi(budget, "fcfs", "stop")``."""

    def __init__(self, budget: int) -> None:
        self.inner, self.ref = VllmV1(budget), Sarathi(budget, admission="stop")
        self.checked = 0

    def plan(self, view: ServingView) -> Plan:
        plan = self.inner.plan(view)
        ref = self.ref.plan(view)
        assert (plan.decode, _chunks(plan)) == (ref.decode, _chunks(ref))
        self.checked += 1
        return plan


@st.composite
def traces(draw):
    n = draw(st.integers(1, 30))
    gaps = draw(st.lists(st.floats(0.0, 0.3), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 6000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 200), min_size=n, max_size=n))
    serving = {
        "num_blocks": draw(st.sampled_from([0, 60, 300])),  # small caches: blocked heads, preemptions
        "max_num_seqs": draw(st.sampled_from([4, 64, 256])),
        "lookahead": draw(st.sampled_from([3, 64])),
    }
    return (
        make_trace(np.cumsum(gaps), prompts, outputs),
        serving,
        draw(st.sampled_from([256, 512, 2048, 8192])),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=traces())
def test_neutral_knobs_plan_what_sarathi_with_stop_admission_plans(case):
    trace, serving, budget = case
    checking = AgainstSarathi(budget)
    checked_sim = make_sim(trace, **serving)
    checked_sim.core.shortcuts = NO_SHORTCUTS  # every iteration planned, so every plan is checked
    checked = checked_sim.run(checking)
    assert checking.checked >= (checked.metrics["finished"] > 0)
    a = make_sim(trace, **serving).run(VllmV1(budget))
    b = make_sim(trace, **serving).run(Sarathi(budget, admission="stop"))
    assert all(np.array_equal(a.iterations[k], b.iterations[k]) for k in b.iterations)
    assert _same_metrics(a.metrics, b.metrics)


def test_the_vllm_v1_preset_is_the_neutral_setting():
    preset = make_policy("vllm_v1_8192")
    assert isinstance(preset, Sarathi) and preset.budget == VllmV1().max_num_batched_tokens


# ---- chunk stretches ------------------------------------------------------------------------------
def _same_metrics(a: dict, b: dict) -> bool:
    a, b = a | {"sim_wall_s": 0.0}, b | {"sim_wall_s": 0.0}
    return a.keys() == b.keys() and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a.values(), b.values(), strict=True)
    )


def _run(trace, serving: dict, policy: Policy, shortcuts: Shortcuts):
    sim = make_sim(trace, **serving)
    sim.core.shortcuts = shortcuts
    return sim, sim.run(policy)


@st.composite
def stretch_runs(draw):
    n = draw(st.integers(1, 20))
    gaps = draw(st.lists(st.floats(0.0, 0.4), min_size=n, max_size=n))
    prompts = draw(
        st.lists(st.one_of(st.integers(1, 2000), st.integers(2000, 30_000)), min_size=n, max_size=n)
    )
    outputs = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    serving = {
        "num_blocks": draw(st.sampled_from([0, 150, 800, 4000])),
        "max_num_seqs": draw(st.sampled_from([4, 256])),
    }
    policy = VllmV1(
        draw(st.sampled_from([256, 512, 2048, 8192])),
        draw(st.sampled_from([0, 64, 300, 2048])),
        draw(st.booleans()),
        True,
        draw(st.sampled_from([None, 2, 4])),
    )
    return make_trace(np.cumsum(gaps), prompts, outputs), serving, policy


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=stretch_runs())
def test_runs_with_and_without_chunk_stretches_agree(case):
    trace, serving, policy = case
    (on, a), (off, b) = (_run(trace, serving, policy, s) for s in (Shortcuts(), NO_SHORTCUTS))
    assert all(np.array_equal(a.iterations[k], b.iterations[k]) for k in b.iterations)
    assert _same_metrics(a.metrics, b.metrics)
    assert list(on.core.token_times) == list(off.core.token_times)


class Counted(VllmV1):
    plans = 0

    def plan(self, view: ServingView) -> Plan:
        self.plans += 1
        return super().plan(view)


@pytest.mark.parametrize("threshold", [0, 512, 2048])
def test_a_long_prompt_beside_decodes_runs_in_stretches_under_a_threshold(threshold):
    # Two streams decode while 24k-token prompts arrive one by one: capped (512) or not (0, and 2048,
    # which the 2048-token budget less the decodes never reaches), the middle chunks are not planned.
    trace = make_trace([0.0, 0.0, 0.5, 2.0, 3.5], [300, 300, *[24_000] * 3], [800, 800, *[20] * 3])
    results = {}
    for shortcuts in (Shortcuts(), NO_SHORTCUTS):
        counted = Counted(2048, threshold)
        _, result = _run(trace, {}, counted, shortcuts)
        results[shortcuts.chunk_stretches] = counted.plans, result
    (planned, on), (every, off) = results[True], results[False]
    assert planned < every / 3
    assert _same_metrics(on.metrics, off.metrics)
    assert on.metrics["finished"] == 5


def test_a_capped_head_is_not_followed_while_another_prompt_waits():
    # The head's cap leaves tokens another queued prompt may take: the follower asks the planner.
    sim, _ = _at_start([40, 5000, 5000], [50, 2, 2], max_num_seqs=2)  # r2 waits for a slot
    policy = VllmV1(2048, 256)
    view = _after(sim, policy, 1e-9)
    plan = policy.plan(view)
    assert view.num_prefilling == 1 and not view.queue[1].running
    sim.step(plan)
    follower = policy.follow(sim.view, plan)
    assert follower is not None and follower() == (0, None)


# ---- full runs under each knob ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "policy",
    [
        VllmV1(2048),
        VllmV1(512, 128),
        VllmV1(512, 32, True),
        VllmV1(8192, enable_chunked_prefill=False),
        VllmV1(8192, 1024, enable_chunked_prefill=False),
        VllmV1(1024, max_num_active_seqs=3),
    ],
    ids=lambda p: p.name,
)
def test_a_run_under_each_knob_finishes_or_rejects_every_request(policy):
    rng = np.random.default_rng(3)
    n = 80
    prompts = rng.integers(20, 6000, n)
    prompts[::17] = 9000  # over the 8192-token max_model_len: rejected
    trace = make_trace(np.cumsum(rng.exponential(0.04, n)), prompts, rng.integers(1, 150, n))
    result = make_sim(trace, max_model_len=8192, num_blocks=1500).run(policy)
    assert result.metrics["finished"] + result.metrics["rejected"] == n
    assert result.metrics["rejected"] == len(prompts[::17])
