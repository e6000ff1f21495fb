"""The one fitting routine: recovers known curves, stays monotone, is deterministic (no data needed)."""

from __future__ import annotations

import numpy as np
import pytest

from calibration.fit import (
    StepRoofline,
    fit_knee_grid,
    fit_step_roofline,
    holdout_mask,
    mape,
    token_step_candidates,
)

TRUE = StepRoofline(
    fixed=20e-6, per_unit=5e-9, mem=100e-6, slope=1e-6, knee=300.0, steps=((128.0, 30e-6), (512.0, 50e-6))
)
TOKENS = np.array([1, 2, 4, *range(8, 1024, 8), *range(1024, 4097, 32)], dtype=np.float64)


def test_recovers_a_known_step_roofline() -> None:
    y = TRUE.predict(TOKENS)
    fit = fit_step_roofline(TOKENS, y, token_step_candidates(TOKENS.max()))
    assert mape(fit.predict(TOKENS), y) < 0.01  # the knee grid is geometric, so 300 is approximated
    assert fit.slope == pytest.approx(TRUE.slope, rel=0.05)
    assert {t for t, _ in fit.steps} >= {128.0, 512.0}


def test_noisy_fit_predicts_held_out_points_and_is_monotone() -> None:
    rng = np.random.default_rng(1)
    y = TRUE.predict(TOKENS) * rng.normal(1.0, 0.02, TOKENS.size)
    held = holdout_mask(TOKENS.size)
    fit = fit_step_roofline(TOKENS[~held], y[~held], token_step_candidates(TOKENS.max()))
    assert mape(fit.predict(TOKENS[held]), y[held]) < 0.03
    grid = np.arange(1, 40_000, dtype=np.float64)
    assert np.all(np.diff(fit.predict(grid)) >= 0)
    assert len(fit.steps) <= 8 and all(h > 0 for _, h in fit.steps)


def test_fit_is_deterministic() -> None:
    y = TRUE.predict(TOKENS) * (1 + 0.01 * np.sin(TOKENS))
    assert fit_step_roofline(TOKENS, y, token_step_candidates(4096)) == fit_step_roofline(
        TOKENS, y, token_step_candidates(4096)
    )


def test_line_fit_for_collectives() -> None:
    size = np.geomspace(2048, 64 << 20, 50)
    y = 30e-6 + size / 150e9
    line = fit_step_roofline(size, y, per_unit=False, knee=False)
    assert line.knee == 0 and not line.steps
    assert line.fixed == pytest.approx(30e-6, rel=1e-3) and line.slope == pytest.approx(1 / 150e9, rel=1e-3)


def test_scalar_and_vector_evaluation_agree() -> None:
    for x in (1.0, 128.0, 129.0, 300.0, 301.0, 5000.0):
        assert TRUE.at(x) == pytest.approx(float(TRUE.predict([x])[0]), rel=1e-12)


def test_split_and_scale() -> None:
    level = TRUE.fixed + TRUE.mem
    split = TRUE.split(60e-6)
    assert (split.fixed, split.mem) == pytest.approx((level - 60e-6, 60e-6))
    assert TRUE.split(1.0).fixed == 0.0  # never more than the level
    faster_memory = split.scaled(mem=0.5)
    assert faster_memory.mem == pytest.approx(30e-6) and faster_memory.knee == pytest.approx(150.0)
    assert faster_memory.slope == split.slope and faster_memory.steps == split.steps
    slower_compute = split.scaled(slope=2.0)
    assert slower_compute.steps[0][1] == pytest.approx(2 * split.steps[0][1])


def test_holdout_mask() -> None:
    mask = holdout_mask(100)
    assert mask.sum() == 20 and not mask[0] and not mask[-1]
    assert np.array_equal(mask, holdout_mask(100)) and not np.array_equal(mask, holdout_mask(100, seed=1))


@pytest.mark.parametrize(
    ("x", "y", "message"),
    [
        ([1, 2, 3], [1.0, 2.0, 3.0], "at least 4 points"),
        ([1, 2, 3, 4], [1.0, 0.0, 3.0, 4.0], "positive"),
    ],
)
def test_bad_input(x, y, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_step_roofline(np.array(x, float), np.array(y, float))


def test_extra_columns_and_a_fixed_knee_grid_recover_their_coefficients() -> None:
    """The whole-iteration form: extra per-sample columns beside the hinge, knees from a given grid."""
    rng = np.random.default_rng(3)
    x = rng.integers(1, 600, 80).astype(np.float64)
    x[:3] = 1.0  # single-token iterations pin the step apart from the constant
    extra = rng.uniform(0.0, 50.0, (80, 2))
    true = np.array([5e-3, 1e-6, 2e-5, 3e-4, 7e-5, 1e-4])  # const, x, hinge at 64, two extras, step at 1
    y = true[0] + true[1] * x + true[2] * np.maximum(x - 64, 0) + extra @ true[3:5] + true[5] * (x > 1)
    fit = fit_knee_grid(x, y, (0, 32, 64, 128), extra, (1,), max_steps=1)
    assert fit.knee == 64.0 and fit.thresholds.tolist() == [1.0]
    assert fit.coef == pytest.approx(true, rel=1e-6)
    assert fit.heights == pytest.approx([true[5]], rel=1e-6)


def test_a_second_hinge_is_found_among_large_knees_and_absent_without_them() -> None:
    """A steeper per-token regime above a large knee (vLLM's CPU steps past ~5k tokens)."""
    rng = np.random.default_rng(4)
    x = rng.integers(1, 16384, 60).astype(np.float64)
    extra = rng.uniform(0.0, 50.0, (60, 1))
    y = 5e-3 + 1e-4 * x + 3e-4 * extra[:, 0] + 5e-5 * np.maximum(x - 5120, 0)
    fit = fit_knee_grid(x, y, (0, 64), extra, large_knees=(2048, 5120, 8192, 1e9))
    assert (fit.knee, fit.large_knee) == (0.0, 5120.0)
    assert fit.coef[[0, 1, 3, 4]] == pytest.approx([5e-3, 1e-4, 3e-4, 5e-5], rel=1e-6)
    plain = fit_knee_grid(x, y, (0, 64), extra)
    assert plain.large_knee is None and len(plain.coef) == 4
    assert fit_knee_grid(x, y, (0, 64), extra, large_knees=(1e9,)).large_knee is None  # outside the data


def test_steps_outside_the_data_and_beyond_max_steps_are_dropped() -> None:
    y = TRUE.predict(TOKENS)
    fit = fit_knee_grid(TOKENS, y, (300.0,), None, (64.0, 128.0, 512.0, 1e6), max_steps=2)
    assert fit.thresholds.tolist() == [128.0, 512.0]
    assert len(fit.coef) == 3 + 2
