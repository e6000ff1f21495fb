"""ServeGen: what the trace parameters mean, exact window counts, rates, and bad archives."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import tarfile

import numpy as np
import pytest

import chunkgym
from envs.serving.workload import TraceError, Workload, WorkloadSpec, load_workload
from envs.serving.workloads.servegen import load_day

ARCHIVE = chunkgym.data_root() / "traces/servegen/servegen_reason_deepseek-r1.tar.gz"
needs_archive = pytest.mark.needs_data("servegen")


def read_trace_rows(path) -> dict[int, list[list[str]]]:
    """The raw trace CSV rows of every client, read independently of the module under test."""
    rows = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if member.name.endswith("-trace.csv"):
                cid = int(member.name.rsplit("/", 1)[-1].split("-")[1])
                rows[cid] = list(csv.reader(io.TextIOWrapper(tar.extractfile(member))))
    return rows


@pytest.fixture(scope="module")
def active_windows() -> np.ndarray:
    """(rate, iat_cv, is_gamma, p1, p2) of every active window of the real archive."""
    out = []
    for rows in read_trace_rows(ARCHIVE).values():
        for _, rate, cv, dist, p1, p2 in rows:
            if float(rate) > 0:
                out.append((float(rate), float(cv), dist == "Gamma", float(p1), float(p2)))
    return np.asarray(out)


@needs_archive
def test_parameters_are_scipy_shape_and_scale_of_the_iats(active_windows):
    rate, cv, gamma, p1, p2 = active_windows.T
    gamma = gamma.astype(bool)
    count = rate * 600
    assert np.allclose(count, np.round(count), atol=1e-6)  # rate = observed count / 600
    # Gamma(shape p1, scale p2): CV is exactly 1/sqrt(p1); the mean p1*p2 matches 1/rate.
    assert np.allclose(cv[gamma], 1 / np.sqrt(p1[gamma]), rtol=1e-6)
    mean_ratio = p1[gamma] * p2[gamma] * rate[gamma]
    assert abs(np.median(mean_ratio) - 1) < 0.02
    busy = count[gamma] >= 100
    assert np.percentile(mean_ratio[busy], 5) > 0.85 and np.percentile(mean_ratio[busy], 95) < 1.05
    # Weibull(shape p1, scale p2): the mean matches 1/rate only roughly, and the CV is below iat_cv.
    k, lam = p1[~gamma], p2[~gamma]
    mean = lam * np.array([math.gamma(1 + 1 / x) for x in k])
    sd = lam * np.sqrt([math.gamma(1 + 2 / x) - math.gamma(1 + 1 / x) ** 2 for x in k])
    assert 0.95 < np.median(mean * rate[~gamma]) < 1.2
    assert 0.75 < np.median(sd / mean / cv[~gamma]) < 0.95


@needs_archive
def test_full_windows_hold_exactly_the_observed_counts():
    day = load_day(ARCHIVE)
    rows = read_trace_rows(ARCHIVE)
    for j in (3, 77, 130):
        expected = sum(round(float(r[j][1]) * 600) for r in rows.values())
        times, prompt, output = day.generate(seed=9, start=j * 600.0, end=(j + 1) * 600.0)
        assert len(times) == expected
        assert np.all((times >= j * 600) & (times < (j + 1) * 600))
        assert prompt.min() >= 1 and output.min() >= 1 and output.max() <= 32768


def native(name: str) -> Workload:
    """A shipped workload at rate_scale 1, so window times are the day's own seconds."""
    return Workload(dataclasses.replace(load_workload(name).spec, rate_scale=1.0))


@needs_archive
def test_window_rate_matches_the_file_rates():
    w = native("servegen_r1")
    rates = {cid: np.array([float(r[1]) for r in rows]) for cid, rows in read_trace_rows(ARCHIVE).items()}
    total = sum(rates.values())  # requests/s of the whole day, per 600 s window
    ratios = []
    for split in ("train", "val", "test"):
        for seed in range(8):
            tr = w.window(split, seed)
            lo, hi = tr.offset_s, tr.offset_s + tr.span_s
            j = np.arange(int(lo // 600), math.ceil(hi / 600))
            overlap = np.minimum(hi, (j + 1) * 600) - np.maximum(lo, j * 600)
            ratios.append(len(tr) / float(total[j] @ overlap))
    assert abs(np.mean(ratios) - 1) < 0.05
    assert 0.5 < min(ratios) and max(ratios) < 1.5


@needs_archive
def test_windows_agree_with_longer_generations_and_stay_in_their_split():
    w = native("servegen_r1")
    day = load_day(ARCHIVE)  # the same cached parse the workload uses
    for split, (lo, hi) in {"train": (0, 51840), "val": (51840, 69120), "test": (69120, 86400)}.items():
        tr = w.window(split, 11)
        assert lo <= tr.offset_s and tr.offset_s + tr.span_s <= hi
        start = math.floor(tr.offset_s / 600) * 600 - 600
        times, prompt, _ = day.generate(11, start, tr.offset_s + tr.span_s + 600)
        inside = (times >= tr.offset_s) & (times < tr.offset_s + tr.span_s)
        np.testing.assert_allclose(times[inside] - tr.offset_s, tr.arrival_s, atol=1e-9)
        assert np.array_equal(prompt[inside], tr.prompt_len)


# --- bad archives -------------------------------------------------------------------------------

GOOD_TRACE = "0,0.5,1.0,Gamma,1.0,2.0\n600,0.1,2.0,Weibull,0.6,5.0\n1200,0,0,,0,0\n"
GOOD_DATASET = {
    "0": {"input_tokens": "{10: 0.5, 20: 0.5}", "output_tokens": "{5: 1.0}", "reason_ratio": "{}"}
}


def write_archive(path, trace=GOOD_TRACE, dataset=GOOD_DATASET, members=("trace", "dataset")):
    with tarfile.open(path, "w:gz") as tar:
        for kind in members:
            data = (trace if kind == "trace" else json.dumps(dataset)).encode()
            name = f"data/reason/m/chunk-0-{'trace.csv' if kind == 'trace' else 'dataset.json'}"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def servegen(path) -> Workload:
    return Workload(WorkloadSpec(name="sg", format="servegen", path=str(path), window_s=600.0))


def test_small_archive_generates_its_counts(tmp_path):
    w = servegen(write_archive(tmp_path / "ok.tar.gz"))
    whole = w.split("all", seed=0)
    assert whole.span_s == 1800 and len(whole) == 300 + 60
    assert set(whole.prompt_len) <= {10, 20} and set(whole.output_len) == {5}
    assert w.source == f"file:{tmp_path / 'ok.tar.gz'}"


@pytest.mark.parametrize(
    ("trace", "line", "field"),
    [
        ("0,0.5,1.0,Gamma,1.0,2.0\n600,fast,1,Gamma,1,1\n", 2, "rate"),
        ("0,0.5,1.0,Pareto,1.0,2.0\n", 1, "dist"),
        ("0,0.5,1.0,Gamma,0,2.0\n", 1, "p1"),
        ("0,-0.5,1.0,Gamma,1,2.0\n", 1, "rate"),
    ],
)
def test_bad_trace_rows_name_member_line_and_field(tmp_path, trace, line, field):
    path = write_archive(tmp_path / "bad.tar.gz", trace=trace)
    with pytest.raises(TraceError) as err:
        servegen(path)
    message = str(err.value)
    assert "chunk-0-trace.csv" in message and str(path) in message
    assert f":{line}:" in message and repr(field) in message


def test_short_row_names_its_line(tmp_path):
    path = write_archive(tmp_path / "short.tar.gz", trace="0,0.5,1.0,Gamma,1.0,2.0\n600,0.1\n")
    with pytest.raises(TraceError, match=r"chunk-0-trace\.csv\]:2: expected 6 fields"):
        servegen(path)


def test_bad_pmf_literal_is_reported_when_used(tmp_path):
    dataset = {"0": {"input_tokens": "{10: 0.5, 20: __import__('os')}", "output_tokens": "{5: 1.0}"}}
    w = servegen(write_archive(tmp_path / "pmf.tar.gz", dataset=dataset))
    with pytest.raises(TraceError) as err:
        w.window("all", 0)
    assert "chunk-0-dataset.json" in str(err.value) and "[0][input_tokens]" in str(err.value)


def test_pmf_with_zero_length_is_rejected(tmp_path):
    dataset = {"0": {"input_tokens": "{0: 0.5, 20: 0.5}", "output_tokens": "{5: 1.0}"}}
    w = servegen(write_archive(tmp_path / "zero.tar.gz", dataset=dataset))
    with pytest.raises(TraceError, match=r"\[0\]\[input_tokens\].*integers >= 1"):
        w.window("all", 0)


def test_missing_member_and_malformed_json(tmp_path):
    with pytest.raises(TraceError, match="no chunk-0-dataset.json"):
        servegen(write_archive(tmp_path / "half.tar.gz", members=("trace",)))
    path = tmp_path / "json.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in (("chunk-0-trace.csv", GOOD_TRACE.encode()), ("chunk-0-dataset.json", b"{oops")):
            info = tarfile.TarInfo(f"d/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(TraceError, match=r"chunk-0-dataset\.json\]: malformed JSON"):
        servegen(path)


def test_unreadable_archive(tmp_path):
    path = tmp_path / "junk.tar.gz"
    path.write_bytes(b"\x1f\x8bnot really gzip")
    with pytest.raises(TraceError, match="cannot read ServeGen archive"):
        servegen(path)
