"""advise.py and the advisor: SLO targets, the fast probes' soundness, capacities against a brute
force, the command line's files and summary, and bad input refused before any work.

The small set-up: Llama-3-8B on one A100 80 GB (vLLM's defaults there: 2048 tokens, 256 sequences,
so the candidate list is the full 24) on the roofline cost model, serving a 40-request Azure-format
trace written here, so each simulation takes milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from advise import RULES, AdviseConfig, Plan, SloConfig, _recommended_recorded, plan_of
from advisor.engines import Candidate, VllmKnobs, candidates
from advisor.report import pick
from advisor.search import Criterion, Found, TargetProbe, at_rate
from advisor.targets import (
    METRICS,
    PERCENTILES,
    REQUEST_METRICS,
    Target,
    holds,
    parse_targets,
    percentile_ms,
    samples,
)
from baselines import VllmV1
from chunkgym import REPO_ROOT
from chunkgym.cli import _compose
from chunkgym.config import to_object
from envs.serving.core import ServingConfig
from envs.serving.metrics import SLO, CapacityResult, RequestOutcomes, capacity_search
from envs.serving.scheduling import Policy
from policies.registry import make_policy
from tests.simtools import make_setup, make_trace, write_azure

MODEL, HARDWARE = "llama3_8b", "a100_80gb"
DEFAULTS = VllmKnobs(2048, 256)  # vLLM 0.32's defaults on an A100
SLO_ARGS = ("slo.itl_ms_p99=50", "slo.ttft_ms_p99=1000")
COMMON = ("engine=vllm", "cost_model=roofline", "progress=false", "n_jobs=2")
SUMMARY_KEYS = {
    "recommended",
    "recommended_capacity_rps",
    "current_capacity_rps",
    "gain_over_current",
    "candidates",
    "hol_share_current",
    "hol_share_recommended",
    "advice_dir",
}
PLOTS = ("capacity_by_knob.png", "bucket_tails.png", "worst_stalls.png")
FIXTURE = Path(__file__).parent / "fixtures" / "vllm_metrics"


# ---- helpers ----------------------------------------------------------------------------------
def small_requests(n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrival times (whole 100 ns ticks, the first at 0), prompts and outputs: short chats and,
    every eighth request, a prompt of 5k to 9k tokens that stalls the others' decodes."""
    rng = np.random.default_rng(seed)
    gaps_ns = rng.integers(50_000_000, 1_500_000_000, n) // 100 * 100
    times_ns = np.cumsum(gaps_ns) - gaps_ns[0]
    prompts = rng.integers(50, 900, n)
    prompts[3::8] = rng.integers(5000, 9000, len(prompts[3::8]))
    return times_ns, prompts, rng.integers(10, 120, n)


def advise(*args: str, cwd: Path = REPO_ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "advise.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_json(stdout: str) -> dict:
    """The last stdout line, which must be one JSON object."""
    lines = stdout.strip().splitlines()
    assert lines, "advise.py printed nothing"
    return json.loads(lines[-1])


def outcomes_of(token_times: list[np.ndarray | None], arrivals: list[float]) -> RequestOutcomes:
    n = len(arrivals)
    return RequestOutcomes.from_token_times(
        arrival=arrivals,
        prompt_len=[100] * n,
        output_len=[5 if t is None else len(t) for t in token_times],
        token_times=token_times,
        first_scheduled=arrivals,
        ttft_bound=[1.0] * n,
        slo=SLO("test", 0.1, 1.0, 1.0, 1.0, 0.01),
    )


def meets(out: RequestOutcomes, targets: tuple[Target, ...]) -> bool:
    """Every target by its plain definition: the ``ceil(p N / 100)``-th smallest sample (a rejected
    request's is infinite), in milliseconds as the report prints it, at most the target; no
    request fails a request-level target, no token gap passes the ITL one."""
    for t in targets:
        if t.metric == "itl":
            values = np.concatenate(out.gaps) if out.gaps else np.empty(0)
            if not len(values):
                continue
        else:
            values = np.where(out.finished, getattr(out, t.metric), np.inf)
            if not len(values):
                return False
        k = math.ceil(Fraction(t.percentile * len(values), 100))
        if not np.sort(values)[k - 1] * 1000.0 <= t.ms:
            return False
    return True


def policy_of(flags: dict) -> tuple[Policy, dict]:
    """The policy and engine settings that ``vllm serve`` with these flags runs, read from the flags:
    ``max_num_seqs`` batch slots, and vLLM's own scheduler sees as many waiting requests as that
    (chunkgym's ``lookahead``, 64 by default, is what a plug-in policy may reorder)."""
    seqs = flags["--max-num-seqs"]
    if "--scheduler-cls" in flags:
        name = json.loads(flags["--additional-config"])["chunkgym"]["policy"]
        return make_policy(name), {"max_num_seqs": seqs}
    policy = VllmV1(
        max_num_batched_tokens=flags["--max-num-batched-tokens"],
        long_prefill_token_threshold=flags.get("--long-prefill-token-threshold", 0),
        long_prefill_token_threshold_adaptive=flags.get("--long-prefill-token-threshold-adaptive", False),
        enable_chunked_prefill="--enable-chunked-prefill" in flags,
        max_num_active_seqs=flags.get("--max-num-active-seqs"),
    )
    assert ("--enable-chunked-prefill" in flags) != ("--no-enable-chunked-prefill" in flags)
    return policy, {"max_num_seqs": seqs, "lookahead": max(ServingConfig().lookahead, seqs)}


def settings_of(flags: dict) -> dict:
    """Each setting the flags make, once (a switch and its ``--no-`` form are one setting)."""
    plugin = (
        json.loads(flags["--additional-config"])["chunkgym"]["policy"]
        if "--additional-config" in flags
        else None
    )
    return {
        "budget": flags["--max-num-batched-tokens"],
        "seqs": flags["--max-num-seqs"],
        "active": flags.get("--max-num-active-seqs"),
        "threshold": flags.get("--long-prefill-token-threshold", 0),
        "adaptive": flags.get("--long-prefill-token-threshold-adaptive", False),
        "chunked": "--enable-chunked-prefill" in flags,
        "plugin": plugin,
    }


def closeness(c: dict, current: dict) -> tuple[int, float, int]:
    """Ties: fewer settings changed from the current ones (the plug-in policy counts as one), then
    the budget moved by fewer doublings, then the smaller budget."""
    ours, theirs = settings_of(c["flags"]), settings_of(current["flags"])
    changed = sum(ours[k] != theirs[k] for k in ours)
    moved = abs(math.log2(ours["budget"] / theirs["budget"]))
    return changed, moved, ours["budget"]


# ---- 1. targets ---------------------------------------------------------------------------------
def test_every_schema_key_parses_and_the_cli_schema_offers_exactly_these():
    keys = {f"{m}_ms_p{p}" for m in METRICS for p in PERCENTILES}
    schema = {f.name for f in dataclasses.fields(SloConfig)} - {"preset", "attainment"}
    assert schema == keys
    for key in keys:
        (t,) = parse_targets({key: 12.5})
        assert (t.key, t.ms, t.seconds) == (key, 12.5, 0.0125)
    assert parse_targets({"itl_ms_p50": 7}) == (Target("itl", 50, 7.0),)


def test_targets_come_in_a_fixed_order_and_unset_ones_are_left_out():
    values = {
        "stall_ms_p50": 9.0,
        "ttft_ms_p99": 1.0,
        "itl_ms_p90": None,
        "itl_ms_p95": 3.0,
        "ttft_ms_p50": 2.0,
    }
    assert [t.key for t in parse_targets(values)] == [
        "ttft_ms_p50",
        "ttft_ms_p99",
        "itl_ms_p95",
        "stall_ms_p50",
    ]
    assert parse_targets({k: None for k in values}) == ()


@pytest.mark.parametrize(
    "key, value",
    [
        ("latency_ms_p99", 5.0),
        ("itl_ms_p98", 5.0),
        ("itl_ms_p100", 5.0),
        ("ttft_ms_p0", 5.0),
        ("ITL_ms_p99", 5.0),
        ("itl_s_p99", 5.0),
        ("itl_ms_p99_", 5.0),
        ("latency_ms_p99", None),  # an unknown key is refused even unset
        ("itl_ms_p99", 0.0),
        ("itl_ms_p99", -1.0),
        ("ttft_ms_p50", math.inf),
        ("ttft_ms_p50", math.nan),
        ("tpot_ms_p90", True),
        ("stall_ms_p95", "5"),
    ],
)
def test_a_bad_key_or_value_is_one_error_naming_it(key, value):
    good = {"ttft_ms_p99": 100.0}
    with pytest.raises(ValueError) as info:
        parse_targets({**good, key: value})
    message = str(info.value)
    assert "\n" not in message and f"slo.{key}" in message, message


@given(st.integers(0, 3000), st.one_of(st.sampled_from(PERCENTILES), st.integers(1, 100)))
def test_allowed_above_is_the_most_samples_that_may_exceed(n, p):
    """At least p% of n samples at most X: ``a`` samples above X is allowed iff 100 (n - a) >= p n."""
    a = Target("ttft", p, 1.0).allowed_above(n)
    assert 0 <= a <= n
    assert 100 * (n - a) >= p * n
    assert a == n or 100 * (n - a - 1) < p * n  # the most: one more breaks it


@st.composite
def request_outcomes(draw, rejected: bool = True) -> RequestOutcomes:
    n = draw(st.integers(0, 12))
    arrivals, times = [], []
    seconds = st.integers(1, 50_000_000).map(lambda k: k / 1e8)  # times as a clock gives them, not round
    for _ in range(n):
        arrival = draw(st.integers(0, 10**9).map(lambda k: k / 1e8))
        arrivals.append(arrival)
        if rejected and draw(st.integers(0, 5)) == 0:
            times.append(None)
            continue
        k = draw(st.integers(1, 6))
        steps = draw(st.lists(seconds, min_size=k, max_size=k))
        times.append(arrival + np.cumsum(steps))
    return outcomes_of(times, arrivals)


def target_ms(draw, out: RequestOutcomes, metric: str, p: int) -> float:
    """A target at the boundary: the percentile as reported (ms), one ulp either side, one of the
    samples in ms, or anything."""
    values = samples(out, metric)
    finite = [float(v) * 1000.0 for v in values if math.isfinite(v) and v > 0]
    reported = percentile_ms(values, p)
    ms = draw(
        st.sampled_from([reported, reported, *finite[:3]]).filter(lambda x: 0 < x < math.inf)
        | st.floats(1e-3, 1000.0)
    )
    return draw(st.sampled_from([ms, ms, np.nextafter(ms, 0.0), np.nextafter(ms, math.inf)]))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_holds_iff_every_reported_percentile_is_within_its_target(data):
    out = data.draw(request_outcomes(rejected=data.draw(st.booleans())))
    targets = []
    for _ in range(data.draw(st.integers(1, 3))):
        metric, p = data.draw(st.sampled_from(METRICS)), data.draw(st.sampled_from(PERCENTILES))
        targets.append(Target(metric, p, target_ms(data.draw, out, metric, p)))
    targets = tuple(targets)
    # no token gap at all: the ITL target holds (nothing to measure), its percentile is NaN
    measured = [t for t in targets if t.metric in REQUEST_METRICS or len(samples(out, t.metric))]
    within = all(percentile_ms(samples(out, t.metric), t.percentile) <= t.ms for t in measured)
    assert holds(out, targets) == within
    assert holds(out, targets) == all(holds(out, (t,)) for t in targets)
    assert holds(out, targets) == meets(out, targets)


def test_a_target_set_to_the_reported_percentile_holds():
    """The report's percentile (ms) and the verdict agree at the boundary: the operator who sets a
    target to the P99 the report shows gets a pass, for any clock value."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        arrival, step = rng.uniform(0, 10), rng.uniform(1e-4, 0.5)
        out = outcomes_of([arrival + np.array([step, step + 0.01])], [arrival])
        for metric in REQUEST_METRICS:
            reported = percentile_ms(samples(out, metric), 99)
            assert holds(out, (Target(metric, 99, reported),)), (metric, arrival, step, reported)


def test_a_rejected_request_counts_above_every_request_level_target():
    """Ten requests, each fast; one or two rejected: P90 allows one sample above, P99 none."""
    arrivals = [float(i) for i in range(10)]
    quick = [a + np.array([0.01, 0.02, 0.03]) for a in arrivals]
    one = outcomes_of([None, *quick[1:]], arrivals)
    two = outcomes_of([None, None, *quick[2:]], arrivals)
    for metric in REQUEST_METRICS:
        generous90, generous99 = Target(metric, 90, 10_000.0), Target(metric, 99, 10_000.0)
        assert holds(one, (generous90,)) and not holds(two, (generous90,))
        assert not holds(one, (generous99,))
        assert percentile_ms(samples(one, metric), 99) == math.inf
    # the ITL target pools token gaps: a rejected request has none, so it is not counted
    assert holds(two, (Target("itl", 99, 10.5),))
    assert not holds(outcomes_of([None] * 3, [0.0, 1.0, 2.0]), (Target("ttft", 50, 1e9),))


# ---- 2. the fast probe is sound ---------------------------------------------------------------
MAX_LEN = 4096  # prompts above it are rejected
SEARCHED = candidates(DEFAULTS, MAX_LEN)


@st.composite
def probe_cases(draw):
    n = draw(st.integers(0, 30))
    gaps = draw(st.lists(st.floats(0.0, 0.3), min_size=n, max_size=n))
    prompts = draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 80), min_size=n, max_size=n))
    blocks = draw(st.sampled_from([0, 150, 400]))  # small caches: preemptions and rejections
    candidate = draw(st.sampled_from(SEARCHED))
    return make_trace(np.cumsum(gaps), prompts, outputs), blocks, candidate


def draw_criterion(data, out: RequestOutcomes) -> Criterion:
    if data.draw(st.integers(0, 5)) == 0:  # a chunkgym preset with its attainment
        return Criterion((), data.draw(st.sampled_from([0.5, 0.9, 0.99, 1.0])))
    targets = {}
    for _ in range(data.draw(st.integers(1, 3))):
        metric, p = data.draw(st.sampled_from(METRICS)), data.draw(st.sampled_from(PERCENTILES))
        level = percentile_ms(samples(out, metric), p)
        if math.isfinite(level) and level > 0:  # around what the run measures: both verdicts occur
            ms = level * data.draw(st.sampled_from([0.5, 0.9, 1.0, 1.1, 2.0]))
        else:
            ms = data.draw(st.floats(0.5, 5000.0))
        targets[f"{metric}_ms_p{p}"] = ms
    return Criterion(parse_targets(targets))


def setup_for(candidate: Candidate, **serving):
    """The engine settings the advisor serves ``candidate`` under (see :func:`policy_of`)."""
    return make_setup(MODEL, HARDWARE, **policy_of(candidate.flags("strict", "cost"))[1], **serving)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(probe_cases(), st.data())
def test_the_fast_probe_agrees_with_the_reference_and_fails_early_only_on_a_fail(case, data):
    trace, blocks, candidate = case
    setup = setup_for(candidate, num_blocks=blocks, max_model_len=MAX_LEN)
    full = setup.simulator(trace).run(candidate.build_policy())
    criterion = draw_criterion(data, full.outcomes)
    reference = TargetProbe(setup, candidate, criterion, fast=False)(1.0, trace)
    fast = TargetProbe(setup, candidate, criterion, fast=True)(1.0, trace)
    assert reference.passed == criterion.holds(full.outcomes) and not reference.decided_early
    assert fast.passed == reference.passed
    assert fast.requests == reference.requests == len(trace)
    if fast.decided_early and criterion.targets:
        assert not fast.passed and not reference.passed
    if not fast.decided_early:
        assert fast.requests_decided == len(trace)
    event(f"decided early: {fast.decided_early}, passed: {fast.passed}")


@pytest.mark.parametrize("key, ms", [("ttft_ms_p99", 50.0), ("itl_ms_p99", 30.0), ("stall_ms_p90", 40.0)])
def test_an_overloaded_probe_stops_early_and_the_full_run_fails(key, ms):
    """Not vacuous: a trace far over capacity is decided long before its end, by each kind of target."""
    times_ns, prompts, outputs = small_requests(120, seed=1)
    trace = make_trace(times_ns / 1e9 / 8.0, prompts, outputs)  # 8 x the rate
    candidate = SEARCHED[0]
    setup = setup_for(candidate)
    criterion = Criterion(parse_targets({key: ms}))
    fast = TargetProbe(setup, candidate, criterion, fast=True)(8.0, trace)
    assert fast.decided_early and not fast.passed
    assert fast.requests_decided < len(trace)
    full = setup.simulator(trace).run(candidate.build_policy())
    assert not meets(full.outcomes, criterion.targets)


# ---- the recommendation's tie-break -----------------------------------------------------------
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=len(SEARCHED), max_size=len(SEARCHED)))
def test_pick_takes_the_highest_capacity_then_the_closest_to_current_then_the_smaller_budget(scales):
    found = [
        Found(c, s, 3.0 * s, CapacityResult(s, (s, 2 * s), ())) for c, s in zip(SEARCHED, scales, strict=True)
    ]
    chosen = pick(found)
    if max(scales) == 0:
        assert chosen is None
        return
    rows = [
        {"flags": c.flags("strict", "cost"), "capacity_rps": 3.0 * s}
        for c, s in zip(SEARCHED, scales, strict=True)
    ]
    best = max(scales)
    expected = min((i for i, s in enumerate(scales) if s == best), key=lambda i: closeness(rows[i], rows[0]))
    assert chosen is found[expected]


# ---- 3. capacities against a brute force; 4. the command line ----------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    tmp = tmp_path_factory.mktemp("advise")
    requests = small_requests()
    return write_azure(tmp / "small.csv", *requests), requests


def plan_for(*overrides: str) -> Plan:
    """What advise.py plans for these overrides, composed and checked as its command line does."""
    cfg = _compose(str(REPO_ROOT / "conf"), "advise", ["engine=vllm", "cost_model=roofline", *overrides])
    return plan_of(to_object(cfg, AdviseConfig, "", RULES))


@pytest.mark.parametrize(
    "current, expected",
    [
        ((), {"--max-num-batched-tokens": 2048, "--max-num-seqs": 256}),  # vLLM's A100 defaults
        (
            ("current.max_num_batched_tokens=4096", "current.max_num_seqs=128", "current.long_prefill_token_threshold=512"),
            {"--max-num-batched-tokens": 4096, "--max-num-seqs": 128, "--long-prefill-token-threshold": 512},
        ),
    ],
)  # fmt: skip
def test_each_candidate_simulates_what_its_flags_say(small, current, expected):
    """The current settings come first; every candidate is a distinct setting; the engine settings
    and the policy simulated for it are those its flags give vLLM (the brute force below relies on it)."""
    trace, _ = small
    plan = plan_for(f"trace={trace}", *SLO_ARGS, *current)
    flags = [c.flags("strict", "cost") for c in plan.candidates]
    assert plan.candidates[0].name == "current"
    assert flags[0] == {**expected, "--enable-chunked-prefill": True}
    assert len(flags) >= 24 and len({json.dumps(f, sort_keys=True) for f in flags}) == len(flags)
    for setup, candidate, f in zip(plan.setups, plan.candidates, flags, strict=True):
        policy, serving = policy_of(f)
        assert setup.config == ServingConfig(**serving), candidate.name
        simulated = candidate.build_policy()
        assert type(simulated) is type(policy) and simulated.name == policy.name, candidate.name
        if candidate.policy is None:
            assert vars(simulated) == vars(policy), candidate.name


@pytest.fixture(scope="module")
def fast_run(small, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The fast search, run from another folder with a relative output_dir."""
    trace, _ = small
    cwd = tmp_path_factory.mktemp("cwd")
    proc = advise(*COMMON, f"trace={trace}", *SLO_ARGS, "output_dir=advice", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd / "advice", proc


@pytest.mark.slow
def test_the_summary_line_and_the_files(fast_run):
    out, proc = fast_run
    summary = last_json(proc.stdout)
    assert set(summary) >= SUMMARY_KEYS
    assert summary["advice_dir"] == str(out.resolve()) and Path(summary["advice_dir"]).is_absolute()
    advice = json.loads((out / "advice.json").read_text())
    rows = advice["candidates"]
    assert isinstance(summary["candidates"], int) and summary["candidates"] == len(rows) >= 24
    for c in rows:
        assert isinstance(c["name"], str) and isinstance(c["flags"], dict) and c["capacity_rps"] >= 0
    assert len({c["name"] for c in rows}) == len(rows)
    assert rows[0]["name"] == "current" and rows[0]["flags"]["--max-num-batched-tokens"] == 2048
    best = max(c["capacity_rps"] for c in rows)
    assert best > 0, "this SLO is met at some rate"
    top = [c for c in rows if c["capacity_rps"] == best]
    assert summary["recommended"] == advice["recommended"] and summary["recommended"] in [
        c["flags"] for c in top
    ]
    assert summary["recommended_capacity_rps"] == best
    assert summary["current_capacity_rps"] == rows[0]["capacity_rps"]
    assert summary["gain_over_current"] == pytest.approx(best / rows[0]["capacity_rps"], rel=1e-12)
    for key in ("hol_share_current", "hol_share_recommended"):
        assert 0 <= summary[key] <= 1 and summary[key] == advice[key]
    page = (out / "advice.md").read_text()
    assert advice["recommended_command"].startswith("vllm serve ") and advice["recommended_command"] in page
    flag, value = next(iter(advice["recommended"].items()))
    assert f"{flag} {value}" in advice["recommended_command"]
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
        assert f"]({name})" in page


def brute_force(
    requests, flags: dict, targets: tuple[Target, ...], rel_tol: float
) -> tuple[CapacityResult, float]:
    """The capacity of the setting ``flags`` name: chunkgym's bracketing and bisection over load
    scale, each probe a full simulation of the trace built here, judged by :func:`meets`."""
    times_ns, prompts, outputs = requests
    arrivals, span = times_ns / 1e9, float(times_ns[-1] / 1e9)
    setup = make_setup(MODEL, HARDWARE, **policy_of(flags)[1])

    def passes(scale: float) -> bool:
        trace = make_trace(arrivals / scale, prompts, outputs, span=span / scale)
        return meets(setup.simulator(trace).run(policy_of(flags)[0]).outcomes, targets)

    result = capacity_search(passes, rel_tol=rel_tol)
    rps = len(prompts) / (span / result.scale) if result.scale > 0 else 0.0
    return result, rps


@pytest.mark.slow
def test_capacities_and_recommendation_equal_a_brute_force_search(fast_run, small):
    """Every candidate's capacity (scale, bracket, req/s) is that of a plain search whose probes
    are full runs of the policy its flags name; the recommendation is the highest, ties to the
    closest to the current settings, then the smaller budget."""
    out, _ = fast_run
    _, requests = small
    advice = json.loads((out / "advice.json").read_text())
    targets = parse_targets({"itl_ms_p99": 50.0, "ttft_ms_p99": 1000.0})
    for c in advice["candidates"]:
        result, rps = brute_force(requests, c["flags"], targets, rel_tol=0.02)
        assert c["capacity_scale"] == result.scale, c["name"]
        assert c["bracket"] == [
            result.bracket[0],
            result.bracket[1] if math.isfinite(result.bracket[1]) else None,
        ]
        assert c["capacity_rps"] == rps, c["name"]
    rows = advice["candidates"]
    best = max(c["capacity_scale"] for c in rows)
    expected = min((c for c in rows if c["capacity_scale"] == best), key=lambda c: closeness(c, rows[0]))
    assert advice["recommended"] == expected["flags"] and advice["recommended_name"] == expected["name"]
    assert len({c["capacity_scale"] for c in rows}) > 3, "the candidates differ on this trace"


@pytest.mark.slow
def test_where_load_is_monotone_the_capacity_brackets_the_boundary_of_a_grid_scan(fast_run, small):
    """A grid of load scales, 4% apart: for each candidate whose pass/fail flips once on it, the
    flip lies inside the advisor's bracket (bisection finds the boundary, not a nearby one)."""
    out, _ = fast_run
    times_ns, prompts, outputs = small[1]
    arrivals, span = times_ns / 1e9, float(times_ns[-1] / 1e9)
    targets = parse_targets({"itl_ms_p99": 50.0, "ttft_ms_p99": 1000.0})
    grid = np.geomspace(0.25, 8.0, 90)
    monotone = 0
    for c in json.loads((out / "advice.json").read_text())["candidates"]:
        if "--scheduler-cls" in c["flags"]:
            continue  # the learned policy is slow; the brute force above covers the plug-in rows
        setup = make_setup(MODEL, HARDWARE, **policy_of(c["flags"])[1])
        verdicts = np.array([
            meets(setup.simulator(make_trace(arrivals / s, prompts, outputs, span=span / s)).run(policy_of(c["flags"])[0]).outcomes, targets)
            for s in grid
        ])  # fmt: skip
        flips = np.flatnonzero(verdicts[1:] != verdicts[:-1])
        lo, hi = c["bracket"]
        if len(flips) == 1 and verdicts[0]:
            monotone += 1
            last_pass, first_fail = grid[flips[0]], grid[flips[0] + 1]
            assert last_pass < hi and first_fail > lo, (c["name"], last_pass, first_fail, lo, hi)
    assert monotone >= 12


@pytest.mark.slow
def test_the_reference_search_gives_the_same_capacities_bit_for_bit(fast_run, small, tmp_path):
    out, _ = fast_run
    trace, _ = small
    proc = advise(
        *COMMON, f"trace={trace}", *SLO_ARGS, "fast=false", "plots=false", f"output_dir={tmp_path / 'ref'}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fast = json.loads((out / "advice.json").read_text())
    reference = json.loads((tmp_path / "ref" / "advice.json").read_text())
    assert fast["recommended"] == reference["recommended"]
    for a, b in zip(fast["candidates"], reference["candidates"], strict=True):
        assert (a["name"], a["capacity_scale"], a["capacity_rps"], a["bracket"]) == (
            b["name"], b["capacity_scale"], b["capacity_rps"], b["bracket"]
        )  # fmt: skip
        assert a["at_current_rate"] == b["at_current_rate"]
    assert last_json(proc.stdout)["advice_dir"] == str((tmp_path / "ref").resolve())


@pytest.mark.slow
def test_no_candidate_meets_an_impossible_slo(small, tmp_path):
    """A TTFT median of 1 us: exit 0, nothing recommended, the closest named with what it reaches."""
    trace, _ = small
    proc = advise(*COMMON, f"trace={trace}", "slo.ttft_ms_p50=0.001", f"output_dir={tmp_path}", "rel_tol=0.2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    assert summary["recommended"] is None and summary["gain_over_current"] is None
    assert summary["recommended_capacity_rps"] == 0 and summary["current_capacity_rps"] == 0
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert all(c["capacity_rps"] == 0 for c in advice["candidates"])
    reached = {c["name"]: c["at_current_rate"]["all"]["ttft_ms_p50"] / 0.001 for c in advice["candidates"]}
    closest = advice["closest"]
    assert closest["name"] == min(reached, key=reached.get)
    assert closest["worst_ratio_at_current_rate"] == pytest.approx(min(reached.values()), rel=1e-9)
    page = (tmp_path / "advice.md").read_text()
    assert "No candidate meets the SLO" in page and closest["name"] in page


@pytest.mark.slow
def test_prompts_longer_than_the_model_takes_fail_every_candidate_and_the_advice_still_says_so(
    small, tmp_path
):
    """Llama-2-7B takes 4096 tokens: the trace's 5k-9k prompts are rejected at every rate, and a
    rejected request is above every P99 target, so nothing is recommended; the closest is named."""
    trace, _ = small
    proc = advise(
        *COMMON, f"trace={trace}", "model=llama2_7b", *SLO_ARGS, "rel_tol=0.2", f"output_dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    assert summary["recommended"] is None and summary["current_capacity_rps"] == 0
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert advice["closest"]["name"] in {c["name"] for c in advice["candidates"]}
    assert "No candidate meets the SLO" in (tmp_path / "advice.md").read_text()


@pytest.mark.slow
def test_traffic_from_two_metrics_scrapes(tmp_path):
    a, b = FIXTURE / "scrape_a.txt", FIXTURE / "scrape_b.txt"
    proc = advise(
        *COMMON,
        f"metrics=[{a},{b}]",
        "interval_s=10.179",
        "duration_s=30",
        *SLO_ARGS,
        f"output_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    assert summary["candidates"] >= 24 and summary["advice_dir"] == str(tmp_path.resolve())
    traffic = json.loads((tmp_path / "advice.json").read_text())["traffic"]
    assert str(a) in traffic["source"] and str(b) in traffic["source"] and traffic["requests"] > 0
    assert "vllm:request_prompt_tokens_bucket" in traffic["fields_used"]
    assert "vllm:request_success_total" in traffic["fields_used"]  # the rate from the two scrapes
    assert traffic["assumptions"]


# ---- 5. bad input: one line, non-zero exit, nothing written, before any work ------------------
def zero_prompt_histogram(path: Path) -> Path:
    lines = (FIXTURE / "scrape_b.txt").read_text().splitlines()
    zeroed = [
        line.rsplit(" ", 1)[0] + " 0.0" if line.startswith(("vllm:request_prompt_tokens_bucket", "vllm:request_prompt_tokens_count", "vllm:request_prompt_tokens_sum")) else line
        for line in lines
    ]  # fmt: skip
    path.write_text("\n".join(zeroed) + "\n")
    return path


BAD_INPUT = {
    "a trace without lengths": (lambda d: [f"trace={write_azure(d / 'empty.csv', *(np.empty(0, int),) * 3)}", *SLO_ARGS], "empty.csv"),
    "a histogram with no counts": (lambda d: [f"metrics=[{zero_prompt_histogram(d / 'zero.txt')}]", "rate=1", *SLO_ARGS], "zero.txt"),
    "a rate of zero": (lambda d: ["trace=TRACE", "rate=0", *SLO_ARGS], "rate=0"),
    "an unknown knob": (lambda d: ["trace=TRACE", "current.no_such=1", *SLO_ARGS], "current.no_such"),
    "a knob vLLM refuses": (lambda d: ["trace=TRACE", "current.max_num_batched_tokens=100", *SLO_ARGS], "current.max_num_batched_tokens=100"),
    "a zero knob": (lambda d: ["trace=TRACE", "current.max_num_seqs=0", *SLO_ARGS], "current.max_num_seqs"),
    "an unknown model": (lambda d: ["trace=TRACE", "model=nope", *SLO_ARGS], "nope"),
    "an SLO key not in the schema": (lambda d: ["trace=TRACE", "slo.latency_ms_p99=5"], "slo.latency_ms_p99"),
    "a percentile not in the schema": (lambda d: ["trace=TRACE", "slo.itl_ms_p98=5"], "slo.itl_ms_p98"),
    "a negative target": (lambda d: ["trace=TRACE", "slo.itl_ms_p99=-5"], "slo.itl_ms_p99"),
    "SGLang": (lambda d: ["engine=sglang", "trace=TRACE", *SLO_ARGS], "sglang"),
    "no traffic": (lambda d: [*SLO_ARGS], "trace="),
    "two traffic sources": (lambda d: ["trace=TRACE", "workload=azure_conv", *SLO_ARGS], "trace, workload"),
    "no SLO": (lambda d: ["trace=TRACE"], "slo"),
    "a missing trace file": (lambda d: [f"trace={d / 'absent.csv'}", *SLO_ARGS], "absent.csv"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_before_any_work_and_writes_nothing(case, small, tmp_path):
    make_args, named = BAD_INPUT[case]
    trace, _ = small
    args = [a.replace("TRACE", str(trace)) for a in make_args(tmp_path)]
    if not any(a.startswith("engine=") for a in args):
        args.insert(0, "engine=vllm")
    out = tmp_path / "out"
    proc = advise(*args, "cost_model=roofline", "progress=false", f"output_dir={out}", timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("advise.py: error: "), proc.stderr[-2000:]
    assert named in lines[0], lines[0]
    assert not out.exists()
    assert proc.stdout == "", "nothing ran before the error"


# ---- 5. the runs at today's rate --------------------------------------------------------------
def outcome_arrays(out: RequestOutcomes) -> dict[str, np.ndarray]:
    return {
        f.name: getattr(out, f.name)
        for f in dataclasses.fields(out)
        if isinstance(getattr(out, f.name), np.ndarray)
    }


@pytest.mark.parametrize("name", ["current", "budget 256", "chunked prefill off", "chunkgym adaptive_srpf"])
def test_a_run_for_its_outcomes_only_has_the_recorded_runs_outcomes_bit_for_bit(small, name):
    """advise.py runs every candidate but the current settings at today's rate with no iteration log;
    the report's latencies and the fast search's verdict at scale 1 read those outcomes, so they must
    be the recorded run's, every array equal bit for bit (NaNs where the recorded run has them)."""
    trace, _ = small
    plan = plan_for(f"trace={trace}", *SLO_ARGS)
    k = [c.name for c in plan.candidates].index(name)
    recorded = at_rate(plan.setups[k], plan.candidates[k], plan.traffic)
    slim = at_rate(plan.setups[k], plan.candidates[k], plan.traffic, recorded=False)
    assert recorded.iterations and not slim.iterations and not slim.token_times
    a, b = outcome_arrays(recorded.outcomes), outcome_arrays(slim.outcomes)
    assert a.keys() == b.keys() and a
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(
            a[key], b[key], equal_nan=a[key].dtype.kind == "f"
        ), key


def test_the_recommendation_is_run_again_recorded_when_its_run_was_outcomes_only(small):
    """The diagnosis reads the recommendation's iterations: a recommendation other than the current
    settings gets its run served again, recorded, with the same outcomes; the other runs stay as they were."""
    trace, _ = small
    plan = plan_for(f"trace={trace}", *SLO_ARGS)
    k = [c.name for c in plan.candidates].index("budget 512")
    runs = [
        at_rate(s, c, plan.traffic, recorded=i == 0)
        for i, (s, c) in enumerate(zip(plan.setups, plan.candidates, strict=True))
    ]
    none = CapacityResult(0.0, (0.0, 1.0), ())
    found = [Found(c, 2.0 if i == k else 1.0, 0.0, none) for i, c in enumerate(plan.candidates)]
    again = _recommended_recorded(plan, found, runs)
    assert again[k].iterations and again[k] is not runs[k]
    assert outcome_arrays(again[k].outcomes).keys() == outcome_arrays(runs[k].outcomes).keys()
    for key, value in outcome_arrays(runs[k].outcomes).items():
        assert np.array_equal(
            outcome_arrays(again[k].outcomes)[key], value, equal_nan=value.dtype.kind == "f"
        ), key
    assert all(again[i] is runs[i] for i in range(len(runs)) if i != k)
    found[0] = Found(plan.candidates[0], 3.0, 0.0, none)  # the current settings win: recorded already
    assert _recommended_recorded(plan, found, runs) is runs
