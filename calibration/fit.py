"""A roofline with tile steps, fitted to any (size, time) series by non-negative least squares.

The shape, for ``x`` tokens (or bytes)::

    y(x) = fixed + per_unit * x + mem + slope * max(x - knee, 0) + sum_k height_k * [x > threshold_k]

Below the knee the GEMMs are memory-bound (``mem``: weights read once) and launches cost
``fixed``; above it they are compute-bound at ``slope`` per unit.  ``per_unit`` covers the
ops whose traffic grows with ``x`` (norms, activations), and the steps are where a GEMM
needs one more row tile or wave.  Every coefficient is >= 0, so the curve never falls as
``x`` grows.  With the knee fixed the model is linear in its coefficients, so each
candidate knee is one NNLS solve on relative residuals (the metric is MAPE), and the best
knee wins.  The knee is free rather than ``mem / slope``: large GEMMs approach their peak
rate gradually, so the compute line does not pass through the origin.  Beyond the
largest measured ``x`` the curve is a straight line of slope ``per_unit + slope``.

The data fix only ``fixed + mem`` (the level below the knee); :meth:`StepRoofline.split`
divides it using a physical memory time, which matters only when deriving other hardware.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import nnls

TOKEN_STEP = 64
"""GEMM row tiles on Ampere and Hopper are multiples of 64, so steps sit at multiples of 64 tokens."""
TOKEN_STEP_LIMIT = 2048
"""No step candidates above this: there steps are a few percent of the time and the line suffices."""
MAX_STEPS = 8
"""Steps kept per fit: enough for held-out MAPE near the noise floor, few enough to stay compact."""
KNEE_GRID = 40


@dataclass(frozen=True)
class StepRoofline:
    """Fitted coefficients of the shape in the module docstring; units follow the data."""

    fixed: float
    per_unit: float
    mem: float
    slope: float
    knee: float
    steps: tuple[tuple[float, float], ...] = ()

    def predict(self, x: np.ndarray | Sequence[float]) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        y = self.fixed + self.mem + self.per_unit * x + self.slope * np.maximum(x - self.knee, 0.0)
        for threshold, height in self.steps:
            y = y + height * (x > threshold)
        return y

    def at(self, x: float) -> float:
        """Scalar evaluation, the same arithmetic the cost model does per iteration."""
        y = self.fixed + self.mem + self.per_unit * x + self.slope * max(x - self.knee, 0.0)
        i = bisect.bisect_left([t for t, _ in self.steps], x)
        return y + sum(h for _, h in self.steps[:i])

    def split(self, mem: float) -> StepRoofline:
        """Move up to ``mem`` of the level below the knee from ``fixed`` into ``mem``."""
        level = self.fixed + self.mem
        mem = min(max(mem, 0.0), level)
        return replace(self, fixed=level - mem, mem=mem)

    def scaled(
        self, fixed: float = 1.0, per_unit: float = 1.0, mem: float = 1.0, slope: float = 1.0
    ) -> StepRoofline:
        """Each term times its own factor.  Steps are compute, so they follow ``slope``; the
        knee, where compute overtakes memory, moves by ``mem / slope``."""
        return StepRoofline(
            self.fixed * fixed,
            self.per_unit * per_unit,
            self.mem * mem,
            self.slope * slope,
            self.knee * mem / slope,
            tuple((t, h * slope) for t, h in self.steps),
        )


def token_step_candidates(max_tokens: float) -> np.ndarray:
    """Multiples of :data:`TOKEN_STEP` below the table's end and :data:`TOKEN_STEP_LIMIT`."""
    top = min(TOKEN_STEP_LIMIT, max_tokens - 1)
    return np.arange(TOKEN_STEP, top + 1, TOKEN_STEP, dtype=np.float64)


def fit_step_roofline(
    x: np.ndarray,
    y: np.ndarray,
    step_candidates: Sequence[float] = (),
    max_steps: int = MAX_STEPS,
    per_unit: bool = True,
    knee: bool = True,
) -> StepRoofline:
    """Least relative squared error fit of :class:`StepRoofline` to ``y(x)`` (all y > 0).

    ``per_unit=False`` drops the linear term below the knee; ``knee=False`` fits a plain
    line ``fixed + slope * x`` (used for collectives, which the cost model keeps linear).
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 4:
        raise ValueError(f"need matching 1-d x and y with at least 4 points, got {x.shape} and {y.shape}")
    if not np.all(y > 0) or not np.all(np.isfinite(x)):
        raise ValueError("times must be positive and sizes finite")
    candidates = np.asarray(step_candidates, dtype=np.float64)
    knees = _knee_grid(x) if knee else np.zeros(1)
    best: tuple[float, StepRoofline] | None = None
    for x0 in knees:
        model = _fit_at_knee(x, y, float(x0), candidates, max_steps, per_unit)
        loss = float(np.sum((model.predict(x) / y - 1.0) ** 2))
        if best is None or loss < best[0] - 1e-12:
            best = (loss, model)
    assert best is not None
    return best[1]


def _knee_grid(x: np.ndarray) -> np.ndarray:
    lo, hi = max(float(x.min()), 1.0), float(x.max())
    return np.concatenate(([0.0], np.unique(np.round(np.geomspace(lo, hi / 2, KNEE_GRID)))))


def _fit_at_knee(
    x: np.ndarray, y: np.ndarray, x0: float, candidates: np.ndarray, max_steps: int, per_unit: bool
) -> StepRoofline:
    thresholds = candidates[(candidates >= x.min()) & (candidates < x.max())]
    coef = _nnls(x, y, x0, thresholds, per_unit)
    heights = coef[3:]
    if len(heights) > max_steps:
        keep = np.sort(np.argsort(-heights, kind="stable")[:max_steps])
        thresholds = thresholds[keep]
        coef = _nnls(x, y, x0, thresholds, per_unit)
        heights = coef[3:]
    steps = tuple((float(t), float(h)) for t, h in zip(thresholds, heights, strict=True) if h > 0)
    return StepRoofline(float(coef[0]), float(coef[1]), 0.0, float(coef[2]), x0, steps)


def _nnls(x: np.ndarray, y: np.ndarray, x0: float, thresholds: np.ndarray, per_unit: bool) -> np.ndarray:
    columns = [np.ones_like(x), x if per_unit else np.zeros_like(x), np.maximum(x - x0, 0.0)]
    columns += [(x > t).astype(np.float64) for t in thresholds]
    a = np.stack(columns, axis=1) / y[:, None]
    coef, _ = nnls(a, np.ones_like(y), maxiter=50 * a.shape[1])
    return coef


def holdout_mask(n: int, fraction: float = 0.2, seed: int = 0) -> np.ndarray:
    """A seeded random ``fraction`` of the points, never the first or last: deterministic.

    Random rather than every k-th point, so the held-out set does not alias with the
    64-token period of the tile steps.  The end points stay in the fit, so the held-out
    error measures interpolation; extrapolation is tested separately.
    """
    if n < 3:
        raise ValueError(f"need at least 3 points to hold some out, got {n}")
    inner = np.random.default_rng(seed).permutation(np.arange(1, n - 1))
    mask = np.zeros(n, dtype=bool)
    mask[inner[: round(fraction * n)]] = True
    return mask


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error as a fraction."""
    predicted, measured = np.asarray(predicted, np.float64), np.asarray(measured, np.float64)
    return float(np.mean(np.abs(predicted / measured - 1.0)))
