"""A running vLLM's ``/metrics`` text as traffic: lengths from its histograms, the rate from its counters.

An operator who cannot export a trace can still scrape ``curl -s HOST:PORT/metrics``. vLLM keeps
per-request histograms of prompt and generated tokens (``vllm:request_prompt_tokens``,
``vllm:request_generation_tokens``; 1-2-5 buckets up to ``max_model_len``) and counts finished
requests (``vllm:request_success_total``, one series per finish reason). :func:`read_metrics`
turns one scrape plus a stated rate, or two scrapes of the same server plus the time between
them, into :class:`MetricsTraffic`; :func:`metrics_trace` and :func:`metrics_workload` draw
requests from it. With two scrapes only the requests that finished between them count: the
cumulative totals since start-up would mix in whatever the server saw hours ago.

The text carries no wall-clock time of the scrape (vLLM's samples have no timestamps and
``process_start_time_seconds`` says when the server started, not when it was scraped), and file
times do not survive a copy or a checkout, so the interval between two scrapes is given
(``interval_s``) unless both files carry Prometheus sample timestamps (a federation endpoint
writes them).

A histogram says how many lengths fell in each bucket, not where inside it, and nothing about
which prompt went with which output: lengths are drawn uniformly over the integers of their
bucket, prompt and output independently. The ``+Inf`` bucket has no upper bound: its lengths are
drawn up to the end that brings the drawn mean to the histogram's ``_sum``, at most twice the
largest finite bound (vLLM's buckets run 1-2-5 up to ``max_model_len``, so a length past the last
bound is below the next step, 2 or 2.5 times it). :attr:`MetricsTraffic.assumptions` says all of
this in sentences the report prints.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from chunkgym.received import MiB, ReceivedFileError, read_bytes
from envs.serving.workload import Workload, WorkloadSpec
from envs.serving.workloads.files import Rows
from envs.serving.workloads.renewal import Renewal, check_seed, rng_for
from envs.serving.workloads.timed import TimedSource
from envs.serving.workloads.trace import Trace

PROMPT_METRIC = "vllm:request_prompt_tokens"
OUTPUT_METRIC = "vllm:request_generation_tokens"
REQUESTS_METRIC = "vllm:request_success"
"""Family names as the parser reports them (a counter's family drops the ``_total`` suffix)."""
INF_FACTOR = 2.0
MAX_SCRAPE_BYTES = 16 * MiB
"""A /metrics file's budget: vLLM's page is about 100 KB, and the parser holds about 13 bytes a byte."""
"""The ``+Inf`` bucket's lengths are drawn up to at most this times the largest finite bound."""


class MetricsError(ValueError):
    """A ``/metrics`` file that cannot give traffic; one line naming the file and the metric."""

    def __init__(self, path: object, message: str, metric: str | None = None):
        self.path, self.metric = str(path), metric
        what = "" if metric is None else f"metric {metric}: "
        super().__init__(f"{self.path}: {what}{message}")


@dataclass(frozen=True)
class Histogram:
    """One token-count histogram: ``counts[i]`` lengths in ``(bounds[i-1], bounds[i]]``, the last
    entry of ``counts`` those above ``bounds[-1]`` (the ``+Inf`` bucket); ``total`` is their sum of
    lengths (the histogram's ``_sum``)."""

    metric: str
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def inf_upper(self) -> int:
        """Where the ``+Inf`` bucket's lengths are taken to end: :meth:`inf_end_for_sum`, kept within
        ``(bounds[-1], INF_FACTOR * bounds[-1]]`` (that cap when the bucket is empty)."""
        first, cap = math.floor(self.bounds[-1]) + 1, math.floor(INF_FACTOR * self.bounds[-1])
        end = self.inf_end_for_sum()
        return cap if end is None else min(cap, max(first, end))

    def inf_end_for_sum(self) -> int | None:
        """The end of the ``+Inf`` bucket's uniform draw that makes the drawn mean equal the
        histogram's (``total / count``); None when that bucket is empty.

        The finite buckets' draws are fixed by their bounds; the ``_sum`` left over is what the
        ``+Inf`` bucket's lengths add up to, and a uniform draw from ``first`` to ``end`` has mean
        ``(first + end) / 2``.
        """
        above = self.counts[-1]
        if above == 0:
            return None
        first = math.floor(self.bounds[-1]) + 1
        pairs = zip(self.counts, self._finite_ranges(), strict=False)
        finite = sum(c * (lo + hi) / 2 for c, (lo, hi) in pairs)
        return round(2 * (self.total - finite) / above - first)

    def _finite_ranges(self) -> list[tuple[int, int]]:
        ranges = []
        for lo, hi in zip((0.0, *self.bounds[:-1]), self.bounds, strict=True):
            first = max(1, math.floor(lo) + 1)
            ranges.append((first, max(first, math.floor(hi))))
        return ranges

    def integer_ranges(self) -> list[tuple[int, int]]:
        """Each bucket's integers ``[lo, hi]`` (at least 1): the support a uniform draw covers."""
        first = max(1, math.floor(self.bounds[-1]) + 1)
        return [*self._finite_ranges(), (first, max(first, self.inf_upper))]

    def draw_mean(self) -> float:
        """The mean length of the within-bucket uniform draw (to set beside ``total / count``)."""
        mids = [(lo + hi) / 2 for lo, hi in self.integer_ranges()]
        return float(np.dot(self.counts, mids) / self.count)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integer lengths: a bucket in proportion to its count, then uniform over its integers."""
        ranges = np.array(self.integer_ranges(), dtype=np.int64)
        bucket = rng.choice(len(self.counts), size=n, p=np.asarray(self.counts) / self.count)
        lo, hi = ranges[bucket, 0], ranges[bucket, 1]
        lengths: np.ndarray = lo + np.floor(rng.random(n) * (hi - lo + 1)).astype(np.int64)
        return lengths


@dataclass(frozen=True)
class MetricsTraffic:
    """Traffic read from ``/metrics``: length histograms, the request count and the arrival rate.

    ``requests`` is the prompt histogram's count (all of it for one scrape, the difference for two);
    ``rate`` is requests/s and ``rate_source`` says where it came from; ``arrival_cv`` is the
    coefficient of variation of the gaps between arrivals (1 is Poisson). ``fields_used`` names
    every metric read and ``assumptions`` every guess, as sentences for the report.
    """

    paths: tuple[str, ...]
    prompt: Histogram
    output: Histogram
    requests: int
    rate: float
    rate_source: str
    arrival_cv: float
    fields_used: list[str]
    assumptions: list[str]

    @property
    def name(self) -> str:
        return "metrics:" + ",".join(Path(p).name for p in self.paths)


@dataclass(frozen=True)
class _Scrape:
    """The parts of one file this module reads; ``time_s`` is the latest sample timestamp, if any."""

    path: str
    prompt: Histogram
    output: Histogram
    finished: float | None
    time_s: float | None


def read_metrics(
    paths: Sequence[str | os.PathLike[str]],
    rate: float | None = None,
    arrival_cv: float = 1.0,
    interval_s: float | None = None,
) -> MetricsTraffic:
    """Traffic from one scrape (``rate`` required) or two of one server, earlier first.

    With two, the lengths are those of the requests that finished between the scrapes, and the rate
    (unless ``rate`` is given) is those finished requests over ``interval_s`` seconds (or over the
    difference of the files' sample timestamps when both carry them): in a steady state as many
    requests arrive as finish. Bad input raises :class:`MetricsError` (or ``ValueError`` for a bad
    argument), one line naming the file and the metric.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if len(paths) not in (1, 2):
        raise ValueError(f"metrics: give one /metrics file or two scrapes of one server, got {len(paths)}")
    if not (math.isfinite(arrival_cv) and arrival_cv > 0):
        raise ValueError(f"arrival_cv={arrival_cv!r}: must be a positive number (1 is Poisson)")
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate={rate!r}: must be a positive number of requests/s")
    if interval_s is not None and not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"interval_s={interval_s!r}: must be a positive number of seconds")
    scrapes = [_read_scrape(Path(p)) for p in paths]
    fields = [
        f"{PROMPT_METRIC}_bucket",
        f"{PROMPT_METRIC}_sum",
        f"{OUTPUT_METRIC}_bucket",
        f"{OUTPUT_METRIC}_sum",
    ]
    assumptions = []
    last = scrapes[-1]
    if len(scrapes) == 1:
        prompt, output = last.prompt, last.output
        if rate is None:
            raise ValueError(
                f"{last.path}: one scrape gives no arrival rate: pass rate= (requests/s), "
                "or two scrapes of the same server and interval_s="
            )
        window = "every request the server finished since it started"
    else:
        first = scrapes[0]
        prompt = _difference(first.prompt, last.prompt, last.path)
        output = _difference(first.output, last.output, last.path)
        window = f"the {prompt.count} requests that finished between the two scrapes"
    for hist in (prompt, output):
        if hist.count == 0:
            when = "between the two scrapes" if len(scrapes) == 2 else "in this scrape"
            raise MetricsError(
                last.path, f"the histogram has no counts (no request finished {when})", hist.metric
            )
    if rate is not None:
        source = f"rate={rate:g} (given)"
    else:
        rate, source = _scrape_rate(scrapes[0], last, interval_s)
        fields.append(f"{REQUESTS_METRIC}_total")
        assumptions.append("arrival rate = completion rate between the scrapes (a steady state)")
    assumptions += [
        f"lengths from {window}",
        "lengths drawn uniformly over the integers of their histogram bucket",
        *(_inf_sentence(h) for h in (prompt, output)),
        "prompt and output lengths drawn independently (the histograms do not pair them)",
        f"mean prompt {prompt.total / prompt.count:.1f} tokens (histogram _sum), {prompt.draw_mean():.1f} drawn; "
        f"mean output {output.total / output.count:.1f}, {output.draw_mean():.1f} drawn",
        "Poisson arrivals"
        if arrival_cv == 1.0
        else f"Gamma renewal arrivals with inter-arrival CV {arrival_cv:g} (given)",
    ]
    return MetricsTraffic(
        paths=tuple(str(p) for p in paths),
        prompt=prompt,
        output=output,
        requests=prompt.count,
        rate=rate,
        rate_source=source,
        arrival_cv=arrival_cv,
        fields_used=fields,
        assumptions=assumptions,
    )


def metrics_trace(traffic: MetricsTraffic, n_requests: int, seed: int) -> Trace:
    """``n_requests`` requests drawn from ``traffic``: lengths from its histograms, renewal arrivals at
    its rate with its CV (Gamma; Poisson at CV 1). The same (traffic, n, seed) gives the same arrays."""
    if isinstance(n_requests, bool) or not isinstance(n_requests, int | np.integer) or n_requests < 1:
        raise ValueError(f"n_requests={n_requests!r}: must be a positive integer")
    seed = check_seed(seed)
    process = Renewal.from_rate(traffic.rate, traffic.arrival_cv)
    times, span = process.first_n(rng_for(seed, "metrics", "arrivals"), int(n_requests))
    prompt, output = _lengths(traffic, seed, int(n_requests))
    return Trace(
        name=traffic.name,
        source=traffic.name,
        arrival_s=times,
        prompt_len=prompt,
        output_len=output,
        hash_ids=None,
        hash_block_tokens=0,
        span_s=span,
        first_row=-1,
    )


class MetricsWorkload(Workload):
    """A :class:`Workload` over a stream generated from ``/metrics`` traffic: the named workloads'
    splits (60/20/20 of its time span), seeded windows and load scaling apply unchanged."""

    def __init__(self, spec: WorkloadSpec, source: TimedSource):
        self.spec = spec
        self._source = source
        self.source = source.source


def metrics_workload(
    traffic: MetricsTraffic, duration_s: float, seed: int, window_s: float = 300.0
) -> MetricsWorkload:
    """A ``duration_s``-second stream drawn from ``traffic`` (fixed by ``seed``) as a workload whose
    ``window(split, seed)`` cuts ``window_s``-second windows out of it, as the synthetic workload does."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s={duration_s!r}: must be a positive number of seconds")
    seed = check_seed(seed)
    process = Renewal.from_rate(traffic.rate, traffic.arrival_cv)
    times = process.arrivals(rng_for(seed, "metrics", "arrivals"), 0.0, duration_s)
    if not len(times):
        raise ValueError(
            f"{traffic.name}: no request arrives in {duration_s:g} s at {traffic.rate:g} req/s; "
            "give a longer duration_s"
        )
    prompt, output = _lengths(traffic, seed, len(times))
    rows = Rows(traffic.name, times, prompt, output)
    spec = WorkloadSpec(
        name=traffic.name,
        format="synthetic",
        window_s=window_s,
        arrival_process="poisson" if traffic.arrival_cv == 1.0 else "gamma",
        base_rate=traffic.rate,
        burstiness_cv=traffic.arrival_cv,
    )
    return MetricsWorkload(spec, TimedSource(traffic.name, traffic.name, rows, 0.0, duration_s))


def _inf_sentence(hist: Histogram) -> str:
    """What was assumed about ``hist``'s lengths past its last finite bound."""
    bound, above, end = f"{hist.bounds[-1]:g}", hist.counts[-1], hist.inf_end_for_sum()
    if end is None:
        return f"{hist.metric}: no lengths above {bound}"
    drawn = f"{hist.metric}: the {above} lengths above {bound} drawn up to {hist.inf_upper}"
    if end == hist.inf_upper:
        return f"{drawn}, the end that brings the drawn mean to the histogram's _sum"
    if end < hist.inf_upper:
        return f"{drawn} (the histogram's _sum leaves less for them: the uniform draws below overstate it)"
    return f"{drawn}, {INF_FACTOR:g} x {bound} (the histogram's _sum asks for more)"


def _lengths(traffic: MetricsTraffic, seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    prompt = traffic.prompt.draw(rng_for(seed, "metrics", "prompt"), n)
    output = traffic.output.draw(rng_for(seed, "metrics", "output"), n)
    return prompt, output


def _read_scrape(path: Path) -> _Scrape:
    if not path.exists():
        raise MetricsError(path, "file not found")
    if path.is_dir():
        raise MetricsError(path, "is a directory, not a /metrics text file")
    try:  # a received file: regular (a FIFO is refused, not waited on) and within its budget
        data = read_bytes(path, MAX_SCRAPE_BYTES)
    except ReceivedFileError as exc:
        raise MetricsError(path, exc.detail.removeprefix(f"{path}: ")) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise MetricsError(path, "not UTF-8 text (expected the Prometheus text of /metrics)") from None
    try:
        families = {f.name: f for f in text_string_to_metric_families(text)}
    except (ValueError, TypeError, IndexError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MetricsError(path, f"not Prometheus text ({first[:120]})") from None
    prompt = _histogram(path, families, PROMPT_METRIC)
    output = _histogram(path, families, OUTPUT_METRIC)
    finished = None
    if (counter := families.get(REQUESTS_METRIC)) is not None:
        finished = sum(s.value for s in counter.samples if s.name == f"{REQUESTS_METRIC}_total")
    stamps = [s.timestamp for f in families.values() for s in f.samples if s.timestamp is not None]
    time_s = max(float(t) for t in stamps) if stamps else None
    return _Scrape(str(path), prompt, output, finished, time_s)


def _histogram(path: Path, families: dict[str, Metric], name: str) -> Histogram:
    """The histogram ``name`` summed over its series (one per engine), with per-bucket counts."""
    family = families.get(name)
    if family is None:
        vllm = sum(1 for f in families if f.startswith("vllm:"))
        hint = (
            f"the file has {vllm} other vllm: metrics"
            if vllm
            else "no vllm: metrics at all: is it vLLM's /metrics?"
        )
        raise MetricsError(path, f"not found ({hint}); no lengths to draw", name)
    if family.type != "histogram":
        raise MetricsError(path, f"is a {family.type}, expected a histogram", name)
    cumulative: dict[float, float] = {}
    total: float | None = None
    series: dict[tuple[tuple[str, str], ...], set[float]] = {}
    for s in family.samples:
        if s.name == f"{name}_bucket":
            try:
                le = float(s.labels.get("le", "nan"))
            except ValueError:
                le = math.nan
            if math.isnan(le) or not (math.isfinite(s.value) and s.value >= 0):
                raise MetricsError(path, f"bad bucket le={s.labels.get('le')!r} value={s.value!r}", name)
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            series.setdefault(key, set()).add(le)
            cumulative[le] = cumulative.get(le, 0.0) + s.value
        elif s.name == f"{name}_sum":
            total = (total or 0.0) + s.value
    bucket_sets = list(series.values())
    if not bucket_sets:
        raise MetricsError(path, "has no buckets; no lengths to draw", name)
    if any(b != bucket_sets[0] for b in bucket_sets):
        raise MetricsError(path, "its series have different bucket bounds", name)
    bounds = sorted(cumulative)
    if bounds[-1] != math.inf or len(bounds) < 2:
        raise MetricsError(path, "needs finite buckets and the +Inf bucket", name)
    counts = np.diff([0.0, *(cumulative[b] for b in bounds)])
    if np.any(counts < 0) or np.any(counts != np.rint(counts)):
        raise MetricsError(path, "bucket counts are not non-decreasing whole numbers", name)
    if total is None or not math.isfinite(total):
        raise MetricsError(path, f"has no {name}_sum sample (the total the lengths add up to)", name)
    return Histogram(name, tuple(bounds[:-1]), tuple(int(c) for c in counts), total)


def _difference(before: Histogram, after: Histogram, path: str) -> Histogram:
    """The requests that finished between two scrapes (``after`` minus ``before``)."""
    if before.bounds != after.bounds:
        raise MetricsError(path, "bucket bounds differ from the earlier scrape's", after.metric)
    counts = np.subtract(after.counts, before.counts)
    if np.any(counts < 0):
        raise MetricsError(
            path,
            "counts fell since the earlier scrape (the server restarted, or the files are in the wrong order)",
            after.metric,
        )
    return dataclasses.replace(after, counts=tuple(int(c) for c in counts), total=after.total - before.total)


def _scrape_rate(first: _Scrape, last: _Scrape, interval_s: float | None) -> tuple[float, str]:
    """Requests/s from the finished-request counters of two scrapes and the time between them."""
    for scrape in (first, last):
        if scrape.finished is None:
            raise MetricsError(
                scrape.path, "not found; no arrival rate (or pass rate=)", f"{REQUESTS_METRIC}_total"
            )
    assert first.finished is not None and last.finished is not None
    finished = last.finished - first.finished
    if interval_s is None:
        if first.time_s is None or last.time_s is None:
            raise ValueError(
                f"{first.path}, {last.path}: the scrapes carry no timestamps: pass interval_s= "
                "(seconds between the two scrapes) or rate="
            )
        interval_s, how = last.time_s - first.time_s, "the files' sample timestamps"
        if interval_s <= 0:
            raise MetricsError(last.path, f"its timestamps are {interval_s:g} s after the earlier scrape's")
    else:
        how = "interval_s (given)"
    if finished <= 0:
        raise MetricsError(
            last.path,
            f"{finished:g} requests finished since the earlier scrape: the rate would be {finished / interval_s:g}",
            f"{REQUESTS_METRIC}_total",
        )
    rate = finished / interval_s
    names = f"{Path(first.path).name}, {Path(last.path).name}"
    return rate, f"two scrapes {names}: {finished:g} requests in {interval_s:g} s ({how})"
