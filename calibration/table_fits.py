"""Per-layer and per-op fits of one Vidur-format table, with held-out errors.

For each tensor-parallel degree of a table the per-layer time (sum of
:data:`calibration.sources.vidur.LAYER_OPS`) is fitted with :func:`calibration.fit.fit_step_roofline`
on 80% of the token points; the other 20% measure the error.  Each op is fitted the same
way, for the per-op error report only (single ops are noisier than their sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calibration.fit import StepRoofline, fit_step_roofline, holdout_mask, mape, token_step_candidates
from calibration.sources.vidur import ALL_OPS, CollectiveTimes, OpTimes

HOLDOUT_FRACTION = 0.2


@dataclass(frozen=True)
class LayerFit:
    """The fitted per-layer time of one (table, tp) and how well it predicts held-out points."""

    source: str
    tp: int
    layer: StepRoofline
    heldout_mape: float
    op_heldout_mape: dict[str, float]
    points: int
    heldout_points: int
    max_tokens: float
    heldout_tokens: np.ndarray
    heldout_measured: np.ndarray
    heldout_predicted: np.ndarray


def fit_layer(times: OpTimes, with_ops: bool = True) -> LayerFit:
    """Fit the per-layer sum (and, if ``with_ops``, each op) on the kept 80% of token points."""
    held = holdout_mask(len(times.tokens), HOLDOUT_FRACTION)
    keep = ~held
    tokens = times.tokens
    candidates = token_step_candidates(tokens.max())
    layer = fit_step_roofline(tokens[keep], times.layer[keep], candidates)
    op_errors = {}
    if with_ops:
        for op in ALL_OPS:
            if op in times.ops:
                y = times.ops[op]
                model = fit_step_roofline(tokens[keep], y[keep], candidates)
                op_errors[op] = mape(model.predict(tokens[held]), y[held])
    return LayerFit(
        source=times.source,
        tp=times.tp,
        layer=layer,
        heldout_mape=mape(layer.predict(tokens[held]), times.layer[held]),
        op_heldout_mape=op_errors,
        points=len(tokens),
        heldout_points=int(held.sum()),
        max_tokens=float(tokens.max()),
        heldout_tokens=tokens[held],
        heldout_measured=times.layer[held],
        heldout_predicted=layer.predict(tokens[held]),
    )


def extrapolation_mape(times: OpTimes, fit_up_to: float) -> tuple[float, float]:
    """Fit on token points <= ``fit_up_to``, return (MAPE above it, largest token count tested).

    Tests the claim that beyond the profiled range the per-layer time is the fitted line.
    """
    below = times.tokens <= fit_up_to
    if below.sum() < 4 or below.all():
        raise ValueError(f"{times.source}: need points both below and above {fit_up_to} tokens")
    model = fit_step_roofline(times.tokens[below], times.layer[below], token_step_candidates(fit_up_to))
    above = ~below
    return mape(model.predict(times.tokens[above]), times.layer[above]), float(times.tokens.max())


@dataclass(frozen=True)
class CollectiveFit:
    """``seconds = fixed + slope * bytes`` for one collective and group size, with its error."""

    source: str
    workers: int
    line: StepRoofline
    heldout_mape: float


def fit_collective(times: CollectiveTimes) -> CollectiveFit:
    held = holdout_mask(len(times.size_bytes), HOLDOUT_FRACTION)
    keep = ~held
    line = fit_step_roofline(times.size_bytes[keep], times.seconds[keep], per_unit=False, knee=False)
    error = mape(line.predict(times.size_bytes[held]), times.seconds[held])
    return CollectiveFit(times.source, times.workers, line, error)
