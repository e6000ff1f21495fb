"""``advisor.prometheus``: a real vLLM's ``/metrics`` scrapes read exactly, and the traffic drawn from them.

The fixture (``tests/fixtures/vllm_metrics``, see its README) is two scrapes of vLLM 0.32's OpenAI
server after requests of known lengths; every count asserted here is in those files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from advisor.prometheus import (
    INF_FACTOR,
    Histogram,
    MetricsError,
    MetricsTraffic,
    metrics_trace,
    metrics_workload,
    read_metrics,
)

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_metrics"
A, B = FIXTURE / "scrape_a.txt", FIXTURE / "scrape_b.txt"
CAPTURE = json.loads((FIXTURE / "capture.json").read_text())
INTERVAL_S = CAPTURE["interval_s"]
BOUNDS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
PROMPT_A = (0, 0, 3, 2, 5, 6, 6, 5, 2, 3, 4, 4)
PROMPT_B = (0, 0, 5, 4, 5, 8, 9, 5, 6, 6, 6, 6)
OUTPUT_A = (2, 4, 8, 5, 4, 5, 8, 4, 0, 0, 0, 0)
OUTPUT_B = (2, 5, 11, 9, 5, 10, 11, 7, 0, 0, 0, 0)


def bucket_counts(lengths, bounds=BOUNDS) -> list[int]:
    """Prometheus's ``le`` rule: a length goes in the first bucket whose bound is at least it."""
    index = np.searchsorted(np.asarray(bounds), np.asarray(lengths, dtype=float), side="left")
    return np.bincount(index, minlength=len(bounds) + 1).tolist()


def one_line_error(call, *words, kind: type[ValueError] = ValueError):
    """Run ``call``; its error (a ``kind``) must be one line that names every one of ``words``."""
    with pytest.raises(kind) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert str(word) in message, (word, message)
    return message


# --- the fixture, read exactly ---------------------------------------------------------------


def test_one_scrape_is_read_exactly():
    t = read_metrics([B], rate=3.0)
    assert t.prompt.bounds == t.output.bounds == BOUNDS
    assert t.prompt.counts == PROMPT_B
    assert t.output.counts == OUTPUT_B
    assert (t.prompt.total, t.output.total) == (27671.0, 2323.0)
    assert t.requests == 60
    assert t.rate == 3.0 and t.rate_source == "rate=3 (given)"
    assert "vllm:request_success_total" not in t.fields_used
    assert {"vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket"} <= set(
        t.fields_used
    )
    assert "Poisson arrivals" in t.assumptions


def test_the_counts_follow_from_the_requests_sent():
    """The histograms hold exactly the (prompt, output) lengths capture.py sent, binned by ``le``."""
    sent = CAPTURE["requests_a"] + CAPTURE["requests_b"]
    a = read_metrics([A], rate=1.0)
    b = read_metrics([B], rate=1.0)
    n_a = len(CAPTURE["requests_a"])
    assert a.prompt.counts == tuple(bucket_counts([p for p, _ in sent[:n_a]]))
    assert a.output.counts == tuple(bucket_counts([o for _, o in sent[:n_a]]))
    assert b.prompt.counts == tuple(bucket_counts([p for p, _ in sent]))
    assert b.output.counts == tuple(bucket_counts([o for _, o in sent]))
    assert b.prompt.total == sum(p for p, _ in sent) and b.output.total == sum(o for _, o in sent)


def test_two_scrapes_give_the_requests_between_them_and_their_rate():
    t = read_metrics([A, B], interval_s=INTERVAL_S)
    assert t.prompt.counts == tuple(np.subtract(PROMPT_B, PROMPT_A))
    assert t.output.counts == tuple(np.subtract(OUTPUT_B, OUTPUT_A))
    assert t.prompt.total == 27671.0 - 17050.0
    assert t.requests == 20
    assert t.rate == pytest.approx(20 / INTERVAL_S, rel=1e-12)
    assert (
        t.rate_source
        == f"two scrapes scrape_a.txt, scrape_b.txt: 20 requests in {INTERVAL_S:g} s (interval_s (given))"
    )
    assert "vllm:request_success_total" in t.fields_used
    assert any("completion rate" in a for a in t.assumptions)


def test_a_given_rate_wins_over_the_scrapes():
    t = read_metrics([A, B], rate=0.5)
    assert t.rate == 0.5 and t.requests == 20
    assert "vllm:request_success_total" not in t.fields_used


def test_sample_timestamps_give_the_interval(tmp_path):
    """A federation endpoint writes a timestamp (ms) on every sample; then no interval_s is needed."""

    def stamped(src: Path, ms: int) -> Path:
        lines = [
            line if line.startswith("#") or not line.strip() else f"{line} {ms}"
            for line in src.read_text().splitlines()
        ]
        out = tmp_path / src.name
        out.write_text("\n".join(lines) + "\n")
        return out

    t = read_metrics([stamped(A, 1_700_000_000_000), stamped(B, 1_700_000_008_000)])
    assert t.rate == pytest.approx(20 / 8.0)
    assert "timestamps" in t.rate_source


# --- drawing requests --------------------------------------------------------------------------


def test_lengths_fall_in_buckets_in_the_histograms_proportions():
    t = read_metrics([B], rate=2.0)
    n = 40_000
    trace = metrics_trace(t, n, seed=0)
    for lengths, hist in ((trace.prompt_len, t.prompt), (trace.output_len, t.output)):
        assert lengths.dtype == np.int64 and lengths.min() >= 1
        p = np.asarray(hist.counts) / hist.count
        observed = np.asarray(bucket_counts(lengths)) / n
        sd = np.sqrt(p * (1 - p) / n)
        assert np.all(np.abs(observed - p) <= 5 * sd + 1e-12), (observed, p)
        assert np.all(observed[p == 0] == 0)  # nothing where the histogram has nothing
    # within a bucket, uniform over its integers: (500, 1000] holds 501..1000, mean 750.5
    inside = trace.prompt_len[(trace.prompt_len > 500) & (trace.prompt_len <= 1000)]
    assert (inside.min(), inside.max()) == (501, 1000)
    assert inside.mean() == pytest.approx(750.5, abs=4 * 144.5 / np.sqrt(len(inside)))
    low, high = np.sum(inside <= 750), np.sum(inside > 750)
    assert abs(low - high) <= 4 * np.sqrt(len(inside))


def test_the_inf_bucket_ends_where_the_sum_says_within_its_cap():
    def hist(total: float) -> Histogram:
        return Histogram("h", (10.0,), (0, 4), total)

    assert hist(4 * 15).inf_upper == 19  # 11..19 has mean 15: the drawn mean is the _sum's
    assert hist(4 * 1000).inf_upper == int(INF_FACTOR * 10)  # capped
    assert hist(4 * 5).inf_upper == 11  # the _sum leaves less than the bound: just above it
    draws = hist(4 * 15).draw(np.random.default_rng(0), 20_000)
    assert draws.min() == 11 and draws.max() == 19
    assert draws.mean() == pytest.approx(15, abs=0.05)
    # the fixture: the +Inf prompts (2010 tokens) are drawn just above 2000, never past 2 x 2000
    t = read_metrics([B], rate=1.0)
    trace = metrics_trace(t, 5000, seed=1)
    assert 2000 < trace.prompt_len.max() <= 2 * 2000
    assert any("6 lengths above 2000" in a for a in t.assumptions)


@pytest.mark.parametrize("cv", [1.0, 2.5])
def test_gaps_have_the_rate_and_cv_asked_for(cv):
    t = read_metrics([A, B], interval_s=INTERVAL_S, arrival_cv=cv)
    trace = metrics_trace(t, 100_000, seed=3)
    gaps = np.diff(trace.arrival_s)
    assert gaps.mean() == pytest.approx(1 / t.rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.03)
    assert ("Poisson arrivals" in t.assumptions) == (cv == 1.0)


def test_the_same_seed_gives_the_same_requests():
    t = read_metrics([A, B], interval_s=INTERVAL_S, arrival_cv=1.5)
    one, two, other = (metrics_trace(t, 500, seed) for seed in (7, 7, 8))
    for field in ("arrival_s", "prompt_len", "output_len"):
        assert np.array_equal(getattr(one, field), getattr(two, field))
        assert not np.array_equal(getattr(one, field), getattr(other, field))
    assert one.span_s == two.span_s and one.span_s >= one.arrival_s[-1]
    assert one.first_row == -1 and one.name == "metrics:scrape_a.txt,scrape_b.txt"


def test_workload_splits_windows_and_scales_like_a_named_one():
    t = read_metrics([A, B], interval_s=INTERVAL_S)
    w = metrics_workload(t, duration_s=3600.0, seed=0, window_s=300.0)
    whole = w.split("all")
    assert whole.span_s == 3600.0
    assert len(whole) / whole.span_s == pytest.approx(t.rate, rel=0.05)
    train, test = w.split("train"), w.split("test")
    assert len(train) + len(w.split("val")) + len(test) == len(whole)
    window = w.window("test", seed=4)
    assert window.span_s == 300.0 and len(window) > 0
    assert np.array_equal(window.prompt_len, w.window("test", seed=4).prompt_len)
    doubled = w.window("test", seed=4, load_scale=2.0)
    assert np.allclose(doubled.arrival_s, window.arrival_s / 2)
    again = metrics_workload(t, duration_s=3600.0, seed=0).split("all")
    assert np.array_equal(again.arrival_s, whole.arrival_s)
    assert not np.array_equal(
        metrics_workload(t, 3600.0, seed=1).split("all").prompt_len[:50], whole.prompt_len[:50]
    )


# --- bad input: one line naming the file and the metric ------------------------------------------


def _edit(tmp_path: Path, src: Path, name: str, edit) -> Path:
    out = tmp_path / name
    out.write_text(edit(src.read_text()))
    return out


def test_a_file_with_no_length_histogram(tmp_path):
    bad = _edit(
        tmp_path, B, "no_prompt.txt", lambda s: re.sub(r"(?m)^.*vllm:request_prompt_tokens.*\n", "", s)
    )
    one_line_error(
        lambda: read_metrics([bad], rate=1.0),
        bad,
        "vllm:request_prompt_tokens",
        "not found",
        kind=MetricsError,
    )
    other = tmp_path / "node.txt"
    other.write_text("# TYPE node_load1 gauge\nnode_load1 0.5\n")
    one_line_error(
        lambda: read_metrics([other], rate=1.0),
        other,
        "vllm:request_prompt_tokens",
        "is it vLLM",
        kind=MetricsError,
    )


def test_a_histogram_with_no_counts(tmp_path):
    def zero(text: str) -> str:
        return re.sub(
            r"(?m)^(vllm:request_generation_tokens_(?:bucket|count|sum)\{[^}]*\}) \S+$", r"\1 0.0", text
        )

    bad = _edit(tmp_path, B, "fresh.txt", zero)
    one_line_error(
        lambda: read_metrics([bad], rate=1.0),
        bad,
        "vllm:request_generation_tokens",
        "no counts",
        kind=MetricsError,
    )
    one_line_error(
        lambda: read_metrics([B, B], interval_s=5.0),
        B,
        "vllm:request_prompt_tokens",
        "between the two scrapes",
        kind=MetricsError,
    )


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan"), float("inf")])
def test_a_rate_that_is_not_positive(rate):
    one_line_error(lambda: read_metrics([B], rate=rate), f"rate={rate!r}")


def test_no_request_finished_between_scrapes_is_a_zero_rate(tmp_path):
    a_success = re.findall(r"(?m)^vllm:request_success_total\{.*$", A.read_text())

    def keep_a_counter(text: str) -> str:
        lines = iter(a_success)
        return re.sub(r"(?m)^vllm:request_success_total\{.*$", lambda _: next(lines), text)

    bad = _edit(tmp_path, B, "stuck.txt", keep_a_counter)
    one_line_error(
        lambda: read_metrics([A, bad], interval_s=5.0),
        bad,
        "vllm:request_success_total",
        "rate would be 0",
        kind=MetricsError,
    )


def test_missing_unreadable_and_garbage_files(tmp_path):
    missing = tmp_path / "nope.txt"
    one_line_error(lambda: read_metrics([missing], rate=1.0), missing, "file not found", kind=MetricsError)
    one_line_error(lambda: read_metrics([tmp_path], rate=1.0), tmp_path, "directory", kind=MetricsError)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    one_line_error(lambda: read_metrics([binary], rate=1.0), binary, "UTF-8", kind=MetricsError)
    for i, text in enumerate(["hello world\n", "<html><body>502 Bad Gateway</body></html>\n"]):
        garbage = tmp_path / f"garbage{i}.txt"
        garbage.write_text(text)
        one_line_error(
            lambda g=garbage: read_metrics([g], rate=1.0), garbage, "not Prometheus text", kind=MetricsError
        )


def test_rate_needs_two_scrapes_and_their_interval():
    one_line_error(lambda: read_metrics([B]), B, "rate=")
    one_line_error(lambda: read_metrics([A, B]), "interval_s=", "no timestamps")
    one_line_error(lambda: read_metrics([B, A], interval_s=5.0), A, "counts fell", kind=MetricsError)
    one_line_error(lambda: read_metrics([A, B, B], interval_s=5.0), "got 3")
    one_line_error(lambda: read_metrics([A, B], interval_s=0.0), "interval_s=0.0")
    one_line_error(lambda: read_metrics([B], rate=1.0, arrival_cv=0.0), "arrival_cv=0.0")


def test_bad_draw_arguments():
    t: MetricsTraffic = read_metrics([B], rate=1.0)
    one_line_error(lambda: metrics_trace(t, 0, seed=0), "n_requests=0")
    one_line_error(lambda: metrics_trace(t, 10, seed=-1), "seed")
    one_line_error(lambda: metrics_workload(t, 0.0, seed=0), "duration_s=0.0")
