"""Heuristic schedulers, each a :class:`~envs.serving.scheduling.Policy` over the shared interface.

Named presets live in ``conf/policy/NAME.yaml`` (``_target_`` plus arguments).
"""

from baselines.adaptive import Adaptive
from baselines.fairness import Edf, Vtc, Wvtc
from baselines.fixed_chunk import FixedChunk
from baselines.prefill_first import PrefillFirst
from baselines.sarathi import Sarathi
from baselines.vllm_v1 import VllmV1

__chunkgym__ = True
__all__ = ["Adaptive", "Edf", "FixedChunk", "PrefillFirst", "Sarathi", "VllmV1", "Vtc", "Wvtc"]
