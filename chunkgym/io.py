"""Output files that are whole or absent, and one writer per output folder.

A run killed mid-write (or out of disk space) must never leave a truncated ``results.csv``
that a later ``evaluate.py results=`` would render as if complete: every output goes to a
temporary file in the same folder and is renamed over the target only once fully written.
Two runs writing into one folder would interleave their files, so a writer holds an
advisory lock (``fcntl.flock``) on the folder, which the kernel also releases when the
process dies, however it dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".chunkgym.lock"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path``; renamed to ``path`` when the block ends without error.

    On an error the temporary file is removed and ``path`` keeps its previous content (if any).
    """
    target = Path(path)
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.tmp{target.suffix}")  # writers that go by suffix
    try:
        yield tmp
        with tmp.open("rb+") as f:  # flushed to disk before the rename makes it visible
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


class FolderLockedError(RuntimeError):
    """Another process writes into the folder; the message names it and the holder's pid."""


@contextlib.contextmanager
def folder_lock(directory: str | os.PathLike[str], tool: str) -> Iterator[Path]:
    """Hold ``directory``'s lock for the block; fail at once if another process holds it.

    The lock file stays (removing it would let a third process lock a fresh file while a
    second still holds the old one); the lock itself ends with the block or the process.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            raise FolderLockedError(
                f"{folder} is in use by another {tool} run ({holder}); wait for it to finish "
                "or pick another output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{tool}, pid {os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)
