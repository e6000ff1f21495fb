"""Readers for request files: Azure 2023 CSV, Mooncake JSONL, length-only CSV.

Each reader validates every row (a bad value raises :class:`TraceError` naming file, 1-based line
and field: lengths at most 2**31 - 1, hash ids within int64) and the time axis (a
trace with no time span, or whose span one outlier timestamp makes, is refused with the
numbers, since every rate computed on it would be meaningless), and returns :class:`Rows`, cached per resolved path, size and modification time, so a
file is parsed once per process however many workloads use it. Nothing is dropped: every data row
becomes a request (blank lines are not rows). Files may be gzip-compressed (``.csv.gz``,
``.jsonl.gz``); text must be UTF-8.
"""

from __future__ import annotations

import errno
import functools
import gzip
import io
import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd

from envs.serving.workloads.trace import TraceError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_BLOCK_TOKENS = 512
MAX_LENGTH = 2**31 - 1
"""Largest token count accepted (far past any context window; exact when parsed as a float)."""
MAX_MOONCAKE_MS = 2**53
INT64 = (-(2**63), 2**63 - 1)
GZIP_MAGIC = b"\x1f\x8b"
MAX_TEXT_BYTES = 4 << 30
"""Decompressed size at which a gzip trace is refused (a bomb, or not a trace)."""
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
    """

    path: str
    times: np.ndarray | None
    prompt: np.ndarray
    output: np.ndarray
    hash_ids: tuple[np.ndarray, ...] | None = None
    hash_block_tokens: int = 0

    def __len__(self) -> int:
        return len(self.prompt)


def sniff_format(path: Path) -> str:
    """The format of ``path`` from its content: a gzip'd tar -> servegen, JSON lines -> mooncake,
    CSV header (each also gzip-compressed)."""
    head = _open_bytes(path, 4096)
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


def _read_text(path: Path) -> str:
    """The whole file as UTF-8 text, gunzipped if compressed; errors name the file and line."""
    try:
        with path.open("rb") as f:
            data = f.read()
        if data[:2] == GZIP_MAGIC:
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as g:
                data = g.read(MAX_TEXT_BYTES + 1)
            if len(data) > MAX_TEXT_BYTES:
                raise TraceError(path, f"decompresses to more than {MAX_TEXT_BYTES} bytes")
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(path, f"cannot read trace file: {exc}") from None
    _check_encoding(path, data[:4096])
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TraceError(path, f"not UTF-8 text (byte {data[exc.start]:#04x})", line=line) from None


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


def _open_bytes(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(limit)
    except OSError as exc:
        raise TraceError(path, f"cannot read trace file: {exc.strerror or exc}") from exc


def _read_csv(path: Path, required: tuple[str, ...]) -> pd.DataFrame:
    """The required columns as strings, indexed by 1-based file line; blank lines left out."""
    text = _read_text(path)
    try:
        df = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, skip_blank_lines=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise TraceError(path, f"cannot read CSV: {exc}") from exc
    df.columns = [str(c).strip() for c in df.columns]
    for column in required:
        if column not in df.columns:
            raise TraceError(
                path, f"missing column (header has {', '.join(df.columns)})", line=1, field=column
            )
    lines = text.splitlines()[1:]
    if len(lines) != len(df):
        raise TraceError(path, "multi-line (quoted) CSV records are not supported")
    df = df[list(required)].set_axis(np.arange(2, len(df) + 2))
    kept: pd.DataFrame = df.loc[np.array([bool(line.strip()) for line in lines], dtype=bool)]
    return kept


def _bad_cell(path: Path, df: pd.DataFrame, column: str, mask: np.ndarray, expected: str) -> TraceError:
    line = int(df.index[np.flatnonzero(mask)[0]])
    raw = cast("str | float", df.at[line, column])  # dtype=str; NaN where a row is short of fields
    problem = "missing value" if pd.isna(raw) or str(raw).strip() == "" else f"got {str(raw).strip()!r}"
    return TraceError(path, f"{problem}; expected {expected}", line=line, field=column)


def _positive_ints(path: Path, df: pd.DataFrame, column: str) -> np.ndarray:
    text = df[column].str.strip()
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(values) | (values < 1) | (values > MAX_LENGTH) | (values != np.floor(values))
    if bad.any():
        raise _bad_cell(path, df, column, bad, f"an integer in 1..{MAX_LENGTH}")
    return values.astype(np.int64)


def _read_azure(path: Path) -> Rows:
    df = _read_csv(path, AZURE_COLUMNS)
    stamps = pd.to_datetime(df["TIMESTAMP"].str.strip(), format="ISO8601", errors="coerce")
    bad = stamps.isna().to_numpy()
    if bad.any():
        raise _bad_cell(path, df, "TIMESTAMP", bad, "a date-time such as 2023-11-16 18:15:46.6805900")
    prompt = _positive_ints(path, df, "ContextTokens")
    output = _positive_ints(path, df, "GeneratedTokens")
    ns = stamps.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    times = (ns - ns.min()) / 1e9 if len(ns) else np.empty(0)
    order = np.argsort(times, kind="stable")
    _check_span(path, times[order], df.index.to_numpy()[order], "TIMESTAMP")
    return Rows(str(path), times[order], prompt[order], output[order])


def _read_lengths(path: Path) -> Rows:
    df = _read_csv(path, LENGTH_COLUMNS)
    prompt = _positive_ints(path, df, "num_prefill_tokens")
    output = _positive_ints(path, df, "num_decode_tokens")
    return Rows(str(path), None, prompt, output)


def _json_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_mooncake(path: Path) -> Rows:
    times, prompt, output, counts, flat, numbers = [], [], [], [], [], []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(path, f"malformed JSON: {exc.msg} at column {exc.colno}", line=number) from None
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
    )
