"""Coefficient files from published profiles (Vidur tables, Splitwise runs).

Fit what is measured, derive what is not, check both.  :func:`calibrate` is pure (reads the
data, returns a :class:`Calibration`); writing the coefficient files and the report is left to
:mod:`calibration.cost_files` and :mod:`calibration.report` (``python -m calibration`` does all
three).  Which table feeds which configuration:

* per-layer time: the Vidur table of that GPU and model; else the same GPU's table of the
  model with the nearest per-layer weight count, roofline-scaled (Mistral-7B uses
  Llama-3-8B's, whose layer shapes it shares); a GPU without tables (H200) takes its
  source GPU's fit scaled by the datasheet bandwidth ratio (compute unchanged);
* all-reduce: the GPU's DGX table; H200 uses H100's (same NVLink and NVSwitch); A40 has
  none, so A100's is slowed by the ratio of the two GPUs' measured send/recv bandwidths;
* attention: the kernels modern engines run, at documented efficiencies (:mod:`calibration.attention`);
* the slower all-reduce regime of large messages: the Splitwise Llama-2-70B fit of that GPU, or
  of its source GPU (A40 from A100, H200 from H100);
* the engine: not in the cost files (``device_only: true``).  Its terms are the profiles in
  ``conf/engine_overhead`` (:mod:`calibration.engine_overheads`): the Splitwise fit as the 2023
  eager engine, and vLLM V1 from its measured host time and published device figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd

from calibration import table_fits, validation, whole_request
from calibration.attention import SOURCE as ATTENTION_SOURCE
from calibration.attention import with_modern_attention
from calibration.cost_files import CostFile
from calibration.derive import scale_collective, scale_layer
from calibration.engine_overheads import VLLM_HOST_CSV, splitwise_2023_eager, vllm_v1
from calibration.fit import StepRoofline, mape
from calibration.kernels import Kernels, kernel_params, layer_weight_seconds
from calibration.sources import splitwise, vidur
from envs.serving.cost_model import CostParams, RooflineCostModel, with_engine_overhead
from envs.serving.engine_overhead import DEFAULT_ENGINE_OVERHEAD, EngineOverhead
from envs.serving.specs import (
    HardwareSpec,
    ModelSpec,
    kv_capacity_tokens,
    load_hardware,
    load_model,
    model_names,
)

HARDWARE = ("a100_80gb", "h100_80gb", "h200", "a40")
MODELS = ("llama2_7b", "llama3_8b", "mistral_7b", "llama2_70b")
TENSOR_PARALLEL = (1, 2, 4, 8)
SOURCE_HARDWARE = {"h200": "h100_80gb", "a40": "a100_80gb"}
"""Where a GPU without its own data takes what it lacks from: tables (H200), or the
all-reduce and whole-request fits (A40, whose per-op tables exist)."""
ENGINE_MODEL = "llama2_70b"
SPLITWISE_NAMES = {"a100_80gb": "a100-80gb", "h100_80gb": "h100-80gb"}
SPLITWISE_MODELS = {"llama2_70b": "llama2-70b", "bloom_176b": "bloom-176b"}
POWER_CAPPED = "h100-80gb-pcap"
DGX_ALLREDUCE = ("a100_80gb", "h100_80gb")
"""GPUs with an all-reduce table (Vidur's ``<gpu>_dgx``, the topology Splitwise ran on)."""
SEND_RECV = {"a100_80gb": "a100_dgx", "h100_80gb": "h100_dgx", "a40": "a40_pairwise_nvlink"}
"""Intra-node pairwise send/recv tables, used only to compare link speeds."""
EXTRAPOLATE_FROM = 4096
"""The tables of all but Llama-3 end here; fits are checked beyond it where data exists."""


@dataclass(frozen=True)
class LayerRecord:
    """A measured table slice and its fit."""

    hardware: str
    model: str
    fit: table_fits.LayerFit


@dataclass(frozen=True)
class EngineRecord:
    hardware: str
    fit: whole_request.EngineFit
    in_sample: dict[str, float]
    leave_one_out: tuple[whole_request.Validation, ...]
    rows: int
    source: str


@dataclass
class Calibration:
    data_root: Path
    files: list[CostFile] = field(default_factory=list)
    layer_fits: list[LayerRecord] = field(default_factory=list)
    allreduce_fits: dict[tuple[str, int], table_fits.CollectiveFit] = field(default_factory=dict)
    engines: dict[str, EngineRecord] = field(default_factory=dict)
    overheads: list[EngineOverhead] = field(default_factory=list)
    exclusions: tuple[splitwise.Exclusion, ...] = ()
    evidence: dict[str, list[dict]] = field(default_factory=dict)
    modern_engines: list[validation.Result] = field(default_factory=list)

    def cost_model(
        self, hardware: str, model: str, tp: int, overhead: str = DEFAULT_ENGINE_OVERHEAD
    ) -> RooflineCostModel:
        """What ``load_cost_model`` would build from the files and profiles this calibration writes."""
        f = next((f for f in self.files if (f.hardware, f.model, f.tp) == (hardware, model, tp)), None)
        if f is None:
            raise ValueError(f"this calibration has no cost file for {model} on {tp} x {hardware}")
        profile = next((p for p in self.overheads if p.name == overhead), None)
        if profile is None:
            raise ValueError(
                f"unknown engine overhead {overhead!r}; valid: {[p.name for p in self.overheads]}"
            )
        params = with_engine_overhead(
            f.params, profile.terms(hardware), load_model(model), load_hardware(hardware), tp
        )
        return RooflineCostModel(
            params, f"{hardware} {model} tp{tp} + {overhead}", serial_host=profile.serial
        )


class _Sources:
    """Loads and fits lazily, once per table, and remembers where each number came from."""

    def __init__(self, data_root: Path) -> None:
        self.root = data_root
        self.models = [load_model(name) for name in model_names()]
        """Every model in conf/model: any of them can lend its table to a derivation."""
        self._tables: dict[Path, pd.DataFrame | None] = {}
        self.layer_fits: dict[tuple[str, str, int], table_fits.LayerFit] = {}
        self.allreduce_fits: dict[tuple[str, int], table_fits.CollectiveFit] = {}

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def table(self, hardware: HardwareSpec, model: ModelSpec) -> pd.DataFrame | None:
        path = vidur.compute_table_path(self.root, hardware.profile_name, model.hf_name)
        if path not in self._tables:
            self._tables[path] = vidur.read_op_table(path) if model.hf_name and path.is_file() else None
        return self._tables[path]

    def measured_table(self, hardware: HardwareSpec, model: ModelSpec) -> pd.DataFrame:
        """:meth:`table` of a slice that has one (callers ask only for those)."""
        table = self.table(hardware, model)
        assert table is not None, f"no Vidur table for {model.name} on {hardware.name}"
        return table

    def layer_fit(self, hardware: HardwareSpec, model: ModelSpec, tp: int) -> table_fits.LayerFit:
        key = (hardware.name, model.name, tp)
        if key not in self.layer_fits:
            table = self.measured_table(hardware, model)
            path = vidur.compute_table_path(self.root, hardware.profile_name, model.hf_name)
            self.layer_fits[key] = table_fits.fit_layer(vidur.op_times(table, tp, self.rel(path)))
        return self.layer_fits[key]

    def allreduce_fit(self, hardware: HardwareSpec, tp: int) -> table_fits.CollectiveFit:
        key = (hardware.name, tp)
        if key not in self.allreduce_fits:
            path = vidur.all_reduce_path(self.root, hardware.profile_name)
            times = vidur.collective_times(path, tp, "all_reduce")
            self.allreduce_fits[key] = table_fits.fit_collective(
                vidur.CollectiveTimes(self.rel(path), times.workers, times.size_bytes, times.seconds)
            )
        return self.allreduce_fits[key]

    def send_recv_slope(self, hardware: str) -> float:
        path = vidur.send_recv_path(self.root, SEND_RECV[hardware])
        return table_fits.fit_collective(vidur.collective_times(path, 2, "send_recv")).line.slope

    def measured_models(
        self, hardware: HardwareSpec, models: Iterable[ModelSpec] | None = None
    ) -> list[ModelSpec]:
        return [m for m in (self.models if models is None else models) if self.table(hardware, m) is not None]


def feasible(model: ModelSpec, hardware: HardwareSpec, tp: int) -> bool:
    """Weights fit (see :func:`kv_capacity_tokens`) and attention heads split evenly."""
    if model.num_kv_heads % tp or model.num_heads % tp:
        return False
    try:
        kv_capacity_tokens(model, hardware, tp)
    except ValueError:
        return False
    return True


def calibrate(
    data_root: Path,
    hardware: Iterable[str] = HARDWARE,
    models: Iterable[str] = MODELS,
    tensor_parallel: Iterable[int] = TENSOR_PARALLEL,
    vllm_host_csv: Path = VLLM_HOST_CSV,
    validation_csv: Path = validation.VALIDATION_CSV,
) -> Calibration:
    """Fit, derive and check everything; nothing is written.  The modern-engine validation rows
    whose configuration this calibration covers are predicted with the default engine profile."""
    src = _Sources(data_root)
    hw_specs = {name: load_hardware(name) for name in hardware}
    model_specs = {name: load_model(name) for name in models}
    cal = Calibration(data_root=data_root)
    measurements = splitwise.clean(splitwise.read_perf_model(splitwise.perf_model_path(data_root)))
    cal.exclusions = measurements.exclusions

    engine_hw = sorted({_engine_hardware(h) for h in hw_specs})
    for name in engine_hw:
        cal.engines[name] = _fit_engine(src, measurements, load_hardware(name))
    cal.overheads = [
        vllm_v1(vllm_host_csv),
        splitwise_2023_eager(
            {name: r.fit for name, r in cal.engines.items()},
            {name: r.source for name, r in cal.engines.items()},
        ),
    ]

    for hw in hw_specs.values():
        for model in model_specs.values():
            for tp in tensor_parallel:
                if feasible(model, hw, tp):
                    cal.files.append(_cost_file(src, cal, hw, model, tp))

    for hw in hw_specs.values():  # every measured slice is reported, feasible or not
        for model in src.measured_models(hw, model_specs.values()):
            for tp in vidur.tensor_parallel_degrees(src.measured_table(hw, model)):
                src.layer_fit(hw, model, tp)
    cal.layer_fits = [LayerRecord(h, m, fit) for (h, m, _), fit in sorted(src.layer_fits.items())]
    cal.allreduce_fits = dict(sorted(src.allreduce_fits.items()))
    cal.evidence = _evidence(src, cal, measurements)
    covered = {(f.hardware, f.model, f.tp) for f in cal.files}
    rows = [r for r in validation.read_rows(validation_csv) if (r.hardware, r.model, r.tp) in covered]
    cal.modern_engines = validation.validate(rows, lambda r: cal.cost_model(r.hardware, r.model, r.tp))
    return cal


# ---- one configuration --------------------------------------------------------------------------


def _engine_hardware(hardware: str) -> str:
    return hardware if hardware in SPLITWISE_NAMES else SOURCE_HARDWARE[hardware]


def _kernels(src: _Sources, hw: HardwareSpec, model: ModelSpec, tp: int) -> tuple[Kernels, bool, dict]:
    """The per-layer and all-reduce fits for this configuration, whether derived, and fit metrics."""
    metrics: dict = {}
    derived = False
    if src.table(hw, model) is not None:
        fit = src.layer_fit(hw, model, tp)
        layer = fit.layer.split(layer_weight_seconds(model, hw, tp))
        layer_source = f"{fit.source} (tp {tp}; fitted on {fit.points - fit.heldout_points} of {fit.points} token points)"
        metrics.update(
            per_layer_heldout_mape=fit.heldout_mape,
            per_op_heldout_mape=dict(fit.op_heldout_mape),
            heldout_points=fit.heldout_points,
            table_max_tokens=int(fit.max_tokens),
        )
    elif hw.name in SOURCE_HARDWARE and not src.measured_models(hw):
        source_hw = load_hardware(SOURCE_HARDWARE[hw.name])
        base, _, base_metrics = _kernels(src, source_hw, model, tp)
        layer = scale_layer(base.layer, model, source_hw, model, hw)
        derived = True
        layer_source = (
            f"derived from {source_hw.name}'s per-layer fit [{base.layer_source}] x datasheet bandwidth ratio "
            f"{source_hw.hbm_bandwidth / hw.hbm_bandwidth:.3f} on memory terms (compute unchanged)"
        )
        metrics["source_fit"] = base_metrics
    else:
        donor = _nearest_measured(src, hw, model)
        fit = src.layer_fit(hw, donor, tp)
        layer = scale_layer(fit.layer.split(layer_weight_seconds(donor, hw, tp)), donor, hw, model, hw)
        derived = True
        how = (
            "identical layer shapes"
            if donor.layer_params == model.layer_params and donor.hidden_size == model.hidden_size
            else f"roofline-scaled by layer weights {model.layer_params / donor.layer_params:.3f}x, "
            f"hidden {model.hidden_size / donor.hidden_size:.3f}x"
        )
        layer_source = f"derived from {donor.name}'s {fit.source} (tp {tp}): {how}"
        metrics["source_per_layer_heldout_mape"] = fit.heldout_mape

    ar_line: StepRoofline | None = None
    ar_source = "none (tp 1)"
    if tp > 1:
        measured_ar = hw.name in DGX_ALLREDUCE
        ar_hw = hw if measured_ar else load_hardware(SOURCE_HARDWARE[hw.name])
        ar = src.allreduce_fit(ar_hw, tp)
        ar_line = ar.line
        ar_source = f"{ar.source} ({tp} workers, one node)"
        if measured_ar:
            metrics["allreduce_heldout_mape"] = ar.heldout_mape
        else:
            derived = True
            ratio = _link_ratio(src, hw.name)
            ar_line = scale_collective(ar_line, ratio)
            ar_source = f"derived from {ar_hw.name}'s {ar_source}" + (
                f" with the per-byte term x {ratio:.3g} (send/recv bandwidth ratio)" if ratio != 1.0 else ""
            )
    return Kernels(layer, ar_line, layer_source, ar_source), derived, metrics


def _link_ratio(src: _Sources, hardware: str) -> float:
    """How much slower this GPU's link is than its source GPU's (1 for H200: same NVLink)."""
    if hardware not in SEND_RECV:
        return 1.0
    return src.send_recv_slope(hardware) / src.send_recv_slope(SOURCE_HARDWARE[hardware])


def _nearest_measured(src: _Sources, hw: HardwareSpec, model: ModelSpec) -> ModelSpec:
    candidates = src.measured_models(hw)
    if not candidates:
        raise ValueError(f"no per-op table on {hw.name} ({hw.profile_name}) to derive {model.name} from")
    return min(
        candidates,
        key=lambda m: (
            abs(math.log(m.layer_params / model.layer_params)),
            abs(m.hidden_size - model.hidden_size),
        ),
    )


def _cost_file(src: _Sources, cal: Calibration, hw: HardwareSpec, model: ModelSpec, tp: int) -> CostFile:
    """Device terms only: kernels, modern attention, and the large-message all-reduce regime."""
    kernels, derived, metrics = _kernels(src, hw, model, tp)
    engine_hw_name = _engine_hardware(hw.name)
    record = cal.engines[engine_hw_name]
    link = _link_ratio(src, hw.name) if hw.name != engine_hw_name else 1.0
    device = whole_request.with_large_allreduce(
        kernel_params(model, hw, tp, kernels), record.fit, model, tp, link
    )
    params = with_modern_attention(device, model, hw, tp)
    if tp > 1:
        derived = derived or hw.name != engine_hw_name
        regime = (
            f"large-message all-reduce regime: {record.source}"
            + (f" (moved to {hw.name} by the link ratio {link:.3g})" if hw.name != engine_hw_name else "")
            + "; "
        )
    else:
        regime = ""
    if hw.name == engine_hw_name and model.name == ENGINE_MODEL:
        metrics["whole_request"] = _whole_request_metrics(record)
    source = (
        f"per-layer: {kernels.layer_source}; all-reduce: {kernels.allreduce_source}; {regime}{ATTENTION_SOURCE}; "
        "engine overhead: none here (device_only), see conf/engine_overhead"
    )
    return CostFile(hw.name, model.name, tp, derived, source, params, metrics, device_only=True)


def _whole_request_metrics(record: EngineRecord) -> dict:
    return {
        "in_sample_mape": dict(record.in_sample),
        "leave_one_tp_out_mape": {
            f"tp{v.tp}": {"prompt": v.prompt_mape, "token": v.token_mape} for v in record.leave_one_out
        },
        "rows": record.rows,
    }


# ---- whole-request fits -------------------------------------------------------------------------


def _kernel_params_for(
    src: _Sources, hw: HardwareSpec, model: ModelSpec, tps: Iterable[int]
) -> dict[int, CostParams]:
    out = {}
    for tp in tps:
        kernels, _, _ = _kernels(src, hw, model, tp)
        out[tp] = kernel_params(model, hw, tp, kernels)
    return out


def _rows(measurements: splitwise.Measurements, model: str, hardware: str) -> pd.DataFrame:
    def pick(df: pd.DataFrame) -> pd.DataFrame:
        return df[(df["model"] == model) & (df["hardware"] == hardware)]

    return whole_request.measurement_rows(pick(measurements.prompt), pick(measurements.token))


def _fit_engine(src: _Sources, measurements: splitwise.Measurements, hw: HardwareSpec) -> EngineRecord:
    model = load_model(ENGINE_MODEL)
    rows = _rows(measurements, SPLITWISE_MODELS[ENGINE_MODEL], SPLITWISE_NAMES[hw.name])
    tps = sorted(int(t) for t in rows["tp"].unique())
    comps = whole_request.components(rows, model, hw, _kernel_params_for(src, hw, model, tps))
    fit = whole_request.fit_engine(comps, rows["seconds"].to_numpy())
    source = (
        f"splitwise/perf_model.csv {SPLITWISE_MODELS[ENGINE_MODEL]} {SPLITWISE_NAMES[hw.name]} "
        f"TP {'/'.join(map(str, tps))} ({len(rows)} medians after exclusions)"
    )
    return EngineRecord(
        hw.name,
        fit,
        whole_request.errors(rows, comps, fit),
        tuple(whole_request.leave_one_tp_out(rows, comps)),
        len(rows),
        source,
    )


# ---- evidence beyond the gates ------------------------------------------------------------------


def _evidence(src: _Sources, cal: Calibration, measurements: splitwise.Measurements) -> dict[str, list[dict]]:
    return {
        "extrapolation": _extrapolation(src),
        "derivation": _derivation_checks(src),
        "allreduce_derivation": _allreduce_derivation(src),
        "bloom_176b": _bloom(src, cal, measurements),
        "power_capped_h100": _power_capped(src, cal, measurements),
    }


def _extrapolation(src: _Sources) -> list[dict]:
    """Fit up to 4096 tokens, test beyond: on Llama-3-8B's own table, and Llama-2-70B's fit
    against Llama-3-70B's table (the same layer shapes, measured separately)."""
    out = []
    a100 = load_hardware("a100_80gb")
    llama3_8b = load_model("llama3_8b")
    table = src.table(a100, llama3_8b)
    if table is not None:
        for tp in vidur.tensor_parallel_degrees(table):
            times = vidur.op_times(table, tp)
            error, top = table_fits.extrapolation_mape(times, EXTRAPOLATE_FROM)
            out.append(
                {
                    "check": "Llama-3-8B A100, own table",
                    "tp": tp,
                    "tokens": f"{EXTRAPOLATE_FROM}-{int(top)}",
                    "mape": error,
                }
            )
    llama3_70b = vidur.compute_table_path(src.root, "a100", "meta-llama/Meta-Llama-3-70B")
    llama2_70b = load_model("llama2_70b")
    if llama3_70b.is_file() and src.table(a100, llama2_70b) is not None:
        other = vidur.read_op_table(llama3_70b)
        for tp in vidur.tensor_parallel_degrees(other):
            fit = src.layer_fit(a100, llama2_70b, tp)
            times = vidur.op_times(other, tp)
            above = times.tokens > EXTRAPOLATE_FROM
            out.append(
                {
                    "check": "Llama-2-70B A100 fit vs Llama-3-70B table (same layer shapes)",
                    "tp": tp,
                    "tokens": f"{EXTRAPOLATE_FROM}-{int(times.tokens.max())}",
                    "mape": mape(fit.layer.predict(times.tokens[above]), times.layer[above]),
                }
            )
    return out


def _derivation_checks(src: _Sources) -> list[dict]:
    """Derive a measured configuration from another measured one and compare with its table."""
    pairs = [
        (
            "a100_80gb",
            "llama2_7b",
            "a100_80gb",
            "llama3_8b",
            "model scaling (used for Llama-3-8B on H100, A40)",
        ),
        (
            "a100_80gb",
            "llama2_7b",
            "h100_80gb",
            "llama2_7b",
            "GPU scaling A100->H100 (the method used for H200)",
        ),
        (
            "a100_80gb",
            "llama2_70b",
            "h100_80gb",
            "llama2_70b",
            "GPU scaling A100->H100 (the method used for H200)",
        ),
        ("h100_80gb", "llama2_7b", "a100_80gb", "llama2_7b", "GPU scaling H100->A100"),
    ]
    out = []
    for src_hw_name, src_model_name, dst_hw_name, dst_model_name, what in pairs:
        src_hw, dst_hw = load_hardware(src_hw_name), load_hardware(dst_hw_name)
        src_model, dst_model = load_model(src_model_name), load_model(dst_model_name)
        if src.table(src_hw, src_model) is None or src.table(dst_hw, dst_model) is None:
            continue
        for tp in TENSOR_PARALLEL:
            base = src.layer_fit(src_hw, src_model, tp).layer.split(
                layer_weight_seconds(src_model, src_hw, tp)
            )
            derived = scale_layer(base, src_model, src_hw, dst_model, dst_hw)
            times = vidur.op_times(src.measured_table(dst_hw, dst_model), tp)
            out.append(
                {
                    "check": f"{src_model_name} {src_hw_name} -> {dst_model_name} {dst_hw_name}: {what}",
                    "tp": tp,
                    "mape": mape(derived.predict(times.tokens), times.layer),
                }
            )
    return out


def _allreduce_derivation(src: _Sources) -> list[dict]:
    """The A40 method checked where both sides are measured: H100's all-reduce from A100's
    and the send/recv bandwidth ratio."""
    out = []
    a100, h100 = load_hardware("a100_80gb"), load_hardware("h100_80gb")
    ratio = src.send_recv_slope("h100_80gb") / src.send_recv_slope("a100_80gb")
    for tp in (2, 4, 8):
        derived = scale_collective(src.allreduce_fit(a100, tp).line, ratio)
        path = vidur.all_reduce_path(src.root, h100.profile_name)
        times = vidur.collective_times(path, tp, "all_reduce")
        out.append(
            {
                "check": "H100 all-reduce from A100's x send/recv ratio",
                "tp": tp,
                "mape": mape(derived.predict(times.size_bytes), times.seconds),
            }
        )
    return out


def _bloom(src: _Sources, cal: Calibration, measurements: splitwise.Measurements) -> list[dict]:
    """BLOOM-176B at TP 8: kernels scaled from Llama-2-70B's table, engine from the Llama-2-70B fit."""
    bloom = whole_request.BLOOM_176B
    llama = load_model(ENGINE_MODEL)
    out = []
    for hw_name, sw_name in SPLITWISE_NAMES.items():
        hw = load_hardware(hw_name)
        rows = _rows(measurements, SPLITWISE_MODELS["bloom_176b"], sw_name)
        if rows.empty or hw_name not in cal.engines:
            continue
        params = {}
        for tp in sorted(int(t) for t in rows["tp"].unique()):
            base = src.layer_fit(hw, llama, tp).layer.split(layer_weight_seconds(llama, hw, tp))
            kernels = Kernels(scale_layer(base, llama, hw, bloom, hw), src.allreduce_fit(hw, tp).line, "", "")
            params[tp] = whole_request.apply_engine(
                kernel_params(bloom, hw, tp, kernels), cal.engines[hw_name].fit, bloom, hw, tp, llama, hw
            )
        out += _row_errors(rows, params, f"BLOOM-176B {sw_name}")
    return out


def _power_capped(src: _Sources, cal: Calibration, measurements: splitwise.Measurements) -> list[dict]:
    """The H100 Llama-2-70B model against power-capped H100 prompt times (its token times are copies)."""
    if "h100_80gb" not in cal.engines:
        return []
    hw, model = load_hardware("h100_80gb"), load_model(ENGINE_MODEL)
    rows = _rows(measurements, SPLITWISE_MODELS[ENGINE_MODEL], POWER_CAPPED)
    tps = sorted(int(t) for t in rows["tp"].unique())
    kernels = _kernel_params_for(src, hw, model, tps)
    params = {
        tp: whole_request.apply_engine(kernels[tp], cal.engines[hw.name].fit, model, hw, tp, model, hw)
        for tp in tps
    }
    return _row_errors(rows, params, f"Llama-2-70B {POWER_CAPPED} vs the H100 model")


def _row_errors(rows: pd.DataFrame, params: dict[int, CostParams], label: str) -> list[dict]:
    pred = whole_request.cost_model_predictions(rows, params)
    out = []
    for (tp, kind), part in rows.groupby(["tp", "kind"]):
        idx = part.index.to_numpy()
        signed = float(np.mean(pred[idx] / part["seconds"].to_numpy() - 1))
        out.append(
            {
                "check": label,
                "tp": int(cast(int, tp)),  # a value of the integer tp column
                "kind": kind,
                "mape": mape(pred[idx], part["seconds"].to_numpy()),
                "bias": signed,
            }
        )
    return out
