"""``chunkgym/ChunkedPrefill-v0``: choose each iteration's token budget and prefill allocation.

One step is one engine iteration of a simulated continuous-batching server replaying a
window of a real trace.

**Action** ``MultiDiscrete([9, 3])``: (budget level, allocation rule).  Budget levels are
64, 128, ..., 16384 tokens per iteration, decodes included (Sarathi-Serve's and vLLM's
meaning); rules are 0 = FCFS fill (partial prefills first, then arrival order),
1 = shortest remaining prompt first, 2 = least TTFT slack first.  Every fixed-budget
Sarathi-Serve is the constant action ``(level, 0)``.  ``action_masks()`` returns one
valid action per distinct plan (see :mod:`envs.actions`); an unmasked invalid action
is mapped to the valid action with the same plan, so ignoring masks is safe.

**Observation** ``Box(-1, 1, (16,), float32)``: the features of :mod:`envs.features`
(``FEATURES_V0`` documents each one).

**Reward**: +1 when a request finishes within its SLO, -1 the moment a request is
known to miss it (TTFT bound passed while queued, a token gap over the stall bound,
TPOT over bound at finish, or rejection), times ``reward_scale``.  Every request of the
window is counted exactly once, so the episode return is ``(good - bad) * scale =
(2 * goodput * span - requests) * scale``: an affine function of the window's goodput.

**Episodes**: a window of ``window_s`` trace-seconds from ``split`` (chosen by the
reset seed), arrivals scaled by a load drawn from ``load_scale``.  An episode ends by
truncation when every request of the window is decided (or after ``max_steps``);
there is no terminal state: the server runs on.

**info** per step: ``now``, ``latency``, ``decode_tokens``, ``prefill_tokens``,
``good``, ``bad``, ``requests``; at the end also ``episode`` (the run's metrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from envs.actions import ACTIONS_V0
from envs.features import FEATURE_NAMES_V0, features_v0
from envs.serving.metrics import SLOSpec, load_slo
from envs.serving.setup import DEFAULT_HARDWARE, DEFAULT_MODEL, ServingSetup
from envs.serving.simulator import Simulator
from envs.serving.specs import HardwareSpec, ModelSpec, load_hardware, load_model
from envs.serving.workload import Workload, load_workload


class ChunkedPrefillEnv(gym.Env[np.ndarray, np.ndarray]):
    """Token-budget and chunk-allocation control of a simulated LLM server.

    Args:
        workload: a name in ``conf/workload`` or ``file:PATH``, or a loaded :class:`Workload`.
        split: ``train`` (default), ``val``, ``test`` or ``all``.
        model, hardware, tp: names in ``conf/model`` and ``conf/hardware`` (or specs); tensor parallelism.
        slo: a name in ``conf/slo`` (or an :class:`~envs.serving.metrics.SLOSpec`).
        cost_model: ``calibrated``, ``roofline`` or a coefficient-file path.
        load_scale: a float, or a (low, high) pair sampled uniformly per episode.
        window_s: trace-seconds per episode (default: the workload's ``window_s``).
        max_steps: hard cap on iterations per episode.
        reward_scale: multiplies the +1/-1 per-request rewards.
        serving: overrides of :class:`~envs.serving.core.ServingConfig` fields.
        data_root: where the traces live (default ``chunkgym.data_root()``).
    """

    metadata = {"render_modes": []}
    feature_names = FEATURE_NAMES_V0
    features = staticmethod(features_v0)
    actions = ACTIONS_V0

    def __init__(
        self,
        workload: str | Workload = "azure_conv",
        split: str = "train",
        model: str | ModelSpec = DEFAULT_MODEL,
        hardware: str | HardwareSpec = DEFAULT_HARDWARE,
        tp: int = 1,
        slo: str | SLOSpec = "strict",
        cost_model: str = "calibrated",
        load_scale: float | Sequence[float] = 1.0,
        window_s: float | None = None,
        max_steps: int = 200_000,
        reward_scale: float = 1.0,
        serving: dict[str, Any] | None = None,
        data_root: str | None = None,
    ) -> None:
        self.workloads = [workload if isinstance(workload, Workload) else load_workload(workload, data_root)]
        self.split = split
        self.setup = ServingSetup.from_specs(
            load_model(model) if isinstance(model, str) else model,
            load_hardware(hardware) if isinstance(hardware, str) else hardware,
            tp,
            load_slo(slo) if isinstance(slo, str) else slo,
            cost_model,
            serving,
        )
        if isinstance(load_scale, int | float):
            load_scale = (float(load_scale), float(load_scale))
        self.load_range = (float(load_scale[0]), float(load_scale[-1]))
        if not 0 < self.load_range[0] <= self.load_range[1]:
            raise ValueError(f"load_scale must be positive and ordered, got {load_scale}")
        self.window_s = window_s
        self.max_steps = max_steps
        self.reward_scale = reward_scale
        self.action_space = spaces.MultiDiscrete(self.actions.nvec)
        self.observation_space = spaces.Box(-1.0, 1.0, (len(self.feature_names),), np.float32)
        self.sim: Simulator | None = None
        self._steps = 0
        self._score = 0

    # ---- gymnasium API -------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        rng = self._episode_rng()
        for _ in range(16):  # a bursty trace can leave a window empty: draw another
            workload = (
                self.workloads[int(rng.integers(len(self.workloads)))]
                if len(self.workloads) > 1
                else self.workloads[0]
            )
            lo, hi = self.load_range
            load = float(rng.uniform(lo, hi)) if lo < hi else lo
            trace = workload.window(self.split, int(rng.integers(2**31)), load, self._window_s(workload))
            if len(trace):
                break
        else:
            raise RuntimeError(
                f"16 windows in a row of {[w.spec.name for w in self.workloads]} ({self.split}) were empty"
            )
        self.workload, self.load = workload, load
        self.sim = self.setup.simulator(trace)
        self._advance()
        self._steps = 0
        self._score = 0
        info = {
            "requests": len(trace),
            "load_scale": load,
            "workload": workload.spec.name,
            "now": self.sim.core.now,
        }
        return self._obs(), info

    def step(self, action: np.ndarray):
        sim = self.sim
        if sim is None:
            raise RuntimeError("call reset() before step()")
        core = sim.core
        latency = sim.step(self.actions.plan(sim.view, int(action[0]), int(action[1])))
        more = self._advance()
        self._steps += 1
        score = self._score_of(core)
        reward = (score - self._score) * self.reward_scale
        self._score = score
        n = len(core.requests)
        truncated = (core.n_good + core.n_bad == n) or not more or self._steps >= self.max_steps
        log = sim.log
        info = {
            "now": core.now,
            "latency": latency,
            "decode_tokens": log["decode_tokens"][-1],
            "prefill_tokens": log["prefill_tokens"][-1],
            "good": core.n_good,
            "bad": core.n_bad,
            "requests": n,
        }
        if truncated:
            info["episode"] = sim.result().metrics
        return self._obs(), float(reward), False, truncated, info

    def action_masks(self) -> np.ndarray:
        """Valid actions for sb3-contrib's MaskablePPO: budget levels, then rules."""
        return self.actions.mask(self.sim.view)

    # ---- hooks for later versions -------------------------------------------------------------
    def _episode_rng(self) -> np.random.Generator:
        """Where an episode's window and load come from: the env's seeded generator."""
        return self.np_random

    def _window_s(self, workload: Workload) -> float | None:
        return self.window_s

    def _advance(self) -> bool:
        """Move to the next decision point; False once the trace is done."""
        return self.sim.advance_to_work()

    def _obs(self) -> np.ndarray:
        return self.features(self.sim.view)

    @staticmethod
    def _score_of(core) -> int:
        """Cumulative reward (unscaled): requests known good minus requests known bad."""
        return core.n_good - core.n_bad
