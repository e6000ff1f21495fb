"""Kernel-level cost parameters: per-layer fits and all-reduce fits turned into :class:`CostParams`.

These are the device-side terms of the cost model that the Vidur tables measure (linear
ops, all-reduce) plus the LM head from the same fit; attention and engine terms are zero
here and come from :mod:`calibration.whole_request`.
"""

from __future__ import annotations

from dataclasses import dataclass

from calibration.fit import StepRoofline
from envs.serving.cost_model import CostParams
from envs.serving.specs import HardwareSpec, ModelSpec

ALLREDUCES_PER_LAYER = 2
"""Megatron-style tensor parallelism: one after attention, one after the MLP."""


@dataclass(frozen=True)
class Kernels:
    """What one (model, hardware, tp) runs per layer: linear ops and all-reduce, with provenance.

    ``layer`` is already split (:meth:`StepRoofline.split`) into launch and weight-read time;
    ``allreduce`` is seconds against message bytes (``None`` at tp 1).
    """

    layer: StepRoofline
    allreduce: StepRoofline | None
    layer_source: str
    allreduce_source: str


def layer_weight_seconds(model: ModelSpec, hardware: HardwareSpec, tp: int) -> float:
    """Reading one layer's weight shard at the datasheet bandwidth: the memory term's share."""
    return model.layer_params * model.dtype_bytes / tp / hardware.hbm_bandwidth


def kernel_params(model: ModelSpec, hardware: HardwareSpec, tp: int, kernels: Kernels) -> CostParams:
    """Device-side :class:`CostParams` of the linear ops, all-reduce and LM head; the rest zero.

    The LM head is a GEMM like the layer's, on ``vocab x hidden`` weights instead of
    ``layer_params``: its weight read and its per-sequence compute scale from the layer fit.
    """
    layer = kernels.layer
    head_ratio = model.vocab_size * model.hidden_size / model.layer_params
    ar = kernels.allreduce
    if tp > 1 and ar is None:
        raise ValueError(
            f"{model.name} on {tp} x {hardware.name}: tensor parallelism needs an all-reduce fit"
        )
    message_bytes = model.hidden_size * model.dtype_bytes
    return CostParams(
        num_layers=model.num_layers,
        lin_fixed_s=layer.fixed,
        lin_mem_s=layer.mem,
        lin_s_per_token=layer.slope,
        lin_knee_tokens=layer.knee,
        lin_elementwise_s_per_token=layer.per_unit,
        lin_steps=tuple((int(t), h) for t, h in layer.steps),
        attn_prefill_s_per_pair=0.0,
        attn_prefill_fixed_s=0.0,
        attn_decode_s_per_token=0.0,
        attn_decode_fixed_s=0.0,
        allreduce_count=ALLREDUCES_PER_LAYER if tp > 1 else 0,
        allreduce_fixed_s=ar.fixed if tp > 1 and ar else 0.0,
        allreduce_s_per_token=ar.slope * message_bytes if tp > 1 and ar else 0.0,
        iter_fixed_s=0.0,
        head_fixed_s=layer.mem * head_ratio,
        head_s_per_seq=layer.slope * head_ratio,
    )
