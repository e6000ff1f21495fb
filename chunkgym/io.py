"""Output files that are whole or absent, written only where the user said, one writer per output folder.

A run killed mid-write (or out of disk space) must never leave a truncated ``results.csv``
that a later ``evaluate.py results=`` would render as if complete: every output goes to a
temporary file in the same folder and is renamed over the target only once fully written.
Two runs writing into one folder would interleave their files, so a writer holds an
advisory lock (``fcntl.flock``) on the folder, which the kernel also releases when the
process dies, however it dies.

Run and output folders may have been received from someone else, so a write never follows a
link planted there (:func:`chunkgym.received.write_target` checks the target, and the temporary
file is created with ``O_EXCL | O_NOFOLLOW``), and an output folder may not be the filesystem
root, a system folder or part of the checkout's source (:func:`check_output_folder`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from chunkgym import REPO_ROOT
from chunkgym.received import ReceivedFileError, write_target

LOCK_FILE = ".chunkgym.lock"
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/boot", "/dev", "/proc", "/sys")
"""Folders whose whole tree is the system's (with ``/lib*``): no output goes inside them."""
SYSTEM_FOLDERS = ("/", "/var")
"""Folders that are the system's while their subfolders may be a user's (``/var/tmp``); the home folder too."""
SOURCE_FOLDERS = (
    "envs", "baselines", "policies", "conf", "leaderboard", "advisor", "engine",
    "calibration", "chunkgym", "tests", "bench", "docs", ".git",
)  # fmt: skip
"""The checkout's source folders: an output written there would change the code or config everyone runs."""
WRITABLE_SOURCE = ("policies/artifacts",)
"""Inside :data:`SOURCE_FOLDERS` but made for outputs (exported policies)."""
_PROCESS_HELD: set[Path] = set()  # folders locked until the process ends (lock_for_process)


class OutputFolderError(ValueError):
    """An output or run folder that chunkgym refuses to write into; one line naming it."""


def check_output_folder(directory: str | os.PathLike[str], key: str = "output_dir") -> Path:
    """``directory`` resolved (links followed), after checking that it is a place for outputs.

    Refused: the filesystem root, ``/var``, the home folder itself, anything inside
    :data:`SYSTEM_TREES` or ``/lib*``, and anything inside the checkout's :data:`SOURCE_FOLDERS`
    except :data:`WRITABLE_SOURCE` (``outputs/``, ``reports/`` and other folders are fine).
    """
    path = Path(directory).expanduser().resolve()
    why = _not_for_outputs(path)
    if why:
        raise OutputFolderError(
            f"{key}={os.fspath(directory)}: resolves to {path}, {why}; pick another folder"
        )
    return path


def _not_for_outputs(path: Path) -> str | None:
    """Why the resolved folder ``path`` may not take outputs; None if it may."""
    if str(path) in SYSTEM_FOLDERS or path == Path.home().resolve():
        return "a system or home folder itself"
    top = path.parts[1] if len(path.parts) > 1 else ""
    if f"/{top}" in SYSTEM_TREES or top.startswith("lib"):
        return f"inside the system folder /{top}"
    root = REPO_ROOT.resolve()
    if root not in path.parents:
        return None
    relative = path.relative_to(root).as_posix()
    if relative.split("/")[0] not in SOURCE_FOLDERS:
        return None
    if any(relative == w or relative.startswith(f"{w}/") for w in WRITABLE_SOURCE):
        return None
    return f"inside the checkout's source folder {relative.split('/')[0]}/"


def _create_new(path: Path) -> None:
    """Create ``path`` as a new empty regular file; a stale entry (a link too) is removed, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], folder: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """A temporary path beside ``path``; renamed to ``path`` when the block ends without error.

    On an error the temporary file is removed and ``path`` keeps its previous content (if any).
    With ``folder``, ``path`` must be inside it and not a link (:func:`chunkgym.received.write_target`).
    The temporary file is created here, as a new regular file, so the writer never follows a link.
    """
    target = write_target(path, folder) if folder is not None else Path(path)
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.tmp{target.suffix}")  # writers that go by suffix
    try:
        _create_new(tmp)
        yield tmp
        with tmp.open("rb+") as f:  # flushed to disk before the rename makes it visible
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(
    path: str | os.PathLike[str], text: str, folder: str | os.PathLike[str] | None = None
) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path, folder) as tmp:
        tmp.write_text(text)


def append_line(path: str | os.PathLike[str], line: str, folder: str | os.PathLike[str]) -> None:
    """Append ``line`` (and a newline) to ``path`` inside ``folder``; a link there is refused, never followed."""
    target = write_target(path, folder)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ReceivedFileError(f"{target}: cannot be appended to ({exc.strerror})") from None
    with os.fdopen(fd, "a") as f:
        f.write(line + "\n")


def refuse_links(folder: str | os.PathLike[str], names: Sequence[str]) -> None:
    """Before a tool writes ``names`` into ``folder`` (some by writers that open by path: plots,
    W&B), a link planted at any of them is refused with one line naming it."""
    for name in names:
        write_target(Path(folder) / name, folder)


class FolderLockedError(RuntimeError):
    """Another process writes into the folder; the message names it and the holder's pid."""


@contextlib.contextmanager
def folder_lock(directory: str | os.PathLike[str], tool: str) -> Iterator[Path]:
    """Hold ``directory``'s lock for the block; fail at once if another process holds it.

    The folder is checked first (:func:`check_output_folder`). The lock file stays (removing it
    would let a third process lock a fresh file while a second still holds the old one); the lock
    itself ends with the block or the process. A folder this process locked for its lifetime
    (:func:`lock_for_process`, taken before Hydra wrote anything) is held already.
    """
    folder = check_output_folder(directory)
    path = folder / LOCK_FILE
    if folder in _PROCESS_HELD:
        yield path
        return
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ReceivedFileError(f"{path}: cannot be opened as the folder's lock ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            raise FolderLockedError(
                f"{directory} is in use by another {tool} run ({holder}); wait for it to finish "
                "or pick another output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{tool}, pid {os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)


_PROCESS_LOCKS = contextlib.ExitStack()  # locks held until the process ends
atexit.register(_PROCESS_LOCKS.close)  # released while the module still stands


def lock_for_process(directory: str | os.PathLike[str], tool: str) -> Path:
    """Take ``directory``'s lock (:func:`folder_lock`) and hold it until the process ends; the
    process's own :func:`folder_lock` blocks on it then pass (another process's fail)."""
    path = _PROCESS_LOCKS.enter_context(folder_lock(directory, tool))
    _PROCESS_HELD.add(path.parent)
    return path
