"""The Trace container and the renewal arrival processes."""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import pytest

from envs.serving.workloads.renewal import Renewal, rng_for
from envs.serving.workloads.trace import Trace


def make(arrival, prompt=None, output=None, span=10.0, hashes=None, block=0):
    n = len(arrival)
    prompt = [5] * n if prompt is None else prompt
    output = [3] * n if output is None else output
    return Trace("t", "mem", np.asarray(arrival), np.asarray(prompt), np.asarray(output), hashes, block, span)


def test_slice_keeps_time_base_and_hashes():
    hashes = tuple(np.array([i]) for i in range(4))
    tr = make([0.0, 1.0, 2.0, 3.0], prompt=[1, 2, 3, 4], hashes=hashes, block=512)
    part = tr.slice(1, 3)
    assert part.arrival_s.tolist() == [1.0, 2.0] and part.prompt_len.tolist() == [2, 3]
    assert [h.tolist() for h in part.hash_ids] == [[1], [2]]
    assert part.span_s == tr.span_s and part.first_row == 1 and len(part) == 2
    assert len(tr.slice(3, 1)) == 0


@pytest.mark.parametrize("hashed", [True, False])
@pytest.mark.parametrize("n", [0, 1, 4])
def test_a_pickled_trace_comes_back_whole(hashed, n):
    """As a capacity probe's trace travels to a pool worker: hash ids packed in one array."""
    hashes = tuple(np.arange(i, 2 * i + 1) for i in range(n)) if hashed else None
    tr = make(
        [0.5 * i for i in range(n)], prompt=list(range(1, n + 1)), hashes=hashes, block=512 if hashed else 0
    )
    back = pickle.loads(pickle.dumps(tr))
    for f in dataclasses.fields(Trace):
        got, want = getattr(back, f.name), getattr(tr, f.name)
        if isinstance(want, np.ndarray):
            assert got.tolist() == want.tolist() and got.dtype == want.dtype
        elif f.name == "hash_ids" and want is not None:
            assert [h.tolist() for h in got] == [h.tolist() for h in want]
            assert not any(h.flags.writeable for h in got)
        else:
            assert got == want


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"arrival": [1.0, 0.5]}, "non-decreasing"),
        ({"arrival": [-1.0]}, "non-negative"),
        ({"arrival": [11.0]}, "span"),
        ({"arrival": [1.0], "prompt": [0]}, ">= 1"),
        ({"arrival": [1.0], "output": [0]}, ">= 1"),
        ({"arrival": [1.0, 2.0], "prompt": [1]}, "lengths differ"),
        ({"arrival": [1.0], "hashes": (np.array([1]),)}, "hash_block_tokens"),
        ({"arrival": [1.0], "hashes": (), "block": 512}, "hash-id lists"),
    ],
)
def test_trace_rejects_inconsistent_streams(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        make(**kwargs)


def test_streams_differ_by_seed_and_key_and_repeat():
    draw = [rng_for(s, k).random() for s, k in ((0, "a"), (0, "a"), (1, "a"), (0, "b"))]
    assert draw[0] == draw[1] and len(set(draw)) == 3


@pytest.mark.parametrize(
    "process", [Renewal.from_rate(2.0, 1.0), Renewal.from_rate(2.0, 3.0), Renewal("weibull", 0.5, 0.5)]
)
def test_stationary_arrivals_have_the_rate(process):
    counts = [len(process.arrivals(rng_for(s, "t"), 0.0, 50.0)) for s in range(400)]
    assert np.mean(counts) == pytest.approx(100, rel=0.05)
    gaps = process.iats(rng_for(0), 200_000)
    assert gaps.mean() == pytest.approx(0.5, rel=0.03)
    if process.dist == "gamma":
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(process.shape), rel=0.05)


def test_first_n_and_circular_counts_are_exact():
    p = Renewal.from_rate(4.0, 2.0)
    times, span = p.first_n(rng_for(3), 250)
    assert len(times) == 250 and np.all(np.diff(times) >= 0) and times[-1] <= span
    t = Renewal("weibull", 0.7, 1.0).circular(rng_for(4), 37, 600.0, 600.0)
    assert len(t) == 37 and np.all(np.diff(t) >= 0) and t[0] >= 600.0 and t[-1] < 1200.0
    assert len(p.circular(rng_for(5), 0, 0.0, 600.0)) == 0
