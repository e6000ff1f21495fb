"""Observation features: a flat vector of normalised numbers describing the serving state.

Computed from a :class:`~envs.serving.scheduling.ServingView` alone, so the simulator,
the env and the real engine (and any other scheduler that implements the view) produce
identical features for identical states.  Each feature is
squashed into [-1, 1] (log scales for token counts; ratios to the SLO bounds for
times), which is what the Box observation space declares.  Cost: one pass over the lookahead
(:func:`envs.lookahead.scan_lookahead`, which the env shares with the action masks) and a cost-model
prediction or two.
"""

from __future__ import annotations

import math

import numpy as np

from envs.lookahead import Lookahead, scan_lookahead
from envs.serving.scheduling import ServingView

FEATURES_V0: tuple[tuple[str, str], ...] = (
    ("decode_fraction", "requests decoding / max_num_seqs"),
    ("queue_log", "log1p(queued prompts) / log1p(1024), clipped to 1"),
    ("prefill_running_fraction", "prompts holding a slot mid-prefill / max_num_seqs"),
    ("pending_prefill_log", "log1p(prefill tokens left over the lookahead) / log1p(2^20)"),
    ("head_remaining_log", "log1p(tokens left of the oldest queued prompt) / log1p(2^17)"),
    ("shortest_remaining_log", "log1p(fewest tokens left of any lookahead prompt) / log1p(2^17)"),
    ("head_slack", "(oldest prompt's TTFT deadline - now) / its TTFT bound, in [-1, 1]"),
    (
        "min_slack",
        "least (deadline - now - remaining * prefill s/token) / TTFT bound in lookahead, in [-1, 1]",
    ),
    ("doomed_fraction", "lookahead prompts already past their TTFT bound / lookahead size"),
    ("oldest_age", "(now - oldest queued arrival) / its TTFT bound / 2, clipped to 1"),
    ("decode_gap", "(now - last decode emission) / stall bound, clipped to 1; 0 without decodes"),
    ("kv_free_fraction", "KV blocks free after the decodes' reservation / total"),
    ("decode_context_log", "log1p(mean KV tokens per decoding request) / log1p(2^17)"),
    ("last_latency", "last iteration's latency / TPOT bound / 4, clipped to 1"),
    ("latency_ewma", "EWMA (alpha 0.1) of iteration latency / TPOT bound / 4, clipped to 1"),
    ("arrival_load", "EWMA arrival rate (10 s) x prefill time of a 1k prompt / 4, clipped to 1"),
)
FEATURE_NAMES_V0 = tuple(name for name, _ in FEATURES_V0)

_L1024 = math.log1p(1024)
_L20 = math.log1p(2**20)
_L17 = math.log1p(2**17)


def _unit(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def features_v0(view: ServingView, look: Lookahead | None = None) -> np.ndarray:
    """``FEATURES_V0``; ``look``: this state's lookahead scan, if the caller has one (the env does)."""
    look = scan_lookahead(view) if look is None else look
    return np.fromiter(_values_v0(view, look), np.float32, len(FEATURES_V0))


def _values_v0(view: ServingView, look: Lookahead) -> tuple[float, ...]:
    """The v0 features as Python floats (v1 and v3 append theirs before the one float32 conversion)."""
    now = view.now
    slo = view.slo
    seqs = view.max_num_seqs
    queue = view.queue
    n_dec = view.num_decode
    n_look, pending, shortest, min_slack, oldest, doomed = look[:6]  # the fields v0 reads
    if queue:
        head = queue[0]
        head_left = head.target - head.computed
        head_slack = (head.deadline - now) / head.ttft_bound
        oldest_age = (now - oldest) / head.ttft_bound / 2
    else:
        head_left, head_slack, oldest_age = 0, 1.0, 0.0
    return (
        n_dec / seqs,
        _unit(math.log1p(len(queue)) / _L1024),
        view.num_prefilling / seqs,
        _unit(math.log1p(pending) / _L20),
        _unit(math.log1p(head_left) / _L17),
        _unit(math.log1p(shortest) / _L17),
        -1.0 if head_slack < -1.0 else 1.0 if head_slack > 1.0 else head_slack,
        -1.0 if min_slack < -1.0 else min_slack,
        doomed / n_look if n_look else 0.0,
        _unit(oldest_age),
        _unit((now - view.last_decode_time) / slo.stall_s) if n_dec else 0.0,
        _unit(view.free_blocks / view.total_blocks),
        _unit(math.log1p(view.decode_context / n_dec) / _L17) if n_dec else 0.0,
        _unit(view.last_latency / slo.tpot_s / 4),
        _unit(view.latency_ewma / slo.tpot_s / 4),
        _unit(view.traffic.rate(now) * view.prefill_s_per_token * 1024 / 4),
    )


FEATURES_V1: tuple[tuple[str, str], ...] = FEATURES_V0 + (
    (
        "tpot_slack",
        "least TPOT slack of a streaming request that can still meet its SLO, "
        "B * (tokens - 1) - (last - first token time), / (8 * TPOT bound B), in [-1, 1]; 1 if none",
    ),
    ("decode_doomed_fraction", "streaming requests already known to miss their SLO / streaming requests"),
    ("decode_gap_tpot", "(now - last decode emission) / TPOT bound / 4, clipped to 1; 0 without decodes"),
    ("alive_queue_log", "log1p(lookahead prompts that can still meet TTFT) / log1p(1024)"),
    ("alive_pending_log", "log1p(prefill tokens left of those prompts) / log1p(2^20)"),
    ("alive_shortest_log", "log1p(fewest tokens left of those prompts) / log1p(2^17)"),
    ("prefix_hit_ewma", "EWMA (alpha 0.05) of the prompt fraction served from the prefix cache at arrival"),
    ("queued_kv_demand", "KV blocks the lookahead prompts still need / free blocks / 2, clipped to 1"),
    (
        "full_plan_latency",
        "predicted latency of all decodes + all lookahead prefill now / TPOT bound / 8, clipped",
    ),
    ("decode_count_log", "log1p(requests decoding) / log1p(256)"),
)
FEATURE_NAMES_V1 = tuple(name for name, _ in FEATURES_V1)
_L256 = math.log1p(256)


def features_v1(view: ServingView, look: Lookahead | None = None) -> np.ndarray:
    """The v0 features plus SLO-risk, doomed-work and prediction features (see ``FEATURES_V1``)."""
    look = scan_lookahead(view) if look is None else look
    return np.fromiter(_values_v0(view, look) + _values_v1(view, look), np.float32, len(FEATURES_V1))


def _values_v1(view: ServingView, look: Lookahead) -> tuple[float, ...]:
    """What v1 appends to the v0 features, as Python floats."""
    pending, alive, alive_pending, alive_shortest = look.pending, *look[6:9]  # the alive fields
    now = view.now
    slo = view.slo
    n_dec = view.num_decode
    slack = view.min_tpot_slack() / (8 * slo.tpot_s)
    free = view.free_blocks
    demand = pending / view.block_size
    latency = view.predict_latency(
        n_dec,
        view.decode_context if n_dec else 0,
        (pending,) if pending else (),
        (0,) if pending else (),
    )
    return (
        -1.0 if slack < -1.0 else 1.0 if slack > 1.0 else slack,
        view.num_decode_doomed / n_dec if n_dec else 0.0,
        _unit((now - view.last_decode_time) / slo.tpot_s / 4) if n_dec else 0.0,
        _unit(math.log1p(alive) / _L1024),
        _unit(math.log1p(alive_pending) / _L20),
        _unit(math.log1p(alive_shortest) / _L17),
        view.traffic.prefix_hit_ewma,
        _unit(demand / max(free, 1) / 2),
        _unit(latency / slo.tpot_s / 8),
        _unit(math.log1p(n_dec) / _L256),
    )


FEATURES_V3: tuple[tuple[str, str], ...] = FEATURES_V1 + (
    ("tpot_bound_ratio", "log(TPOT bound / reference decode latency) / log(64): 0.39 strict, 0.77 relaxed"),
    ("ttft_factor_log", "log2(TTFT bound factor over the prompt's prefill alone) / 6, clipped to 1"),
    ("ttft_base_log", "log1p(TTFT bound floor, s) / log1p(30), clipped to 1"),
    ("decode_latency_tpot", "predicted decode-only iteration latency now / TPOT bound, clipped to 1"),
)
FEATURE_NAMES_V3 = tuple(name for name, _ in FEATURES_V3)
_L64 = math.log(64)
_L30 = math.log1p(30)


def features_v3(view: ServingView, look: Lookahead | None = None) -> np.ndarray:
    """The v1 features plus the SLO's bounds, so one policy can tell the SLOs apart (``FEATURES_V3``)."""
    look = scan_lookahead(view) if look is None else look
    values = _values_v0(view, look) + _values_v1(view, look) + _values_v3(view)
    return np.fromiter(values, np.float32, len(FEATURES_V3))


def _values_v3(view: ServingView) -> tuple[float, ...]:
    """What v3 appends to the v1 features, as Python floats."""
    slo = view.slo
    n_dec = view.num_decode
    decode = view.predict_latency(n_dec, view.decode_context, (), ()) if n_dec else 0.0
    return (
        _unit(math.log(slo.tpot_s / slo.reference_decode_s) / _L64),
        _unit(math.log2(max(slo.ttft_factor, 1.0)) / 6),
        _unit(math.log1p(slo.ttft_base_s) / _L30),
        _unit(decode / slo.tpot_s),
    )


FEATURES_V4: tuple[tuple[str, str], ...] = FEATURES_V3 + (
    ("prompt_log_mean", "mean log1p(prompt tokens) of recent arrivals (~50) / log1p(2^17)"),
    ("prompt_log_spread", "standard deviation of log1p(prompt tokens) of recent arrivals / 3, clipped to 1"),
    ("output_log_mean", "mean log1p(tokens generated) of recently finished requests (~50) / log1p(2^14)"),
)
FEATURE_NAMES_V4 = tuple(name for name, _ in FEATURES_V4)
_L14 = math.log1p(2**14)


def features_v4(view: ServingView, look: Lookahead | None = None) -> np.ndarray:
    """The v3 features plus the lengths of recent traffic, which tell workloads apart (``FEATURES_V4``)."""
    look = scan_lookahead(view) if look is None else look
    return np.fromiter(_values_v4(view, look), np.float32, len(FEATURES_V4))


def _values_v4(view: ServingView, look: Lookahead) -> tuple[float, ...]:
    traffic = view.traffic
    return (
        _values_v0(view, look)
        + _values_v1(view, look)
        + _values_v3(view)
        + (
            _unit(traffic.prompt_log_mean / _L17),
            _unit(traffic.prompt_log_std / 3),
            _unit(traffic.output_log_mean / _L14),
        )
    )


CLASSES_V6 = ("interactive", "standard", "batch")
"""The SLO classes v6 describes one by one (``conf/slo_class``); prompts of any other class, or of
the run's SLO, count only in the tenant features."""
FEATURES_V6: tuple[tuple[str, str], ...] = (
    FEATURES_V4
    + tuple(
        (f"{c}_waiting_fraction", f"lookahead prompts of class {c} / lookahead size; 0 if none waits")
        for c in CLASSES_V6
    )
    + tuple(
        (
            f"{c}_min_slack",
            f"least (deadline - now - remaining * prefill s/token) / TTFT bound among lookahead prompts "
            f"of class {c}, in [-1, 1]; 1 if none",
        )
        for c in CLASSES_V6
    )
    + (
        ("tenants_waiting_log", "log1p(distinct tenants in the lookahead) / log1p(64), clipped to 1"),
        ("top_tenant_share", "the largest tenant's share of the lookahead prompts; 0 if none waits"),
    )
)
FEATURE_NAMES_V6 = tuple(name for name, _ in FEATURES_V6)
_L64T = math.log1p(64)


def features_v6(view: ServingView, look: Lookahead | None = None) -> np.ndarray:
    """The v4 features plus who waits: per SLO class and per tenant (``FEATURES_V6``), so a policy
    can favour a class about to miss its TTFT and see a flood."""
    look = scan_lookahead(view) if look is None else look
    return np.fromiter(_values_v4(view, look) + _values_v6(view), np.float32, len(FEATURES_V6))


def _values_v6(view: ServingView) -> tuple[float, ...]:
    """What v6 appends to the v4 features: one more pass over the lookahead, by class and tenant."""
    prompts = view.lookahead
    k = len(CLASSES_V6)
    if not prompts:
        return (0.0,) * k + (1.0,) * k + (0.0, 0.0)
    now, per_token = view.now, view.prefill_s_per_token
    count = dict.fromkeys(CLASSES_V6, 0)
    slack = dict.fromkeys(CLASSES_V6, 1.0)
    tenants: dict[str, int] = {}
    for r in prompts:
        tenants[r.tenant] = tenants.get(r.tenant, 0) + 1
        c = r.slo_class
        if c in count:
            count[c] += 1
            s = (r.deadline - now - per_token * (r.target - r.computed)) / r.ttft_bound
            if s < slack[c]:
                slack[c] = s
    n = len(prompts)
    return (
        tuple(count[c] / n for c in CLASSES_V6)
        + tuple(max(-1.0, slack[c]) for c in CLASSES_V6)
        + (_unit(math.log1p(len(tenants)) / _L64T), max(tenants.values()) / n)
    )
