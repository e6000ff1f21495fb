"""Readers for request files: Azure 2023 CSV, Mooncake JSONL, length-only CSV.

Each reader validates every row (a bad value raises :class:`TraceError` naming file, 1-based line
and field) and returns :class:`Rows`, cached per resolved path, size and modification time, so a
file is parsed once per process however many workloads use it. Nothing is dropped: every data row
becomes a request (blank lines are not rows).
"""

from __future__ import annotations

import functools
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from envs.serving.workloads.trace import TraceError

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_BLOCK_TOKENS = 512


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
    """The format of ``path`` from its content: gzip -> servegen, JSON lines -> mooncake, CSV header."""
    head = _open_bytes(path, 4096)
    if head[:2] == b"\x1f\x8b":
        return "servegen"
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
    try:
        text = path.read_text(encoding="utf-8-sig")
        df = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, skip_blank_lines=False)
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
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
    return df.loc[np.array([bool(line.strip()) for line in lines], dtype=bool)]


def _bad_cell(path: Path, df: pd.DataFrame, column: str, mask: np.ndarray, expected: str) -> TraceError:
    line = int(df.index[np.flatnonzero(mask)[0]])
    raw = df.at[line, column]
    problem = "missing value" if pd.isna(raw) or str(raw).strip() == "" else f"got {str(raw).strip()!r}"
    return TraceError(path, f"{problem}; expected {expected}", line=line, field=column)


def _positive_ints(path: Path, df: pd.DataFrame, column: str) -> np.ndarray:
    text = df[column].str.strip()
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(values) | (values < 1) | (values != np.floor(values))
    if bad.any():
        raise _bad_cell(path, df, column, bad, "an integer >= 1")
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
    return Rows(str(path), times[order], prompt[order], output[order])


def _read_lengths(path: Path) -> Rows:
    df = _read_csv(path, LENGTH_COLUMNS)
    prompt = _positive_ints(path, df, "num_prefill_tokens")
    output = _positive_ints(path, df, "num_decode_tokens")
    return Rows(str(path), None, prompt, output)


def _json_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_mooncake(path: Path) -> Rows:
    times, prompt, output, counts, flat = [], [], [], [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(path, f"cannot read trace file: {exc}") from exc
    for number, line in enumerate(lines, start=1):
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
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
            raise TraceError(path, f"expected milliseconds >= 0, got {ts!r}", line=number, field="timestamp")
        for field, value in (("input_length", n_in), ("output_length", n_out)):
            if not _json_int(value) or value < 1:
                raise TraceError(path, f"expected an integer >= 1, got {value!r}", line=number, field=field)
        blocks = math.ceil(n_in / MOONCAKE_BLOCK_TOKENS)
        if not isinstance(ids, list) or len(ids) != blocks or not all(_json_int(h) for h in ids):
            raise TraceError(
                path,
                f"expected a list of {blocks} integer block ids (ceil(input_length/"
                f"{MOONCAKE_BLOCK_TOKENS})), got {str(ids)[:80]}",
                line=number,
                field="hash_ids",
            )
        times.append(ts / 1000.0)
        prompt.append(n_in)
        output.append(n_out)
        counts.append(blocks)
        flat.extend(ids)
    t = np.asarray(times, dtype=np.float64)
    order = np.argsort(t, kind="stable")
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
