"""advise.py ``topology=auto``: colocated serving against every prefill-decode split of the same
servers, judged by the same SLO targets, and the answer's 2% rule.

The set-up is tests/test_advise.py's (Llama-3-8B on A100 80 GB servers, roofline cost model, a
40-request Azure-format trace) on three servers behind ``least_requests``, so there are two splits
(1P2D, 2P1D) and each search takes well under a second.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from advisor.engines import Candidate, VllmKnobs, serve_command
from advisor.report import topology_json, topology_lines
from advisor.search import Found
from advisor.targets import parse_targets
from advisor.topology import STRICT_WIN, Topology, best, recommend, splits, tried
from baselines.routers import make_router
from envs.serving.fleet import FleetSpec
from envs.serving.loop import SimResult
from envs.serving.metrics import CapacityResult, capacity_search
from tests.simtools import make_setup, make_trace
from tests.test_advise import (
    COMMON,
    HARDWARE,
    MODEL,
    SLO_ARGS,
    advise,
    last_json,
    meets,
    outcomes_of,
    policy_of,
    small_requests,
    write_azure,
)
from tests.test_fleet_tools import TARGETS

REPLICAS, ROUTER = 3, "least_requests"
FLEET_ARGS = (f"fleet.replicas={REPLICAS}", f"fleet.router={ROUTER}", "plots=false")
SPLITS = ("1P2D", "2P1D")
BLOCK_KEYS = {"gpus", "tp", "strict_win", "colocated", "disaggregated", "recommended", "engine", "tried"}
KV_CONFIG = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    requests = small_requests()
    return write_azure(tmp_path_factory.mktemp("topology") / "small.csv", *requests), requests


def run(trace: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = advise(*COMMON, f"trace={trace}", *SLO_ARGS, *FLEET_ARGS, *overrides, f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def auto_run(small, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("auto") / "out"
    return out, run(small[0], out, "topology=auto")


def split_brute_force(requests, flags: dict, split: FleetSpec) -> tuple[CapacityResult, float]:
    """The capacity of ``split``'s prefill and decode servers, all with the setting ``flags`` names:
    bracketing and bisection over load scale, each probe a full run judged by
    :func:`tests.test_advise.meets`."""
    times_ns, prompts, outputs = requests
    arrivals, span = times_ns / 1e9, float(times_ns[-1] / 1e9)
    setup = make_setup(MODEL, HARDWARE, **policy_of(flags)[1])

    def passes(scale: float) -> bool:
        trace = make_trace(arrivals / scale, prompts, outputs, span=span / scale)
        fleet = setup.fleet_for(
            trace,
            split,
            lambda: policy_of(flags)[0],
            make_router(split.router),
            make_router(split.decode_router),
        )
        return meets(fleet.run().outcomes, parse_targets(TARGETS))

    result = capacity_search(passes, rel_tol=0.02)
    return result, len(prompts) / (span / result.scale) if result.scale > 0 else 0.0


# ---- the splits and the rule -----------------------------------------------------------------
def test_auto_splits_every_server_count_into_prefill_and_decode_with_the_fleets_link_and_routers():
    fleet = FleetSpec(replicas=4, router="least_requests", link="ib_200g", decode_router="least_requests")
    found = splits("auto", fleet)
    assert [(f.prefill, f.decode) for f in found] == [(1, 3), (2, 2), (3, 1)]
    assert {(f.link, f.router, f.decode_router, f.servers) for f in found} == {
        ("ib_200g", "least_requests", "least_requests", 4)
    }
    assert splits("colocated", fleet) == ()


@pytest.mark.parametrize(
    "topology, replicas, named", [("auto", 1, "fleet.replicas=1"), ("bogus", 2, "topology='bogus'")]
)
def test_no_split_to_try_or_an_unknown_topology_is_an_error_naming_it(topology, replicas, named):
    with pytest.raises(ValueError, match=named):
        splits(topology, FleetSpec(replicas=replicas))


@pytest.mark.parametrize(
    "colocated, disaggregated, expected",
    [
        (10.0, 10.0 * (1 + STRICT_WIN), "colocated"),  # exactly 2% more: not a strict win
        (10.0, math.nextafter(10.0 * (1 + STRICT_WIN), math.inf), "disaggregated"),
        (10.0, 9.0, "colocated"),
        (0.0, 0.0, "colocated"),  # nothing meets the SLO either way
        (0.0, 1.0, "disaggregated"),
    ],
)
def test_disaggregation_is_recommended_only_beyond_two_percent_more_capacity(
    colocated, disaggregated, expected
):
    assert recommend(colocated, disaggregated) == expected


def test_the_best_split_is_the_highest_capacity_ties_to_the_first_tried():
    c = Candidate("current", "current", VllmKnobs(2048, 256))
    found = [Found(c, s, s, CapacityResult(s, (s, s), ())) for s in (1.0, 3.0, 2.0, 3.0)]
    assert best(found) == 1


def test_each_split_is_tried_with_the_current_settings_the_best_budget_and_the_recommendation():
    rows = [("current", "current", 2.0), ("budget 256", "max_num_batched_tokens", 1.0)]
    rows += [("budget 512", "max_num_batched_tokens", 3.0), ("budget 1024", "max_num_batched_tokens", 3.0)]
    rows += [("chunkgym adaptive_srpf", "plugin", 4.0)]
    found = [
        Found(Candidate(n, fam, VllmKnobs(2048, 256)), s, s, CapacityResult(s, (s, s), ()))
        for n, fam, s in rows
    ]
    two = splits("auto", FleetSpec(replicas=3))
    assert tried(two, found, found[4]) == [(f, i) for f in two for i in (0, 2, 4)]
    assert tried(two, found, found[2]) == [(f, i) for f in two for i in (0, 2)]  # each once
    assert tried(two, found, None) == [(f, i) for f in two for i in (0, 2)]


def test_a_disaggregated_answer_gives_both_pools_instances_with_the_kv_connector():
    """Where a split wins beyond 2%, the engine block starts its prefill and decode instances with
    the winning setting's flags and vLLM's NIXL connector, and the page says so."""
    colocated = Candidate("budget 512", "max_num_batched_tokens", VllmKnobs(512, 256))
    winner = Candidate("budget 4096", "max_num_batched_tokens", VllmKnobs(4096, 256))
    two = splits("auto", FleetSpec(replicas=3, link="ib_200g"))
    found = [
        Found(c, s, s, CapacityResult(s, (s, s * 1.02), ())) for c, s in ((colocated, 1.5), (winner, 2.5))
    ]
    metrics = {"first_decode_gap_transfer_share": 0.25, "kv_transfer_s_mean": 0.004}
    at_capacity = SimResult(outcomes_of([np.array([0.0, 0.1])], [0.0]), {}, metrics, {})
    pairs = [(two[0], 0), (two[1], 1)]
    t = Topology(FleetSpec(replicas=3), 1, found[0], pairs, found, at_capacity)
    block = topology_json(t, "m", "strict", "c")
    assert block["recommended"] == "disaggregated"
    dis, engine = block["disaggregated"], block["engine"]
    assert (dis["split"], dis["link"], dis["name"], dis["capacity_rps_per_gpu"]) == (
        "2P1D",
        "ib_200g",
        "budget 4096",
        2.5 / 3,
    )
    assert (dis["first_decode_gap_transfer_share"], dis["kv_transfer_ms_mean"]) == (0.25, 4.0)
    flags = {**winner.flags("strict", "c"), "--kv-transfer-config": KV_CONFIG}
    assert engine["prefill"] == {"instances": 2, "flags": flags, "command": engine["decode"]["command"]}
    assert engine["decode"]["instances"] == 1 and engine["decode"]["flags"] == flags
    assert (
        engine["prefill"]["command"] == serve_command("m", flags)
        and "--kv-transfer-config" in engine["prefill"]["command"]
    )
    assert [r["split"] for r in block["tried"]] == ["1P2D", "2P1D"]
    page = "\n".join(topology_lines(block))
    assert "**disaggregated**" in page and "2 prefill and 1 decode instances" in page and "25%" in page


# ---- end to end ------------------------------------------------------------------------------
@pytest.mark.slow
def test_auto_answers_with_both_sides_every_split_and_the_two_percent_rule(auto_run):
    out, proc = auto_run
    advice = json.loads((out / "advice.json").read_text())
    t = advice["topology"]
    assert set(t) == BLOCK_KEYS and t["gpus"] == REPLICAS and t["tp"] == 1
    co, dis = t["colocated"], t["disaggregated"]
    assert co["name"] == advice["recommended_name"] and co["flags"] == advice["recommended"]
    assert co["capacity_rps"] == advice["recommended_capacity_rps"] > 0
    assert (co["replicas"], co["router"]) == (REPLICAS, ROUTER)
    # every split, each with the current settings, the best budget (ties: the first) and the recommendation
    budgets = [c for c in advice["candidates"] if c["family"] == "max_num_batched_tokens"]
    best_budget = max(budgets, key=lambda c: c["capacity_scale"])
    names = {"current", best_budget["name"], advice["recommended_name"]}
    assert {(r["split"], r["name"]) for r in t["tried"]} == {(s, n) for s in SPLITS for n in names}
    assert len(t["tried"]) == len(SPLITS) * len(names) and [r["split"] for r in t["tried"]] == sorted(
        r["split"] for r in t["tried"]
    )
    top = max(t["tried"], key=lambda r: r["capacity_rps"])
    assert (dis["split"], dis["name"], dis["capacity_rps"]) == (
        top["split"],
        top["name"],
        top["capacity_rps"],
    )
    assert (dis["prefill"] + dis["decode"], dis["link"], dis["router"]) == (REPLICAS, "nvlink", ROUTER)
    for side in (co, dis):
        assert side["capacity_rps_per_gpu"] == pytest.approx(side["capacity_rps"] / REPLICAS, rel=1e-12)
    assert 0 < dis["first_decode_gap_transfer_share"] < 1 and dis["kv_transfer_ms_mean"] > 0
    assert dis["flags"]["--kv-transfer-config"] == KV_CONFIG
    expected = "disaggregated" if dis["capacity_rps"] > co["capacity_rps"] * 1.02 else "colocated"
    assert t["recommended"] == expected == last_json(proc.stdout)["topology"]
    engine = t["engine"]
    if expected == "colocated":
        assert engine["instances"] == REPLICAS and engine["flags"] == co["flags"]
    else:
        assert engine["prefill"]["flags"] == engine["decode"]["flags"] == dis["flags"]
        assert (engine["prefill"]["instances"], engine["decode"]["instances"]) == (
            dis["prefill"],
            dis["decode"],
        )
    page = (out / "advice.md").read_text()
    assert f"## Topology: {REPLICAS} GPUs" in page and f"**{expected}**" in page


@pytest.mark.slow
def test_each_splits_capacity_equals_a_brute_force_on_the_split(auto_run, small):
    """The disaggregated probes judge the operator's targets as the colocated ones do: each split's
    capacity (scale, bracket, req/s) is a plain search's whose probes are full runs of the split."""
    out, _ = auto_run
    advice = json.loads((out / "advice.json").read_text())
    flags = {c["name"]: c["flags"] for c in advice["candidates"]}
    for row in advice["topology"]["tried"]:
        prefill, decode = (int(x) for x in row["split"][:-1].split("P"))
        split = FleetSpec(router=ROUTER, prefill=prefill, decode=decode)
        result, rps = split_brute_force(small[1], flags[row["name"]], split)
        assert row["capacity_scale"] == result.scale and row["capacity_rps"] == rps, row
        assert row["bracket"] == [
            result.bracket[0],
            result.bracket[1] if np.isfinite(result.bracket[1]) else None,
        ]
    assert len({r["capacity_scale"] for r in advice["topology"]["tried"]}) > 1, "the settings differ here"


@pytest.mark.slow
def test_the_reference_search_gives_the_same_topology_bit_for_bit(auto_run, small, tmp_path):
    out, _ = auto_run
    ref = tmp_path / "ref"
    run(small[0], ref, "topology=auto", "fast=false")
    fast, reference = (json.loads((d / "advice.json").read_text())["topology"] for d in (out, ref))
    assert fast == reference


@pytest.mark.slow
def test_colocated_advice_is_unchanged_and_auto_only_adds_its_block(auto_run, small, tmp_path):
    """Without ``topology=auto`` (the default, or ``topology=colocated``) the advice has no topology
    block; with it, everything else is the same advice."""
    auto_out, auto_proc = auto_run
    default, explicit = tmp_path / "default", tmp_path / "colocated"
    procs = [run(small[0], default), run(small[0], explicit, "topology=colocated")]
    advices = [json.loads((d / "advice.json").read_text()) for d in (default, explicit, auto_out)]
    summaries = [last_json(p.stdout) for p in (*procs, auto_proc)]
    for a, s in zip(advices, summaries, strict=True):
        a.pop("advice_dir"), s.pop("advice_dir")
    auto, auto_summary = advices.pop(), summaries.pop()
    assert "topology" not in advices[0] and "topology" not in summaries[0]
    assert advices[0] == advices[1] and summaries[0] == summaries[1]
    auto.pop("topology"), auto_summary.pop("topology")
    assert auto == advices[0] and auto_summary == summaries[0]
    assert "## Topology" not in (default / "advice.md").read_text()


# ---- bad input -------------------------------------------------------------------------------
BAD_TOPOLOGY = {
    "an unknown topology": (["topology=bogus", "fleet.replicas=2"], "topology='bogus'"),
    "one server to split": (["topology=auto"], "fleet.replicas=1"),
    "a split named by hand": (["topology=auto", "fleet.prefill=1", "fleet.decode=1"], "topology=auto"),
}


@pytest.mark.parametrize("case", list(BAD_TOPOLOGY))
def test_bad_topology_is_one_line_before_any_work_and_writes_nothing(case, small, tmp_path):
    overrides, named = BAD_TOPOLOGY[case]
    out = tmp_path / "out"
    proc = advise(*COMMON, f"trace={small[0]}", *SLO_ARGS, *overrides, f"output_dir={out}", timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("advise.py: error: ") and named in lines[0], lines[0]
    assert not out.exists() and proc.stdout == ""
