"""Readers for request files: Azure 2023 CSV, Mooncake JSONL, length-only CSV.

Each reader validates every row (a bad value raises :class:`TraceError` naming file, 1-based line
and field: lengths at most 2**31 - 1, hash ids within int64; the optional tenant and SLO-class
labels, a ``Tenant``/``SloClass`` column in CSV or a ``tenant``/``slo_class`` field in every
Mooncake record or none, non-empty printable text of at most 64 characters, a class named in
``conf/slo_class``) and the time axis (a
trace with no time span, or whose span one outlier timestamp makes, is refused with the
numbers, since every rate computed on it would be meaningless), and returns :class:`Rows`, cached per resolved path, size and modification time, so a
file is parsed once per process however many workloads use it. Nothing is dropped: every data row
becomes a request (blank lines are not rows). Files may be gzip-compressed (``.csv.gz``,
``.jsonl.gz``); text must be UTF-8 (a leading byte-order mark, as Excel writes, is dropped).

A trace is received data, so reading it is bounded: the file is opened as a regular file (a FIFO
or device is refused, never waited on), its text (decompressed, blank lines included) may hold at
most :func:`max_trace_bytes` (64 MiB, ``CHUNKGYM_MAX_TRACE_BYTES`` raises it), checked on the
apparent size before reading (a sparse file counts in full) and while decompressing (never past
the budget), and rows are parsed a batch at a time into arrays, so memory is a small multiple of
the text's size (about 10 bytes per byte at worst, with rows of a few bytes each) however the
text is shaped.  The file is read twice: once to check that all of it decompresses and decodes
(those problems come first, as for a file read whole), then to parse.
"""

from __future__ import annotations

import codecs
import errno
import functools
import gzip
import io
import itertools
import json
import math
import os
import re
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import numpy as np
import pandas as pd

from chunkgym.received import MiB, ReceivedFileError, open_regular
from envs.serving.workloads.trace import TraceError, class_problem, label_problem

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
LABEL_COLUMNS = ("Tenant", "SloClass")
"""Optional CSV columns (Azure and length-only files): each row's tenant and SLO class."""
LABEL_FIELDS = ("tenant", "slo_class")
"""Optional Mooncake fields: each record's tenant and SLO class."""
MOONCAKE_BLOCK_TOKENS = 512
MAX_LENGTH = 2**31 - 1
"""Largest token count accepted (far past any context window; exact when parsed as a float)."""
MAX_MOONCAKE_MS = 2**53
INT64 = (-(2**63), 2**63 - 1)
GZIP_MAGIC = b"\x1f\x8b"
MAX_TRACE_BYTES_ENV = "CHUNKGYM_MAX_TRACE_BYTES"
DEFAULT_MAX_TRACE_BYTES = 64 * MiB
"""A trace's text budget: 20 times the largest real trace (Mooncake conversation, 3 MB)."""
CHUNK_BYTES = MiB
"""Bytes read (or decompressed) at a time."""
_LINE_BREAK = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
"""Where ``str.splitlines`` ends a line."""
OUTLIER_GAP = 0.9
OUTLIER_MIN_REQUESTS = 10
YEAR_S = 365 * 86400.0
"""A single gap between arrivals holding 90% of the span, with at most 1% of the requests
beyond it, marks an outlier timestamp (a 2099 date among 2023 ones): in files of at least
10 requests, or of any size when the gap exceeds a year."""


@dataclass(frozen=True, eq=False)
class Rows:
    """Requests of one file in file order (timestamped files: stably sorted by time).

    ``times`` are seconds from the trace's zero (Azure: the first request; Mooncake: the file's
    zero) and ``None`` for length-only files. ``hash_ids`` are per-request views of one array.
    ``tenant`` and ``slo_class``: each request's labels where the file carries them, else None.
    """

    path: str
    times: np.ndarray | None
    prompt: np.ndarray
    output: np.ndarray
    hash_ids: tuple[np.ndarray, ...] | None = None
    hash_block_tokens: int = 0
    tenant: tuple[str, ...] | None = None
    slo_class: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.prompt)


def sniff_format(path: Path) -> str:
    """The format of ``path`` from its content: a gzip'd tar -> servegen, JSON lines -> mooncake,
    CSV header (each also gzip-compressed)."""
    with _open(path) as f:
        head = f.read(4096)
    if head[:2] == GZIP_MAGIC:
        raw, stream = head, zlib.decompressobj(wbits=31)
        try:
            head = stream.decompress(raw, 4096)
        except zlib.error as exc:
            raise TraceError(path, f"corrupt gzip data ({exc})") from None
        if len(raw) < 4096 and len(head) < 4096 and not stream.eof:  # the whole file read, stream unfinished
            raise TraceError(
                path, "cannot read trace file: Compressed file ended before the end of the stream"
            )
        if head[257:262] == b"ustar":
            return "servegen"
    _check_encoding(path, head)
    text = head.decode("utf-8-sig", errors="replace").lstrip()
    if text.startswith("{"):
        return "mooncake"
    columns = {c.strip() for c in text.splitlines()[0].split(",")} if text else set()
    if set(AZURE_COLUMNS) <= columns:
        return "azure"
    if set(LENGTH_COLUMNS) <= columns:
        return "lengths"
    raise TraceError(
        path,
        f"cannot infer the trace format: expected JSON lines (Mooncake), a ServeGen .tar.gz, or a CSV "
        f"header with {', '.join(AZURE_COLUMNS)} (Azure) or {', '.join(LENGTH_COLUMNS)} (lengths)",
        line=1,
    )


def link_problem(path: Path) -> str | None:
    """Why a path that is a symbolic link cannot be followed (a loop, or a missing target); else None."""
    if not path.is_symlink():
        return None
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symbolic link loop (the link points back to itself through other links)"
        return f"symbolic link to {os.readlink(path)!r}, which does not exist"
    return None


def _check_encoding(path: Path, head: bytes) -> None:
    if head[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in head:
        raise TraceError(
            path,
            "the file is UTF-16 (or binary): traces must be UTF-8 text; convert it with "
            f"`iconv -f UTF-16 -t UTF-8 {path} > converted.csv`",
            line=1,
        )


def max_trace_bytes() -> int:
    """The byte budget of a trace's text: ``CHUNKGYM_MAX_TRACE_BYTES``, else 64 MiB."""
    raw = os.environ.get(MAX_TRACE_BYTES_ENV)
    if raw is None:
        return DEFAULT_MAX_TRACE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{MAX_TRACE_BYTES_ENV}={raw!r}: expected a positive whole number of bytes")
    return value


def _open(path: Path) -> BinaryIO:
    """``path`` opened for reading as a regular file (a FIFO, device or socket refused without
    waiting on it), refused when its apparent size is over the budget."""
    try:
        fd, size = open_regular(path)
    except ReceivedFileError as exc:
        raise TraceError(path, str(exc).removeprefix(f"{path}: ")) from None
    budget = max_trace_bytes()
    if size > budget:
        os.close(fd)
        raise TraceError(path, _over_budget(budget, f"is {size} bytes"))
    return os.fdopen(fd, "rb")


def _over_budget(budget: int, what: str) -> str:
    return f"{what}, over the trace limit of {budget} bytes (set {MAX_TRACE_BYTES_ENV} to raise it)"


def _byte_chunks(path: Path) -> Iterator[bytes]:
    """The file's bytes, gunzipped if compressed, a chunk at a time; never decompresses more
    than the budget (and one byte, to tell that it is over)."""
    budget, total = max_trace_bytes(), 0
    try:
        with _open(path) as raw:
            compressed = raw.read(2) == GZIP_MAGIC
            raw.seek(0)
            stream: BinaryIO = cast(BinaryIO, gzip.GzipFile(fileobj=raw)) if compressed else raw
            while chunk := stream.read(min(CHUNK_BYTES, budget + 1 - total)):
                total += len(chunk)
                if total > budget:
                    raise TraceError(path, _over_budget(budget, "holds more text (decompressed)"))
                yield chunk
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(path, f"cannot read trace file: {exc}") from None


def _check_text(path: Path) -> None:
    """Read the whole file once, raising its first problem: unreadable, over the budget or a
    corrupt gzip stream (anywhere) before UTF-16 or binary text at the start, before bytes
    that are not UTF-8 (naming their line)."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    problem: TraceError | None = None
    newlines = 0
    for i, chunk in enumerate(_byte_chunks(path)):
        if problem is not None:
            continue
        try:
            if i == 0:
                _check_encoding(path, chunk[:4096])
            decoder.decode(chunk)
            newlines += chunk.count(b"\n")
        except TraceError as exc:
            problem = exc
        except UnicodeDecodeError as exc:
            line = newlines + exc.object[: exc.start].count(b"\n") + 1
            problem = TraceError(path, f"not UTF-8 text (byte {exc.object[exc.start]:#04x})", line=line)
    if problem is None:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            line = newlines + 1
            problem = TraceError(path, f"not UTF-8 text (byte {exc.object[exc.start]:#04x})", line=line)
    if problem is not None:
        raise problem


def split_lines(chunks: Iterable[str]) -> Iterator[list[str]]:
    """The lines of the concatenated ``chunks``, ends kept, in lists (about a chunk's worth each):
    exactly what ``str.splitlines(True)`` gives on the whole text, holding one chunk and one
    unfinished line at a time (a line spanning many chunks is joined once, when it ends)."""
    held: list[str] = []  # the text after the last line known to be finished
    for chunk in chunks:
        if held and held[-1][-1:] != "\r" and not _LINE_BREAK.search(chunk):
            held.append(chunk)
            continue
        lines = ("".join(held) + chunk).splitlines(keepends=True)
        held = [lines.pop()] if lines else []  # it may go on (or be a "\r" before a "\n") in the next chunk
        if lines:
            yield lines
    if held:
        yield "".join(held).splitlines(keepends=True)


def _line_lists(path: Path) -> Iterator[list[str]]:
    """The file's lines (ends kept) a chunk at a time, after :func:`_check_text` accepted all of it."""
    _check_text(path)
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    yield from split_lines(decoder.decode(chunk) for chunk in _byte_chunks(path))


def _numbered(lists: Iterable[list[str]], first: int) -> Iterator[tuple[np.ndarray, list[str]]]:
    """Each list's non-blank lines and their 1-based line numbers, counting from ``first``."""
    for lines in lists:
        distinct = set(lines)  # cheap: a flood of blank lines is a few distinct strings
        blanks = sum(1 for line in distinct if line.isspace())
        if blanks == 0:
            yield first + np.arange(len(lines)), lines
        elif blanks < len(distinct):
            kept = np.flatnonzero(~np.fromiter(map(str.isspace, lines), dtype=bool, count=len(lines)))
            yield first + kept, [lines[i] for i in kept]
        first += len(lines)


def _check_span(path: Path, times: np.ndarray, lines: np.ndarray, field: str) -> None:
    """Refuse sorted ``times`` with no span, or a span made by a few outlying requests."""
    n = len(times)
    if n < 2:  # one request spans 0 s: its rates are NaN, never a number
        return
    span = float(times[-1] - times[0])
    if span <= 0:
        raise TraceError(
            path,
            f"all {n} requests arrive at the same time, so the trace spans 0 s and no rate "
            "(requests/s, goodput) can be computed on it",
            line=int(lines[0]),
            field=field,
        )
    gaps = np.diff(times)
    k = int(np.argmax(gaps))
    gap = float(gaps[k])
    few = min(k + 1, n - k - 1)
    outlying = gap > OUTLIER_GAP * span and few <= max(1, n // 100)
    if outlying and (n >= OUTLIER_MIN_REQUESTS or gap > YEAR_S):
        first = k + 1 if n - k - 1 <= k + 1 else 0
        raise TraceError(
            path,
            f"{few} request(s) arrive {gap:.6g} s ({gap / 86400:.4g} days) away from the other {n - few}: "
            f"one gap makes {100 * gap / span:.2f}% of the trace's {span:.6g} s span, so rates would be "
            "computed over empty time; an outlier timestamp? Fix or remove it",
            line=int(lines[first]),
            field=field,
        )


def read_rows(path: Path, fmt: str) -> Rows:
    """Parsed, validated rows of ``path`` in format ``fmt`` (cached while the file is unchanged)."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise TraceError(path, f"cannot read trace file: {exc.strerror or exc}") from exc
    rows = _read_cached(str(path), fmt, stat.st_mtime_ns, stat.st_size)
    if not len(rows):
        raise TraceError(path, "the file holds no requests")
    return rows


@functools.lru_cache(maxsize=32)
def _read_cached(path: str, fmt: str, _mtime_ns: int, _size: int) -> Rows:
    readers = {"azure": _read_azure, "mooncake": _read_mooncake, "lengths": _read_lengths}
    if fmt not in readers:
        raise ValueError(f"no row reader for format {fmt!r}; valid: {', '.join(readers)}")
    return readers[fmt](Path(path))


def _csv_batches(path: Path, required: tuple[str, ...]) -> Iterator[pd.DataFrame]:
    """The required columns and the :data:`LABEL_COLUMNS` the header has, as strings, indexed by
    1-based file line, a chunk of the file at a time (so pandas' strings, about 60 bytes a cell,
    exist for one chunk only); blank lines left out.

    The header is checked alone first; each batch is parsed with the header in front, as the
    same lines of the whole file would be."""
    lists = _line_lists(path)
    first = next(lists, [""])
    header = first[0]
    present = _csv_frame(path, header, [], np.empty(0, np.int64), required).columns
    wanted = required + tuple(c for c in LABEL_COLUMNS if c in present)
    for numbers, lines in _numbered(itertools.chain([first[1:]], lists), 2):
        if len(lines):
            yield _csv_frame(path, header, lines, numbers, wanted)


def _csv_frame(
    path: Path, header: str, lines: list[str], numbers: np.ndarray, required: tuple[str, ...]
) -> pd.DataFrame:
    """``lines`` (file lines ``numbers``, ends kept) under ``header``, parsed as strings."""
    try:
        df = pd.read_csv(
            io.StringIO(header + "".join(lines)), dtype=str, keep_default_na=False, skip_blank_lines=False
        )
    except pd.errors.ParserError as exc:
        message, line = " ".join(str(exc).split()), None  # pandas ends it with a newline
        where = re.search(r" in line (\d+)", message)  # pandas counts the batch's lines, header first
        if where and 2 <= int(where[1]) < len(numbers) + 2:
            message, line = message[: where.start()] + message[where.end() :], int(numbers[int(where[1]) - 2])
        raise TraceError(path, f"cannot read CSV: {message}", line=line) from None
    except pd.errors.EmptyDataError as exc:
        raise TraceError(path, f"cannot read CSV: {' '.join(str(exc).split())}") from None
    df.columns = [str(c).strip() for c in df.columns]
    for column in required:
        if column not in df.columns:
            raise TraceError(
                path, f"missing column (header has {', '.join(df.columns)})", line=1, field=column
            )
    if len(df) != len(lines):
        raise TraceError(path, "multi-line (quoted) CSV records are not supported")
    if not lines:  # the header alone: which optional columns it has
        return df
    columns: pd.DataFrame = df[list(required)].set_axis(numbers)
    return columns


def _bad_cell(path: Path, df: pd.DataFrame, column: str, mask: np.ndarray, expected: str) -> TraceError:
    line = int(df.index[np.flatnonzero(mask)[0]])
    raw = cast("str | float", df.at[line, column])  # dtype=str; NaN where a row is short of fields
    text = "" if pd.isna(raw) else str(raw).strip()
    shown = text if len(text) <= 100 else f"{text[:100]}..."
    problem = "missing value" if not text else f"got {shown!r}"
    return TraceError(path, f"{problem}; expected {expected}", line=line, field=column)


def _positive_ints(path: Path, df: pd.DataFrame, column: str) -> np.ndarray:
    text = df[column].str.strip()
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(values) | (values < 1) | (values > MAX_LENGTH) | (values != np.floor(values))
    if bad.any():
        raise _bad_cell(path, df, column, bad, f"an integer in 1..{MAX_LENGTH}")
    return values.astype(np.int64)


def _csv_labels(path: Path, df: pd.DataFrame, column: str, canonical: dict[str, str]) -> list[str]:
    """The ``column`` cells (stripped) as labels, each distinct value checked once and stored
    once (``canonical``: the column's values so far, shared across a file's batches)."""
    cells = [str(v).strip() if isinstance(v, str) else "" for v in df[column].tolist()]
    for value in set(cells) - canonical.keys():
        problem = label_problem(value) or (class_problem(value) if column == "SloClass" else None)
        if problem:
            mask = np.fromiter((c == value for c in cells), dtype=bool, count=len(cells))
            raise _bad_cell(path, df, column, mask, f"a label ({problem})")
        canonical[value] = value
    return [canonical[c] for c in cells]


def _ordered(labels: list[str] | None, order: np.ndarray) -> tuple[str, ...] | None:
    return None if labels is None else tuple(labels[i] for i in order.tolist())


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype)


def _read_azure(path: Path) -> Rows:
    ns_parts: list[np.ndarray] = []
    prompt_parts: list[np.ndarray] = []
    output_parts: list[np.ndarray] = []
    line_parts: list[np.ndarray] = []
    labels: dict[str, list[str]] = {}
    canonical: dict[str, dict[str, str]] = {column: {} for column in LABEL_COLUMNS}
    zones: set[str] = set()
    for df in _csv_batches(path, AZURE_COLUMNS):
        for column in LABEL_COLUMNS:
            if column in df.columns:
                labels.setdefault(column, []).extend(_csv_labels(path, df, column, canonical[column]))
        try:
            stamps = pd.to_datetime(df["TIMESTAMP"].str.strip(), format="ISO8601", errors="coerce")
        except ValueError as exc:  # time zones that differ between rows
            raise TraceError(path, str(exc).splitlines()[0], field="TIMESTAMP") from None
        bad = stamps.isna().to_numpy()
        if bad.any():
            raise _bad_cell(path, df, "TIMESTAMP", bad, "a date-time such as 2023-11-16 18:15:46.6805900")
        zones.add(str(getattr(stamps.dtype, "tz", None)))
        if len(zones) > 1:  # as pandas says of one column parsed whole
            raise TraceError(path, f"mixed time zones {sorted(zones)}", field="TIMESTAMP")
        prompt_parts.append(_positive_ints(path, df, "ContextTokens"))
        output_parts.append(_positive_ints(path, df, "GeneratedTokens"))
        ns_parts.append(stamps.to_numpy(dtype="datetime64[ns]").astype(np.int64))
        line_parts.append(df.index.to_numpy())
    ns, prompt, output = (
        _joined(ns_parts, np.int64),
        _joined(prompt_parts, np.int64),
        _joined(output_parts, np.int64),
    )
    times = (ns - ns.min()) / 1e9 if len(ns) else np.empty(0)
    order = np.argsort(times, kind="stable")
    _check_span(path, times[order], _joined(line_parts, np.int64)[order], "TIMESTAMP")
    return Rows(
        str(path),
        times[order],
        prompt[order],
        output[order],
        tenant=_ordered(labels.get("Tenant"), order),
        slo_class=_ordered(labels.get("SloClass"), order),
    )


def _read_lengths(path: Path) -> Rows:
    prompt_parts, output_parts = [], []
    labels: dict[str, list[str]] = {}
    canonical: dict[str, dict[str, str]] = {column: {} for column in LABEL_COLUMNS}
    for df in _csv_batches(path, LENGTH_COLUMNS):
        prompt_parts.append(_positive_ints(path, df, "num_prefill_tokens"))
        output_parts.append(_positive_ints(path, df, "num_decode_tokens"))
        for column in LABEL_COLUMNS:
            if column in df.columns:
                labels.setdefault(column, []).extend(_csv_labels(path, df, column, canonical[column]))
    tenant, slo_class = labels.get("Tenant"), labels.get("SloClass")
    return Rows(
        str(path),
        None,
        _joined(prompt_parts, np.int64),
        _joined(output_parts, np.int64),
        tenant=None if tenant is None else tuple(tenant),
        slo_class=None if slo_class is None else tuple(slo_class),
    )


def _json_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _records(path: Path) -> Iterator[tuple[int, str]]:
    """The file's non-blank lines, without their ends, with their 1-based numbers."""
    for numbers, lines in _numbered(_line_lists(path), 1):
        for number, line in zip(numbers.tolist(), lines, strict=True):
            yield number, line.splitlines()[0]


def _read_mooncake(path: Path) -> Rows:
    """Rows of JSON lines, kept in typed arrays (8 bytes a number) as they are read."""
    times, numbers = array("d"), array("q")
    prompt, output, counts, flat = array("q"), array("q"), array("q"), array("q")
    labels: dict[str, list[str]] | None = None  # the label fields the first record has
    canonical: dict[str, dict[str, str]] = {field: {} for field in LABEL_FIELDS}
    for number, line in _records(path):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(path, f"malformed JSON: {exc.msg} at column {exc.colno}", line=number) from None
        except (RecursionError, ValueError) as exc:  # deep nesting; an integer past Python's digit limit
            reason = str(exc).splitlines()[0][:120]
            raise TraceError(path, f"not a readable JSON record ({reason})", line=number) from None
        if not isinstance(rec, dict):
            raise TraceError(path, f"expected a JSON object, got {type(rec).__name__}", line=number)
        for field in MOONCAKE_FIELDS:
            if field not in rec:
                raise TraceError(path, "missing field", line=number, field=field)
        ts, n_in, n_out, ids = (rec[f] for f in MOONCAKE_FIELDS)
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not 0 <= ts <= MAX_MOONCAKE_MS:
            raise TraceError(
                path,
                f"expected milliseconds in 0..{MAX_MOONCAKE_MS}, got {ts!r}",
                line=number,
                field="timestamp",
            )
        for field, value in (("input_length", n_in), ("output_length", n_out)):
            if not _json_int(value) or not 1 <= value <= MAX_LENGTH:
                raise TraceError(
                    path, f"expected an integer in 1..{MAX_LENGTH}, got {value!r}", line=number, field=field
                )
        blocks = math.ceil(n_in / MOONCAKE_BLOCK_TOKENS)
        if not isinstance(ids, list) or len(ids) != blocks or not all(_json_int(h) for h in ids):
            raise TraceError(
                path,
                f"expected a list of {blocks} integer block ids (ceil(input_length/"
                f"{MOONCAKE_BLOCK_TOKENS})), got {str(ids)[:80]}",
                line=number,
                field="hash_ids",
            )
        big = [h for h in ids if not INT64[0] <= h <= INT64[1]]
        if big:
            raise TraceError(
                path, f"block id {big[0]} does not fit in a 64-bit integer", line=number, field="hash_ids"
            )
        if labels is None:
            labels = {field: [] for field in LABEL_FIELDS if field in rec}
        for field in LABEL_FIELDS:
            if (field in rec) != (field in labels):
                problem = "missing field" if field in labels else "the first record lacks this field"
                raise TraceError(
                    path, f"{problem}: every record has it or none does", line=number, field=field
                )
        for field, out in labels.items():
            out.append(_json_label(path, rec[field], canonical[field], number, field))
        times.append(ts / 1000.0)
        prompt.append(n_in)
        output.append(n_out)
        counts.append(blocks)
        flat.extend(ids)
        numbers.append(number)
    t = np.asarray(times, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    _check_span(path, t[order], np.asarray(numbers)[order], "timestamp")
    ids_flat = np.asarray(flat, dtype=np.int64)
    ids_flat.flags.writeable = False
    per_request = np.split(ids_flat, np.cumsum(counts)[:-1]) if counts else []
    return Rows(
        str(path),
        t[order],
        np.asarray(prompt, dtype=np.int64)[order],
        np.asarray(output, dtype=np.int64)[order],
        tuple(per_request[i] for i in order),
        MOONCAKE_BLOCK_TOKENS,
        _ordered((labels or {}).get("tenant"), order),
        _ordered((labels or {}).get("slo_class"), order),
    )


def _json_label(path: Path, value: object, canonical: dict[str, str], line: int, field: str) -> str:
    """``value`` checked as a label (each distinct text once) and stored once."""
    if isinstance(value, str) and value in canonical:
        return canonical[value]
    problem = label_problem(value)
    if problem is None and field == "slo_class":
        problem = class_problem(cast(str, value))
    if problem:
        raise TraceError(path, problem, line=line, field=field)
    text = cast(str, value)
    canonical[text] = text
    return text
