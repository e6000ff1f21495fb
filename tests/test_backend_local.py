"""backend=local: the process pool's workers start with the cyclic collector quietened."""

from __future__ import annotations

import gc

from chunkgym.backends import WORKER_GC_THRESHOLD, executor


def collector_state(_: int) -> tuple[tuple[int, int, int], int]:
    return gc.get_threshold(), gc.get_freeze_count()


def test_local_workers_freeze_what_they_start_with_and_collect_rarer_and_the_driver_is_left_alone():
    before = gc.get_threshold()
    with executor("local", 2) as pool:
        states = list(pool.map(collector_state, range(4)))
    assert all(threshold == WORKER_GC_THRESHOLD and frozen > 0 for threshold, frozen in states)
    assert gc.get_threshold() == before != WORKER_GC_THRESHOLD
