"""The ``fleet`` schema in train.py and advise.py: a budget env refuses a fleet, the routing env's
servers are ``fleet.replicas``, the advisor's capacities are a fleet's (against a brute force on the
fleet, the fast search against the reference), and bad fleet values are one line, nothing written.

The advisor's set-up is tests/test_advise.py's: Llama-3-8B on one A100 80 GB per server, roofline
cost model, a 40-request Azure-format trace, here on two servers behind ``least_requests`` (a router
that reads the servers, so the fleet's lazy views are exercised).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from advisor.search import Criterion, TargetProbe
from advisor.targets import parse_targets
from baselines.routers import make_router, router_names
from chunkgym import REPO_ROOT
from envs.serving.fleet import ONE_SERVER, FleetSpec
from envs.serving.metrics import CapacityResult, capacity_search
from policies import router_training
from policies.config import to_train_config
from tests.simtools import make_setup, make_trace
from tests.test_advise import (
    COMMON,
    HARDWARE,
    MODEL,
    SEARCHED,
    SLO_ARGS,
    advise,
    closeness,
    draw_criterion,
    last_json,
    meets,
    plan_for,
    policy_of,
    probe_cases,
    setup_for,
    small_requests,
    write_azure,
)
from tests.test_train_cli import compose_train

REPLICAS, ROUTER = 2, "least_requests"
FLEET_ARGS = (f"fleet.replicas={REPLICAS}", f"fleet.router={ROUTER}")
TARGETS = {"itl_ms_p99": 50.0, "ttft_ms_p99": 1000.0}  # SLO_ARGS


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), *overrides, f"hydra.run.dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env)


# ---- train.py ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, named",
    [
        (["fleet.replicas=2"], "fleet.replicas=2"),  # the budget env (v4) is one server
        (["env.id=chunkgym/ChunkedPrefill-v1", "fleet.replicas=8"], "fleet.replicas=8"),
        (["fleet.prefill=1", "fleet.decode=2"], "not simulated"),
        (["fleet.router=nope"], "fleet.router='nope'"),
        (["+experiment=learned_router", "fleet.replicas=1"], "fleet.replicas=1"),  # routing among 1
        (["fleet.replicas=0"], "fleet.replicas=0"),
        (["fleet.link=copper"], "fleet.link='copper'"),
    ],
)
def test_train_refuses_a_fleet_its_env_cannot_take_in_one_line(tmp_path, overrides, named):
    proc = train(tmp_path, *overrides)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert named in lines[0], lines[0]
    assert not (tmp_path / "run").exists() and proc.stdout == ""


def test_one_server_leaves_the_run_config_as_before_fleets():
    """A budget env's config (and so its hash and resumable run folders) has no fleet key at one
    server; the routing env's records its fleet."""
    from policies.config import run_config

    dcfg = compose_train(["fleet.router=prefix_affinity"])  # ignored at one server
    assert "fleet" not in run_config(dcfg, to_train_config(dcfg))
    dcfg = compose_train(["+experiment=learned_router"])
    assert run_config(dcfg, to_train_config(dcfg))["fleet"]["replicas"] == 8


@pytest.mark.parametrize("overrides, replicas", [([], 8), (["fleet.replicas=3"], 3)])
def test_the_learned_router_experiment_trains_and_evaluates_on_fleet_replicas(
    monkeypatch, overrides, replicas
):
    """The recipe's env and its evaluation fleets have ``fleet.replicas`` servers (8 as shipped)."""
    cfg = to_train_config(compose_train(["+experiment=learned_router", "env.workloads=[]", *overrides]))
    assert cfg.fleet.replicas == replicas
    seen: list[int] = []
    trace = make_trace([0.0, 0.5], [100, 200], [5, 5])
    workload = SimpleNamespace(spec=SimpleNamespace(name=cfg.workload.name), window=lambda *a: trace)
    monkeypatch.setattr(router_training, "Workload", lambda *a: workload)
    monkeypatch.setattr(router_training, "FleetRoutingEnv", lambda *a, **k: seen.append(a[2]))
    router_training.make_env(cfg)
    metrics = {"goodput_rps": 1.0, "slo_attainment": 1.0}
    run = SimpleNamespace(run=lambda: SimpleNamespace(metrics=metrics))

    def fleet(trace, n, *args):
        seen.append(n)
        return run

    setup = SimpleNamespace(fleet=fleet)
    router_training.evaluate(cfg, setup, {"round_robin": make_router("round_robin")})  # type: ignore[arg-type]
    assert seen == [replicas] * (1 + len(cfg.eval.seeds))


# ---- advise.py: the fast fleet probe is sound ---------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(probe_cases(), st.integers(2, 4), st.sampled_from(router_names()), st.data())
def test_the_fast_fleet_probe_agrees_with_the_reference(case, replicas, router, data):
    trace, blocks, candidate = case
    setup = setup_for(candidate, num_blocks=blocks, max_model_len=4096)
    fleet = FleetSpec(replicas=replicas, router=router)
    full = setup.fleet(trace, replicas, candidate.build_policy, make_router(router)).run()
    criterion = draw_criterion(data, full.outcomes)
    reference = TargetProbe(setup, candidate, criterion, False, fleet)(1.0, trace)
    fast = TargetProbe(setup, candidate, criterion, True, fleet)(1.0, trace)
    assert reference.passed == criterion.holds(full.outcomes) == fast.passed
    assert not reference.decided_early and fast.requests == len(trace)
    if fast.decided_early and criterion.targets:
        assert not fast.passed
    if not fast.decided_early:
        assert fast.requests_decided == len(trace)
    event(f"decided early: {fast.decided_early}, passed: {fast.passed}")


def test_the_fast_fleet_probe_moves_no_server_the_fleet_would_not():
    """Where servers stand when the router reads them decides the routing: here a server moved to a
    check time ahead of the fleet would take request 3 and pass a TTFT median the fleet misses."""
    trace = make_trace([0, 0, 0.25, 0.25, 0.25, 0.25], [1, 1, 1, 1, 272, 272], [1] * 6, span=1.25)
    candidate = SEARCHED[0]
    setup = setup_for(candidate)
    full = setup.fleet(trace, 2, candidate.build_policy, make_router("least_outstanding_tokens")).run()
    ttft_ms = sorted(full.outcomes.ttft * 1000.0)
    criterion = Criterion(parse_targets({"ttft_ms_p50": (ttft_ms[1] + ttft_ms[2]) / 2}))
    fleet = FleetSpec(2, "least_outstanding_tokens")
    verdicts = {
        TargetProbe(setup, candidate, criterion, fast, fleet)(1.0, trace).passed for fast in (False, True)
    }
    assert verdicts == {criterion.holds(full.outcomes)} == {False}


@pytest.mark.parametrize("key, ms", [("ttft_ms_p99", 50.0), ("itl_ms_p99", 30.0)])
def test_an_overloaded_fleet_probe_stops_early_and_the_full_run_fails(key, ms):
    times_ns, prompts, outputs = small_requests(120, seed=1)
    trace = make_trace(times_ns / 1e9 / 16.0, prompts, outputs)
    candidate = SEARCHED[0]
    setup = setup_for(candidate)
    criterion = Criterion(parse_targets({key: ms}))
    fast = TargetProbe(setup, candidate, criterion, True, FleetSpec(REPLICAS, ROUTER))(16.0, trace)
    assert fast.decided_early and not fast.passed and fast.requests_decided < len(trace)
    full = setup.fleet(trace, REPLICAS, candidate.build_policy, make_router(ROUTER)).run()
    assert not meets(full.outcomes, criterion.targets)


# ---- advise.py: capacities against a brute force on the fleet -----------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    requests = small_requests()
    return write_azure(tmp_path_factory.mktemp("fleet") / "small.csv", *requests), requests


@pytest.fixture(scope="module")
def fleet_run(small, tmp_path_factory) -> Path:
    trace, _ = small
    out = tmp_path_factory.mktemp("advice") / "out"
    proc = advise(*COMMON, f"trace={trace}", *SLO_ARGS, *FLEET_ARGS, "plots=false", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert last_json(proc.stdout)["candidates"] == len(SEARCHED)
    return out


def fleet_brute_force(requests, flags: dict) -> tuple[CapacityResult, float]:
    """The capacity of ``REPLICAS`` servers of the setting ``flags`` names behind ``ROUTER``:
    bracketing and bisection over load scale, each probe a full run of the fleet judged by
    :func:`tests.test_advise.meets`, the rate the whole fleet's."""
    times_ns, prompts, outputs = requests
    arrivals, span = times_ns / 1e9, float(times_ns[-1] / 1e9)
    setup = make_setup(MODEL, HARDWARE, **policy_of(flags)[1])

    def passes(scale: float) -> bool:
        trace = make_trace(arrivals / scale, prompts, outputs, span=span / scale)
        fleet = setup.fleet(trace, REPLICAS, lambda: policy_of(flags)[0], make_router(ROUTER))
        return meets(fleet.run().outcomes, parse_targets(TARGETS))

    result = capacity_search(passes, rel_tol=0.02)
    return result, len(prompts) / (span / result.scale) if result.scale > 0 else 0.0


@pytest.mark.slow
def test_fleet_capacities_and_recommendation_equal_a_brute_force_on_the_fleet(fleet_run, small):
    advice = json.loads((fleet_run / "advice.json").read_text())
    assert advice["fleet"] == {"replicas": REPLICAS, "router": ROUTER}
    assert f"{REPLICAS} servers behind the {ROUTER} router" in (fleet_run / "advice.md").read_text()
    rows = advice["candidates"]
    for c in rows:
        result, rps = fleet_brute_force(small[1], c["flags"])
        assert c["capacity_scale"] == result.scale and c["capacity_rps"] == rps, c["name"]
        assert c["bracket"] == [
            result.bracket[0],
            result.bracket[1] if np.isfinite(result.bracket[1]) else None,
        ]
    best = max(c["capacity_scale"] for c in rows)
    expected = min((c for c in rows if c["capacity_scale"] == best), key=lambda c: closeness(c, rows[0]))
    assert advice["recommended"] == expected["flags"] and best > 0
    assert len({c["capacity_scale"] for c in rows}) > 3, "the candidates differ on this trace"


@pytest.mark.slow
def test_the_reference_search_on_a_fleet_gives_the_same_advice_bit_for_bit(fleet_run, small, tmp_path):
    trace, _ = small
    ref = tmp_path / "ref"
    proc = advise(
        *COMMON, f"trace={trace}", *SLO_ARGS, *FLEET_ARGS, "fast=false", "plots=false", f"output_dir={ref}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fast, reference = (json.loads((d / "advice.json").read_text()) for d in (fleet_run, ref))
    assert fast["recommended"] == reference["recommended"]
    keys = ("name", "capacity_scale", "capacity_rps", "bracket", "at_current_rate")
    for a, b in zip(fast["candidates"], reference["candidates"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_one_server_is_the_plan_without_a_fleet(small):
    """At one replica the router is ignored: the plan's fleet is the one-server default."""
    trace, _ = small
    assert plan_for(f"trace={trace}", *SLO_ARGS, "fleet.router=prefix_affinity").fleet is ONE_SERVER
    assert plan_for(f"trace={trace}", *SLO_ARGS, *FLEET_ARGS).fleet == FleetSpec(REPLICAS, ROUTER)


# ---- advise.py: bad fleet values ----------------------------------------------------------------
BAD_FLEET = {
    "no servers": (["fleet.replicas=0"], "fleet.replicas=0"),
    "too many servers": (["fleet.replicas=100000"], "fleet.replicas=100000"),
    "not a number": (["fleet.replicas=many"], "fleet.replicas"),
    "an unknown router": (["fleet.replicas=2", "fleet.router=nope"], "fleet.router='nope'"),
    "disaggregated": (["fleet.prefill=1", "fleet.decode=1"], "topology=auto"),  # advise.py splits
    "prefill alone": (["fleet.prefill=1"], "fleet.prefill=1"),
    "an unknown link": (["fleet.link=copper"], "fleet.link='copper'"),
    "an unknown key": (["fleet.gpus=2"], "fleet.gpus"),
}


@pytest.mark.parametrize("case", list(BAD_FLEET))
def test_bad_fleet_values_are_one_line_and_write_nothing(case, small, tmp_path):
    overrides, named = BAD_FLEET[case]
    trace, _ = small
    out = tmp_path / "out"
    proc = advise(*COMMON, f"trace={trace}", *SLO_ARGS, *overrides, f"output_dir={out}", timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("advise.py: error: ") and named in lines[0], lines[0]
    assert not out.exists() and proc.stdout == ""
