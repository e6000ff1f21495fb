"""Coefficient files (``conf/cost/*.yaml``) and engine overhead profiles (``conf/engine_overhead/*.yaml``):
their content and writing them, for every source.

Reading and validating them is :func:`envs.serving.cost_model.read_cost_file` and
:func:`envs.serving.engine_overhead.read_engine_overhead`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from envs.serving.cost_model import DEVICE_ONLY, OPTIONAL_FIELDS, CostParams, cost_file_name
from envs.serving.engine_overhead import EngineOverhead

SIGNIFICANT = 6
"""Digits kept: far below measurement noise, and stable against last-bit float differences."""

HEADER = (
    "# Cost-model coefficients for chunkgym's simulator (envs/serving/cost_model.py).\n"
    "# Written by `python -m calibration`; do not edit by hand. Times in seconds.\n"
)
"""The header of files fitted to published profiles; a live source names its own command."""
PROFILE_HEADER = (
    "# Engine overhead profile for chunkgym's cost model (envs/serving/engine_overhead.py).\n"
    "# Written by `python -m calibration`; do not edit by hand. Times in seconds.\n"
)


@dataclasses.dataclass(frozen=True)
class CostFile:
    """One coefficient file's content."""

    hardware: str
    model: str
    tp: int
    derived: bool
    source: str
    params: CostParams
    fit: dict
    device_only: bool = False


def write_cost_files(files: list[CostFile], out_dir: Path, header: str = HEADER) -> list[Path]:
    """One YAML per configuration under ``header``, overwriting; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for f in files:
        path = out_dir / cost_file_name(f.hardware, f.model, f.tp)
        path.write_text(
            header + yaml.safe_dump(cost_file_mapping(f), sort_keys=False, width=110, default_flow_style=None)
        )
        written.append(path)
    return written


def cost_file_mapping(f: CostFile) -> dict[str, Any]:
    params = {k: v for k, v in dataclasses.asdict(f.params).items() if v or k not in OPTIONAL_FIELDS}
    params["lin_steps"] = [[int(t), _round(h)] for t, h in f.params.lin_steps]
    out: dict[str, Any] = {"hardware": f.hardware, "model": f.model, "tp": f.tp, "derived": f.derived}
    if f.device_only:
        out[DEVICE_ONLY] = True
    out.update(source=f.source, params={k: _round(v) for k, v in params.items()}, fit=_round(f.fit))
    return out


def write_engine_overheads(profiles: list[EngineOverhead], out_dir: Path) -> list[Path]:
    """One YAML per profile, ``<name>.yaml``, overwriting; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for p in profiles:
        path = out_dir / f"{p.name}.yaml"
        mapping = {
            "name": p.name,
            "source": p.source,
            "combine": p.combine,
            "notes": list(p.notes),
            "hardware": {
                hw: {
                    k: _round(v)
                    for k, v in dataclasses.asdict(t).items()
                    if v is not None and (v != 0 or k.startswith("attention_"))
                }
                for hw, t in p.hardware.items()
            },
        }
        path.write_text(PROFILE_HEADER + yaml.safe_dump(mapping, sort_keys=False, width=110))
        written.append(path)
    return written


def _round(value: Any) -> Any:
    if isinstance(value, bool) or isinstance(value, int) and not isinstance(value, float):
        return value
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT}g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_round(v) for v in value]
    return value
