"""Is there head-of-line blocking, and does chunking cure it: the article's test on a simulated run.

For every token gap over the gap target, the iteration that ended it (the one whose end is the
late token's time) and the prefill tokens it carried: a gap behind an iteration of at least
``HOL_PREFILL_TOKENS`` prefill tokens waited on a prefill. ``hol_share`` is their share of the
over-target gaps (0 when there are none). Then the article's comparison: short requests' P99 token
gap while a long prompt prefills against otherwise. The gap target is the first ITL target, else
the first TPOT target, else the stall target, else the TPOT bound of the SLO the policies run under.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from advisor.targets import Target, percentile_ms
from envs.serving.loop import SimResult

HOL_PREFILL_TOKENS = 1024
"""Prefill tokens in an iteration from which a gap it ends counts as waiting on a prefill."""
SHORT_PROMPT = 1024
"""Prompts below this are the short requests whose gaps the comparison reads ([0,1k) bucket)."""
LONG_PROMPT = 4096
"""Prompts of this length and more are the long ones whose prefill may stall the others."""
HOL_EVIDENCE = 0.5
"""``hol_share`` from which the advice calls it head-of-line blocking."""
WINDOW_S = 60.0


@dataclass(frozen=True)
class Gaps:
    """Every token gap of a run: its end time, length (s), whose request, and its iteration's prefill tokens."""

    end: np.ndarray
    length: np.ndarray
    prompt_len: np.ndarray
    prefill_tokens: np.ndarray

    @classmethod
    def of(cls, result: SimResult) -> Gaps:
        out, it = result.outcomes, result.iterations
        ends = it["start"] + it["latency"]
        order = np.argsort(ends, kind="stable")
        ends, prefill = ends[order], it["prefill_tokens"][order]
        end_parts, gap_parts, prompt_parts = [], [], []
        for rid, gaps in enumerate(out.gaps):  # a request's id is its index in the run
            if len(gaps):
                end_parts.append(result.token_times[rid][1:])
                gap_parts.append(gaps)
                prompt_parts.append(np.full(len(gaps), out.prompt_len[rid]))
        end = np.concatenate(end_parts) if end_parts else np.empty(0)
        tokens = prefill[_nearest(ends, end)] if len(ends) else np.zeros(len(end), dtype=np.int64)
        length = np.concatenate(gap_parts) if gap_parts else np.empty(0)
        prompts = np.concatenate(prompt_parts) if prompt_parts else np.empty(0, dtype=np.int64)
        return cls(end, length, prompts, tokens)


def _nearest(ends: np.ndarray, times: np.ndarray) -> np.ndarray:
    """The index of the iteration end nearest each token time (a token is emitted at an iteration's
    end; the log's start + latency may round differently from the clock's sum)."""
    right = np.clip(np.searchsorted(ends, times), 0, len(ends) - 1)
    left = np.maximum(right - 1, 0)
    return np.where(np.abs(ends[left] - times) < np.abs(ends[right] - times), left, right)


@dataclass(frozen=True)
class Diagnosis:
    """What the run says about head-of-line blocking (times in ms)."""

    gap_target_ms: float
    gaps_over: int
    hol_share: float
    itl_p99_ms: float
    short_itl_p99_during_long_ms: float
    short_itl_p99_otherwise_ms: float
    worst_window_s: tuple[float, float]


def gap_target_ms(targets: tuple[Target, ...], tpot_bound_s: float) -> float:
    for metric in ("itl", "tpot", "stall"):
        found = [t for t in targets if t.metric == metric]
        if found:
            return found[0].ms
    return tpot_bound_s * 1000.0


def diagnose(result: SimResult, target_ms: float) -> Diagnosis:
    gaps = Gaps.of(result)
    over = gaps.length * 1000.0 > target_ms
    n_over = int(over.sum())
    hol = float((gaps.prefill_tokens[over] >= HOL_PREFILL_TOKENS).mean()) if n_over else 0.0
    out = result.outcomes
    long_ = out.finished & (out.prompt_len >= LONG_PROMPT)
    starts = out.arrival[long_] + out.sched_delay[long_]
    stops = out.arrival[long_] + out.ttft[long_]
    during = _within(gaps.end, starts, stops)
    short = gaps.prompt_len < SHORT_PROMPT
    return Diagnosis(
        gap_target_ms=target_ms,
        gaps_over=n_over,
        hol_share=hol,
        itl_p99_ms=percentile_ms(gaps.length, 99),
        short_itl_p99_during_long_ms=percentile_ms(gaps.length[short & during], 99),
        short_itl_p99_otherwise_ms=percentile_ms(gaps.length[short & ~during], 99),
        worst_window_s=worst_window(gaps, over),
    )


def _within(times: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Whether each time falls inside any [start, stop] interval."""
    if not len(starts) or not len(times):
        return np.zeros(len(times), dtype=bool)
    order = np.argsort(starts)
    starts, reach = starts[order], np.maximum.accumulate(stops[order])
    i = np.searchsorted(starts, times, side="right") - 1
    return (i >= 0) & (times <= reach[np.maximum(i, 0)])


def worst_window(gaps: Gaps, over: np.ndarray) -> tuple[float, float]:
    """The ``WINDOW_S`` seconds holding the most over-target gaps (else around the longest gap)."""
    if not len(gaps.end):
        return (0.0, WINDOW_S)
    if over.any():
        ends = np.sort(gaps.end[over])
        counts = np.searchsorted(ends, ends + WINDOW_S, side="right") - np.arange(len(ends))
        start = float(ends[int(np.argmax(counts))])
        return (start - 1.0, start - 1.0 + WINDOW_S)
    centre = float(gaps.end[int(np.argmax(gaps.length))])
    return (centre - WINDOW_S / 2, centre + WINDOW_S / 2)


def verdict(current: Diagnosis, recommended: Diagnosis | None, setting: str | None) -> str:
    """The one sentence the advice opens its diagnosis with; ``setting`` names the recommendation."""
    if current.hol_share < HOL_EVIDENCE or not current.gaps_over:
        return "no evidence of head-of-line blocking"
    share = (
        f"{current.gaps_over} token gaps over {current.gap_target_ms:g} ms, {current.hol_share:.0%} of them "
        f"ending an iteration with {HOL_PREFILL_TOKENS}+ prefill tokens"
    )
    if recommended is not None and setting is not None and recommended.itl_p99_ms < current.itl_p99_ms:
        return (
            f"head-of-line blocking ({share}): {setting} cuts P99 ITL "
            f"from {_ms(current.itl_p99_ms)} to {_ms(recommended.itl_p99_ms)} ms"
        )
    return f"head-of-line blocking ({share}), and no candidate that serves more cuts P99 ITL"


def _ms(x: float) -> str:
    return f"{x:.0f}" if math.isfinite(x) and x >= 10 else f"{x:.2f}"
