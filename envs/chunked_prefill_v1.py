"""``chunkgym/ChunkedPrefill-v1``: v0's problem, made learnable across workloads.

Differences from v0 (which stays registered, unchanged):

* **Steps are decisions.**  Iterations whose only valid action is forced (no prompt
  waiting: every action just steps the decodes) run without asking the agent; their
  rewards accrue to the next step.  So one step is one iteration in which the
  budget or the rule can change the plan.
* **Action** ``MultiDiscrete([9, 4])``: v0's rules plus 3 = least TTFT slack first
  among prompts that can still meet TTFT, the ones already past it last.
* **Observation** ``Box(-1, 1, (26,))``: :data:`envs.features.FEATURES_V1` (v0's 16 plus
  TPOT slack of the most at-risk stream, doomed work, queued KV demand, a cost-model
  prediction of serving everything now, prefix-cache hits).
* **Episodes** draw a workload from ``workloads`` and a load from ``load_scale`` (each
  workload's own 1x), over ``window_scale`` times its window.  With ``input_seed``
  set, the k-th episode of every env with that seed replays the same (workload,
  window, load): common random numbers across parallel envs, so the advantage of an
  action is not drowned by the difference between two arrival sequences.

* **Reward, same sum, earlier signal.**  v0 pays +1 when a request finishes within its SLO
  and -1 the moment one is known to miss it.  v1 pays the +1 as soon as the request's
  first token meets its TTFT bound, and -2 if it later misses TPOT or stall (-1 if it
  never met TTFT).  Every request still nets exactly +1 or -1, so the return is v0's,
  ``(2 * goodput * span - requests) * scale``; but TTFT decisions, the ones the
  allocation rule makes, are rewarded seconds earlier instead of at the end of decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from envs.actions import ACTIONS_V1
from envs.chunked_prefill import ChunkedPrefillEnv
from envs.features import FEATURE_NAMES_V1, features_v1
from envs.serving.loop import StepDecodes
from envs.serving.workload import Workload, load_workload

TRAIN_WORKLOADS = ("azure_conv", "azure_code", "mooncake_conv", "sharegpt_poisson")


class ChunkedPrefillEnvV1(ChunkedPrefillEnv):
    """Decision-level steps over several workloads; see the module docstring.

    Args (beyond :class:`ChunkedPrefillEnv`'s, whose ``workload`` this replaces):
        workloads: names (``conf/workload``, ``file:PATH``) or loaded workloads to draw from.
        window_scale: episode window = this x each workload's ``window_s`` (unless ``window_s`` is set).
        input_seed: if set, episode inputs come from ``(input_seed, episode index)``.
    """

    feature_names = FEATURE_NAMES_V1
    features = staticmethod(features_v1)
    actions = ACTIONS_V1

    def __init__(
        self,
        workloads: Sequence[str | Workload] | str = TRAIN_WORKLOADS,
        window_scale: float = 1.0,
        input_seed: int | None = None,
        data_root: str | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(workloads, str | Workload):
            workloads = [workloads]
        if not workloads:
            raise ValueError("workloads must name at least one workload")
        loaded = [w if isinstance(w, Workload) else load_workload(w, data_root) for w in workloads]
        super().__init__(workload=loaded[0], data_root=data_root, **kwargs)
        self.workloads = loaded
        if window_scale <= 0:
            raise ValueError(f"window_scale must be > 0, got {window_scale}")
        self.window_scale = window_scale
        self.input_seed = input_seed
        self._episodes = 0

    def _episode_rng(self) -> np.random.Generator:
        self._episodes += 1
        if self.input_seed is None:
            return self.np_random
        return np.random.default_rng([self.input_seed, self._episodes])

    def _window_s(self, workload: Workload) -> float | None:
        return self.window_s if self.window_s is not None else workload.spec.window_s * self.window_scale

    @staticmethod
    def _score_of(core) -> int:
        """+1 per request credited at its first token, -1 per request known bad, -1 more if it was credited."""
        return core.n_credited - core.n_uncredited - core.n_bad

    def _advance(self) -> bool:
        """Run forced iterations (no prompt waiting) until a decision matters or all requests are decided."""
        core = self.sim.core
        n = len(core.requests)
        return self.sim.run_until(
            StepDecodes(), stop=lambda: bool(core.queue) or core.n_good + core.n_bad == n
        )
