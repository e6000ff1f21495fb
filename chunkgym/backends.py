"""Where parallel jobs run: ``local`` (this machine's processes) or ``ray`` (a Ray cluster).

One switch (``backend=local|ray``) for every tool that fans work out: evaluate.py's grid, capacity
searches and validation (through :func:`chunkgym.parallel.parallel_map`), the speculative
capacity search (any :class:`~concurrent.futures.Executor`: :func:`executor`) and
bench/headroom.py.  ``ray`` joins the cluster at ``$RAY_ADDRESS``; unset, it starts a Ray instance
on this machine, on loopback, for the run.  Ray is imported only when ``ray`` is asked for.

Jobs are deterministic and take everything they depend on as arguments, so a result does not
depend on the backend.  Ray workers must import the driver's checkout (the same path on every
node): each task checks it, and runs with one math thread, as the local workers do.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from chunkgym import DATA_ENV_VAR, REPO_ROOT, data_root

if TYPE_CHECKING:
    from ray import ObjectRef

BACKENDS = ("local", "ray")
ADDRESS_ENV_VAR = "RAY_ADDRESS"
"""The cluster ``backend=ray`` joins (``ray://`` or ``HOST:PORT``); unset: a fresh local instance."""
LOOPBACK_ENV_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's single-node switch: "0" keeps every Ray server of a local instance on 127.0.0.1 (it binds
to all interfaces otherwise); read when ray is first imported."""
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2
"""A locally started instance's shared-memory store: jobs pass traces and rows, never large arrays."""
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def worker_env() -> dict[str, str]:
    """Environment of the cluster's workers: the driver's checkout first on the path, its data, one thread."""
    return {
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        DATA_ENV_VAR: str(data_root()),
        "RAY_USAGE_STATS_ENABLED": "0",
        **dict.fromkeys(THREAD_ENV_VARS, "1"),
    }


@contextlib.contextmanager
def ray_session(num_cpus: int | None = None) -> Iterator[None]:
    """Connected to Ray inside the block: to ``$RAY_ADDRESS``, else to a local instance started here
    (``num_cpus``: its size, None: every core; on loopback only) and stopped at the end.  An existing
    connection is reused."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports leave the machine
    address = os.environ.get(ADDRESS_ENV_VAR) or None
    if address is None or _on_loopback(address):
        os.environ.setdefault(LOOPBACK_ENV_VAR, "0")  # else Ray swaps 127.0.0.1 for the host's address
    if address is not None and _token_available():
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # clusters check a token; sent in this mode only
    import ray  # reads both settings

    if ray.is_initialized():
        yield
        return
    common: dict[str, Any] = {
        "runtime_env": {"env_vars": worker_env()},
        "logging_level": logging.WARNING,
        "configure_logging": False,
    }
    if address is None:
        ray.init(
            address="local",  # never a cluster left running by someone else on this machine
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            _node_ip_address="127.0.0.1",
            **common,
        )
        log.info("started a local Ray instance (%s CPUs)", num_cpus or "all")
    else:
        ray.init(address=address, **common)
        log.info("joined the Ray cluster at %s", address)
    try:
        yield
    finally:
        ray.shutdown()


def _token_available() -> bool:
    """Whether Ray would find a cluster token here: ``$RAY_AUTH_TOKEN(_PATH)`` or ``~/.ray/auth_token``."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.isfile(path)


def _on_loopback(address: str) -> bool:
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def session(backend: str, workers: int = 0) -> Iterator[None]:
    """The block's jobs share one backend session: on ``ray``, one connection (or local instance of
    ``workers`` CPUs, 0: every core) for all of them; ``local`` needs none."""
    check_backend(backend)
    if backend == "local":
        yield
        return
    with ray_session(workers or None):
        yield


class _RayFuture(Future[Any]):
    """A task's future; cancelling it cancels the task (a queued one never starts)."""

    def __init__(self, ref: ObjectRef[Any]) -> None:
        super().__init__()
        self.ref = ref
        ref.future().add_done_callback(self._settle)

    def _settle(self, done: Future[Any]) -> None:
        if not self.set_running_or_notify_cancel():
            return
        exc = done.exception()
        if exc is None:
            self.set_result(done.result())
        else:
            self.set_exception(getattr(exc, "cause", None) or exc)  # the task's own exception

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        import ray

        ray.cancel(self.ref)
        return True


class RayExecutor(Executor):
    """``submit(fn, *args)`` runs ``fn(*args)`` as a one-CPU Ray task; needs :func:`ray_session`."""

    def __init__(self) -> None:
        import ray

        self._task = ray.remote(num_cpus=1, max_retries=0)(_run_task)
        self._live: set[_RayFuture] = set()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        future = _RayFuture(self._task.remote(str(REPO_ROOT), fn, *args, **kwargs))
        self._live.add(future)
        future.add_done_callback(self._live.discard)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        live = list(self._live)
        if cancel_futures:
            for future in live:
                future.cancel()
        if wait:
            for future in live:
                with contextlib.suppress(Exception):
                    future.exception()


@contextlib.contextmanager
def executor(backend: str, workers: int) -> Iterator[Executor]:
    """An executor of ``backend`` (``workers`` processes here; on Ray, tasks in flight are the caller's
    to bound); work still queued or running when the block ends is cancelled."""
    check_backend(backend)
    if backend == "local":
        with ProcessPoolExecutor(workers, initializer=quiet_collector) as pool:
            try:
                yield pool
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        return
    with session(backend, workers):
        tasks = RayExecutor()
        try:
            yield tasks
        finally:
            tasks.shutdown(wait=False, cancel_futures=True)


_pinned = False

WORKER_GC_THRESHOLD = (50_000, 50, 1_000)
"""The cyclic collector's thresholds in a worker (CPython's default: 700, 10, 10)."""


def quiet_collector() -> None:
    """In a worker process, before its first job: everything it inherited or imported so far (the
    driver's state, torch and the rest) is moved out of the cyclic collector's reach (``gc.freeze``),
    and collections come rarer. Why: a simulation allocates objects that outlive many collections
    (requests, their token records), so CPython's default thresholds scan the whole heap, the
    imports included, over and over. Collection only frees memory; no result depends on when it runs."""
    gc.freeze()
    gc.set_threshold(*WORKER_GC_THRESHOLD)


def _run_task(root: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """In a Ray worker: refuse another checkout than the driver's, pin math threads to one, run."""
    global _pinned
    if str(REPO_ROOT) != root:
        raise RuntimeError(
            f"the Ray worker on {socket.gethostname()} imports chunkgym from {REPO_ROOT}, not the "
            f"driver's {root}: put the same checkout at the same path on every node"
        )
    if not _pinned:
        _pinned = True
        if "torch" in sys.modules:  # imported before the env vars took effect
            sys.modules["torch"].set_num_threads(1)
        quiet_collector()
    return fn(*args, **kwargs)
