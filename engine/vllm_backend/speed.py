"""A machine's speed from its fitted vLLM profile, and the bench load that keeps the regime it was chosen for.

vLLM's CPU step times differ between machines of the same size (up to ~2.8x for a 512-token prefill
of ``vllm_small`` on 2-vCPU machines; docs/vllm.md), and a load fixed for the faster one puts every
policy deep in overload on the slower, where ``bench/sim_to_real_vllm.py`` no longer compares what it
was designed to.  The load therefore moves with the speed the fitted profile measures, never with a
result of the replays.  vLLM-free (pure arithmetic on a cost model), so tested in the default install.
"""

from __future__ import annotations

from calibration.iterations import Composition
from envs.serving.cost_model import RooflineCostModel

SPEED_PROBE = Composition(
    "prefill 448 + 16 decodes x ctx 256",
    decode_contexts=(256,) * 16,
    prefill_tokens=(448,),
    prefill_context=(0,),
)
"""The step whose fitted time stands for a machine's speed: a Sarathi-512 mixed batch of the profile grid."""


def probe_seconds(cost: RooflineCostModel) -> float:
    """The cost model's time for :data:`SPEED_PROBE`, priced as the profile's samples are."""
    return cost.iteration_time(*SPEED_PROBE.cost_args())


def machine_load(
    load_scale: float, reference_step_s: float | None, cost: RooflineCostModel
) -> tuple[float, float]:
    """(the load to serve at, the machine's speed against the reference): ``load_scale`` x
    ``reference_step_s`` / :func:`probe_seconds`, to two decimals; ``load_scale`` and 1.0 without a reference."""
    if reference_step_s is None:
        return load_scale, 1.0
    speed = reference_step_s / probe_seconds(cost)
    return round(load_scale * speed, 2), speed
