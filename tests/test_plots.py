"""The goodput plot a person reads: which policies stand out, bands that stay above zero, titled setup."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from leaderboard import plots

POLICIES = ("fcfs", "adaptive_srpf", "learned", "learned_cpu", "sarathi_512", "sarathi_2048", "sglang_8192")


def ranked() -> pd.DataFrame:
    rows = []
    for wl, best in (("azure_conv", "sarathi_2048"), ("azure_code", "sarathi_512")):
        for load in (1.0, 2.0, 4.0):
            for i, policy in enumerate(POLICIES):
                mean = (3.0 if policy == best else 1.0 + 0.1 * i) / load
                rows.append(
                    {
                        "workload": wl,
                        "load_scale": load,
                        "policy": policy,
                        "goodput_mean": mean,
                        "goodput_ci95": 2.0,  # wider than the mean: the band must stop at 0
                        "slo_attainment_mean": 1.0 / load,
                    }
                )
    return pd.DataFrame(rows)


def test_goodput_plot_emphasises_the_compared_policies_and_clips_bands_at_zero() -> None:
    fig = plots.goodput_figure(ranked(), "llama3_8b on 1 x a100_80gb, SLO strict")
    try:
        bests = ("sarathi_2048", "sarathi_512")
        for ax, best in zip(fig.axes[:2], bests, strict=True):  # goodput row: one axis per workload
            strong = {line.get_label() for line in ax.get_lines() if line.get_linewidth() > 2}
            assert strong == {"fcfs", "adaptive_srpf", "learned", f"{best} (best other heuristic)"}
            faint = [line for line in ax.get_lines() if line.get_linewidth() < 1]
            assert len(faint) == len(POLICIES) - 4  # learned_cpu and the other sarathi/sglang
            for band in ax.collections:
                assert np.min(band.get_paths()[0].vertices[:, 1]) >= 0.0
            assert len(ax.collections) == 4 and ax.get_ylim()[0] == 0.0
        for ax, best in zip(fig.axes[2:], bests, strict=True):  # the legend, below each column
            texts = [t.get_text() for t in ax.get_legend().get_texts()]
            assert texts == [
                "fcfs",
                "adaptive_srpf",
                "learned",
                f"{best} (best other heuristic)",
                "other policies",
            ]
        assert "llama3_8b on 1 x a100_80gb, SLO strict" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_setup_label_names_model_hardware_slo_and_seeds() -> None:
    rows = pd.DataFrame(
        {
            "model": ["llama3_8b"] * 2,
            "tp": [1, 1],
            "hardware": ["a100_80gb"] * 2,
            "slo": ["strict"] * 2,
            "slo_tpot_s": [0.18, 0.18],
            "slo_stall_s": [0.9, 0.9],
            "cost_model": ["calibrated"] * 2,
            "seed": [1, 0],
        }
    )
    label = plots.setup_label(rows)
    assert label == (
        "llama3_8b on 1 x a100_80gb, SLO strict (TPOT <= 180 ms, stall <= 0.90 s), calibrated cost model, seeds 0, 1"
    )
    assert plots.setup_label(rows, with_seeds=False) == label.rsplit(", seeds", 1)[0]


def test_tbt_cdfs_draw_the_four_compared_policies_strong_and_name_the_rest_once(
    tmp_path, monkeypatch
) -> None:
    setup = {
        "model": "llama3_8b",
        "tp": 1,
        "hardware": "a100_80gb",
        "slo": "strict",
        "cost_model": "calibrated",
    }
    rows = pd.DataFrame(
        [
            {
                **setup,
                "workload": "azure_conv",
                "load_scale": 1.0,
                "seed": 0,
                "policy": p,
                "slo_tpot_s": 0.11,
                "slo_stall_s": 0.55,
            }
            for p in POLICIES
        ]
    )
    probs = np.linspace(0.0, 1.0, 11)
    quantiles = [np.linspace(0.01, 0.1 * (i + 1), 11) for i in range(len(POLICIES))]
    figures: list[plt.Figure] = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    plots.tbt_cdfs(rows, quantiles, probs, tmp_path / "tbt.png")
    (ax,) = [a for a in figures[0].axes if a.get_lines()]
    try:
        strong = {line.get_label() for line in ax.get_lines() if line.get_linewidth() >= 2}
        assert strong == {"fcfs", "sarathi_512", "adaptive_srpf", "learned"}
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [
            "fcfs", "sarathi_512", "adaptive_srpf", "learned", "other policies",
        ]  # fmt: skip
    finally:
        plt.close(figures[0])
