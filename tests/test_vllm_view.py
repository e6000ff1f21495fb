"""The ServingView over a vLLM scheduler's state, fed vLLM-shaped requests (runs without vLLM).

The plugin's end-to-end tests against the pinned vLLM are in tests/test_vllm_plugin.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from engine.vllm_backend.config import PluginConfig, load_plugin
from engine.vllm_backend.view import VllmView, mirrored
from envs.actions import ACTIONS_V1
from envs.features import features_v1
from envs.serving import Rule, ServingView, plan_budget
from envs.serving.request import Request


@dataclass(eq=False)
class Engine:
    """The attributes of a vLLM request the view reads."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int = 8
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    is_prefill_chunk: bool = False
    outputs: int = 0
    priority: int = 0
    sampling_params: object = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.outputs

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens


def _view() -> VllmView:
    plugin = load_plugin(PluginConfig(policy="fcfs"))
    return VllmView(plugin.slo, plugin.cost_model, 64, 16, 200, 8, 4096)


def _state():
    d1 = Engine("d1", 1.0, 100, num_computed_tokens=104, outputs=5)  # attends 105; block not full
    d2 = Engine("d2", 2.0, 32, num_computed_tokens=32, outputs=1)  # its next token opens a block
    p = Engine("p", 3.0, 500, num_computed_tokens=256, is_prefill_chunk=True)
    w1 = Engine("w1", 9.0, 300)
    w2 = Engine("w2", 5.0, 200, outputs=3)
    view = _view()
    for e in (d1, d2, p, w1, w2):
        view.add(e, 0)
    w2.num_preemptions = 1  # preempted after it arrived: first in line
    cached = {"w1": 64, "w2": 0}
    view.refresh(10.0, [d1, d2, p], [w1, w2], 100, 5, lambda e: cached[e.request_id])
    return view


def test_the_view_reads_vllm_state_as_the_core_would_hold_it():
    view = _state()
    assert isinstance(view, ServingView)
    assert (view.num_decode, view.decode_context, view.num_prefilling) == (2, 105 + 33, 1)
    assert view.free_blocks == 99 and view.free_slots == 5 and view.total_blocks == 200
    assert [r.request_id for r in view.queue] == ["w2", "p", "w1"]  # preempted, then arrival order
    w2, p, w1 = view.queue
    assert (p.running, p.computed, p.target) == (True, 256, 500)
    assert (w1.running, w1.computed, w1.target) == (False, 64, 300)  # prefix hit counted
    assert w2.target == 203  # recompute prompt + generated tokens
    assert w1.ttft_bound >= view.slo.ttft_base_s and w1.deadline == pytest.approx(9.0 + w1.ttft_bound)


def test_planners_features_and_masks_run_on_it():
    view = _state()
    fcfs = plan_budget(view, 512, Rule.FCFS)
    assert fcfs.decode and [(mirrored(r).request_id, n) for r, n in fcfs.chunks] == [
        ("p", 244),
        ("w2", 203),
        ("w1", 63),
    ]
    srpf = plan_budget(view, 512, Rule.SHORTEST_FIRST)
    assert [(mirrored(r).request_id, n) for r, n in srpf.chunks] == [("w2", 203), ("w1", 236), ("p", 71)]
    feats = features_v1(view)
    assert feats.shape == (26,) and np.all(np.abs(feats) <= 1)
    assert ACTIONS_V1.mask(view).any()
    with pytest.raises(TypeError, match="not a request of the vLLM view"):
        mirrored(Request(0, 0.0, 10, 1))


def test_token_times_are_checked_against_the_slo():
    view = _view()
    e = Engine("r", 100.0, 50)
    view.add(e, 25)
    assert view.traffic.prefix_hit_ewma > 0 and view.traffic.rate(view.now) > 0
    view.refresh(100.1, [e], [], 100, 7, lambda _: 0)
    assert view.min_tpot_slack() == math.inf
    tpot, stall = view.slo.tpot_s, view.slo.stall_s
    view.observe([("r", 1)], 100.5, 0.4)
    req = view.requests["r"]
    assert not req.violated and view.last_latency == 0.4 and view.last_decode_time == -math.inf
    view.observe([("r", 1)], 100.5 + tpot / 2, tpot / 2)
    assert view.last_decode_time == 100.5 + tpot / 2
    assert view.min_tpot_slack() == pytest.approx(tpot / 2)
    view.observe([("r", 1)], 100.5 + tpot / 2 + stall * 1.01, stall)
    view.refresh(102.0, [e], [], 100, 7, lambda _: 0)
    assert req.violated and view.num_decode_doomed == 1 and view.min_tpot_slack() == math.inf


def test_the_arrival_rate_does_not_depend_on_the_order_requests_reach_the_engine():
    rates = []
    for order in ((0.0, 1.0, 3.0), (3.0, 0.0, 1.0)):
        view = _view()
        for i, t in enumerate(order):
            view.add(Engine(f"r{i}", t, 10), 0)
        view.now = 4.0
        rates.append(view.traffic.rate(view.now))
    assert rates[0] == pytest.approx(rates[1]) and 0 < rates[0] < 3 / 10


def test_a_prompt_past_its_ttft_bound_is_known_to_miss_and_finished_requests_leave():
    view = _view()
    e = Engine("late", 0.0, 10)
    view.add(e, 0)
    bound = view.requests["late"].ttft_bound
    view.refresh(bound * 0.9, [], [e], 100, 8, lambda _: 0)
    assert not view.queue[0].violated
    view.refresh(bound * 1.1, [], [e], 100, 8, lambda _: 0)
    assert view.queue[0].violated
    view.refresh(bound * 1.2, [], [], 100, 8, lambda _: 0)
    assert view.requests == {} and view.queue == []
    assert view.traffic.finishes == 1 and view.traffic.output_log_mean == 0.0  # it left with no token


@dataclass
class Params:
    extra_args: dict | None = None


def test_with_tenants_a_request_takes_its_class_from_its_priority_and_its_tenant_from_extra_args(caplog):
    from envs.serving.slo_classes import resolve_classes

    plugin = load_plugin(PluginConfig(policy="fcfs"))
    view = VllmView(plugin.slo, plugin.cost_model, 64, 16, 200, 8, 4096, tenants=True)
    engines = [
        Engine("a", 0.0, 100, priority=0, sampling_params=Params({"tenant": "acme"})),
        Engine("b", 0.0, 100, priority=2, sampling_params=Params(None)),
        Engine("c", 0.0, 100, priority=7, sampling_params=Params({"tenant": " padded "})),
    ]
    for e in engines:
        view.add(e, 0)
    a, b, c = (view.requests[e.request_id] for e in engines)
    classes = resolve_classes(["interactive", "batch"], plugin.cost_model)
    assert (a.tenant, a.slo_class, a.tpot_bound) == ("acme", "interactive", classes["interactive"].slo.tpot_s)
    assert (b.tenant, b.slo_class, b.stall_bound, b.weight) == (
        "default",
        "batch",
        classes["batch"].slo.stall_s,
        1.0,
    )
    assert (c.tenant, c.slo_class, c.tpot_bound) == (
        "default",
        "",
        plugin.slo.tpot_s,
    )  # no class has priority 7
    assert "served as tenant 'default'" in caplog.text
    # Each request's stalls are judged by its own class: a gap the batch bound allows breaks interactive.
    gap = (classes["interactive"].slo.stall_s + classes["batch"].slo.stall_s) / 2
    view.observe([("a", 1), ("b", 1)], 0.1, 0.01)  # first tokens, within every TTFT bound (>= 0.5 s)
    assert not a.violated and not b.violated
    view.observe([("a", 1), ("b", 1)], 0.1 + gap, 0.01)
    assert a.violated and not b.violated


def test_without_tenants_priority_and_extra_args_change_nothing():
    view = _view()
    e = Engine("a", 0.0, 100, priority=2, sampling_params=Params({"tenant": "acme"}))
    view.add(e, 0)
    req = view.requests["a"]
    assert (req.tenant, req.slo_class, req.tpot_bound) == ("default", "", view.slo.tpot_s)
