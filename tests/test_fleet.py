"""The fleet: servers behind a router, exact against the single-server loop and against eager stepping."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.routers import ROUTERS, make_router, router_names
from envs.serving.capacity import measure_capacity
from envs.serving.fleet import Fleet, FleetSpec
from envs.serving.loop import SimResult
from envs.serving.routing import ServerView
from envs.serving.simulator import Simulator
from policies.registry import make_policy
from tests.simtools import make_setup, make_trace, same_run

UNIT = 32  # prefix hash unit of the generated traces (two 16-token KV blocks)


def hashed_trace(n: int = 120, seed: int = 0, rate: float = 40.0):
    """Conversations sharing a system prompt (unit 0) and their own earlier turns, at ``rate`` req/s."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    prompts, outputs, hashes = [], [], []
    conversations: dict[int, list[int]] = {}
    next_id = 1
    for _ in range(n):
        c = int(rng.integers(0, 12))
        history = conversations.setdefault(c, [0])
        new = [next_id + i for i in range(int(rng.integers(1, 6)))]
        next_id += len(new)
        history.extend(new)
        prompts.append(len(history) * UNIT - int(rng.integers(0, UNIT)))
        outputs.append(int(rng.integers(1, 120)))
        hashes.append(list(history))
    return make_trace(arrivals, prompts, outputs, hashes, unit=UNIT)


def servers(setup, trace, n: int) -> list[Simulator]:
    return [
        Simulator(
            trace,
            setup.model,
            setup.hardware,
            setup.cost_model,
            setup.slo,
            setup.config,
            setup.tp,
            serve_trace=False,
        )
        for _ in range(n)
    ]


def fleet_of(setup, trace, n: int, router: str, policy: str = "sarathi_512", seed: int = 0) -> Fleet:
    return Fleet(
        trace, servers(setup, trace, n), [make_policy(policy) for _ in range(n)], make_router(router), seed
    )


def run_eagerly(fleet: Fleet) -> SimResult:
    """Every server brought to each arrival before the router reads any: the definition the lazy
    views must match."""
    fleet.start()
    while fleet.next_arrival < len(fleet.requests):
        fleet.advance_to(fleet.requests[fleet.next_arrival].arrival)
        fleet.route_next()
    fleet.run_until()
    return fleet.result()


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("policy", ["fcfs", "sarathi_512", "adaptive_srpf"])
def test_one_server_serves_as_the_single_server_loop(router: str, policy: str) -> None:
    setup = make_setup(num_blocks=400)  # a small cache: preemptions and prefix evictions happen
    trace = hashed_trace(150, seed=3, rate=60.0)
    single = setup.simulator(trace).run(make_policy(policy))
    fleet = fleet_of(setup, trace, 1, router, policy).run()
    assert same_run(single, fleet)
    assert np.array_equal(single.iterations["start"], fleet.iterations["start"])
    assert single.metrics["preemptions"] > 0


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("max_model_len", [0, 300])  # 300: some prompts are rejected at admission
def test_lazy_views_route_as_eager_stepping(router: str, max_model_len: int) -> None:
    setup = make_setup(num_blocks=600, max_model_len=max_model_len)
    trace = hashed_trace(200, seed=1, rate=90.0)
    lazy = fleet_of(setup, trace, 3, router).run()
    assert same_run(lazy, run_eagerly(fleet_of(setup, trace, 3, router)))
    assert (lazy.metrics["rejected"] > 0) == (max_model_len > 0)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 4), rate=st.floats(5.0, 200.0))
def test_lazy_views_route_as_eager_stepping_on_any_traffic(seed: int, n: int, rate: float) -> None:
    setup = make_setup(num_blocks=500)
    trace = hashed_trace(80, seed=seed, rate=rate)
    for router in ("least_requests", "prefix_affinity"):
        assert same_run(
            fleet_of(setup, trace, n, router).run(), run_eagerly(fleet_of(setup, trace, n, router))
        )


def test_every_request_is_served_once_and_counted_fleet_wide() -> None:
    setup = make_setup()
    trace = hashed_trace(200, seed=2, rate=80.0)
    fleet = fleet_of(setup, trace, 4, "least_outstanding_tokens")
    result = fleet.run()
    served = sorted(r.rid for s in fleet.servers for r in s.core.requests)
    assert served == list(range(len(trace)))
    assert all(len(s.core.requests) > 0 for s in fleet.servers)
    assert fleet.n_good + fleet.n_bad == len(trace)
    assert result.metrics["requests"] == len(trace)
    assert result.metrics["iterations"] == sum(len(s.log) for s in fleet.servers)
    assert result.metrics["load_imbalance"] >= 1.0


def test_round_robin_cycles_and_power_of_two_is_seeded() -> None:
    setup = make_setup()
    trace = hashed_trace(40, seed=4)
    fleet = fleet_of(setup, trace, 3, "round_robin")
    fleet.start()
    assert [fleet.route_next() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]

    def choices(seed: int) -> list[int]:
        f = fleet_of(setup, trace, 4, "power_of_two", seed=seed)
        f.start()
        return [f.route_next() for _ in range(30)]

    assert choices(5) == choices(5)
    assert choices(5) != choices(6)


class FakeView(ServerView):
    """A view with set numbers, for the routers' rules."""

    def __init__(
        self, index: int, in_flight: int = 0, waiting: int = 0, tokens: int = 0, kv: float = 0.0
    ) -> None:
        self.index = index
        self._numbers = (in_flight, waiting, tokens, kv)

    in_flight = property(lambda self: self._numbers[0])  # type: ignore[assignment]
    waiting = property(lambda self: self._numbers[1])  # type: ignore[assignment]
    outstanding_prefill_tokens = property(lambda self: self._numbers[2])  # type: ignore[assignment]
    kv_utilization = property(lambda self: self._numbers[3])  # type: ignore[assignment]
    prefix_unit_tokens = property(lambda self: UNIT)  # type: ignore[assignment]


def request(rid: int, hashes: list[int], prompt: int | None = None, arrival: float = 0.0):
    from envs.serving.request import Request

    return Request(rid, arrival, prompt or len(hashes) * UNIT, 10, hashes)


def test_load_routers_pick_the_lightest_server() -> None:
    views = [FakeView(0, 5, 2, 900), FakeView(1, 3, 3, 100), FakeView(2, 4, 0, 50)]
    assert make_router("least_requests").route(request(0, [1]), views) == 1
    assert make_router("least_outstanding_tokens").route(request(0, [1]), views) == 2


def test_prefix_affinity_follows_the_cache_until_loads_are_imbalanced() -> None:
    router = make_router("prefix_affinity")
    router.reset(3, 0)
    balanced = [FakeView(0, 2), FakeView(1, 1), FakeView(2, 0)]
    first = router.route(request(0, [7, 8, 9, 10]), balanced)
    assert first == 2  # no record matches: the smallest record (all empty), ties to the least loaded
    assert router.route(request(1, [7, 8, 9, 10, 11]), balanced) == first  # 80% of its prompt recorded there
    assert router.route(request(2, [40, 41]), balanced) != first  # no match: the smallest record
    imbalanced = [FakeView(0, 1), FakeView(1, 30), FakeView(2, 100)]  # 100 - 1 > 64 and 100 > 1.5 x 1
    assert router.route(request(3, [7, 8, 9, 10, 11, 12]), imbalanced) == 0


def test_llmd_default_weighs_prefix_queue_and_kv() -> None:
    router = make_router("llmd_default")
    router.reset(2, 0)
    views = [FakeView(0, waiting=0, kv=0.0), FakeView(1, waiting=0, kv=0.0)]
    assert router.route(request(0, [1, 2, 3, 4]), views) == 0  # ties: the lowest index
    # Server 0 now holds the prefix (3 x 1.0) but is the longest queue (0) and fuller (2 x 0.5):
    # 3 + 0 + 1 = 4 against server 1's 0 + 2 + 2 = 4 -> the tie goes to 0; a fuller server 0 loses.
    assert (
        router.route(request(1, [1, 2, 3, 4]), [FakeView(0, waiting=4, kv=0.5), FakeView(1, waiting=0)]) == 0
    )
    assert (
        router.route(request(2, [1, 2, 3, 4]), [FakeView(0, waiting=4, kv=0.9), FakeView(1, waiting=0)]) == 1
    )


def test_prefix_affinity_beats_round_robin_on_shared_prefixes() -> None:
    setup = make_setup(num_blocks=800)
    trace = hashed_trace(300, seed=7, rate=70.0)
    rr = fleet_of(setup, trace, 4, "round_robin").run().metrics
    pa = fleet_of(setup, trace, 4, "prefix_affinity").run().metrics
    assert pa["prefix_hit_rate"] > rr["prefix_hit_rate"]


def test_router_presets_name_every_router_kind() -> None:
    assert set(router_names()) == set(ROUTERS)
    with pytest.raises(ValueError, match="fleet.router='nope' is not a router; choose one of"):
        make_router("nope")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 0}, "fleet.replicas=0: an integer in 1..1024"),
        ({"replicas": 2.5}, "fleet.replicas=2.5"),
        ({"prefill": 2}, "disaggregation needs both > 0"),
        ({"prefill": 1, "decode": 1, "replicas": 2}, "leave replicas at 1"),
        ({"link": "carrier_pigeon"}, "fleet.link='carrier_pigeon': one of nvlink"),
    ],
)
def test_fleet_spec_refuses_bad_shapes_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")) as info:
        FleetSpec(**kwargs)
    assert "\n" not in str(info.value)


def test_fleet_capacity_grows_with_replicas_and_early_stop_changes_nothing() -> None:
    from envs.serving.workload import load_workload

    setup = make_setup()
    workload = load_workload("azure_code")
    policy = functools.partial(make_policy, "sarathi_512")
    router = functools.partial(make_router, "least_requests")
    kw = {"rel_tol": 0.05}
    one = measure_capacity(setup, workload, policy, **kw)
    two = measure_capacity(
        setup,
        workload,
        policy,
        fleet=FleetSpec(replicas=2, router="least_requests"),
        make_router=router,
        **kw,
    )
    ref = measure_capacity(
        setup,
        workload,
        policy,
        fleet=FleetSpec(replicas=2, router="least_requests"),
        make_router=router,
        early_stop=False,
        **kw,
    )
    assert two.scale > 1.5 * one.scale
    assert (two.scale, two.rps) == (ref.scale, ref.rps)
