"""The one fitting routine of calibration, and the per-layer curve it fits to Vidur tables.

:func:`fit_knee_grid` fits every measured cost in the package: non-negative least squares
on relative residuals (the metric is MAPE), with columns::

    1, x, max(x - knee, 0), <extra columns>, [max(x - large_knee, 0)], [x > threshold_k] ...

for each knee of a grid (and each of an optional second, larger knee); the best wins.  With
the knees fixed the model is linear in its coefficients, so each is one NNLS solve.  Per-layer tables (``x`` = tokens) and
collectives (``x`` = bytes) use it through :func:`fit_step_roofline`; whole-iteration
profiles of a live engine add the attention and per-sequence columns
(:mod:`calibration.iterations`).

The per-layer shape, for ``x`` tokens (or bytes)::

    y(x) = fixed + per_unit * x + mem + slope * max(x - knee, 0) + sum_k height_k * [x > threshold_k]

Below the knee the GEMMs are memory-bound (``mem``: weights read once) and launches cost
``fixed``; above it they are compute-bound at ``slope`` per unit.  ``per_unit`` covers the
ops whose traffic grows with ``x`` (norms, activations), and the steps are where a GEMM
needs one more row tile or wave.  Every coefficient is >= 0, so the curve never falls as
``x`` grows.  The knee is free rather than ``mem / slope``: large GEMMs approach their peak
rate gradually, so the compute line does not pass through the origin.  Beyond the
largest measured ``x`` the curve is a straight line of slope ``per_unit + slope``.

The data fix only ``fixed + mem`` (the level below the knee); :meth:`StepRoofline.split`
divides it using a physical memory time, which matters only when deriving other hardware.
"""

from __future__ import annotations

import bisect
import itertools
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


@dataclass(frozen=True)
class KneeFit:
    """What :func:`fit_knee_grid` found: one coefficient per column, the knee, the step thresholds kept."""

    coef: np.ndarray
    knee: float
    thresholds: np.ndarray
    large_knee: float | None = None
    """Where the optional second hinge starts (its coefficient follows the extra columns); None: no hinge."""

    @property
    def heights(self) -> np.ndarray:
        """The step columns' coefficients, one per threshold."""
        return self.coef[len(self.coef) - len(self.thresholds) :]


def fit_knee_grid(
    x: np.ndarray,
    y: np.ndarray,
    knees: Sequence[float] | np.ndarray | None = None,
    extra: np.ndarray | None = None,
    step_candidates: Sequence[float] | np.ndarray = (),
    max_steps: int = MAX_STEPS,
    per_unit: bool = True,
    large_knees: Sequence[float] = (),
) -> KneeFit:
    """Least relative squared error, non-negative coefficients, the best of ``knees``.

    ``knees=None`` tries 0 and :data:`KNEE_GRID` points spaced geometrically over ``x``.
    Columns (see the module docstring): ones, ``x`` (zeros if not ``per_unit``), the hinge at
    the knee, each column of ``extra`` (``len(x)`` rows), with ``large_knees`` a second hinge
    ``max(x - large_knee, 0)`` (each one inside the data's range is tried with every knee; none
    inside it, no second hinge), and a step ``[x > t]`` per candidate inside the data's range;
    if more than ``max_steps`` candidates, the largest steps of a first solve are kept and
    solved again.  All ``y`` must be > 0.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 4:
        raise ValueError(f"need matching 1-d x and y with at least 4 points, got {x.shape} and {y.shape}")
    if not np.all(y > 0) or not np.all(np.isfinite(x)):
        raise ValueError("times must be positive and sizes finite")
    extra = np.empty((len(x), 0)) if extra is None else np.asarray(extra, dtype=np.float64)
    knees = _knee_grid(x) if knees is None else knees
    candidates = np.asarray(step_candidates, dtype=np.float64)
    candidates = candidates[(candidates >= x.min()) & (candidates < x.max())]
    larges: list[float | None] = [float(k) for k in large_knees if x.min() <= k < x.max()] or [None]
    best: tuple[float, KneeFit] | None = None
    for knee, large in itertools.product(knees, larges):
        cols = extra if large is None else np.column_stack([extra, np.maximum(x - large, 0.0)])
        thresholds = candidates
        a = _design(x, float(knee), cols, thresholds, per_unit) / y[:, None]
        coef = _nnls(a)
        if len(thresholds) > max_steps:
            heights = coef[len(coef) - len(thresholds) :]
            thresholds = thresholds[np.sort(np.argsort(-heights, kind="stable")[:max_steps])]
            a = _design(x, float(knee), cols, thresholds, per_unit) / y[:, None]
            coef = _nnls(a)
        loss = float(np.sum((a @ coef - 1.0) ** 2))
        if best is None or loss < best[0] - 1e-12:
            best = (loss, KneeFit(coef, float(knee), thresholds, large))
    assert best is not None, "need at least one knee"
    return best[1]


def _design(
    x: np.ndarray, knee: float, extra: np.ndarray, thresholds: np.ndarray, per_unit: bool
) -> np.ndarray:
    columns = [np.ones_like(x), x if per_unit else np.zeros_like(x), np.maximum(x - knee, 0.0)]
    columns += list(extra.T)
    columns += [(x > t).astype(np.float64) for t in thresholds]
    return np.stack(columns, axis=1)


def _nnls(a: np.ndarray) -> np.ndarray:
    coef, _ = nnls(a, np.ones(a.shape[0]), maxiter=50 * a.shape[1])
    return coef


def fit_step_roofline(
    x: np.ndarray,
    y: np.ndarray,
    step_candidates: Sequence[float] | np.ndarray = (),
    max_steps: int = MAX_STEPS,
    per_unit: bool = True,
    knee: bool = True,
) -> StepRoofline:
    """:class:`StepRoofline` fitted to ``y(x)`` (all y > 0) by :func:`fit_knee_grid`.

    ``per_unit=False`` drops the linear term below the knee; ``knee=False`` fits a plain
    line ``fixed + slope * x`` (used for collectives, which the cost model keeps linear).
    """
    fit = fit_knee_grid(x, y, None if knee else (0.0,), None, step_candidates, max_steps, per_unit)
    steps = tuple((float(t), float(h)) for t, h in zip(fit.thresholds, fit.heights, strict=True) if h > 0)
    return StepRoofline(float(fit.coef[0]), float(fit.coef[1]), 0.0, float(fit.coef[2]), fit.knee, steps)


def _knee_grid(x: np.ndarray) -> np.ndarray:
    lo, hi = max(float(x.min()), 1.0), float(x.max())
    return np.concatenate(([0.0], np.unique(np.round(np.geomspace(lo, hi / 2, KNEE_GRID)))))


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


def mape(predicted: np.ndarray | Sequence[float], measured: np.ndarray | Sequence[float]) -> float:
    """Mean absolute percentage error as a fraction."""
    predicted, measured = np.asarray(predicted, np.float64), np.asarray(measured, np.float64)
    return float(np.mean(np.abs(predicted / measured - 1.0)))
