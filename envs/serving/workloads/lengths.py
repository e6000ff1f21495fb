"""Splits and windows of a length-only file (ShareGPT, arXiv) paired with generated arrivals.

Splits take rows 60/20/20 in file order. A split's arrivals are the first ``n`` of a seeded renewal
stream (``n`` = its rows; its span runs to the next arrival). A window draws the stream over
``window_s`` seconds, then takes that many consecutive rows from a seed-chosen offset.
"""

from __future__ import annotations

from envs.serving.workloads.files import Rows
from envs.serving.workloads.renewal import Renewal, check_count, rng_for
from envs.serving.workloads.trace import Trace, split_fractions


class LengthSource:
    """Rows of (prompt, output) lengths with arrivals from ``process``."""

    def __init__(self, name: str, source: str, rows: Rows, process: Renewal):
        check_count(len(rows), f"{rows.path}: arrivals for its {len(rows)} rows")
        self.name, self.source, self.rows, self.process = name, source, rows, process

    def bounds(self, split: str) -> tuple[int, int]:
        """Row range ``[first, stop)`` of ``split``."""
        n = len(self.rows)
        lo, hi = split_fractions(split)
        return int(lo * n), int(hi * n)

    def extract(self, split: str, seed: int, window_s: float | None) -> Trace:
        i0, i1 = self.bounds(split)
        if window_s is None:
            times, span = self.process.first_n(rng_for(seed, "arrivals", split), i1 - i0)
        else:
            rng = rng_for(seed, "window", split)
            times, span = self.process.arrivals(rng, 0.0, window_s), window_s
            times = times[: i1 - i0]
            i0 += int(rng.integers(0, i1 - i0 - len(times) + 1))
            i1 = i0 + len(times)
        return Trace(
            name=self.name,
            source=self.source,
            arrival_s=times,
            prompt_len=self.rows.prompt[i0:i1],
            output_len=self.rows.output[i0:i1],
            hash_ids=None,
            hash_block_tokens=0,
            span_s=span,
            offset_s=0.0,
            first_row=i0,
            tenant=None if self.rows.tenant is None else self.rows.tenant[i0:i1],
            slo_class=None if self.rows.slo_class is None else self.rows.slo_class[i0:i1],
        )

    def mean_rate(self, split: str) -> float:
        """Requests per second of the arrival process (the same for every split)."""
        return 1.0 / self.process.mean_iat
