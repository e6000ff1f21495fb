"""A heap whose cost does not depend on history: glibc's allocator told never to map or trim.

glibc's ``malloc`` serves a block above its mmap threshold with a fresh mapping (page faults on
first touch, unmapped again on free), and moves that threshold up after such a block is freed,
so whether a step's activations land in fresh pages depends on the steps before it.  On vLLM's
CPU backend that made the per-token cost of ``vllm_small`` grow with the step's size (16 x 1024
tokens: 3.36-3.40 s with glibc's default, 2.46-2.61 s pinned; docs/vllm.md).  vLLM's CPU guide preloads tcmalloc for its allocation cost; the
pinned wheel does not bundle it and a preload cannot be set for a process already running, so the
engine's process sets glibc's own options instead (``mallopt``, malloc.h).  Imports no vLLM.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
"""``mallopt`` parameters (glibc's malloc.h)."""
pinned = False
"""Whether :func:`pin_heap` has pinned this process's heap (it stays so for the process's life)."""


def pin_heap() -> bool:
    """Serve every later allocation of this process from the heap (no mmapped blocks) and never hand
    freed memory back to the system (no trimming); :data:`pinned` records it.  False where the C
    library is not glibc (nothing changes there)."""
    global pinned
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    pinned = pinned or (bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1)))
    return pinned
