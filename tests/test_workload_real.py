"""Workloads on the real traces: row counts, splits, windows, load scaling, jitter, speed.

Skipped unless every trace is in the data root (``python -m chunkgym.data fetch``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import chunkgym
from envs.serving.workload import Workload, load_workload, workload_names
from envs.serving.workloads import files

DATA = chunkgym.data_root()
pytestmark = pytest.mark.needs_data(
    "azure_llm_2023", "mooncake", "sharegpt_lengths", "arxiv_lengths", "servegen"
)

# Row counts of the files data/sources.json pins by hash: every file row must become a request.
ROWS = {
    "azure_conv": 19366,
    "azure_code": 8819,
    "mooncake_conv": 12031,
    "mooncake_synth": 3993,
    "sharegpt_poisson": 30731,
    "arxiv_poisson": 28257,
}
TIMED = ["azure_conv", "azure_code", "mooncake_conv", "mooncake_synth"]
FILE_WORKLOADS = [n for n in workload_names() if n != "synthetic_azure_conv" and not n.startswith("mix_")]


@pytest.fixture(scope="module")
def loaded() -> dict[str, Workload]:
    """The shipped workloads at their native rate (rate_scale 1), so times are the file's own seconds."""
    return {
        name: Workload(dataclasses.replace(load_workload(name).spec, rate_scale=1.0))
        for name in workload_names()
    }


def same(a, b) -> bool:
    hashes_equal = (a.hash_ids is None and b.hash_ids is None) or (
        a.hash_ids is not None
        and b.hash_ids is not None
        and len(a.hash_ids) == len(b.hash_ids)
        and all(np.array_equal(x, y) for x, y in zip(a.hash_ids, b.hash_ids, strict=True))
    )
    return (
        np.array_equal(a.arrival_s, b.arrival_s)
        and np.array_equal(a.prompt_len, b.prompt_len)
        and np.array_equal(a.output_len, b.output_len)
        and a.span_s == b.span_s
        and hashes_equal
    )


@pytest.mark.parametrize("name", FILE_WORKLOADS)
def test_config_reads_its_file_and_windows_fit(loaded, name):
    w = loaded[name]
    assert w.source.startswith("file:") and w.source.endswith(w.spec.path)
    for split in ("train", "val", "test"):
        tr = w.window(split, seed=0)
        assert tr.name == name and tr.source == w.source
        assert 300 <= len(tr) <= 2500, (split, len(tr))
        assert tr.span_s == pytest.approx(w.spec.window_s / w.spec.rate_scale)
        assert 0 <= tr.arrival_s[0] and tr.arrival_s[-1] <= tr.span_s


@pytest.mark.parametrize("name", ROWS)
def test_every_row_becomes_a_request(loaded, name):
    assert len(loaded[name].split("all")) == ROWS[name]


@pytest.mark.parametrize("name", ["mooncake_conv", "mooncake_synth"])
def test_mooncake_hash_ids_cover_the_prompt(loaded, name):
    tr = loaded[name].window("val", seed=2)
    assert tr.hash_block_tokens == 512
    assert [len(h) for h in tr.hash_ids] == [math.ceil(p / 512) for p in tr.prompt_len]


@pytest.mark.parametrize("name", TIMED)
def test_time_splits_are_disjoint_and_cover_60_20_20(loaded, name):
    w = loaded[name]
    whole = w.split("all", seed=1)
    parts = [w.split(s, seed=1) for s in ("train", "val", "test")]
    assert sum(len(p) for p in parts) == len(whole)
    assert parts[0].offset_s == 0 and parts[-1].offset_s + parts[-1].span_s == pytest.approx(whole.span_s)
    for a, b in zip(parts, parts[1:], strict=False):
        assert b.first_row == a.first_row + len(a)
        assert b.offset_s == pytest.approx(a.offset_s + a.span_s)
        assert a.offset_s + a.arrival_s[-1] < b.offset_s + b.arrival_s[0]
    # Cuts move forward to the next arrival (slot), so shares match to within the longest gap.
    tolerance = (np.diff(whole.arrival_s).max() + w.spec.slot_jitter_s) / whole.span_s
    for part, share in zip(parts, (0.6, 0.2, 0.2), strict=True):
        assert part.span_s / whole.span_s == pytest.approx(share, abs=tolerance)


@pytest.mark.parametrize("name", ["sharegpt_poisson", "arxiv_poisson"])
def test_length_splits_are_consecutive_rows(loaded, name):
    w = loaded[name]
    n = ROWS[name]
    parts = [w.split(s, seed=0) for s in ("train", "val", "test")]
    assert [p.first_row for p in parts] == [0, int(0.6 * n), int(0.8 * n)]
    assert [len(p) for p in parts] == [int(0.6 * n), int(0.8 * n) - int(0.6 * n), n - int(0.8 * n)]
    assert all(p.arrival_s[-1] <= p.span_s for p in parts)


@pytest.mark.parametrize("name", workload_names())
def test_windows_are_deterministic_and_differ_across_seeds(loaded, name):
    w = loaded[name]
    a, b, c = w.window("train", 7), w.window("train", 7), w.window("train", 8)
    assert same(a, b)
    assert not same(a, c)
    windows = [w.window("train", s) for s in range(10)]
    if name.startswith("mix_"):  # each tenant's window starts apart: a mix has no one offset or row
        assert len({win.arrival_s.tobytes() for win in windows}) == 10
        return
    starts = {win.offset_s for win in windows}
    rows = {win.first_row for win in windows}
    assert len(starts) == 10 or len(rows) == 10


@pytest.mark.parametrize("name", TIMED)
def test_window_is_the_split_between_its_bounds(loaded, name):
    w = loaded[name]
    split, win = w.split("val", seed=4), w.window("val", seed=4)
    assert split.offset_s <= win.offset_s and win.offset_s + win.span_s <= split.offset_s + split.span_s
    k = win.first_row - split.first_row
    part = split.slice(k, k + len(win))
    assert np.array_equal(part.prompt_len, win.prompt_len)
    np.testing.assert_allclose(part.arrival_s + split.offset_s, win.arrival_s + win.offset_s, atol=1e-9)
    before, after = split.arrival_s[k - 1 : k], split.arrival_s[k + len(win) : k + len(win) + 1]
    assert np.all(before + split.offset_s < win.offset_s)
    assert np.all(after + split.offset_s >= win.offset_s + win.span_s)


@pytest.mark.parametrize("name", workload_names())
def test_load_scale_divides_inter_arrival_times(loaded, name):
    w = loaded[name]
    base = w.window("test", 5)
    double = w.window("test", 5, load_scale=2.0)
    assert np.array_equal(double.arrival_s * 2.0, base.arrival_s)
    assert double.span_s * 2.0 == base.span_s
    slow = w.window("test", 5, load_scale=0.7)
    np.testing.assert_allclose(np.diff(slow.arrival_s), np.diff(base.arrival_s) / 0.7, rtol=1e-12, atol=1e-12)
    assert np.array_equal(slow.prompt_len, base.prompt_len)
    assert np.array_equal(slow.output_len, base.output_len)


def test_mooncake_conversation_jitter_stays_in_slot_and_keeps_order(loaded):
    w = loaded["mooncake_conv"]
    raw = files.read_rows(DATA / w.spec.path, "mooncake")
    stamps = np.unique(raw.times)
    next_stamp = np.append(stamps[1:], np.inf)[np.searchsorted(stamps, raw.times)]
    first, second = w.split("all", seed=0), w.split("all", seed=1)
    for tr in (first, second):
        shift = tr.arrival_s - raw.times
        assert np.all(shift >= 0) and np.all(shift < 3.0)
        assert np.all(tr.arrival_s < next_stamp)
        assert np.array_equal(tr.prompt_len, raw.prompt)  # file order kept
        assert 0.45 < np.mean(shift / 3.0) < 0.55  # spread over the slot, not bunched
    assert not np.array_equal(first.arrival_s, second.arrival_s)


def test_mooncake_synthetic_keeps_its_timestamps(loaded):
    w = loaded["mooncake_synth"]
    raw = files.read_rows(DATA / w.spec.path, "mooncake")
    assert np.array_equal(w.split("all", seed=3).arrival_s, raw.times)


def test_file_paths_infer_their_format():
    for name in FILE_WORKLOADS:
        spec = load_workload(name).spec
        by_path = load_workload(f"file:{DATA / spec.path}")
        assert by_path.spec.format == spec.format
        assert by_path.spec.name == f"file:{DATA / spec.path}"
    assert (
        load_workload(f"file:{DATA / 'traces/mooncake/conversation_trace.jsonl'}").spec.slot_jitter_s == 3.0
    )
