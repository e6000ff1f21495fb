"""The sim-to-real comparison against vLLM (pure arithmetic, no vLLM needed): rank agreement with
tied pairs, per-policy errors over windows, plan agreement, the table."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import kendalltau

from engine.vllm_backend.compare import compare, kendall_tau_b, plan_agreement, table
from envs.serving.loop import SimResult


def test_tau_b_matches_scipy_without_ties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.random(7), rng.random(7)
        assert kendall_tau_b(a, b) == pytest.approx(kendalltau(a, b).statistic)


def test_tau_b_counts_close_pairs_as_ties():
    a = [1.0, 1.03, 2.0, 3.0]  # 1.0 and 1.03 are 3% apart: tied at 5%
    b = [1.03, 1.0, 2.0, 3.0]
    assert kendall_tau_b(a, b, tie=0.0) == pytest.approx(kendalltau(a, b).statistic)
    assert kendall_tau_b(a, b, tie=0.0) < 1.0
    assert kendall_tau_b(a, b, tie=0.05) == pytest.approx(1.0)  # the swapped pair is a tie in both
    # scipy's tau-b on the same ranks once the tie is made exact
    assert kendall_tau_b([1.0, 1.03, 2.0, 3.0], [1.0, 1.5, 2.0, 3.0], tie=0.05) == pytest.approx(
        kendalltau([1, 1, 2, 3], [1, 1.5, 2, 3]).statistic
    )
    assert kendall_tau_b([3.0, 2.0, 1.0], [1.0, 2.0, 3.0]) == pytest.approx(-1.0)
    assert math.isnan(kendall_tau_b([1.0, 1.01, 1.02], [1.0, 2.0, 3.0], tie=0.05))


def _run(latency, predicted, agrees, **metrics) -> SimResult:
    its = {"latency": np.array(latency), "predicted": np.array(predicted), "plan_agrees": np.array(agrees)}
    return SimResult(None, its, metrics, {})  # type: ignore[arg-type]


def test_compare_averages_windows_and_pools_steps():
    base = {"ttft_p50_s": 0.1, "ttft_p99_s": 1.0, "tbt_p99_s": 0.05}
    runs = {
        ("a", "vllm", 0): _run([1.0, 1.0], [1.1, 0.9], [True, False], **base, goodput_rps=4.0),
        ("a", "vllm", 1): _run([2.0], [2.0], [True], **{**base, "ttft_p99_s": 3.0}, goodput_rps=6.0),
        ("a", "sim", 0): _run([], [], [], **base, goodput_rps=4.0),
        ("a", "sim", 1): _run([], [], [], **{**base, "ttft_p99_s": 1.0}, goodput_rps=6.0),
        ("b", "vllm", 0): _run([1.0], [1.5], [True], **base, goodput_rps=1.0),
        ("b", "vllm", 1): _run([1.0], [1.5], [True], **base, goodput_rps=1.0),
        ("b", "sim", 0): _run([], [], [], **{**base, "tbt_p99_s": 0.06}, goodput_rps=2.0),
        ("b", "sim", 1): _run([], [], [], **{**base, "tbt_p99_s": 0.06}, goodput_rps=2.0),
    }
    out = compare(runs, ["a", "b"], [0, 1], tie=0.05)
    a, b = out["per_policy"]["a"], out["per_policy"]["b"]
    assert a["iteration_mape"] == pytest.approx(0.2 / 3)  # |1.1-1|, |0.9-1|, 0 over 3 steps
    assert a["plan_agreement"] == pytest.approx(2 / 3)
    assert a["ttft_p99_rel_err"] == pytest.approx(abs(1.0 / 2.0 - 1))  # window means 2.0 vs 1.0
    assert b["tbt_p99_rel_err"] == pytest.approx(0.2)
    assert out["iteration_mape"] == pytest.approx((0.1 + 0.1 + 0 + 0.5 + 0.5) / 5)
    assert out["ttft_p99_rel_err"] == pytest.approx(0.5)  # the worst policy
    assert out["plan_agreement"] == pytest.approx(4 / 5)
    assert out["kendall_tau"] == pytest.approx(1.0)  # a above b on both sides
    assert a["goodput_per_window"] == {"vllm": [4.0, 6.0], "sim": [4.0, 6.0]}
    assert a["step_speed_per_window"] == pytest.approx([1.0, 1.0]) and b["step_speed_per_window"] == [
        1.5,
        1.5,
    ]
    assert out["iteration_mape_profile"] == out["iteration_mape"]  # no time scales: the same steps
    assert a["time_scale_per_window"] == [1.0, 1.0]
    assert out["step_speed_range"] == pytest.approx([1.0, 1.5])  # over every policy's windows
    text = table(out)
    assert "| `a` | 3 |" in text and "Kendall tau-b 1.000" in text
    assert "| 1.000 | 1.50-1.50 |" in text  # b's plan agreement, then its windows' step speeds
    assert "| 1.00-1.50 | Kendall tau-b" in text


def test_compare_scales_each_windows_predictions_by_its_time_scale():
    base = {"ttft_p50_s": 0.1, "ttft_p99_s": 1.0, "tbt_p99_s": 0.05, "goodput_rps": 1.0}
    runs = {
        ("a", "vllm", 0): _run([2.0, 2.0], [1.0, 1.0], [True, True], **base),  # ran 2x the profile
        ("a", "vllm", 1): _run([1.0], [1.25], [True], **base),
        ("a", "sim", 0): _run([], [], [], **base),
        ("a", "sim", 1): _run([], [], [], **base),
    }
    out = compare(runs, ["a"], [0, 1], tie=0.05, time_scales={("a", 0): 2.0, ("a", 1): 0.8})
    a = out["per_policy"]["a"]
    assert a["iteration_mape"] == pytest.approx(0.0)  # 2 x 1.0 vs 2.0, 0.8 x 1.25 vs 1.0
    assert a["iteration_mape_profile"] == pytest.approx((0.5 + 0.5 + 0.25) / 3)
    assert (
        out["iteration_mape"] == pytest.approx(0.0)
        and out["iteration_mape_profile"] == a["iteration_mape_profile"]
    )
    assert a["time_scale_per_window"] == [2.0, 0.8]
    assert a["step_speed_per_window"] == pytest.approx([0.5, 1.25])  # the profile's, unscaled


def test_plan_agreement_without_steps_is_nan():
    assert math.isnan(plan_agreement({"plan_agrees": np.array([], dtype=bool)}))
