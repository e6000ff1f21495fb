"""The cost model's form and its coefficient files: monotone, non-negative, loadable, strict.

Runs on the committed ``conf/cost`` files (no data needed).
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration.cost_files import CostFile, cost_file_mapping, write_cost_files
from envs.serving.cost_model import (
    COST_DIR,
    OPTIONAL_FIELDS,
    CostParams,
    RooflineCostModel,
    cost_file_name,
    load_cost_model,
    read_cost_file,
    roofline_params,
)
from envs.serving.specs import load_hardware, load_model

FILES = sorted(COST_DIR.glob("*.yaml"))
EXAMPLE = COST_DIR / cost_file_name("a100_80gb", "llama2_70b", 4)


def _model(path: Path) -> RooflineCostModel:
    return RooflineCostModel(read_cost_file(path)["params"])


def test_every_hardware_model_tp_that_fits_has_a_file() -> None:
    assert len(FILES) >= 56
    for path in FILES:
        data = read_cost_file(path)
        assert path.name == cost_file_name(data["hardware"], data["model"], data["tp"])
        assert data["source"]
        if data["hardware"] == "h200" or data["model"] == "mistral_7b":
            assert data["derived"], f"{path.name}: no table measures it, so it must be marked derived"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_monotone_in_tokens_and_context_and_never_negative(path: Path) -> None:
    cost = _model(path)
    tokens = [1, 2, 7, 63, 64, 65, 128, 129, 500, 1024, 2047, 2048, 2049, 4096, 4097, 8192, 16384, 32768]
    prefill = [cost.iteration_time(0, 0, (t,), (0,)) for t in tokens]
    decode = [cost.iteration_time(t, 100 * t, (), ()) for t in tokens]
    for series in (prefill, decode):
        assert min(series) > 0
        assert all(b >= a for a, b in zip(series, series[1:], strict=False))
    contexts = [0, 1, 100, 10_000, 1_000_000]
    with_context = [cost.iteration_time(0, 0, (256,), (c,)) for c in contexts]
    decode_context = [cost.iteration_time(8, c, (), ()) for c in contexts]
    for series in (with_context, decode_context):
        assert all(b >= a for a, b in zip(series, series[1:], strict=False))
    assert cost.iteration_time(0, 0, (), ()) == 0.0


@settings(max_examples=200, deadline=None)
@given(
    base=st.lists(st.integers(1, 4096), min_size=0, max_size=4),
    extra=st.integers(1, 2048),
    decodes=st.integers(0, 256),
    context=st.integers(0, 500_000),
)
def test_adding_work_never_makes_an_iteration_faster(
    base: list[int], extra: int, decodes: int, context: int
) -> None:
    cost = _model(EXAMPLE)
    zeros = [0] * len(base)
    before = cost.iteration_time(decodes, context, base, zeros)
    assert cost.iteration_time(decodes, context, [*base, extra], [*zeros, 0]) >= before
    assert cost.iteration_time(decodes + 1, context + 1000, base, zeros) >= before
    assert cost.iteration_time(decodes, context, base, [c + extra for c in zeros]) >= before


@pytest.mark.parametrize(
    "path", [EXAMPLE, COST_DIR / cost_file_name("h200", "mistral_7b", 1)], ids=["a100", "h200"]
)
def test_decode_times_match_iteration_time(path: Path) -> None:
    cost = _model(path)
    contexts = np.array([0, 512, 64_000, 900_000])
    for n in (1, 16, 256):
        expected = [cost.iteration_time(n, int(c), (), ()) for c in contexts]
        np.testing.assert_allclose(cost.decode_times(n, contexts), expected, rtol=1e-12)


@pytest.mark.parametrize(
    "path", [EXAMPLE, COST_DIR / cost_file_name("h200", "mistral_7b", 1)], ids=["a100", "h200"]
)
def test_decode_iteration_times_are_iteration_time_bit_for_bit(path: Path) -> None:
    cost = _model(path)
    contexts = np.arange(0, 2_000_000, 7919, dtype=np.int64)
    for n in (0, 1, 3, 16, 255):
        expected = [cost.iteration_time(n, int(c), (), ()) for c in contexts]
        assert cost.decode_iteration_times(n, contexts).tolist() == expected
        assert super(RooflineCostModel, cost).decode_iteration_times(n, contexts).tolist() == expected
        for step_time in (cost.decode_step_time(n), super(RooflineCostModel, cost).decode_step_time(n)):
            assert [step_time(c) for c in contexts.tolist()] == expected


@pytest.mark.parametrize(
    "path", [EXAMPLE, COST_DIR / cost_file_name("h200", "mistral_7b", 1)], ids=["a100", "h200"]
)
@given(
    n=st.integers(0, 300),
    context=st.integers(0, 2_000_000),
    tokens=st.integers(1, 16_384),
    computed=st.integers(0, 200_000),
)
@settings(max_examples=60, deadline=None)
def test_chunk_iteration_times_are_iteration_time_bit_for_bit(
    path: Path, n: int, context: int, tokens: int, computed: int
) -> None:
    cost = _model(path)
    expected = [
        cost.iteration_time(n, context + i * n, (tokens,), (computed + i * tokens,)) for i in range(9)
    ]
    assert cost.chunk_iteration_times(n, context, tokens, computed, 9) == expected
    assert super(RooflineCostModel, cost).chunk_iteration_times(n, context, tokens, computed, 9) == expected


@pytest.mark.parametrize("serial_host", [False, True])
def test_a_pickled_model_is_rebuilt_from_its_constructor_arguments(serial_host: bool) -> None:
    # What a pool worker receives: the same prices, the same description and host rule.
    cost = RooflineCostModel(read_cost_file(EXAMPLE)["params"], "example", serial_host)
    copy = pickle.loads(pickle.dumps(cost))
    assert (copy.params, copy.description, copy.serial_host) == (cost.params, "example", serial_host)
    for batch in [(0, 0, (512,), (0,)), (32, 40_000, (), ()), (8, 9000, (300, 40), (1000, 0))]:
        assert copy.iteration_time(*batch) == cost.iteration_time(*batch)


def test_roofline_v0_is_the_textbook_roofline() -> None:
    model, hw = load_model("llama2_7b"), load_hardware("a100_80gb")
    p = roofline_params(model, hw, 1)
    cost = RooflineCostModel(p)
    for t in (1, 10, 100, 1000, 10_000):
        expected = p.lin_fixed_s + max(p.lin_mem_s, p.lin_s_per_token * t)
        assert cost.linear_time(t) == pytest.approx(expected, rel=1e-12)


def test_tile_steps_add_once_the_threshold_is_passed() -> None:
    p = dataclasses.replace(roofline_params(load_model("llama2_7b"), load_hardware("a100_80gb"), 1))
    stepped = RooflineCostModel(dataclasses.replace(p, lin_steps=((64, 1e-4), (128, 2e-4))))
    plain = RooflineCostModel(p)
    assert stepped.linear_time(64) == pytest.approx(plain.linear_time(64))
    assert stepped.linear_time(65) == pytest.approx(plain.linear_time(65) + 1e-4)
    assert stepped.linear_time(129) == pytest.approx(plain.linear_time(129) + 3e-4)


def test_the_large_regime_adds_its_slope_above_its_knee_only() -> None:
    p = roofline_params(load_model("llama2_7b"), load_hardware("a100_80gb"), 1)
    large = RooflineCostModel(
        dataclasses.replace(p, lin_large_s_per_token=1e-5, lin_large_knee_tokens=4096.0)
    )
    plain = RooflineCostModel(p)
    assert large.linear_time(4096) == plain.linear_time(4096)
    assert large.linear_time(6096) == pytest.approx(plain.linear_time(6096) + 2000 * 1e-5)
    assert large.iteration_time(0, 0, (6096,), (0,)) == pytest.approx(
        plain.iteration_time(0, 0, (6096,), (0,)) + p.num_layers * 2000 * 1e-5
    )


def test_files_without_the_large_regime_are_written_as_before(tmp_path: Path) -> None:
    """The optional fields appear in a coefficient file only when set, so older files regenerate unchanged."""
    params = roofline_params(load_model("llama2_7b"), load_hardware("a100_80gb"), 1)
    plain = cost_file_mapping(CostFile("a100_80gb", "llama2_7b", 1, False, "test", params, {}))
    assert not set(OPTIONAL_FIELDS) & set(plain["params"])
    set_ = dataclasses.replace(params, lin_large_s_per_token=1e-5, lin_large_knee_tokens=4096.0)
    path = write_cost_files([CostFile("a100_80gb", "llama2_7b", 1, False, "test", set_, {})], tmp_path)[0]
    back = read_cost_file(path)["params"]
    assert (back.lin_large_s_per_token, back.lin_large_knee_tokens) == (1e-5, 4096.0)


def test_host_floor_sets_the_pace_of_short_iterations() -> None:
    p = roofline_params(load_model("llama2_7b"), load_hardware("h100_80gb"), 1)
    floored = RooflineCostModel(
        dataclasses.replace(p, cpu_fixed_s=0.05, cpu_prefill_s=0.01, cpu_s_per_seq=1e-3)
    )
    assert floored.iteration_time(2, 100, (), ()) == pytest.approx(0.05 + 2e-3)
    assert floored.iteration_time(0, 0, (16,), (0,)) == pytest.approx(0.06 + 1e-3)
    long = RooflineCostModel(p).iteration_time(0, 0, (32768,), (0,))
    assert long > 0.07 and floored.iteration_time(0, 0, (32768,), (0,)) == pytest.approx(long)


# ---- loading ---------------------------------------------------------------------------------


def test_load_cost_model_kinds() -> None:
    model, hw = load_model("llama2_70b"), load_hardware("a100_80gb")
    calibrated = load_cost_model(model, hw, 4)
    v0 = load_cost_model(model, hw, 4, kind="roofline")
    by_path = load_cost_model(model, hw, 4, path=EXAMPLE)
    assert calibrated.iteration_time(8, 8000, (512,), (0,)) == by_path.iteration_time(8, 8000, (512,), (0,))
    assert "calibrated" in calibrated.description and "roofline" in v0.description
    with pytest.raises(ValueError, match="unknown cost model kind"):
        load_cost_model(model, hw, 4, kind="magic")


def test_missing_calibration_lists_what_exists() -> None:
    with pytest.raises(FileNotFoundError, match=r"a100_80gb__llama2_70b__tp1\.yaml is absent.*available"):
        load_cost_model(load_model("llama2_70b"), load_hardware("a100_80gb"), 1)


def test_file_for_another_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="field 'tp' is 4, but 8 was asked for"):
        load_cost_model(load_model("llama2_70b"), load_hardware("a100_80gb"), 8, path=EXAMPLE)
    with pytest.raises(ValueError, match="field 'model'"):
        load_cost_model(load_model("llama2_7b"), load_hardware("a100_80gb"), 4, path=EXAMPLE)


def _write(tmp_path: Path, mutate) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    mutate(data)
    path = tmp_path / "coefficients.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("derived"), r"missing field\(s\) \['derived'\]"),
        (lambda d: d.pop("params"), r"missing field\(s\) \['params'\]"),
        (lambda d: d.update(tp="4"), "field 'tp' must be int"),
        (lambda d: d.update(derived="no"), "field 'derived' must be bool"),
        (lambda d: d["params"].pop("lin_mem_s"), r"missing cost parameter\(s\) \['lin_mem_s'\]"),
        (lambda d: d["params"].update(lin_mem_s="0.1"), "'lin_mem_s' must be a finite number"),
        (lambda d: d["params"].update(num_layers=80.0), "'num_layers' must be an integer"),
        (lambda d: d["params"].update(allreduce_count=True), "'allreduce_count' must be an integer"),
        (lambda d: d["params"].update(lin_fixed_s=-1e-6), "'lin_fixed_s' must be >= 0"),
        (lambda d: d["params"].update(lin_fixd_s=1e-6), r"unknown cost parameter\(s\) \['lin_fixd_s'\]"),
        (lambda d: d["params"].update(lin_steps=[[128, 1e-5], [64, 1e-5]]), "thresholds must increase"),
        (
            lambda d: d["params"].update(lin_steps=[[128]]),
            r"'lin_steps'\[0\] must be a \(tokens, seconds\) pair",
        ),
        (lambda d: d["params"].update(lin_steps=5), "'lin_steps' must be a list"),
    ],
)
def test_bad_coefficient_file_names_file_and_field(tmp_path: Path, mutate, message: str) -> None:
    path = _write(tmp_path, mutate)
    with pytest.raises(ValueError, match=message) as info:
        load_cost_model(load_model("llama2_70b"), load_hardware("a100_80gb"), 4, path=path)
    assert str(path) in str(info.value)


def test_cost_params_reject_non_numbers_directly() -> None:
    p = roofline_params(load_model("llama2_7b"), load_hardware("a100_80gb"), 1)
    with pytest.raises(ValueError, match="'iter_fixed_s' must be a finite number"):
        dataclasses.replace(p, iter_fixed_s=float("nan"))
    assert isinstance(
        CostParams.from_mapping(dataclasses.asdict(p) | {"lin_steps": [[64, 1e-6]]}, "x"), CostParams
    )
