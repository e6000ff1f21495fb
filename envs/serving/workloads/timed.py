"""Splits and windows of a timestamped request table (Azure, Mooncake, the synthetic stand-in).

Splits cut the trace's time span 60/20/20; each cut moves forward to the next arrival (or slot)
so that no request of one split can be jittered into the next. A window is ``window_s`` trace
seconds of a split starting at a seed-chosen offset; its times are rebased to its start.
"""

from __future__ import annotations

import numpy as np

from envs.serving.workloads.files import Rows
from envs.serving.workloads.renewal import rng_for
from envs.serving.workloads.trace import Trace, split_fractions


class TimedSource:
    """Requests with arrival times; ``slot_s`` > 0 spreads quantised timestamps over their slot."""

    def __init__(self, name: str, source: str, rows: Rows, slot_s: float = 0.0, duration_s: float = 0.0):
        if rows.times is None:
            raise ValueError(f"{rows.path}: a timed workload needs timestamps")
        self.name, self.source, self.rows, self.slot_s = name, source, rows, slot_s
        self.times: np.ndarray = rows.times
        self.duration_s = max(float(rows.times[-1]) + slot_s, duration_s)
        if slot_s > 0:
            raw = rows.times
            new_slot = np.concatenate(([True], raw[1:] != raw[:-1]))
            starts = raw[new_slot]
            next_start = np.append(starts[1:], raw[-1] + slot_s)
            self._slot_id = np.cumsum(new_slot) - 1
            self._width: np.ndarray = np.minimum(slot_s, next_start - starts)[self._slot_id]

    def bounds(self, split: str) -> tuple[float, float, int, int]:
        """``(start_s, stop_s, first_row, stop_row)`` of ``split``, cuts moved to the next arrival."""
        times, n = self.times, len(self.rows)
        edges = []
        for frac in split_fractions(split):
            if frac <= 0.0:
                edges.append((0.0, 0))
            elif frac >= 1.0:
                edges.append((self.duration_s, n))
            else:
                i = int(np.searchsorted(times, frac * self.duration_s, side="left"))
                edges.append((float(times[i]) if i < n else self.duration_s, i))
        (t0, i0), (t1, i1) = edges
        return t0, t1, i0, i1

    def arrivals(self, seed: int) -> np.ndarray:
        """Arrival times for ``seed``: raw, or each slot's requests spread uniformly over the slot
        (sorted draws keep the file's order; the spread ends before the next slot begins)."""
        if self.slot_s <= 0:
            return self.times
        u = rng_for(seed, "slot-jitter").random(len(self.rows))
        u = u[np.lexsort((u, self._slot_id))]
        spread: np.ndarray = self.times + u * self._width
        return spread

    def extract(self, split: str, seed: int, window_s: float | None) -> Trace:
        t0, t1, i0, i1 = self.bounds(split)
        times = self.arrivals(seed)
        if window_s is not None and window_s < t1 - t0:
            t0 += float(rng_for(seed, "window", split).random()) * (t1 - t0 - window_s)
            t1 = t0 + window_s
            i0, i1 = (i0 + int(i) for i in np.searchsorted(times[i0:i1], [t0, t1], side="left"))
        rows = self.rows
        return Trace(
            name=self.name,
            source=self.source,
            arrival_s=times[i0:i1] - t0,
            prompt_len=rows.prompt[i0:i1],
            output_len=rows.output[i0:i1],
            hash_ids=None if rows.hash_ids is None else rows.hash_ids[i0:i1],
            hash_block_tokens=rows.hash_block_tokens,
            span_s=t1 - t0,
            offset_s=t0,
            first_row=int(i0),
            tenant=None if rows.tenant is None else rows.tenant[i0:i1],
            slo_class=None if rows.slo_class is None else rows.slo_class[i0:i1],
        )

    def mean_rate(self, split: str) -> float:
        """Requests per trace second over ``split``."""
        t0, t1, i0, i1 = self.bounds(split)
        return (i1 - i0) / (t1 - t0)


def infer_slot_s(times: np.ndarray) -> float:
    """The slot length of timestamps quantised to slots, else 0.

    Quantised means fewer distinct stamps than half the rows (Mooncake conversation: 1180 stamps
    for 12,031 requests); the slot is then the median gap between distinct stamps (3.0 s there).
    """
    stamps = np.unique(times)
    if len(stamps) < 2 or len(stamps) >= len(times) / 2:
        return 0.0
    return float(np.median(np.diff(stamps)))
