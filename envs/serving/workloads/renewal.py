"""Seeded random streams and the renewal arrival processes the generated workloads use.

A renewal process has i.i.d. inter-arrival times (IATs). Poisson is the Gamma case with shape 1;
burstier streams have a smaller Gamma shape (coefficient of variation ``cv = 1/sqrt(shape)``).
Streams start in equilibrium: the first arrival is the forward-recurrence time of a stationary
process (a uniform fraction of a length-biased IAT), so a window cut out of a longer stream and a
stream generated for that window alone look alike.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

MAX_GENERATED_REQUESTS = 5_000_000
"""Requests one generated stream may hold (expected count, checked before drawing): 250 times an
hour of the Azure conversation trace, about 120 MB of arrays; more is a mistyped rate or window."""


def check_count(expected: float, what: str) -> None:
    """Refuse a stream expected to hold more than :data:`MAX_GENERATED_REQUESTS` requests."""
    if not expected <= MAX_GENERATED_REQUESTS:
        raise ValueError(
            f"{what} would generate {expected:.6g} requests, over the limit of {MAX_GENERATED_REQUESTS}"
        )


def check_seed(seed: int) -> int:
    """``seed`` as an int; seeds are non-negative integers (numpy's seeding takes no others)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def rng_for(seed: int, *keys: int | str) -> np.random.Generator:
    """An independent generator for ``(seed, *keys)``: one stream per purpose, stable across runs."""
    words = [check_seed(seed)] + [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in keys]
    return np.random.default_rng(np.random.SeedSequence(words))


@dataclass(frozen=True)
class Renewal:
    """IATs from ``dist`` ("gamma" or "weibull") with the given shape, rescaled to mean ``mean_iat``."""

    dist: str
    shape: float
    mean_iat: float

    def __post_init__(self) -> None:
        if self.dist not in ("gamma", "weibull"):
            raise ValueError(f"unknown IAT distribution {self.dist!r}; valid: gamma, weibull")
        if not (self.shape > 0 and math.isfinite(self.shape)):
            raise ValueError(f"IAT shape must be a positive number, got {self.shape!r}")
        if not (self.mean_iat > 0 and math.isfinite(self.mean_iat)):
            raise ValueError(f"mean IAT must be a positive number, got {self.mean_iat!r}")

    @classmethod
    def from_rate(cls, rate: float, cv: float = 1.0) -> Renewal:
        """Gamma IATs with ``rate`` arrivals/s and coefficient of variation ``cv`` (1.0 is Poisson)."""
        if not (rate > 0 and cv > 0):
            raise ValueError(f"rate and cv must be positive, got rate={rate!r}, cv={cv!r}")
        return cls("gamma", 1.0 / cv**2, 1.0 / rate)

    @property
    def _scale(self) -> float:
        if self.dist == "gamma":
            return self.mean_iat / self.shape
        return self.mean_iat / math.gamma(1.0 + 1.0 / self.shape)

    def iats(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "gamma":
            return rng.gamma(self.shape, self._scale, n)
        return self._scale * rng.weibull(self.shape, n)

    def residual(self, rng: np.random.Generator) -> float:
        """Time from a random instant to the next arrival: ``U`` times a length-biased IAT.

        Length-biasing Gamma(k, s) gives Gamma(k + 1, s); for Weibull(k, s), ``(X/s)**k`` is
        Exp(1) and its length-biased law is Gamma(1 + 1/k, 1).
        """
        u = rng.random()
        if self.dist == "gamma":
            return float(u * rng.gamma(self.shape + 1.0, self._scale))
        return float(u * self._scale * rng.gamma(1.0 + 1.0 / self.shape) ** (1.0 / self.shape))

    def arrivals(self, rng: np.random.Generator, start: float, end: float) -> np.ndarray:
        """The stationary stream's arrival times in ``[start, end)``."""
        check_count((end - start) / self.mean_iat, f"{1 / self.mean_iat:g} arrivals/s over {end - start:g} s")
        chunks = []
        nxt = start + self.residual(rng)
        while nxt < end:
            n = math.ceil(1.2 * (end - nxt) / self.mean_iat) + 16
            gaps = self.iats(rng, n)
            times = nxt + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
            chunks.append(times[: np.searchsorted(times, end)])
            nxt = times[-1] + gaps[-1]
        return np.concatenate(chunks) if chunks else np.empty(0)

    def first_n(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, float]:
        """The first ``n`` arrivals from time 0, and the time of the next one (the stream's span)."""
        check_count(n, "a stream of the first n arrivals")
        gaps = self.iats(rng, n)
        times = self.residual(rng) + np.concatenate(([0.0], np.cumsum(gaps)))
        return times[:n], float(times[n])

    def circular(self, rng: np.random.Generator, n: int, start: float, length: float) -> np.ndarray:
        """Exactly ``n`` arrivals in ``[start, start + length)``, gaps shaped like this process.

        ``n`` IATs are scaled to sum to ``length``, laid around a circle of that circumference and
        the circle is cut at a uniform random phase: counts match the source exactly and the gap
        straddling the cut is length-biased, as in a stationary stream.
        """
        if n == 0:
            return np.empty(0)
        gaps = self.iats(rng, n)
        total = gaps.sum()
        gaps = gaps / total if total > 0 else np.full(n, 1.0 / n)
        positions = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
        times = start + length * np.sort((positions + rng.random()) % 1.0)
        return np.minimum(times, np.nextafter(start + length, -np.inf))
