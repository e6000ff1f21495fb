"""What ``ChunkedPrefillEnv.render()`` shows: a text line or the batch timeline, from the simulator's state.

Both read what the simulator already records (its core and iteration log), so rendering
costs nothing unless asked for.
"""

from __future__ import annotations

import numpy as np

from envs.serving.loop import IterationLog
from envs.serving.simulator import Simulator

TIMELINE_ITERATIONS = 256  # image width: one pixel column per iteration, the newest on the right
TIMELINE_HEIGHT = 96
DECODE_RGB = (31, 119, 180)
PREFILL_RGB = (255, 127, 14)
BACKGROUND_RGB = (255, 255, 255)


def ansi_line(sim: Simulator) -> str:
    """The clock, the last iteration's batch and latency, the queue, and the requests decided so far."""
    core, log = sim.core, sim.log
    if len(log):
        last = (
            f"iteration {len(log)}: {log['decode_tokens'][-1]} decode + {log['prefill_tokens'][-1]} prefill "
            f"tokens in {log['latency'][-1] * 1e3:.2f} ms"
        )
    else:
        last = "no iteration yet"
    return (
        f"t={core.now:.3f}s {last}; {len(core.queue)} prompts queued, {core.decode.n} decoding; "
        f"{core.n_good} good, {core.n_bad} bad of {len(core.requests)}"
    )


def timeline_image(log: IterationLog) -> np.ndarray:
    """``uint8[TIMELINE_HEIGHT, TIMELINE_ITERATIONS, 3]``: the last iterations' batches as stacked bars,
    decode tokens (blue) under prefill tokens (orange), scaled to the largest batch shown."""
    decode = np.asarray(log["decode_tokens"][-TIMELINE_ITERATIONS:], dtype=np.float64)
    total = decode + np.asarray(log["prefill_tokens"][-TIMELINE_ITERATIONS:], dtype=np.float64)
    pad = TIMELINE_ITERATIONS - len(decode)
    decode, total = np.pad(decode, (pad, 0)), np.pad(total, (pad, 0))
    scale = TIMELINE_HEIGHT / max(float(total.max(initial=0.0)), 1.0)
    height = (np.arange(TIMELINE_HEIGHT, 0, -1, dtype=np.float64) - 0.5)[
        :, None
    ]  # row centres, from the bottom
    image = np.empty((TIMELINE_HEIGHT, TIMELINE_ITERATIONS, 3), dtype=np.uint8)
    image[...] = BACKGROUND_RGB
    image[height < total * scale] = PREFILL_RGB
    image[height < decode * scale] = DECODE_RGB
    return image
