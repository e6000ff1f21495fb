"""Property tests of split and window invariants on in-memory sources, and the Hydra schema."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from chunkgym.config import from_mapping
from envs.serving.workload import WORKLOAD_DIR, Workload, WorkloadSpec, workload_names
from envs.serving.workloads.files import Rows
from envs.serving.workloads.lengths import LengthSource
from envs.serving.workloads.renewal import Renewal
from envs.serving.workloads.timed import TimedSource

SPLITS = ("train", "val", "test")


@st.composite
def timed_sources(draw):
    """Quantised (slot > 0) or free timestamps, 5-400 requests."""
    n = draw(st.integers(5, 400))
    slot = draw(st.sampled_from([0.0, 3.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    times = np.sort(rng.exponential(2.0, n).cumsum())
    if slot:
        times = np.floor(times / slot) * slot
    rows = Rows("mem", times, rng.integers(1, 5000, n), rng.integers(1, 900, n))
    return TimedSource("mem", "mem", rows, slot)


@settings(max_examples=60, deadline=None)
@given(src=timed_sources(), seed=st.integers(0, 10**6))
def test_timed_splits_partition_rows_and_time(src, seed):
    parts = [src.extract(s, seed, None) for s in SPLITS]
    assert sum(len(p) for p in parts) == len(src.rows)
    assert [p.first_row for p in parts[1:]] == [a.first_row + len(a) for a in parts[:-1]]
    for a, b in zip(parts, parts[1:], strict=False):
        assert a.offset_s + a.span_s == b.offset_s
    absolute = np.concatenate([p.arrival_s + p.offset_s for p in parts])
    assert np.all(np.diff(absolute) >= -1e-9)
    shift = absolute - src.rows.times
    assert np.all(shift >= -1e-9) and np.all(shift < max(src.slot_s, 1e-9))


@settings(max_examples=60, deadline=None)
@given(
    src=timed_sources(),
    seed=st.integers(0, 10**6),
    split=st.sampled_from(SPLITS),
    window_s=st.floats(1.0, 400.0),
)
def test_timed_window_lies_in_its_split(src, seed, split, window_s):
    whole, win = src.extract(split, seed, None), src.extract(split, seed, window_s)
    assert whole.offset_s <= win.offset_s
    assert win.offset_s + win.span_s <= whole.offset_s + whole.span_s + 1e-9
    assert win.span_s == pytest.approx(min(window_s, whole.span_s))
    k = win.first_row - whole.first_row
    assert 0 <= k and k + len(win) <= len(whole)
    assert np.array_equal(win.prompt_len, whole.prompt_len[k : k + len(win)])
    again = src.extract(split, seed, window_s)
    assert np.array_equal(again.arrival_s, win.arrival_s) and again.offset_s == win.offset_s


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(5, 3000),
    cv=st.floats(0.3, 4.0),
    seed=st.integers(0, 10**6),
    split=st.sampled_from(SPLITS),
    window_s=st.floats(1.0, 500.0),
)
def test_length_windows_take_consecutive_rows_of_their_split(n, cv, seed, split, window_s):
    prompt = np.arange(1, n + 1)
    src = LengthSource("mem", "mem", Rows("mem", None, prompt, prompt), Renewal.from_rate(4.0, cv))
    whole, win = src.extract(split, seed, None), src.extract(split, seed, window_s)
    assert len(whole) == len(whole.prompt_len) and whole.arrival_s[-1] <= whole.span_s
    assert win.span_s == window_s and (len(win) == 0 or win.arrival_s[-1] < window_s)
    assert np.array_equal(win.prompt_len, np.arange(win.first_row + 1, win.first_row + len(win) + 1))
    assert whole.first_row <= win.first_row and win.first_row + len(win) <= whole.first_row + len(whole)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    split=st.sampled_from((*SPLITS, "all")),
    load=st.floats(0.05, 20.0),
    window_s=st.floats(1.0, 5000.0),
)
def test_workload_windows_scale_and_repeat(seed, split, load, window_s):
    w = Workload(WorkloadSpec(name="s", format="synthetic", rate_scale=1.5))
    base = w.window(split, seed, 1.0, window_s)
    scaled = w.window(split, seed, load, window_s)
    np.testing.assert_allclose(scaled.arrival_s * load, base.arrival_s, rtol=1e-12)
    assert scaled.span_s == pytest.approx(base.span_s / load)
    assert np.array_equal(w.window(split, seed, load, window_s).arrival_s, scaled.arrival_s)


@pytest.mark.parametrize("name", workload_names())
def test_configs_fit_the_hydra_schema(name):
    data = yaml.safe_load((WORKLOAD_DIR / f"{name}.yaml").read_text())
    merged = OmegaConf.merge(OmegaConf.structured(WorkloadSpec), data)
    spec = OmegaConf.to_object(merged)
    assert isinstance(spec, WorkloadSpec) and spec.name == name
    assert spec == from_mapping(WorkloadSpec, data, name)
