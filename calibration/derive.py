"""Roofline scaling of fitted terms to configurations no table measures.

A fitted per-layer curve splits into launch (``fixed``), element-wise traffic
(``per_unit``), weight reads (``mem``) and compute (``slope``, with the tile steps).  Moving
to another model or device multiplies each by the ratio of the work it does and the
rate it runs at: bytes over datasheet bandwidth for the memory-bound terms, FLOPs over
datasheet peak for compute, and launches unchanged.  Tensor-parallel degree is never
changed by a derivation (every source table has the degree asked for).
"""

from __future__ import annotations

from calibration.fit import StepRoofline
from envs.serving.specs import HardwareSpec, ModelSpec


def scale_layer(
    layer: StepRoofline,
    src_model: ModelSpec,
    src_hw: HardwareSpec,
    dst_model: ModelSpec,
    dst_hw: HardwareSpec,
) -> StepRoofline:
    """``layer`` (already :meth:`~StepRoofline.split`) of ``src_model`` on ``src_hw``, moved to the destination.

    Weight reads scale with layer weights over bandwidth; compute and the tile steps with
    layer FLOPs (proportional to the weights) over peak; element-wise traffic with the
    hidden size over bandwidth; launches stay.
    """
    weights = dst_model.layer_params / src_model.layer_params
    bandwidth = src_hw.hbm_bandwidth / dst_hw.hbm_bandwidth
    compute = src_hw.peak_flops / dst_hw.peak_flops
    return layer.scaled(
        fixed=1.0,
        per_unit=dst_model.hidden_size / src_model.hidden_size * bandwidth,
        mem=weights * bandwidth,
        slope=weights * compute,
    )


def scale_collective(line: StepRoofline, bandwidth_ratio: float) -> StepRoofline:
    """A collective on a link ``bandwidth_ratio`` times slower: the per-byte term scales, latency stays."""
    return line.scaled(slope=bandwidth_ratio)
