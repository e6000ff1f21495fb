"""SLOs and serving metrics: the one definition every part of chunkgym uses.

Per request (token times ``t[0..n-1]``, arrival ``a``, first scheduled ``s``):

* TTFT = ``t[0] - a``
* TPOT = ``(t[-1] - t[0]) / (n - 1)``; a 1-token output meets any TPOT bound
* stall = the largest gap between consecutive tokens, ``max(diff(t))`` (0 for 1 token)
* scheduling delay = ``s - a``

A request meets its SLO when TTFT <= its TTFT bound, TPOT <= the TPOT bound and
stall <= the stall bound.  The TTFT bound is ``max(base, factor * prefill time of the
prompt run alone)``; the TPOT bound follows Sarathi-Serve's rule, a multiple (strict 5x,
relaxed 25x) of the decode-iteration latency at batch 32 with 4k context; the stall
bound is a multiple of the TPOT bound.  Rejected requests never meet their SLO.

System level: ``goodput_rps`` = requests meeting SLO / span of the arrival window;
``slo_attainment`` = fraction of all requests (rejected included) meeting SLO;
percentiles use numpy's default (linear) interpolation; TBT pools every token gap of
every request.  The capacity search is :func:`capacity_search`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from chunkgym.config import from_mapping
from envs.serving.cost_model import CostModel
from envs.serving.request import Request
from envs.serving.specs import CONF_DIR

BUCKET_EDGES = (0, 1024, 4096, 16384, 65536)
BUCKET_LABELS = ("[0,1k)", "[1k,4k)", "[4k,16k)", "[16k,64k)", "[64k,inf)")


@dataclass(frozen=True)
class SLOSpec:
    """An SLO recipe (``conf/slo/NAME.yaml``); :meth:`resolve` turns it into bounds."""

    name: str
    tpot_multiplier: float
    ttft_base_s: float
    ttft_factor: float
    stall_factor: float = 5.0
    reference_batch: int = 32
    reference_context: int = 4096

    def resolve(self, cost_model: CostModel) -> SLO:
        ref = float(
            cost_model.decode_times(
                self.reference_batch, np.array([self.reference_batch * self.reference_context])
            )[0]
        )
        tpot = self.tpot_multiplier * ref
        return SLO(self.name, tpot, self.stall_factor * tpot, self.ttft_base_s, self.ttft_factor, ref)


@dataclass(frozen=True)
class SLO:
    """Resolved bounds, in seconds, for one model on one hardware."""

    name: str
    tpot_s: float
    stall_s: float
    ttft_base_s: float
    ttft_factor: float
    reference_decode_s: float

    def ttft_bound(self, prefill_alone_s: float) -> float:
        return max(self.ttft_base_s, self.ttft_factor * prefill_alone_s)


def slo_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "slo").glob("*.yaml"))


def load_slo(name: str) -> SLOSpec:
    import yaml

    path = CONF_DIR / "slo" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown slo {name!r}; valid names: {', '.join(slo_names())}")
    return from_mapping(SLOSpec, yaml.safe_load(path.read_text()), source=str(path))


# ---- per request -----------------------------------------------------------------------
def ttft_of(times: np.ndarray, arrival: float) -> float:
    return float(times[0] - arrival)


def tpot_of(times: np.ndarray) -> float:
    n = len(times)
    return float((times[-1] - times[0]) / (n - 1)) if n > 1 else 0.0


def stall_of(times: np.ndarray) -> float:
    return float((times[1:] - times[:-1]).max()) if len(times) > 1 else 0.0  # np.diff, minus its overhead


def meets_slo(ttft: float, tpot: float, stall: float, req: Request) -> bool:
    """Whether a finished request met its own SLO's bounds (its class's, or the run's)."""
    return ttft <= req.ttft_bound and tpot <= req.tpot_bound and stall <= req.stall_bound


@dataclass
class RequestOutcomes:
    """Per-request results of a run (one row per request of the window, rejected included)."""

    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    finished: np.ndarray  # bool
    reject_reason: list[str]
    ttft: np.ndarray  # NaN where not finished
    tpot: np.ndarray
    stall: np.ndarray
    sched_delay: np.ndarray
    ttft_bound: np.ndarray
    good: np.ndarray  # bool: met its own SLO's bounds (its class's, or the run's)
    gaps: list[np.ndarray] = field(repr=False)  # every request's token gaps (empty if none)
    prefix_hit: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    preemptions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    e2el: np.ndarray = field(default_factory=lambda: np.zeros(0))  # last token - arrival; NaN if unfinished

    @classmethod
    def from_token_times(
        cls,
        arrival: Sequence[float],
        prompt_len: Sequence[int],
        output_len: Sequence[int],
        token_times: Sequence[np.ndarray | None],
        first_scheduled: Sequence[float],
        ttft_bound: Sequence[float],
        slo: SLO,
        reject_reason: Sequence[str] | None = None,
        prefix_hit: Sequence[int] | None = None,
        preemptions: Sequence[int] | None = None,
        tpot_bound: Sequence[float] | None = None,
        stall_bound: Sequence[float] | None = None,
    ) -> RequestOutcomes:
        """Apply the definitions above; ``token_times[i] is None`` for a rejected request.
        ``tpot_bound`` and ``stall_bound``: each request's own (its SLO class's), else ``slo``'s.

        Vectorised over all requests; the arithmetic is the per-request functions' own
        (``ttft_of``, ``tpot_of``, ``stall_of``), so both give bit-identical numbers.
        """
        n = len(arrival)
        arrival_a = np.asarray(arrival, dtype=np.float64)
        lens = np.array([0 if t is None else len(t) for t in token_times], dtype=np.int64)
        finished = lens > 0
        flat = np.concatenate([t for t in token_times if t is not None and len(t)] or [np.empty(0)])
        stops = np.cumsum(lens)
        starts = stops - lens
        ttft, tpot, stall, delay, e2el = (np.full(n, np.nan) for _ in range(5))
        fin = np.flatnonzero(finished)
        first, last = flat[starts[fin]], flat[stops[fin] - 1]
        ttft[fin] = first - arrival_a[fin]
        e2el[fin] = last - arrival_a[fin]
        many = lens[fin] > 1
        tpot[fin] = np.where(many, (last - first) / np.maximum(lens[fin] - 1, 1), 0.0)
        diffs = np.diff(flat)
        gaps = [diffs[a : b - 1] if b - a > 1 else np.empty(0) for a, b in zip(starts, stops, strict=True)]
        stall[fin] = _largest_gaps(diffs, stops, starts[fin], lens[fin])
        delay[fin] = np.asarray(first_scheduled, dtype=np.float64)[fin] - arrival_a[fin]
        bounds = np.asarray(ttft_bound, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            tpot_ok = tpot <= (slo.tpot_s if tpot_bound is None else np.asarray(tpot_bound, dtype=np.float64))
            stall_ok = stall <= (
                slo.stall_s if stall_bound is None else np.asarray(stall_bound, dtype=np.float64)
            )
            good = finished & (ttft <= bounds) & tpot_ok & stall_ok
        return cls(
            arrival=arrival_a,
            prompt_len=np.asarray(prompt_len, dtype=np.int64),
            output_len=np.asarray(output_len, dtype=np.int64),
            finished=finished,
            reject_reason=list(reject_reason) if reject_reason is not None else [""] * n,
            ttft=ttft,
            tpot=tpot,
            stall=stall,
            sched_delay=delay,
            ttft_bound=bounds,
            good=good,
            gaps=gaps,
            prefix_hit=np.asarray(prefix_hit if prefix_hit is not None else np.zeros(n), dtype=np.int64),
            preemptions=np.asarray(preemptions if preemptions is not None else np.zeros(n), dtype=np.int64),
            e2el=e2el,
        )

    def __getstate__(self) -> dict[str, object]:
        """For a worker process sending its run's outcomes back: the token gaps as one array and
        their lengths, not one small array per request (a whole-trace run's 19k of them cost several
        times as much to pickle and unpickle as their 30 MB of numbers)."""
        state = dict(self.__dict__)
        gaps = state.pop("gaps")
        state["gap_lengths"] = np.array([len(g) for g in gaps], dtype=np.int64)
        state["gap_values"] = np.concatenate(gaps) if gaps else np.empty(0)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        state = dict(state)
        lengths = cast(np.ndarray, state.pop("gap_lengths"))
        values = cast(np.ndarray, state.pop("gap_values"))
        state["gaps"] = np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []
        self.__dict__.update(state)

    def subset(self, mask: np.ndarray) -> RequestOutcomes:
        idx = np.flatnonzero(mask)
        return RequestOutcomes(
            arrival=self.arrival[idx],
            prompt_len=self.prompt_len[idx],
            output_len=self.output_len[idx],
            finished=self.finished[idx],
            reject_reason=[self.reject_reason[i] for i in idx],
            ttft=self.ttft[idx],
            tpot=self.tpot[idx],
            stall=self.stall[idx],
            sched_delay=self.sched_delay[idx],
            ttft_bound=self.ttft_bound[idx],
            good=self.good[idx],
            gaps=[self.gaps[i] for i in idx],
            prefix_hit=self.prefix_hit[idx],
            preemptions=self.preemptions[idx],
            e2el=self.e2el[idx],
        )


def _largest_gaps(diffs: np.ndarray, stops: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Each request's largest token gap (0 for one token), ``diffs[a : a + n - 1].max()`` per start
    ``a`` and length ``n``, in one pass: ``stops`` (every request's end in the flat token times)
    mark the differences that span two requests, which are masked off."""
    out = np.zeros(len(starts))
    many = lens > 1
    if many.any():
        own = diffs.copy()
        cross = stops - 1
        own[cross[(cross >= 0) & (cross < len(own))]] = -np.inf
        out[many] = np.maximum.reduceat(own, starts[many])
    return out


# ---- system level ------------------------------------------------------------------------
def pct(values: np.ndarray, q: float) -> float:
    """Percentile ``q`` (0-100) with linear interpolation; NaN for no values."""
    return pcts(values, (q,))[0]


def pcts(values: np.ndarray, qs: Sequence[float]) -> list[float]:
    """:func:`pct` for each of ``qs``, with one partition of ``values`` (the same numbers)."""
    # A copy (without the NaNs), so the partition may reorder it in place.
    values = values[~np.isnan(values)] if values.dtype.kind == "f" else values.copy()
    if not len(values):
        return [math.nan] * len(qs)
    return [float(x) for x in np.percentile(values, qs, overwrite_input=True)]


def request_summary(out: RequestOutcomes, span_s: float) -> dict[str, float]:
    """Request-level system metrics over a window of ``span_s`` seconds of arrivals."""
    n = len(out.arrival)
    fin = out.finished
    gaps = np.concatenate(out.gaps) if out.gaps else np.empty(0)
    multi = fin & (out.output_len > 1)
    n_good = int(out.good.sum())
    ttft, tpot, tbt = (pcts(x, (50, 95, 99)) for x in (out.ttft[fin], out.tpot[multi], gaps))
    return {
        "requests": n,
        "finished": int(fin.sum()),
        "rejected": int(sum(1 for r in out.reject_reason if r)),
        "goodput_rps": n_good / span_s if span_s > 0 else math.nan,
        "slo_attainment": n_good / n if n else math.nan,
        "ttft_p50_s": ttft[0],
        "ttft_p95_s": ttft[1],
        "ttft_p99_s": ttft[2],
        "tpot_p50_s": tpot[0],
        "tpot_p95_s": tpot[1],
        "tpot_p99_s": tpot[2],
        "tbt_p50_s": tbt[0],
        "tbt_p95_s": tbt[1],
        "tbt_p99_s": tbt[2],
        "max_tbt_s": float(gaps.max()) if len(gaps) else math.nan,
        "sched_delay_p50_s": pct(out.sched_delay[fin], 50),
        "max_sched_delay_s": float(np.nanmax(out.sched_delay)) if fin.any() else math.nan,
        "preemptions": int(out.preemptions.sum()),
        "prefix_hit_rate": float(out.prefix_hit.sum() / out.prompt_len.sum()) if n else math.nan,
        **vllm_summary(out, span_s),
    }


VLLM_STATS = ("mean", "median", "std", "p99")
VLLM_COLUMNS = (
    *(f"{m}_ms_{stat}" for m in ("ttft", "tpot", "itl", "e2el") for stat in VLLM_STATS),
    "duration_s",
    "request_throughput",
    "request_goodput",
    "output_throughput",
)
"""The columns named as ``vllm bench serve`` reports them (added to every results row)."""


def _ms_stats(name: str, seconds: np.ndarray) -> dict[str, float]:
    values = seconds[~np.isnan(seconds)] * 1e3
    if not len(values):
        return {f"{name}_ms_{stat}": math.nan for stat in VLLM_STATS}
    mean, std = float(np.mean(values)), float(np.std(values))
    # ``values`` is this function's own copy, so the order statistics may reorder it in place;
    # mean and std, whose sums depend on the order, are taken before.
    median = float(np.median(values, overwrite_input=True))
    return {
        f"{name}_ms_mean": mean,
        f"{name}_ms_median": median,
        f"{name}_ms_std": std,
        f"{name}_ms_p99": float(np.percentile(values, 99, overwrite_input=True)),
    }


def vllm_summary(out: RequestOutcomes, span_s: float) -> dict[str, float]:
    """``vllm bench serve``'s metrics under its names and units, so results compare line by line.

    TTFT, TPOT (multi-token outputs) and E2EL (last token - arrival) over finished requests, ITL over
    every token gap pooled (this module's TBT), in ms: mean, median, std (population, as numpy's
    default) and P99. vLLM divides by the benchmark's duration, from the first send to the last
    response: here ``duration_s`` = the later of the arrival window's end and the last token.
    ``request_goodput`` counts requests meeting this run's SLO (vLLM's ``--goodput`` bounds are the
    user's); ``goodput_rps`` divides the same count by the arrival window alone.
    """
    fin = out.finished
    gaps = np.concatenate(out.gaps) if out.gaps else np.empty(0)
    last = float(np.max(out.arrival[fin] + out.e2el[fin])) if fin.any() else 0.0
    duration = max(span_s, last)
    per = (lambda k: k / duration) if duration > 0 else (lambda k: math.nan)
    return {
        **_ms_stats("ttft", out.ttft[fin]),
        **_ms_stats("tpot", out.tpot[fin & (out.output_len > 1)]),
        **_ms_stats("itl", gaps.astype(np.float64)),
        **_ms_stats("e2el", out.e2el[fin]),
        "duration_s": duration,
        "request_throughput": per(int(fin.sum())),
        "request_goodput": per(int(out.good.sum())),
        "output_throughput": per(int(out.output_len[fin].sum())),
    }


def bucket_summaries(out: RequestOutcomes) -> list[dict[str, float | str]]:
    """Per prompt-length bucket (raw prompt length): attainment, TTFT and TBT percentiles."""
    rows: list[dict[str, float | str]] = []
    edges = (*BUCKET_EDGES, np.inf)
    for label, lo, hi in zip(BUCKET_LABELS, edges[:-1], edges[1:], strict=True):
        sub = out.subset((out.prompt_len >= lo) & (out.prompt_len < hi))
        s = request_summary(sub, span_s=1.0)
        rows.append(
            {
                "bucket": label,
                "requests": s["requests"],
                "slo_attainment": s["slo_attainment"],
                **{k: s[k] for k in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s")},
                **{k: s[k] for k in ("tbt_p50_s", "tbt_p95_s", "tbt_p99_s")},
                "max_sched_delay_s": s["max_sched_delay_s"],
            }
        )
    return rows


# ---- capacity ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CapacityResult:
    """Highest passing load scale (0 when even ``min_scale`` fails) and the final bracket."""

    scale: float
    bracket: tuple[float, float]
    evaluations: tuple[tuple[float, bool], ...]


def capacity_search(
    passes: Callable[[float], bool],
    start: float = 1.0,
    rel_tol: float = 0.01,
    min_scale: float = 1 / 64,
    max_scale: float = 1024.0,
) -> CapacityResult:
    """The highest load scale at which ``passes(scale)`` holds, by bracketing then bisection.

    Doubles (or halves) from ``start`` until a passing and a failing scale bracket the
    boundary, then bisects until ``(hi - lo) / lo <= rel_tol``.  Returns scale 0 with
    bracket ``(0, min_scale)`` when even the lowest load fails, and ``max_scale`` with
    bracket ``(max_scale, inf)`` when even the highest passes.
    """
    steps = capacity_steps(start, rel_tol, min_scale, max_scale)
    try:
        scale = next(steps)
        while True:
            scale = steps.send(bool(passes(scale)))
    except StopIteration as done:
        result: CapacityResult = done.value  # the generator's return value
        return result


MIN_REL_TOL = 1e-6
"""The finest relative bracket a capacity search may ask for (about 20 bisections from a doubling)."""


def capacity_steps(
    start: float = 1.0, rel_tol: float = 0.01, min_scale: float = 1 / 64, max_scale: float = 1024.0
) -> Generator[float, bool, CapacityResult]:
    """:func:`capacity_search` as a generator: yields each scale to probe, is sent its outcome.

    The one definition of the probe sequence, so a driver that evaluates probes ahead of
    time (:mod:`envs.serving.capacity`) follows exactly the sequential search.
    """
    if not MIN_REL_TOL <= rel_tol < 1:  # below the floor, bisection may never narrow the bracket enough
        raise ValueError(f"rel_tol must be in [{MIN_REL_TOL:g}, 1), got {rel_tol!r}")
    seen: list[tuple[float, bool]] = []

    def check(scale: float) -> Generator[float, bool, bool]:
        ok = yield scale
        seen.append((scale, ok))
        return ok

    if (yield from check(start)):
        lo, hi = start, start * 2
        while (yield from check(hi)):
            lo, hi = hi, hi * 2
            if lo >= max_scale:
                return CapacityResult(lo, (lo, math.inf), tuple(seen))
    else:
        lo, hi = start / 2, start
        while not (yield from check(lo)):
            lo, hi = lo / 2, lo
            if lo < min_scale:
                return CapacityResult(0.0, (0.0, hi), tuple(seen))
    while (hi - lo) / lo > rel_tol:
        mid = 0.5 * (lo + hi)
        if (yield from check(mid)):
            lo = mid
        else:
            hi = mid
    return CapacityResult(lo, (lo, hi), tuple(seen))


ATTAIN90_TARGET = 0.9
"""``attain90``'s bar: the fraction of all requests that must meet their SLO."""


def attain90(summary: dict[str, float]) -> bool:
    """DistServe's capacity criterion: at least 90% of requests meet their SLO."""
    return summary["slo_attainment"] >= ATTAIN90_TARGET


def tbt_criterion(summary: dict[str, float], tpot_bound_s: float, max_median_delay_s: float = 2.0) -> bool:
    """Sarathi-Serve's criterion: P99 TBT within the TPOT bound, median scheduling delay <= 2 s."""
    tbt, delay = summary["tbt_p99_s"], summary["sched_delay_p50_s"]
    return (math.isnan(tbt) or tbt <= tpot_bound_s) and not delay > max_median_delay_s
