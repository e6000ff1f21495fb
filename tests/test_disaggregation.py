"""Prefill-decode disaggregation: roles, the KV hand-over, the link and the fleet's metrics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.routers import make_router
from envs.serving.disaggregation import DisaggregatedFleet
from envs.serving.fleet import Fleet, FleetSpec
from envs.serving.kv_transfer import LinkSpec, exposed_transfer_time, kv_transfer_bytes
from policies.registry import make_policy
from tests.simtools import make_setup, make_trace, same_run


def trace_of(n: int, seed: int, rate: float, prompts: tuple[int, int], outputs: tuple[int, int]):
    rng = np.random.default_rng(seed)
    return make_trace(
        np.cumsum(rng.exponential(1 / rate, n)),
        rng.integers(prompts[0], prompts[1] + 1, n),
        rng.integers(outputs[0], outputs[1] + 1, n),
    )


def pd_fleet(
    trace,
    prefill: int = 1,
    decode: int = 1,
    policy: str = "sarathi_512",
    link: str | LinkSpec = "nvlink",
    layerwise: bool = False,
    setup=None,
    decode_setup=None,
    router: str = "least_outstanding_tokens",
    decode_router: str = "least_requests",
) -> DisaggregatedFleet:
    setup = setup or make_setup()
    return setup.disaggregated_fleet(
        trace,
        prefill,
        decode,
        lambda: make_policy(policy),
        make_router(router),
        make_router(decode_router),
        link,
        decode_setup=decode_setup,
        layerwise=layerwise,
    )


def test_no_prefill_pool_is_todays_colocated_fleet() -> None:
    setup = make_setup(num_blocks=600)
    trace = trace_of(150, seed=1, rate=40.0, prompts=(20, 900), outputs=(1, 80))
    for replicas in (1, 3):
        spec = FleetSpec(replicas=replicas, router="least_requests")
        built = setup.fleet_for(
            trace,
            spec,
            lambda: make_policy("sarathi_512"),
            make_router("least_requests"),
            make_router("round_robin"),
        )
        assert isinstance(built, Fleet) and len(built.servers) == replicas
        plain = setup.fleet(
            trace, replicas, lambda: make_policy("sarathi_512"), make_router("least_requests")
        )
        a, b = built.run(), plain.run()
        assert same_run(a, b)
        assert np.array_equal(a.iterations["start"], b.iterations["start"])
    single = setup.simulator(trace).run(make_policy("sarathi_512"))
    one = setup.fleet_for(
        trace, FleetSpec(), lambda: make_policy("sarathi_512"), make_router("round_robin")
    ).run()
    assert same_run(single, one)


def owned_blocks(fleet: DisaggregatedFleet) -> None:
    """Every server's private KV blocks are exactly those of the requests it holds, and every handed-over
    request's KV is held by exactly one server (the prefill server until a decode server admits it)."""
    for pool in (fleet.prefill, fleet.decode):
        for server in pool:
            core = server.core
            core.kv.check()
            blocks = sum(core.kv.blocks_for(r.computed) for r in core.queue)
            blocks += sum(core.kv.blocks_for(r.computed) for r in core.held.values())
            dec = core.decode
            blocks += sum(
                core.kv.blocks_for(r.decode_kv0 + dec.clock - r.decode_join) for r in dec.members.values()
            )
            assert blocks == core.kv.private
    for rid, tr in fleet.transfers.items():
        on_prefill = [rid in s.core.held for s in fleet.prefill]
        on_decode = [
            rid in s.core.decode.members or any(r.rid == rid for r in s.core.queue) for s in fleet.decode
        ]
        finished = any(r.rid == rid for s in fleet.decode for r in s.core.finished)
        if np.isnan(tr.admitted):
            assert on_prefill == [i == tr.prefill for i in range(len(fleet.prefill))] and not any(on_decode)
        else:
            assert not any(on_prefill)
            assert on_decode == [k == tr.decode and not finished for k in range(len(fleet.decode))]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 30),
    rate=st.floats(2.0, 400.0),
    prefill=st.integers(1, 2),
    decode=st.integers(1, 2),
    blocks=st.integers(40, 160),
    decode_blocks=st.integers(40, 160),
    layerwise=st.booleans(),
    policy=st.sampled_from(["sarathi_512", "fcfs"]),
    link=st.sampled_from(["nvlink", "eth_25g"]),
)
def test_kv_blocks_are_conserved_across_hand_overs(
    seed, n, rate, prefill, decode, blocks, decode_blocks, layerwise, policy, link
) -> None:
    trace = trace_of(n, seed, rate, prompts=(1, 500), outputs=(1, 60))
    fleet = pd_fleet(
        trace,
        prefill,
        decode,
        policy,
        link,
        layerwise,
        setup=make_setup(num_blocks=blocks),
        decode_setup=make_setup(num_blocks=decode_blocks),
    )
    fleet.start()
    while fleet.step():
        owned_blocks(fleet)
    for server in fleet.servers:
        assert server.core.kv.private == 0 and server.core.kv.free == server.core.kv.total
        assert not server.core.held and not server.core.landed and server.core.done()
    assert all(link.active == 0 for link in fleet.links)
    result = fleet.result()
    assert fleet.n_good + fleet.n_bad == n  # each request judged once, fleet-wide
    assert fleet.n_good == int(result.outcomes.good.sum())
    handed = {int(i) for i in np.flatnonzero(trace.output_len > 1)} - {
        r.rid for s in fleet.prefill for r in s.core.rejected
    }
    assert set(fleet.transfers) == handed
    assert all(tr.start <= tr.landed <= tr.admitted for tr in fleet.transfers.values())


def spaced_trace(n: int = 6, prompt: int = 1000, output: int = 4):
    """One request at a time: each is done before the next arrives."""
    return make_trace(np.arange(n) * 2.0, [prompt + 97 * i for i in range(n)], [output] * n)


def test_a_link_twice_as_fast_takes_half_the_time_above_its_base_latency() -> None:
    trace = spaced_trace()
    setup = make_setup()
    times = {}
    for bw in (10e9, 20e9):
        fleet = pd_fleet(trace, link=LinkSpec("test", bw, 2e-4), setup=setup)
        fleet.run()
        times[bw] = np.array([tr.transfer_s for tr in fleet.transfers.values()])
        nbytes = [kv_transfer_bytes(setup.model, int(p), 1) for p in trace.prompt_len]
        assert times[bw] == pytest.approx(2e-4 + np.array(nbytes) / bw, rel=1e-12)
    assert times[10e9] - 2e-4 == pytest.approx(2 * (times[20e9] - 2e-4), rel=1e-12)


def test_layerwise_streaming_leaves_the_exposed_time_alone_on_the_link() -> None:
    trace = spaced_trace()
    setup = make_setup()
    link = LinkSpec("slow", 2e9, 1e-4)
    whole = pd_fleet(trace, link=link, setup=setup)
    layered = pd_fleet(trace, link=link, setup=setup, layerwise=True)
    whole.run(), layered.run()
    for rid, tr in layered.transfers.items():
        req = trace_req = layered.prefill[0].core.requests[rid]
        prefill_s = tr.start - trace_req.first_scheduled
        nbytes = kv_transfer_bytes(setup.model, req.prompt_len, 1)
        exposed = exposed_transfer_time(link, nbytes, prefill_s, setup.model.num_layers)
        assert tr.transfer_s == pytest.approx(exposed, rel=1e-9)
        assert tr.transfer_s < whole.transfers[rid].transfer_s


def test_ttft_ends_on_the_prefill_server_and_the_first_decode_gap_holds_the_transfer() -> None:
    trace = trace_of(60, seed=4, rate=30.0, prompts=(200, 3000), outputs=(2, 40))
    fleet = pd_fleet(trace, link="eth_25g", decode=2)
    result = fleet.run()
    assert fleet.transfers
    for rid, tr in fleet.transfers.items():
        ts = result.token_times[rid]
        assert ts[0] == tr.start  # the first token is the prefill server's
        assert result.outcomes.ttft[rid] == ts[0] - trace.arrival_s[rid]
        assert ts[1] > tr.admitted >= tr.landed > tr.start  # the gap holds the transfer and the wait
    m = result.metrics
    gaps = [result.token_times[r][1] - result.token_times[r][0] for r in fleet.transfers]
    shares = [tr.transfer_s / g for tr, g in zip(fleet.transfers.values(), gaps, strict=True)]
    assert m["first_decode_gap_transfer_share"] == pytest.approx(np.mean(shares))
    assert 0 < m["first_decode_gap_transfer_share"] < 1 and m["ttft_transfer_share"] == 0.0
    assert m["goodput_per_gpu"] == m["goodput_rps"] / 3 and m["handovers"] == len(fleet.transfers)


def test_a_full_decode_server_delays_admission_and_the_gap_grows() -> None:
    # A (400-token prompt, 200 outputs) fills most of a 40-block decode cache; B (300 tokens) waits for it.
    trace = make_trace([0.0, 0.05], [400, 300], [200, 5])
    gaps, waits = {}, {}
    for blocks in (40, 4000):
        fleet = pd_fleet(trace, decode_setup=make_setup(num_blocks=blocks))
        result = fleet.run()
        b = fleet.transfers[1]
        gaps[blocks] = result.token_times[1][1] - result.token_times[1][0]
        waits[blocks] = b.admitted - b.landed
        if blocks == 40:
            assert b.admitted >= result.token_times[0][-1]  # only once A finished and freed its blocks
    assert waits[40] > 10 * waits[4000] and gaps[40] > gaps[4000] + waits[40] * 0.9


def test_decode_servers_run_no_prefill_and_their_gaps_are_decode_iterations() -> None:
    trace = trace_of(40, seed=7, rate=6.0, prompts=(2000, 4000), outputs=(20, 60))
    setup = make_setup()
    pd = pd_fleet(trace, setup=setup)
    dis = pd.run()
    colo = setup.simulator(trace).run(make_policy("sarathi_512"))
    log = pd.decode[0].log.arrays()
    assert not log["prefill_tokens"].any() and dis.metrics["preemptions"] == 0
    decode_only = float(log["latency"].max())
    later = {r: np.diff(t[1:]) for r, t in dis.token_times.items() if len(t) > 2}
    assert max(float(g.max()) for g in later.values()) <= decode_only
    colo_later = max(float(np.diff(t[1:]).max()) for t in colo.token_times.values() if len(t) > 2)
    assert colo_later > 1.5 * decode_only  # a colocated server's decodes wait on prefill chunks
    assert dis.metrics["tpot_p99_s"] < colo.metrics["tpot_p99_s"]


def test_reruns_are_identical() -> None:
    trace = trace_of(120, seed=9, rate=50.0, prompts=(50, 2500), outputs=(1, 100))
    runs = [pd_fleet(trace, prefill=2, decode=2, link="ib_200g", layerwise=True) for _ in range(2)]
    a, b = (f.run() for f in runs)
    assert same_run(a, b)
    assert [vars(t) for t in runs[0].transfers.values()] == [vars(t) for t in runs[1].transfers.values()]


def test_fleet_for_builds_the_disaggregated_fleet_and_its_stop_counts_both_pools() -> None:
    trace = trace_of(80, seed=2, rate=40.0, prompts=(50, 1500), outputs=(1, 50))
    setup = make_setup()
    spec = FleetSpec(prefill=2, decode=1, link="ib_400g", decode_router="least_requests")
    fleet = setup.fleet_for(
        trace,
        spec,
        lambda: make_policy("sarathi_512"),
        make_router("round_robin"),
        make_router("least_requests"),
    )
    assert isinstance(fleet, DisaggregatedFleet)
    assert (len(fleet.prefill), len(fleet.decode), fleet.link_spec.name) == (2, 1, "ib_400g")
    with pytest.raises(ValueError, match="decode router"):
        setup.fleet_for(trace, spec, lambda: make_policy("sarathi_512"), make_router("round_robin"))
    stopped = fleet.run(fleet.count_stop(good=10, bad=10**9))
    assert stopped.stopped and fleet.n_good == 10


def test_the_decode_pool_refuses_what_it_could_never_hold() -> None:
    trace = make_trace([0.0, 0.1], [300, 300], [400, 1])  # the first needs 44 blocks at full length
    fleet = pd_fleet(trace, decode_setup=make_setup(num_blocks=30))
    result = fleet.run()
    assert "decode pool" in result.outcomes.reject_reason[0] and not result.outcomes.reject_reason[1]
    assert fleet.n_bad == 1 and fleet.n_good == 1 and not fleet.transfers
