"""Map a function over jobs on a process pool or a Ray cluster with a progress bar; results in job order."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from joblib import Parallel, delayed
from tqdm import tqdm

from chunkgym.backends import check_backend, executor


class JobError(RuntimeError):
    """A job failed; the message names the job (its ``label``)."""


def default_jobs() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parallel_map(
    fn: Callable[[Any], Any],
    jobs: Sequence[Any],
    n_jobs: int = 0,
    desc: str = "",
    progress: bool = True,
    backend: str = "local",
) -> list[Any]:
    """``[fn(job) for job in jobs]`` on ``backend`` (:mod:`chunkgym.backends`).

    ``local``: over ``n_jobs`` loky processes (0: all cores; 1: in this process). ``ray``: as
    Ray tasks, at most ``n_jobs`` in flight (0: all at once; the cluster queues them).
    Each job is independent and deterministic, so the results do not depend on the backend,
    ``n_jobs`` or the order jobs finish in; they come back in job order. A failure raises
    :class:`JobError` naming the job.
    """
    check_backend(backend)
    results: list[Any] = [None] * len(jobs)
    with tqdm(total=len(jobs), desc=desc, disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        done = _on_ray(fn, jobs, n_jobs) if backend == "ray" else _on_loky(fn, jobs, n_jobs)
        for i, result in done:
            results[i] = result
            bar.update()
    return results


def _on_loky(fn: Callable[[Any], Any], jobs: Sequence[Any], n_jobs: int) -> Iterator[tuple[int, Any]]:
    n_jobs = n_jobs or default_jobs()
    tasks = (delayed(_indexed)(fn, i, job, os.getpid()) for i, job in enumerate(jobs))
    runner = Parallel(n_jobs=min(n_jobs, max(len(jobs), 1)), return_as="generator_unordered")
    yield from runner(tasks)


def _on_ray(fn: Callable[[Any], Any], jobs: Sequence[Any], n_jobs: int) -> Iterator[tuple[int, Any]]:
    """(index, result) as Ray tasks finish; leaving early (an error, Ctrl-C) cancels the rest."""
    width = n_jobs or max(len(jobs), 1)
    queue = iter(enumerate(jobs))
    with executor("ray", n_jobs) as pool:
        running: dict[Future[Any], int] = {}
        while True:
            for i, job in queue if len(running) < width else ():
                running[pool.submit(_labelled, fn, job)] = i
                if len(running) >= width:
                    break
            if not running:
                return
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                yield running.pop(future), future.result()


_watched = False
PARENT_POLL_S = 0.5


def _exit_with_parent(parent: int) -> None:
    """In a worker: exit as soon as ``parent`` (the process that mapped the jobs) is gone, even by SIGKILL.

    Loky's workers otherwise finish their queued jobs as orphans; the parent's own exits
    (Ctrl-C, SIGTERM) shut the pool down through joblib already.
    """
    global _watched
    if _watched or parent == os.getpid():  # n_jobs=1 runs jobs in the parent itself
        return
    _watched = True

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _indexed(fn: Callable[[Any], Any], i: int, job: Any, parent: int) -> tuple[int, Any]:
    _exit_with_parent(parent)
    return i, _labelled(fn, job)


def _labelled(fn: Callable[[Any], Any], job: Any) -> Any:
    try:
        return fn(job)
    except Exception as exc:
        raise JobError(f"{getattr(job, 'label', job)}: {type(exc).__name__}: {exc}") from exc
