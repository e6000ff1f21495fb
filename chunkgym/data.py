"""The public data files chunkgym reads: where each comes from, and the command that fetches them.

``data/sources.json`` pins every trace and GPU profile to its upstream repository, a commit and a
SHA-256 per file. The two Azure LLM inference 2023 traces ship in the repository (``data/``, the
fallback data folder, see :func:`chunkgym.data_file`); everything else is fetched into the data folder
(``$CHUNKGYM_DATA``, else the per-user cache ``$XDG_CACHE_HOME/chunkgym/data`` or
``~/.cache/chunkgym/data``, see :func:`chunkgym.data_root`)::

    python -m chunkgym.data fetch                   # download into the data folder, checking hashes
    python -m chunkgym.data fetch --from DIR        # the same from a local mirror, offline
    python -m chunkgym.data verify                  # check what the data folder holds
    python -m chunkgym.data list                    # sources, licences, what is present

A mirror holds each file either under ``DIR/<owner>/<repo>/<path upstream>`` (a copy of the upstream
locations) or under its place in a data folder (``DIR/traces/...``, another machine's data folder).
ServeGen's per-client files are checked one by one and packed into the one archive its workload reads.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from chunkgym import DATA_ENV_VAR, REPO_ROOT, SHIPPED_DATA, data_root
from chunkgym.received import MiB, ReceivedFileError, read_bytes

MANIFEST = REPO_ROOT / "data" / "sources.json"
FETCH_COMMAND = "python -m chunkgym.data fetch"


class MissingDataError(Exception):
    """A file the data folder lacks; every tool prints it as one line (it names :data:`FETCH_COMMAND`)."""


class MissingDataFile(MissingDataError, FileNotFoundError):
    """A missing profile or table, also a FileNotFoundError for callers that catch that."""

    def __init__(self, what: str, path: Path | str) -> None:
        super().__init__(f"{what} not found: {path}. Run `{FETCH_COMMAND}` (or `{FETCH_COMMAND} --from DIR`)")


RAW_URL = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
TIMEOUT_S = 60.0
MAX_FILE_BYTES = 64 * MiB
"""A pinned file (or an archive's members together) read from a mirror, a download or the data
folder: 20 times the largest (3 MB); checked before reading, so a sparse or endless file is refused."""

F = TypeVar("F", bound=Callable[..., Any])


class DataError(Exception):
    """A data file that is missing, unreadable or differs from its pinned hash; the message names it."""


@dataclass(frozen=True)
class DataFile:
    """One upstream file: its path in the upstream repository, its place in the data folder, its hash."""

    upstream: str
    path: str
    sha256: str


@dataclass(frozen=True)
class Archive:
    """Upstream files packed into one ``.tar.gz`` (members named by their upstream paths)."""

    path: str
    members: tuple[DataFile, ...]


@dataclass(frozen=True)
class Source:
    """One upstream repository at a pinned commit, and the files taken from it."""

    name: str
    repo: str
    commit: str
    licence: str
    files: tuple[DataFile, ...]
    archive: Archive | None = None
    shipped: bool = False

    def url(self, upstream: str) -> str:
        return RAW_URL.format(repo=self.repo, commit=self.commit, path=upstream)

    def paths(self) -> list[str]:
        """Every path this source puts in the data folder."""
        return [f.path for f in self.files] + ([self.archive.path] if self.archive else [])


def load_sources(manifest: Path = MANIFEST) -> list[Source]:
    """The sources of ``manifest`` (``data/sources.json``)."""
    raw = json.loads(manifest.read_text())

    def files(rows: list[dict[str, str]]) -> tuple[DataFile, ...]:
        return tuple(DataFile(r["upstream"], r["path"], r["sha256"]) for r in rows)

    sources = []
    for s in raw["sources"]:
        archive = s.get("archive")
        sources.append(
            Source(
                name=s["name"],
                repo=s["repo"],
                commit=s["commit"],
                licence=s["licence"],
                files=files(s["files"]),
                archive=Archive(archive["path"], files(archive["members"])) if archive else None,
                shipped=bool(s.get("shipped", False)),
            )
        )
    return sources


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- getting bytes: a mirror or the upstream URL ---------------------------------------------
Getter = Callable[[Source, DataFile, str | None], bytes]


def download(source: Source, file: DataFile, archive: str | None) -> bytes:
    """The file from its pinned upstream URL."""
    url = source.url(file.upstream)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            data: bytes = response.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise DataError(f"{url}: download failed ({exc}); use --from DIR with a local mirror") from exc
    if len(data) > MAX_FILE_BYTES:
        raise DataError(f"{url}: more than {MAX_FILE_BYTES} bytes; not the pinned file")
    return data


def from_mirror(mirror: Path) -> Getter:
    """A getter reading ``mirror/<owner>/<repo>/<upstream path>``, else the file's data-folder place."""

    def get(source: Source, file: DataFile, archive: str | None) -> bytes:
        upstream = mirror / source.repo / file.upstream
        if upstream.is_file():
            return _read(upstream)
        if archive is None:
            local = mirror / file.path
            if local.is_file():
                return _read(local)
            raise DataError(f"{file.path}: not in the mirror (tried {upstream} and {local})")
        members = _archive_members(mirror / archive)
        if file.path in members:
            return members[file.path]
        raise DataError(f"{file.path}: not in the mirror (tried {upstream} and {mirror / archive})")

    return get


def _read(path: Path) -> bytes:
    """A file of a mirror or the data folder, within :data:`MAX_FILE_BYTES` (a FIFO refused)."""
    try:
        return read_bytes(path, MAX_FILE_BYTES)
    except ReceivedFileError as exc:
        raise DataError(str(exc)) from None


@functools.lru_cache(maxsize=2)
def _archive_members_cached(path: str, _mtime_ns: int) -> dict[str, bytes]:
    members = {}
    with tarfile.open(path, "r:*") as tar:
        for m in tar:
            if m.offset_data + m.size > MAX_FILE_BYTES:  # before its data is read, or skipped over
                raise tarfile.ReadError(f"{path}: over {MAX_FILE_BYTES} bytes at member {m.name}")
            if m.isfile():
                content = tar.extractfile(m)
                assert content is not None  # a regular member always has a file object
                members[m.name] = content.read()
    return members


def _archive_members(path: Path) -> dict[str, bytes]:
    """Member name -> bytes of a ``.tar.gz`` (empty when absent or unreadable)."""
    try:
        return _archive_members_cached(str(path), path.stat().st_mtime_ns)
    except (OSError, tarfile.TarError, EOFError):
        return {}


# ---- checking and writing ---------------------------------------------------------------------
def problems(source: Source, root: Path) -> Iterator[str]:
    """Why ``source``'s files under ``root`` are not exactly the pinned ones (nothing when they are)."""
    for file in source.files:
        path = root / file.path
        if not path.is_file():
            yield f"{path}: missing"
            continue
        try:
            got = sha256(_read(path))
        except DataError as exc:
            yield str(exc)
            continue
        if got != file.sha256:
            yield f"{path}: SHA-256 {got} is not the pinned {file.sha256}"
    if source.archive is not None:
        yield from archive_problems(source.archive, root)


def archive_problems(archive: Archive, root: Path) -> Iterator[str]:
    """Why the archive under ``root`` does not hold exactly the pinned members."""
    path = root / archive.path
    members = _archive_members(path)
    if not members:
        yield f"{path}: missing or not a readable archive"
        return
    for m in archive.members:
        if m.path not in members:
            yield f"{path}[{m.path}]: missing"
        elif (got := sha256(members[m.path])) != m.sha256:
            yield f"{path}[{m.path}]: SHA-256 {got} is not the pinned {m.sha256}"


def checked(source: Source, file: DataFile, get: Getter, archive: str | None = None) -> bytes:
    """``file``'s bytes from ``get``, refused unless they hash to the pinned value."""
    data = get(source, file, archive)
    got = sha256(data)
    if got != file.sha256:
        raise DataError(
            f"{file.path}: SHA-256 {got} is not the pinned {file.sha256} "
            f"({source.repo}@{source.commit[:12]}:{file.upstream}); nothing written"
        )
    return data


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    os.replace(part, path)


def pack(members: list[tuple[str, bytes]]) -> bytes:
    """A reproducible ``.tar.gz``: sorted members, zero times and owners, so equal files give equal bytes."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, data in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def fetch_source(source: Source, dest: Path, get: Getter, say: Callable[[str], None]) -> int:
    """Put ``source``'s files into ``dest``, each checked; returns how many were written."""
    written = 0
    for i, file in enumerate(source.files, 1):
        path = dest / file.path
        if path.is_file() and sha256(_read(path)) == file.sha256:
            continue
        data = checked(source, file, get)
        _write(path, data)
        written += 1
        say(f"{source.name}: [{i}/{len(source.files)}] {file.path} ({len(data) / 1e6:.2f} MB, SHA-256 ok)")
    archive = source.archive
    if archive is not None and next(archive_problems(archive, dest), None) is not None:
        members = []
        for i, m in enumerate(archive.members, 1):
            members.append((m.path, checked(source, m, get, archive.path)))
            if i % 25 == 0 or i == len(archive.members):
                say(f"{source.name}: [{i}/{len(archive.members)}] archive members SHA-256 ok")
        _write(dest / archive.path, pack(members))
        written += 1
        say(f"{source.name}: packed {len(members)} files into {archive.path}")
    return written


def fetch(
    dest: Path, sources: list[Source], get: Getter = download, say: Callable[[str], None] = print
) -> int:
    """Fetch every non-shipped source into ``dest``; returns the number of files written."""
    written = 0
    for source in sources:
        if source.shipped:
            continue
        n = fetch_source(source, dest, get, say)
        say(
            f"{source.name}: {'up to date' if n == 0 else f'{n} file(s) written'} ({source.licence}, {source.repo})"
        )
        written += n
    return written


def verify(root: Path, sources: list[Source]) -> list[str]:
    """Every problem of ``root``'s files; shipped sources may live in the repository's ``data/``."""
    found = []
    for source in sources:
        where = [root, SHIPPED_DATA] if source.shipped else [root]
        per_root = [list(problems(source, r)) for r in where]
        if all(per_root):
            found.extend(per_root[0])
    return found


def exit_on(tool: str, *errors: type[BaseException]) -> Callable[[F], F]:
    """Turn ``errors`` raised by an entry point into one line on stderr and exit status 1 (no traceback)."""

    def decorate(main: F) -> F:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return main(*args, **kwargs)
            except errors as exc:
                raise SystemExit(f"{tool}: error: {exc}") from exc

        return run  # type: ignore[return-value]

    return decorate


# ---- command line -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkgym.data", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["fetch", "verify", "list"])
    parser.add_argument(
        "--from", dest="mirror", type=Path, help="a local mirror instead of the upstream URLs"
    )
    parser.add_argument(
        "--data",
        type=Path,
        help=f"the data folder (default ${DATA_ENV_VAR}, else the per-user cache "
        f"$XDG_CACHE_HOME/chunkgym/data or ~/.cache/chunkgym/data; now {str(data_root()).replace('%', '%%')})",
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these sources only (see `list`)")
    args = parser.parse_args(_hydra_style(sys.argv[1:] if argv is None else argv))
    sources = load_sources()
    if args.only:
        names = {s.name for s in sources}
        unknown = sorted(set(args.only) - names)
        if unknown:
            parser.error(f"unknown source(s) {unknown}; valid: {', '.join(sorted(names))}")
        sources = [s for s in sources if s.name in args.only]
    root = data_root(args.data)
    try:
        if args.command == "list":
            for s in sources:
                state = "ok" if not verify(root, [s]) else "absent or differs"
                kind = "shipped" if s.shipped else "fetched"
                print(f"{s.name:20s} {kind:8s} {s.licence:11s} {s.repo}@{s.commit[:12]}  {state}")
            return 0
        if args.command == "fetch":
            if args.mirror is not None and not args.mirror.is_dir():
                raise DataError(f"--from {args.mirror}: not a folder")
            get = download if args.mirror is None else from_mirror(args.mirror.resolve())
            print(f"fetching into {root}", flush=True)
            fetch(root, sources, get, functools.partial(print, flush=True))
        bad = verify(root, sources)
    except DataError as exc:
        print(f"chunkgym.data: error: {exc}", file=sys.stderr)
        return 1
    for line in bad:
        print(line, file=sys.stderr)
    if bad:
        print(
            f"chunkgym.data: {len(bad)} file(s) missing or differing; run `{FETCH_COMMAND}`", file=sys.stderr
        )
        return 1
    n = sum(len(s.files) + (len(s.archive.members) if s.archive else 0) for s in sources)
    print(f"{root}: all {n} files of {len(sources)} source(s) match their pinned SHA-256")
    return 0


def _hydra_style(argv: list[str]) -> list[str]:
    """Accept ``from=DIR``, ``data=DIR`` and ``only=[a,b]`` as well as the ``--`` options."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in ("from", "data", "only") and not arg.startswith("-"):
            out += [f"--{key}", *(value.strip("[]").split(",") if key == "only" else [value])]
        else:
            out.append(arg)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
