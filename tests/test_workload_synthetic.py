"""The synthetic stand-in: its fit matches the Azure conv trace, and it behaves like that trace."""

from __future__ import annotations

import numpy as np
import pytest

import chunkgym
from envs.serving.workload import Workload, WorkloadSpec, load_workload
from envs.serving.workloads import synthetic

AZURE_CONV = chunkgym.data_file(synthetic.AZURE_CONV_PATH)


@pytest.mark.needs_data("azure_llm_2023")
def test_stored_fit_is_what_refitting_gives():
    assert synthetic.fit(AZURE_CONV) == synthetic.AZURE_CONV_FIT


def test_generated_stream_matches_the_fit(tmp_path):
    fit = synthetic.AZURE_CONV_FIT
    w = Workload(WorkloadSpec(name="s", format="synthetic"), data_root=tmp_path)
    whole = w.split("all")
    assert w.source == whole.source == "synthetic:azure_conv_fit"
    assert whole.span_s == fit.span_s
    assert len(whole) / whole.span_s == pytest.approx(fit.rate, rel=0.05)
    gaps = np.diff(whole.arrival_s)
    assert gaps.std() / gaps.mean() == pytest.approx(fit.iat_cv, rel=0.05)
    for lengths, knots in ((whole.prompt_len, fit.prompt_q), (whole.output_len, fit.output_q)):
        for q in (0.1, 0.5, 0.9):
            expected = np.interp(q, synthetic.QUANTILES, knots)
            assert np.quantile(lengths, q) == pytest.approx(expected, rel=0.06)


def test_base_rate_overrides_the_fitted_rate(tmp_path):
    w = Workload(WorkloadSpec(name="s", format="synthetic", base_rate=2.0), data_root=tmp_path)
    whole = w.split("all")
    assert len(whole) / whole.span_s == pytest.approx(2.0, rel=0.06)


def test_synthetic_config_needs_no_data(tmp_path):
    w = load_workload("synthetic_azure_conv", data_root=tmp_path)
    tr = w.window("val", seed=3)
    assert 800 < len(tr) < 1300 and tr.span_s == pytest.approx(w.spec.window_s / w.spec.rate_scale)
