"""Reading files a user may have received: inside the folder they named, within a budget.

Run folders, policy folders, results files, traces and cost files come from other people.  A
received file is data and nothing more, so every read here holds three promises:

* **containment**: a path derived from a folder the user named resolves inside that folder, and
  is opened without following a link (``O_NOFOLLOW`` on the last component, the resolved parent
  checked against the folder), as a regular file: links, FIFOs (which would block ``open``),
  devices and sockets are refused;
* **budget**: the size is checked before anything is allocated, by the file's apparent size (a
  sparse file counts in full), and a read never materialises more than the budget;
* **one line**: every refusal is a :class:`ReceivedFileError` whose message names the file and the
  limit or field, which the tools print as one line (exit code 2).

JSON and YAML documents also get a nesting limit (deep nesting is a ``RecursionError`` in the
parsers) and YAML refuses anchors and aliases (a few KB of aliases expand to gigabytes), so parsing
a document costs memory in proportion to its size.  Nothing here is a third-party library's job:
the standard library's ``os.open`` flags and PyYAML's event stream are the tools, and no
well-kept package bundles these checks for local files.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

MiB = 1 << 20
MAX_DOCUMENT_BYTES = 16 * MiB  # a JSON or YAML document (policy.json, checkpoint.json, config.yaml, ...)
MAX_DEPTH = 64  # nesting of lists and mappings in a JSON or YAML document


class ReceivedFileError(ValueError):
    """A received file (or a path inside a received folder) that is refused; the message is one
    line naming the path and the reason.  ``detail`` is the reason alone where a reader words it
    its own way (a YAML syntax error: the parser's context and problem, never the line's text)."""

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = detail if detail is not None else message


def inside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """``path`` resolved, after checking that it stays inside ``folder`` (resolved) and is not a link.

    Raises :class:`ReceivedFileError` when it leaves the folder (through ``..`` or a link in a
    parent) or is a symbolic link itself.
    """
    root = Path(folder).resolve()
    p = Path(path)
    if not p.is_absolute():
        p = root / p
    if p.is_symlink():
        raise ReceivedFileError(f"{p}: is a symbolic link; files in {root} must be regular files inside it")
    resolved = p.parent.resolve() / p.name
    if resolved != root and root not in resolved.parents:
        raise ReceivedFileError(f"{p}: resolves to {resolved}, outside {root}")
    return resolved


def open_regular(
    path: str | os.PathLike[str], folder: str | os.PathLike[str] | None = None
) -> tuple[int, int]:
    """Open ``path`` for reading without following a final link; ``(fd, apparent size)``.

    With ``folder``, the path must stay inside it (:func:`inside`).  Refuses anything but a
    regular file, before reading a byte: ``O_NONBLOCK`` keeps a FIFO from blocking the open.
    """
    p = inside(path, folder) if folder is not None else Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a link
            raise ReceivedFileError(f"{p}: is a symbolic link; a regular file is expected") from None
        raise ReceivedFileError(f"{p}: cannot be opened ({exc.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "directory" if stat.S_ISDIR(info.st_mode) else "FIFO, device or socket"
        raise ReceivedFileError(f"{p}: is a {kind}; a regular file is expected")
    os.set_blocking(fd, True)
    return fd, info.st_size


def read_bytes(
    path: str | os.PathLike[str], max_bytes: int, folder: str | os.PathLike[str] | None = None
) -> bytes:
    """The whole of a regular file of at most ``max_bytes`` (apparent size, checked before reading)."""
    fd, size = open_regular(path, folder)
    try:
        if size > max_bytes:
            raise ReceivedFileError(f"{path}: {size} bytes, over the limit of {max_bytes} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while being read
        raise ReceivedFileError(f"{path}: over the limit of {max_bytes} bytes")
    return data


def read_text(
    path: str | os.PathLike[str], max_bytes: int, folder: str | os.PathLike[str] | None = None
) -> str:
    """:func:`read_bytes` decoded as UTF-8 (a leading byte-order mark, as Excel writes, dropped)."""
    data = read_bytes(path, max_bytes, folder)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ReceivedFileError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _check_depth(text: str, source: str, max_depth: int) -> None:
    """Refuse JSON nested deeper than ``max_depth`` (brackets outside strings), before parsing."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                raise ReceivedFileError(f"{source}: nested deeper than {max_depth} levels")
        elif ch in "]}":
            depth -= 1


def parse_json(text: str, source: str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` with a nesting limit and one-line errors naming ``source``."""
    if text.count("[") + text.count("{") > max_depth:  # cheap: only then scan for depth
        _check_depth(text, source, max_depth)
    try:
        return json.loads(text)
    except ReceivedFileError:
        raise
    except json.JSONDecodeError as exc:
        raise ReceivedFileError(
            f"{source}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except (RecursionError, ValueError) as exc:  # ValueError: an integer past Python's digit limit
        raise ReceivedFileError(
            f"{source}: not a readable JSON document ({str(exc).splitlines()[0][:120]})"
        ) from None


def load_json(
    path: str | os.PathLike[str],
    folder: str | os.PathLike[str] | None = None,
    max_bytes: int = MAX_DOCUMENT_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """A received JSON document: contained, within ``max_bytes`` and ``max_depth``."""
    return parse_json(read_text(path, max_bytes, folder), str(path), max_depth)


def parse_yaml(text: str, source: str, max_depth: int = MAX_DEPTH) -> Any:
    """``yaml.safe_load`` of a received document, refusing anchors, aliases and deep nesting
    (checked on the event stream, before any node is built)."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                mark = event.start_mark
                raise ReceivedFileError(
                    f"{source}: uses a YAML anchor or alias (line {mark.line + 1 if mark else '?'}); "
                    "received files must spell every value out"
                )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > max_depth:
                    raise ReceivedFileError(f"{source}: nested deeper than {max_depth} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        return yaml.safe_load(text)
    except ReceivedFileError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        context = getattr(exc, "context", None)
        detail = f"{context}: {problem}{where}" if context else f"{problem}{where}"
        raise ReceivedFileError(f"{source}: not valid YAML{where}: {problem}", detail) from None
    except (RecursionError, ValueError) as exc:
        raise ReceivedFileError(
            f"{source}: not a readable YAML document ({str(exc).splitlines()[0][:120]})"
        ) from None


def load_yaml(
    path: str | os.PathLike[str],
    folder: str | os.PathLike[str] | None = None,
    max_bytes: int = MAX_DOCUMENT_BYTES,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """A received YAML document: contained, within ``max_bytes`` and ``max_depth``, no aliases."""
    return parse_yaml(read_text(path, max_bytes, folder), str(path), max_depth)


def write_target(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """``path`` checked as a place to write inside ``folder``: inside it, and not a link (a link
    planted in a shared run folder would redirect the write elsewhere)."""
    return inside(path, folder)
