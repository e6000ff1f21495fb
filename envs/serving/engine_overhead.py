"""Engine overhead as its own named profile: what a serving engine adds to an iteration's device time.

A cost file in ``conf/cost/`` marked ``device_only: true`` holds the device time of one
(GPU, model, TP): per-op kernel fits, attention, all-reduces, LM head.  The engine around the
kernels (scheduling, input preparation, kernel launches, sampling) is a profile
``conf/engine_overhead/<name>.yaml``, chosen by name (``cost_model=calibrated`` takes
:data:`DEFAULT_ENGINE_OVERHEAD`; ``cost_model=calibrated:<name>`` another), with a ``source`` for
every number.  Its terms, per GPU (``hardware: {<name>: {...}}``, or ``default`` for any GPU)::

    host   = host_fixed_s + host_s_per_layer * L + host_prefill_s_per_layer * L * [any prefill]
             + host_s_per_seq * S + host_s_per_token * T
    device += device_fixed_s + device_s_per_seq * S
              + device_bytes_per_token_hidden_layer * hidden * L / HBM bandwidth * T

and, optionally, the engine's own attention kernels (``attention_*``: efficiency factors over
the datasheet peak and bandwidth, and per-chunk / per-sequence seconds), which replace the
cost file's.  ``combine`` says how host and device time make the iteration: ``max`` where the
host works ahead of the device (an eager engine that queues kernels asynchronously, or vLLM
V1's async scheduling, which plans step N+1 while step N runs), ``sum`` where each step's host
work waits for the previous step's device work (a synchronous engine).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from envs.serving.specs import CONF_DIR, HardwareSpec, ModelSpec

ENGINE_OVERHEAD_DIR = CONF_DIR / "engine_overhead"
DEFAULT_ENGINE_OVERHEAD = "vllm_v1"
"""The modern engine: vLLM V1 with CUDA graphs and async scheduling."""
COMBINES = ("max", "sum")
DEFAULT_HARDWARE_KEY = "default"
PROFILE_FIELDS: dict[str, type] = {"name": str, "source": str, "combine": str, "hardware": dict}
"""Top-level fields every profile must have, with their YAML types (``notes`` is optional)."""


@dataclass(frozen=True)
class OverheadTerms:
    """One GPU's engine terms (see the module docstring); seconds unless named otherwise."""

    host_fixed_s: float = 0.0
    host_s_per_layer: float = 0.0
    host_prefill_s_per_layer: float = 0.0
    host_s_per_seq: float = 0.0
    host_s_per_token: float = 0.0
    device_fixed_s: float = 0.0
    device_s_per_seq: float = 0.0
    device_bytes_per_token_hidden_layer: float = 0.0
    attention_prefill_factor: float | None = None
    attention_prefill_chunk_s: float | None = None
    attention_decode_factor: float | None = None
    attention_decode_seq_s: float | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name.startswith("attention_"):
                continue
            check_non_negative(repr(f.name), value)
        for kind in ("prefill", "decode"):
            factor = getattr(self, f"attention_{kind}_factor")
            if factor is not None and factor < 1:
                raise ValueError(
                    f"'attention_{kind}_factor' must be >= 1 (no kernel beats the datasheet), got {factor!r}"
                )
        given = [
            getattr(self, f.name) is None for f in dataclasses.fields(self) if f.name.startswith("attention_")
        ]
        if any(given) and not all(given):
            raise ValueError("the attention_* terms come together: give all four or none")

    @property
    def has_attention(self) -> bool:
        return self.attention_prefill_factor is not None


@dataclass(frozen=True)
class EngineOverhead:
    """A profile file's content: its terms per GPU, and how host and device time combine."""

    name: str
    source: str
    combine: str
    hardware: dict[str, OverheadTerms]
    notes: tuple[str, ...] = ()
    path: Path | None = None

    def terms(self, hardware: str) -> OverheadTerms:
        """The terms for ``hardware``: its own entry, else ``default``."""
        if hardware in self.hardware:
            return self.hardware[hardware]
        if DEFAULT_HARDWARE_KEY in self.hardware:
            return self.hardware[DEFAULT_HARDWARE_KEY]
        raise ValueError(
            f"{self.path or self.name}: no engine terms for hardware {hardware!r} "
            f"(has {sorted(self.hardware)}, no {DEFAULT_HARDWARE_KEY!r})"
        )

    @property
    def serial(self) -> bool:
        """Whether host and device time add up (``combine: sum``) rather than overlap."""
        return self.combine == "sum"


def check_non_negative(label: str, value: Any, integer: bool = False) -> None:
    """ValueError naming ``label`` unless ``value`` is a finite number >= 0 (an int if ``integer``;
    a bool is not a number): the check of every cost and overhead coefficient."""
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{label} must be {kind}, got {value!r}")
    if value < 0:
        raise ValueError(f"{label} must be >= 0, got {value!r}")


def engine_overhead_names(directory: Path = ENGINE_OVERHEAD_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))


def load_engine_overhead(name: str, directory: Path = ENGINE_OVERHEAD_DIR) -> EngineOverhead:
    """The profile ``<directory>/<name>.yaml``, checked: one-line errors name the file, field and value."""
    path = directory / f"{name}.yaml"
    if not path.is_file():
        valid = engine_overhead_names(directory)
        raise ValueError(
            f"unknown engine overhead profile {name!r}: {path} is absent; valid: {', '.join(valid) or 'none'}"
        )
    return read_engine_overhead(path)


def read_engine_overhead(path: Path) -> EngineOverhead:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not a readable YAML engine overhead profile ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    unknown = sorted(set(data) - set(PROFILE_FIELDS) - {"notes"})
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; valid: {sorted([*PROFILE_FIELDS, 'notes'])}")
    missing = [name for name in PROFILE_FIELDS if name not in data]
    if missing:
        raise ValueError(f"{path}: missing field(s) {missing}")
    for name, kind in PROFILE_FIELDS.items():
        if not isinstance(data[name], kind):
            raise ValueError(f"{path}: field {name!r} must be {kind.__name__}, got {data[name]!r}")
    if data["name"] != path.stem:
        raise ValueError(f"{path}: field 'name' is {data['name']!r}, but the file is named {path.stem!r}")
    if data["combine"] not in COMBINES:
        raise ValueError(f"{path}: field 'combine' is {data['combine']!r}; valid: {', '.join(COMBINES)}")
    if not data["hardware"]:
        raise ValueError(f"{path}: field 'hardware' must name at least one GPU (or {DEFAULT_HARDWARE_KEY!r})")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ValueError(f"{path}: field 'notes' must be a list of strings, got {notes!r}")
    terms = {str(hw): _terms(path, str(hw), values) for hw, values in data["hardware"].items()}
    return EngineOverhead(data["name"], data["source"], data["combine"], terms, tuple(notes), path)


def _terms(path: Path, hardware: str, values: Any) -> OverheadTerms:
    where = f"{path}: hardware.{hardware}"
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a mapping of terms, got {type(values).__name__}")
    fields = {f.name for f in dataclasses.fields(OverheadTerms)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown term(s) {unknown}; valid: {sorted(fields)}")
    try:
        return OverheadTerms(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def prefill_pair_seconds(model: ModelSpec, hardware: HardwareSpec, tp: int) -> float:
    """One query-key pair of one layer at peak: QK^T and PV, 2 FLOPs each per head dimension."""
    return 4 * model.num_heads / tp * model.head_dim / hardware.peak_flops


def decode_token_seconds(model: ModelSpec, hardware: HardwareSpec, tp: int) -> float:
    """Reading one cached token's K and V of one layer at datasheet bandwidth."""
    return 2 * model.num_kv_heads / tp * model.head_dim * model.dtype_bytes / hardware.hbm_bandwidth


def per_token_seconds(terms: OverheadTerms, model: ModelSpec, hardware: HardwareSpec) -> float:
    """The engine's per-token device work: bytes per token, hidden unit and layer, at this GPU's bandwidth
    (not split over TP: every rank does it)."""
    return (
        terms.device_bytes_per_token_hidden_layer
        * model.hidden_size
        * model.num_layers
        / hardware.hbm_bandwidth
    )
