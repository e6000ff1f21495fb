"""The window an episode serves: one draw shared by every env class, so that the same seed gives the
same windows whichever env (one server, a routed fleet, a disaggregated fleet) serves them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from envs.serving.workload import Workload
from envs.serving.workloads.trace import Trace

MAX_DRAWS = 16
"""Windows drawn in a row before an episode gives up: a bursty trace can leave a window empty."""


def episode_rng(np_random: np.random.Generator, input_seed: int | None, episode: int) -> np.random.Generator:
    """The generator an episode draws its window with: the env's own (``reset(seed=)``), or, with an
    ``input_seed``, one fixed by that seed and the episode's number, so the windows do not depend on
    how the agent's own randomness was seeded."""
    return np_random if input_seed is None else np.random.default_rng([input_seed, episode])


def draw_window(
    rng: np.random.Generator,
    workloads: Sequence[Workload],
    load_ranges: Mapping[str, tuple[float, float]],
    split: str,
    window_s: float | None,
    window_scale: float,
) -> tuple[Workload, float, Trace]:
    """A workload (uniform over ``workloads``), a load scale (uniform over its range) and a non-empty
    window of ``split`` (``window_s`` seconds, or the workload's own length times ``window_scale``)."""
    for _ in range(MAX_DRAWS):
        workload = workloads[int(rng.integers(len(workloads)))] if len(workloads) > 1 else workloads[0]
        lo, hi = load_ranges[workload.spec.name]
        load = float(rng.uniform(lo, hi)) if lo < hi else lo
        seconds = window_s if window_s is not None else workload.spec.window_s * window_scale
        trace = workload.window(split, int(rng.integers(2**31)), load, seconds)
        if len(trace):
            return workload, load, trace
    raise RuntimeError(
        f"{MAX_DRAWS} windows in a row of {[w.spec.name for w in workloads]} ({split}) were empty"
    )
