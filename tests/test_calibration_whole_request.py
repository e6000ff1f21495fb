"""The whole-request fit optimises exactly what the simulator evaluates (no data needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from calibration import whole_request
from calibration.fit import StepRoofline
from calibration.kernels import Kernels, kernel_params, layer_weight_seconds
from envs.serving.specs import load_hardware, load_model

MODEL = load_model("llama2_70b")
HW = load_hardware("h100_80gb")
ENGINE = whole_request.EngineFit(
    cpu_fixed_s=0.03,
    cpu_prefill_s=0.02,
    cpu_s_per_seq=3e-4,
    iter_fixed_s=0.007,
    prefill_attention_factor=3.0,
    prefill_chunk_s=1e-4,
    decode_attention_factor=3.5,
    decode_seq_s=4e-6,
    s_per_token=2e-5,
    large_allreduce_s_per_byte=1e-11,
)


def _kernels(tp: int):
    layer = StepRoofline(60e-6, 2e-8, 0.0, 1e-6 / tp, 200.0, ((128.0, 2e-5), (256.0, 3e-5))).split(
        layer_weight_seconds(MODEL, HW, tp)
    )
    ar = StepRoofline(3e-5, 0.0, 0.0, 5e-12, 0.0) if tp > 1 else None
    return kernel_params(MODEL, HW, tp, Kernels(layer, ar, "", ""))


def _rows() -> pd.DataFrame:
    prompt = pd.DataFrame(
        [(tp, p, b, 1.0) for tp in (2, 8) for p, b in ((128, 1), (512, 8), (8192, 1), (512, 64))],
        columns=["tp", "prompt", "batch", "seconds"],
    )
    token = pd.DataFrame(
        [(tp, p, b, 128, 1.0) for tp in (2, 8) for p, b in ((128, 1), (512, 32), (4096, 1))],
        columns=["tp", "prompt", "batch", "tokens", "seconds"],
    )
    return whole_request.measurement_rows(prompt, token)


def test_vectorised_fit_form_equals_the_cost_model() -> None:
    rows = _rows()
    kernels = {tp: _kernels(tp) for tp in (2, 8)}
    comps = whole_request.components(rows, MODEL, HW, kernels)
    vectorised = whole_request.predict(whole_request.engine_vector(ENGINE), comps)
    params = {
        tp: whole_request.apply_engine(k, ENGINE, MODEL, HW, tp, MODEL, HW) for tp, k in kernels.items()
    }
    direct = whole_request.cost_model_predictions(rows, params)
    np.testing.assert_allclose(vectorised, direct, rtol=1e-6)


def test_fit_recovers_its_own_predictions() -> None:
    rows = _rows()
    kernels = {tp: _kernels(tp) for tp in (2, 8)}
    comps = whole_request.components(rows, MODEL, HW, kernels)
    seconds = whole_request.predict(whole_request.engine_vector(ENGINE), comps)
    fit = whole_request.fit_engine(comps, seconds)
    refit = whole_request.predict(whole_request.engine_vector(fit), comps)
    assert np.max(np.abs(refit / seconds - 1)) < 0.02
    assert fit.prefill_attention_factor >= 1.0 and fit.decode_attention_factor >= 1.0


def test_transfer_rules() -> None:
    small = load_model("llama2_7b")
    a40 = load_hardware("a40")
    base = dataclasses.replace(_kernels(2), num_layers=small.num_layers)
    moved = whole_request.apply_engine(base, ENGINE, small, a40, 2, MODEL, HW, link_ratio=10.0)
    assert moved.cpu_fixed_s == pytest.approx(ENGINE.cpu_fixed_s * small.num_layers / MODEL.num_layers)
    traffic = small.hidden_size * small.num_layers / (MODEL.hidden_size * MODEL.num_layers)
    assert moved.iter_s_per_token == pytest.approx(
        ENGINE.s_per_token * traffic * HW.hbm_bandwidth / a40.hbm_bandwidth
    )
    assert moved.allreduce_knee_tokens == whole_request.LARGE_MESSAGE_BYTES // (small.hidden_size * 2)
    assert moved.allreduce_s_per_token_above == pytest.approx(1e-11 * 1.0 * small.hidden_size * 2 * 10.0)
    single = whole_request.apply_engine(dataclasses.replace(_kernels(1)), ENGINE, MODEL, HW, 1, MODEL, HW)
    assert single.allreduce_s_per_token_above == 0.0 and single.allreduce_count == 0
