"""Engine overhead profiles: loading with one-line errors, how they combine with device time, selection by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from calibration.engine_overheads import fit_vllm_host
from envs.serving.cost_model import (
    COST_DIR,
    ENGINE_FIELDS,
    RooflineCostModel,
    cost_file_name,
    load_cost_model,
    read_cost_file,
    with_engine_overhead,
)
from envs.serving.engine_overhead import (
    DEFAULT_ENGINE_OVERHEAD,
    engine_overhead_names,
    load_engine_overhead,
)
from envs.serving.setup import ServingSetup, split_cost_model
from envs.serving.specs import load_hardware, load_model

MODEL, HW = load_model("llama2_7b"), load_hardware("h100_80gb")
DEVICE_FILE = COST_DIR / cost_file_name("h100_80gb", "llama2_7b", 1)
GOOD = {
    "name": "toy",
    "source": "a test",
    "combine": "max",
    "hardware": {"default": {"host_fixed_s": 0.002, "host_s_per_seq": 1e-5, "device_fixed_s": 1e-4}},
}


def _write(directory: Path, data: dict, name: str = "toy") -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_profiles_load_and_the_default_is_the_modern_engine() -> None:
    assert DEFAULT_ENGINE_OVERHEAD == "vllm_v1"
    assert {"vllm_v1", "splitwise_2023_eager"} <= set(engine_overhead_names())
    for name in engine_overhead_names():
        profile = load_engine_overhead(name)
        assert profile.name == name and profile.source and profile.combine in ("max", "sum")
    splitwise = load_engine_overhead("splitwise_2023_eager")
    assert {"a100_80gb", "h100_80gb", "a40", "h200"} <= set(splitwise.hardware)
    assert all(t.has_attention for t in splitwise.hardware.values())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("source"), r"toy.yaml: missing field\(s\) \['source'\]"),
        (lambda d: d.update(combine="min"), r"toy.yaml: field 'combine' is 'min'; valid: max, sum"),
        (lambda d: d.update(name="other"), r"toy.yaml: field 'name' is 'other', but the file is named 'toy'"),
        (lambda d: d.update(extra=1), r"toy.yaml: unknown field\(s\) \['extra'\]"),
        (lambda d: d.update(hardware={}), r"toy.yaml: field 'hardware' must name at least one GPU"),
        (lambda d: d.update(hardware=[1]), r"toy.yaml: field 'hardware' must be dict, got \[1\]"),
        (lambda d: d.update(notes="x"), r"toy.yaml: field 'notes' must be a list of strings"),
        (
            lambda d: d["hardware"]["default"].update(host_fixed_s=-1.0),
            r"toy.yaml: hardware.default: 'host_fixed_s' must be >= 0, got -1.0",
        ),
        (
            lambda d: d["hardware"]["default"].update(host_fixed_s="fast"),
            r"toy.yaml: hardware.default: 'host_fixed_s' must be a finite number, got 'fast'",
        ),
        (
            lambda d: d["hardware"]["default"].update(launch_s=1e-3),
            r"toy.yaml: hardware.default: unknown term\(s\) \['launch_s'\]",
        ),
        (
            lambda d: d["hardware"]["default"].update(attention_decode_factor=2.0),
            r"toy.yaml: hardware.default: the attention_\* terms come together",
        ),
        (
            lambda d: d["hardware"]["default"].update(
                attention_prefill_factor=0.5,
                attention_prefill_chunk_s=0.0,
                attention_decode_factor=2.0,
                attention_decode_seq_s=0.0,
            ),
            r"toy.yaml: hardware.default: 'attention_prefill_factor' must be >= 1",
        ),
    ],
)
def test_bad_profile_names_file_and_field(tmp_path: Path, mutate, message: str) -> None:
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    mutate(data)
    _write(tmp_path, data)
    with pytest.raises(ValueError, match=message) as err:
        load_engine_overhead("toy", tmp_path)
    assert "\n" not in str(err.value)


def test_unknown_profile_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"unknown engine overhead profile 'nope'.*valid: splitwise_2023_eager, vllm_v1"
    ):
        load_engine_overhead("nope")
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["hardware"] = {"h100_80gb": data["hardware"]["default"]}
    _write(tmp_path, data)
    profile = load_engine_overhead("toy", tmp_path)
    assert profile.terms("h100_80gb").host_fixed_s == 0.002
    with pytest.raises(ValueError, match=r"toy.yaml: no engine terms for hardware 'a40'"):
        profile.terms("a40")


def test_host_and_device_combine_as_the_profile_says(tmp_path: Path) -> None:
    """``max``: host work hides under longer device work; ``sum``: it adds to it."""
    device = RooflineCostModel(read_cost_file(DEVICE_FILE)["params"])
    _write(tmp_path, GOOD)
    overlapped = load_cost_model(MODEL, HW, 1, engine_overhead=load_engine_overhead("toy", tmp_path))
    serial_data = {**GOOD, "combine": "sum"}
    _write(tmp_path, serial_data)
    serial = load_cost_model(MODEL, HW, 1, engine_overhead=load_engine_overhead("toy", tmp_path))
    host_1 = 0.002 + 1e-5  # host_fixed + one sequence
    short = (1, 10, (), ())  # device ~6 ms: the 2 ms host is hidden under max, added under sum
    gpu = device.iteration_time(*short) + 1e-4
    assert overlapped.iteration_time(*short) == pytest.approx(gpu, rel=1e-12)
    assert serial.iteration_time(*short) == pytest.approx(gpu + host_1, rel=1e-12)
    heavy = {**GOOD, "hardware": {"default": {"host_fixed_s": 0.05}}}
    _write(tmp_path, heavy)
    host_bound = load_cost_model(MODEL, HW, 1, engine_overhead=load_engine_overhead("toy", tmp_path))
    assert host_bound.iteration_time(*short) == pytest.approx(0.05, rel=1e-12)


@pytest.mark.parametrize("profile", ["vllm_v1", "splitwise_2023_eager", "serial"])
def test_stretch_prices_stay_bit_identical_to_iteration_time(tmp_path: Path, profile: str) -> None:
    if profile == "serial":
        _write(tmp_path, {**GOOD, "combine": "sum"})
        overhead = load_engine_overhead("toy", tmp_path)
    else:
        overhead = load_engine_overhead(profile)
    cost = load_cost_model(MODEL, HW, 1, engine_overhead=overhead)
    contexts = np.arange(0, 2_000_000, 7919, dtype=np.int64)
    for n in (1, 3, 16, 255):
        expected = [cost.iteration_time(n, int(c), (), ()) for c in contexts]
        assert cost.decode_iteration_times(n, contexts).tolist() == expected
        assert [cost.decode_step_time(n)(c) for c in contexts.tolist()] == expected
        np.testing.assert_allclose(cost.decode_times(n, contexts), expected, rtol=1e-12)
        chunks = [cost.iteration_time(n, 5000 + i * n, (300,), (777 + i * 300,)) for i in range(50)]
        assert cost.chunk_iteration_times(n, 5000, 300, 777, 50) == chunks


def test_profile_terms_land_where_the_docstring_says() -> None:
    device = read_cost_file(DEVICE_FILE)["params"]
    terms = load_engine_overhead("splitwise_2023_eager").terms("h100_80gb")
    full = with_engine_overhead(device, terms, MODEL, HW, 1)
    assert full.cpu_fixed_s == pytest.approx(terms.host_s_per_layer * MODEL.num_layers)
    assert full.cpu_prefill_s == pytest.approx(terms.host_prefill_s_per_layer * MODEL.num_layers)
    assert full.iter_s_per_token == pytest.approx(
        terms.device_bytes_per_token_hidden_layer * MODEL.hidden_size * MODEL.num_layers / HW.hbm_bandwidth
    )
    assert (
        full.attn_decode_s_per_token > 3 * device.attn_decode_s_per_token / 1.25
    )  # the 2023 kernels were slower
    assert full.lin_mem_s == device.lin_mem_s and full.lin_steps == device.lin_steps


def test_every_gpu_file_is_device_only() -> None:
    for path in COST_DIR.glob("*.yaml"):
        data = read_cost_file(path)
        if path.name.startswith("cpu__"):
            assert not data["device_only"]  # a live engine profile holds its own engine terms
            continue
        assert data["device_only"], path.name
        assert all(getattr(data["params"], name) == 0 for name in ENGINE_FIELDS), path.name


def test_device_only_file_with_engine_terms_is_refused(tmp_path: Path) -> None:
    data = yaml.safe_load(DEVICE_FILE.read_text())
    data["params"]["cpu_fixed_s"] = 0.01
    path = tmp_path / DEVICE_FILE.name
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(
        ValueError,
        match=r"a device_only file must leave the engine terms to a profile, but sets \['cpu_fixed_s'\]",
    ):
        read_cost_file(path)
    data["params"]["cpu_fixed_s"] = 0.0
    data["device_only"] = "yes"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"field 'device_only' must be bool, got 'yes'"):
        read_cost_file(path)


def test_live_engine_file_keeps_its_own_engine_terms() -> None:
    cpu_file = COST_DIR / "cpu__engine_small__tp1.yaml"
    data = read_cost_file(cpu_file)
    model, hw = load_model(data["model"]), load_hardware(data["hardware"])
    a = load_cost_model(model, hw, 1, path=cpu_file)
    b = load_cost_model(model, hw, 1, path=cpu_file, engine_overhead="splitwise_2023_eager")
    assert a.iteration_time(4, 400, (64,), (0,)) == b.iteration_time(4, 400, (64,), (0,))


def test_cost_model_names_its_profile() -> None:
    assert split_cost_model("calibrated") == ("calibrated", "vllm_v1")
    assert split_cost_model("calibrated:splitwise_2023_eager") == ("calibrated", "splitwise_2023_eager")
    assert split_cost_model("conf/cost/x.yaml:vllm_v1") == ("conf/cost/x.yaml", "vllm_v1")
    assert split_cost_model("C:/costs/x.yaml") == ("C:/costs/x.yaml", "vllm_v1")
    new = ServingSetup.from_names("llama2_7b", "h100_80gb", 1, "strict", "calibrated")
    old = ServingSetup.from_names("llama2_7b", "h100_80gb", 1, "strict", "calibrated:splitwise_2023_eager")
    assert new.cost_model.iteration_time(1, 1024, (), ()) < 0.5 * old.cost_model.iteration_time(
        1, 1024, (), ()
    )
    assert "engine overhead vllm_v1" in new.cost_model.description
    with pytest.raises(ValueError, match="unknown engine overhead profile 'nope'"):
        ServingSetup.from_names("llama2_7b", "h100_80gb", 1, "strict", "calibrated:nope")
    with pytest.raises(ValueError, match="the roofline v0 carries its own nominal overhead"):
        ServingSetup.from_names("llama2_7b", "h100_80gb", 1, "strict", "roofline:vllm_v1")


def test_vllm_host_fit_reads_the_measured_steps(tmp_path: Path) -> None:
    fit = fit_vllm_host()
    assert fit.rows >= 3 and fit.mape < 0.2
    assert fit.terms.host_fixed_s > 0 and fit.terms.host_s_per_seq > 0
    shipped = load_engine_overhead("vllm_v1").terms("default")
    assert shipped.host_fixed_s == pytest.approx(fit.terms.host_fixed_s, rel=1e-5)
    bad = tmp_path / "host.csv"
    bad.write_text("shape,decode_seqs\n")
    with pytest.raises(ValueError, match=r"host.csv: expected a '# \.\.\.' provenance line first"):
        fit_vllm_host(bad)
    bad.write_text("# x\nshape,decode_seqs,prefill_tokens,host_s\nd,1,0,fast\n")
    with pytest.raises(ValueError, match=r"host.csv: bad row"):
        fit_vllm_host(bad)
