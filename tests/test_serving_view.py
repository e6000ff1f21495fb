"""Features, masks, planners and baselines read nothing but the ``ServingView`` protocol.

Each is run on a stand-in that exposes only the protocol's members over a live core, and
must give exactly what it gives on the core itself: so another scheduler's state (a vLLM
plugin's) that implements the protocol runs them unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from baselines import Adaptive, FixedChunk, PrefillFirst, Sarathi, VllmV1
from envs.actions import ACTIONS_V1
from envs.features import features_v0, features_v1, features_v4
from envs.serving import Plan, Policy, Rule, ServingView, plan_budget
from envs.serving.core import ServingCore
from envs.serving.scheduling import plan_latency
from tests.simtools import make_sim, make_trace

MEMBERS = frozenset(n for n in vars(ServingView) if not n.startswith("_"))


class ProtocolOnly:
    """A view with the protocol's members and nothing else."""

    def __init__(self, core: ServingCore) -> None:
        self._core = core

    def __getattr__(self, name: str):
        if name not in MEMBERS:
            raise AttributeError(f"{name!r} is not a ServingView member")
        return getattr(self._core, name)


def _key(plan: Plan):
    return plan.decode, [(r.rid, n) for r, n in plan.chunks]


def _policies() -> list[Policy]:
    return [
        Adaptive(spend_slack=True, rule="least_slack"),
        Adaptive(rule="shortest_first"),
        PrefillFirst(whole_prompts=True),
        PrefillFirst(max_batched_tokens=700, whole_prompts=False),
        FixedChunk(300),
        VllmV1(1024, 128, True, True, 4),
        VllmV1(131072, 256, enable_chunked_prefill=False),
    ]


class Checking(Policy):
    """Sarathi-256 that, every iteration, compares everything view-reading on the core and on the stand-in."""

    def __init__(self) -> None:
        self.inner = Sarathi(256, "shortest_first")
        self.on_core, self.on_view = _policies(), _policies()
        self.checked = 0

    def reset(self, view: ServingView) -> None:
        for a, b in zip(self.on_core, self.on_view, strict=True):
            a.reset(view)
            b.reset(ProtocolOnly(view))

    def plan(self, view: ServingView) -> Plan:
        only = ProtocolOnly(view)
        np.testing.assert_array_equal(features_v0(view), features_v0(only))
        np.testing.assert_array_equal(features_v1(view), features_v1(only))
        np.testing.assert_array_equal(features_v4(view), features_v4(only))
        np.testing.assert_array_equal(ACTIONS_V1.mask(view), ACTIONS_V1.mask(only))
        for rule in Rule:
            for budget in (64, 1024):
                plan = plan_budget(view, budget, rule)
                assert _key(plan) == _key(plan_budget(only, budget, rule))
                assert plan_latency(view, plan) == plan_latency(only, plan)
        for a, b in zip(self.on_core, self.on_view, strict=True):
            assert _key(a.plan(view)) == _key(b.plan(only)), a
        self.checked += 1
        return self.inner.plan(view)


def test_the_core_is_a_serving_view():
    sim = make_sim(make_trace([0.0], [10], [2]))
    assert isinstance(sim.view, ServingView) and sim.view is sim.core
    assert {"now", "queue", "lookahead", "free_blocks", "predict_latency"} <= MEMBERS
    with pytest.raises(AttributeError, match="not a ServingView member"):
        _ = ProtocolOnly(sim.core).kv


def test_everything_policy_side_reads_only_the_protocol():
    rng = np.random.default_rng(0)
    n = 40
    trace = make_trace(np.cumsum(rng.exponential(0.05, n)), rng.integers(50, 3000, n), rng.integers(1, 80, n))
    checking = Checking()
    result = make_sim(trace, num_blocks=400).run(checking)
    assert checking.checked > 50
    assert result.metrics["finished"] == n
