"""ServeGen per-client rate windows and length PMFs, turned into a request stream.

The archive (alibaba/ServeGen ``data/<category>/<model>/``, read straight from the .tar.gz) has,
per client ``i``, ``chunk-i-trace.csv`` rows ``window_start_s, rate, iat_cv, dist, p1, p2`` (one per
600 s window of a day) and ``chunk-i-dataset.json``: ``{block_start: {field: PMF}}`` with PMFs as
Python dict literals (parsed with ``ast.literal_eval``, lazily, once per block). In the DeepSeek-R1
file the PMF blocks are 6 h long; a window uses the latest non-empty block at or before its start,
as ServeGen does.

What p1/p2 mean, checked on the R1 file (``tests/test_workload_servegen.py`` asserts it): scipy's
(shape, scale) of the inter-arrival time (IAT) law in seconds, as ServeGen's own sampler uses them.

- ``rate * 600`` is an integer in every window: ``rate`` is the window's observed count / 600.
- Gamma (2589 active windows, 74% of requests): ``iat_cv == 1/sqrt(p1)`` in every window; the
  mean ``p1*p2`` matches ``1/rate`` (median ratio 0.99; 0.89-1.003 for 5-95% of windows with
  >= 100 requests; sparse windows drift, down to 0.03 below 20 requests).
- Weibull (522 windows, 26% of requests): the mean ``p2*Gamma(1 + 1/p1)`` is ``1/rate`` only
  roughly (median ratio 1.08, 5-95%: 0.72-2.3) and the fit's CV is below ``iat_cv`` (median ratio
  0.84): the fit keeps the shape of the gaps, not their moments.

Generation therefore keeps each window's count exactly and the fitted shape: per (client,
window), ``rate*600`` arrivals with gaps drawn from the family with shape ``p1``, normalised onto
a circle of 600 s and cut at a random phase (:meth:`Renewal.circular`). Prompt and output lengths
are drawn i.i.d. from the window's PMFs; ``output_tokens`` already counts the reasoning tokens, so
``reason_ratio`` is not used. Every (client, window) has its own seeded stream, so any time range
is generated alone and agrees with the same range of a longer generation.

The archive is received data, so reading it is bounded like a trace's text
(:func:`~envs.serving.workloads.files.max_trace_bytes`): the decompressed archive, headers and
skipped members included, and the members read (by their stated size, so a sparse member counts
in full) stay within the budget, checked before each step; PMFs in the plain form ServeGen writes
are read by a linear scan into at most :data:`MAX_PMF_ENTRIES` entries (others, up to
:data:`MAX_LITERAL_CHARS`, by ``ast.literal_eval``); and a day generates at most
:data:`~envs.serving.workloads.renewal.MAX_GENERATED_REQUESTS` requests.
"""

from __future__ import annotations

import ast
import bisect
import bz2
import functools
import gzip
import itertools
import json
import lzma
import math
import os
import re
import sys
import tarfile
import zlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import numpy as np

from chunkgym.received import MiB, ReceivedFileError, open_regular
from envs.serving.workloads.files import max_trace_bytes, split_lines
from envs.serving.workloads.renewal import MAX_GENERATED_REQUESTS, Renewal, rng_for
from envs.serving.workloads.trace import Trace, TraceError, split_fractions

TRACE_FIELDS = ("window_start_s", "rate", "iat_cv", "dist", "p1", "p2")
LENGTH_FIELDS = ("input_tokens", "output_tokens")
_MEMBER = re.compile(r"(?:^|/)chunk-(\d+)-(trace\.csv|dataset\.json)$")
_DECOMPRESSORS: dict[bytes, Callable[[BinaryIO], BinaryIO]] = {
    b"\x1f\x8b": lambda f: cast(BinaryIO, gzip.GzipFile(fileobj=f)),
    b"BZh": lambda f: cast(BinaryIO, bz2.BZ2File(f)),
    b"\xfd7zXZ\x00": lambda f: cast(BinaryIO, lzma.LZMAFile(f)),
}
"""What ``tarfile``'s ``r:*`` mode reads, by magic bytes; anything else is read as a plain tar."""
MAX_PMF_ENTRIES = 1 << 20
"""Token counts in one PMF: a context of a million tokens has no more distinct lengths."""
MAX_LITERAL_CHARS = MiB
"""A PMF not in the plain form goes through ``ast.literal_eval``, about 115 bytes of memory a character."""
_WS = r"[ \t\r\n]*"
_NUMBER = r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_PMF_OPEN = re.compile(rf"{_WS}\{{")
_PMF_ITEM = re.compile(rf"{_WS}({_NUMBER}){_WS}:{_WS}({_NUMBER}){_WS}(?:,|(?=\}}))")
_PMF_CLOSE = re.compile(rf"{_WS}\}}{_WS}")


@dataclass(frozen=True, eq=False)
class Client:
    """One client's day: per-window arrival parameters and the PMF block each window uses."""

    cid: int
    where: str
    pmf_where: str
    rate: np.ndarray
    dist: tuple[str, ...]
    shape: np.ndarray
    block: np.ndarray
    pmf_text: dict[int, dict[str, str]]


class ServeGenDay:
    """A parsed ServeGen archive: clients on a common window grid, PMFs parsed on first use."""

    def __init__(self, path: Path):
        self.path = str(path)
        members = _read_members(path)
        grids, clients = set(), []
        for cid in sorted(members):
            parts = members[cid]
            for kind in ("trace.csv", "dataset.json"):
                if kind not in parts:
                    raise TraceError(path, f"client {cid} has no chunk-{cid}-{kind}")
            starts, client = _parse_client(path, cid, parts)
            grids.add(tuple(starts))
            clients.append(client)
        if not clients:
            raise TraceError(path, "no chunk-<i>-trace.csv / chunk-<i>-dataset.json members found")
        if len(grids) != 1:
            raise TraceError(path, "clients' trace files use different window_start_s grids")
        grid = np.asarray(grids.pop(), dtype=np.float64)
        self.window_s = float(grid[1] - grid[0]) if len(grid) > 1 else 600.0
        if grid[0] != 0 or np.any(np.diff(grid) != self.window_s):
            raise TraceError(path, "window_start_s must run 0, w, 2w, ... with one window length w")
        self.clients = tuple(clients)
        self.duration_s = len(grid) * self.window_s
        total = sum(float(np.rint(c.rate * self.window_s).sum()) for c in self.clients)
        if not total <= MAX_GENERATED_REQUESTS:
            raise TraceError(
                path, f"its rates make {total:.6g} requests a day, over the limit of {MAX_GENERATED_REQUESTS}"
            )
        self._pmfs: dict[tuple[int, int, str], tuple[np.ndarray, np.ndarray]] = {}

    def pmf(self, client: Client, block: int, field: str) -> tuple[np.ndarray, np.ndarray]:
        """(values, cumulative probabilities) of ``field`` in ``client``'s PMF block ``block``."""
        key = (client.cid, block, field)
        if key not in self._pmfs:
            self._pmfs[key] = _parse_pmf(client, block, field)
        return self._pmfs[key]

    def count(self, start: float, end: float) -> float:
        """Requests of the rate windows in ``[start, end)``, a partly covered window pro rata."""
        w = self.window_s
        edges = np.arange(len(self.clients[0].rate) + 1) * w
        cover = np.clip(np.minimum(edges[1:], end) - np.maximum(edges[:-1], start), 0.0, w) / w
        return float(sum(np.dot(np.rint(c.rate * w), cover) for c in self.clients))

    def generate(self, seed: int, start: float, end: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Arrival times in ``[start, end)`` with prompt and output lengths, sorted by time."""
        w = self.window_s
        first, stop = int(start // w), min(math.ceil(end / w), round(self.duration_s / w))
        times: list[np.ndarray] = []
        prompt: list[np.ndarray] = []
        output: list[np.ndarray] = []
        for j in range(max(first, 0), stop):
            for client in self.clients:
                n = round(float(client.rate[j]) * w)
                if n == 0:
                    continue
                rng = rng_for(seed, "servegen", client.cid, j)
                t = Renewal(client.dist[j], float(client.shape[j]), 1.0).circular(rng, n, j * w, w)
                keep = (t >= start) & (t < end)
                times.append(t[keep])
                for field, out in zip(LENGTH_FIELDS, (prompt, output), strict=True):
                    values, cdf = self.pmf(client, int(client.block[j]), field)
                    u = rng.random(n)[keep]  # drawn for the whole window: any crop sees the same lengths
                    out.append(values[np.searchsorted(cdf, u, side="right")])
        if not times:
            return np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64)
        t = np.concatenate(times)
        order = np.argsort(t, kind="stable")
        return t[order], np.concatenate(prompt)[order], np.concatenate(output)[order]


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, _mtime_ns: int, _size: int) -> ServeGenDay:
    return ServeGenDay(Path(path))


def load_day(path: Path) -> ServeGenDay:
    """The parsed archive at ``path`` (cached while the file is unchanged)."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise TraceError(path, f"cannot read trace file: {exc.strerror or exc}") from exc
    return _load_cached(str(path), stat.st_mtime_ns, stat.st_size)


class ServeGenSource:
    """Splits (60/20/20 of the day by time) and windows of a ServeGen day."""

    def __init__(self, name: str, source: str, day: ServeGenDay):
        self.name, self.source, self.day = name, source, day

    def extract(self, split: str, seed: int, window_s: float | None) -> Trace:
        lo, hi = (f * self.day.duration_s for f in split_fractions(split))
        if window_s is not None and window_s < hi - lo:
            lo += float(rng_for(seed, "window", split).random()) * (hi - lo - window_s)
            hi = lo + window_s
        times, prompt, output = self.day.generate(seed, lo, hi)
        return Trace(
            name=self.name,
            source=self.source,
            arrival_s=times - lo,
            prompt_len=prompt,
            output_len=output,
            hash_ids=None,
            hash_block_tokens=0,
            span_s=hi - lo,
            offset_s=lo,
            first_row=-1,
        )

    def mean_rate(self, split: str) -> float:
        """Requests per second over ``split``: its rate windows' counts over its length."""
        lo, hi = (f * self.day.duration_s for f in split_fractions(split))
        return self.day.count(lo, hi) / (hi - lo)


class _Capped:
    """An archive's decompressed stream that ``tarfile`` reads and seeks in, refusing to go past
    ``budget`` bytes (a header claiming gigabytes, or a member skipped over, is refused before
    it is decompressed)."""

    def __init__(self, stream: BinaryIO, budget: int, path: Path):
        self.stream, self.budget, self.path = stream, budget, path

    def _refuse(self) -> TraceError:
        return TraceError(
            self.path,
            f"the archive holds more than {self.budget} bytes (decompressed), over the trace limit "
            "(set CHUNKGYM_MAX_TRACE_BYTES to raise it)",
        )

    def tell(self) -> int:
        return self.stream.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = offset if whence == os.SEEK_SET else self.stream.tell() + offset
        if whence not in (os.SEEK_SET, os.SEEK_CUR) or target > self.budget:
            raise self._refuse()
        return self.stream.seek(target)

    def read(self, size: int = -1) -> bytes:
        left = self.budget + 1 - self.stream.tell()
        data = self.stream.read(left if size < 0 else min(size, left))
        if len(data) == left:
            raise self._refuse()
        return data


def _read_members(path: Path) -> dict[int, dict[str, tuple[str, bytes]]]:
    """``{client: {"trace.csv" | "dataset.json": (member name, bytes)}}`` from one folder of the archive."""
    found: dict[int, dict[str, tuple[str, bytes]]] = {}
    folders = set()
    budget, read = max_trace_bytes(), 0
    try:
        fd, size = open_regular(path)
    except ReceivedFileError as exc:
        raise TraceError(path, str(exc).removeprefix(f"{path}: ")) from None
    try:
        with os.fdopen(fd, "rb") as raw:
            if size > budget:
                raise TraceError(path, f"is {size} bytes, over the trace limit of {budget} bytes")
            magic = raw.read(6)
            raw.seek(0)
            opener = next((o for m, o in _DECOMPRESSORS.items() if magic.startswith(m)), None)
            stream = opener(raw) if opener else raw
            capped = cast(BinaryIO, _Capped(stream, budget, path))
            with tarfile.open(fileobj=capped, mode="r:") as tar:
                for member in tar:
                    match = _MEMBER.search(member.name)
                    if not (member.isfile() and match):
                        continue
                    read += member.size  # its stated size: a sparse member's holes count too
                    if read > budget:
                        raise TraceError(
                            path,
                            f"its members up to {member.name} hold {read} bytes (stated sizes), over the trace "
                            f"limit of {budget} bytes (set CHUNKGYM_MAX_TRACE_BYTES to raise it)",
                        )
                    folders.add(member.name[: match.start() + 1])
                    file = tar.extractfile(member)
                    assert file is not None, "a regular member (isfile() above) always has its data"
                    data = file.read(member.size)
                    found.setdefault(int(match.group(1)), {})[match.group(2)] = (member.name, data)
    except (OSError, tarfile.TarError, EOFError, zlib.error) as exc:
        raise TraceError(path, f"cannot read ServeGen archive: {exc}") from exc
    if len(folders) > 1:
        raise TraceError(path, f"archive holds several ServeGen folders {sorted(folders)}; expected one")
    return found


def _parse_client(path: Path, cid: int, parts: dict[str, tuple[str, bytes]]) -> tuple[list[float], Client]:
    name, data = parts["trace.csv"]
    where = f"{path}[{name}]"
    starts, rate, shape, lines = array("d"), array("d"), array("d"), array("q")
    dist: list[str] = []
    decoded = data.decode("utf-8", errors="replace")
    pieces = (decoded[i : i + MiB] for i in range(0, len(decoded), MiB))
    for line, text in enumerate(itertools.chain.from_iterable(split_lines(pieces)), start=1):
        if not text.strip():
            continue
        cells = [c.strip() for c in text.split(",")]
        if len(cells) != len(TRACE_FIELDS):
            raise TraceError(
                where, f"expected {len(TRACE_FIELDS)} fields {TRACE_FIELDS}, got {len(cells)}", line
            )
        row = {}
        for field, cell in zip(TRACE_FIELDS, cells, strict=True):
            if field == "dist":
                continue
            try:
                row[field] = float(cell)
            except ValueError:
                raise TraceError(where, f"expected a number, got {cell!r}", line, field) from None
            if not (math.isfinite(row[field]) and row[field] >= 0):
                raise TraceError(where, f"expected a finite number >= 0, got {cell!r}", line, field)
        kind = cells[3].lower()
        if row["rate"] > 0:
            if kind not in ("gamma", "weibull"):
                raise TraceError(where, f"expected Gamma or Weibull, got {cells[3]!r}", line, "dist")
            if row["p1"] <= 0:
                raise TraceError(where, f"shape must be > 0, got {cells[4]!r}", line, "p1")
        lines.append(line)
        starts.append(row["window_start_s"])
        rate.append(row["rate"])
        dist.append(sys.intern(kind or "gamma"))
        shape.append(row["p1"] if row["rate"] > 0 else 1.0)
    pmf_where = f"{path}[{parts['dataset.json'][0]}]"
    pmf_text = _parse_dataset(pmf_where, parts["dataset.json"][1])
    usable = sorted(
        b for b, fields in pmf_text.items() if all(fields[f].strip() != "{}" for f in LENGTH_FIELDS)
    )
    rate_a = np.asarray(rate)
    block = np.full(len(starts), -1, dtype=np.int64)
    for j, s in enumerate(starts):
        earlier = bisect.bisect_right(usable, s)  # the blocks at or before s
        if earlier:
            block[j] = usable[earlier - 1]
        elif rate_a[j] > 0:
            raise TraceError(
                where, f"no non-empty length PMFs at or before window {s:g} s", lines[j], "window_start_s"
            )
    client = Client(cid, where, pmf_where, rate_a, tuple(dist), np.asarray(shape), block, pmf_text)
    return list(starts), client


def _parse_dataset(where: str, data: bytes) -> dict[int, dict[str, str]]:
    try:
        raw = json.loads(data)
    except (RecursionError, ValueError) as exc:  # also deep nesting and integers past the digit limit
        raise TraceError(where, f"malformed JSON: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(raw, dict):
        raise TraceError(where, "expected a JSON object mapping window start to PMFs")
    blocks = {}
    for key, fields in raw.items():
        if not key.isdigit():
            raise TraceError(where, f"window key must be seconds, got {key!r}")
        for field in LENGTH_FIELDS:
            if not isinstance(fields, dict) or not isinstance(fields.get(field), str):
                raise TraceError(where, "missing PMF string", field=f"[{key}][{field}]")
        blocks[int(key)] = {f: fields[f] for f in LENGTH_FIELDS}
    return blocks


def _parse_pmf(client: Client, block: int, field: str) -> tuple[np.ndarray, np.ndarray]:
    where, label = client.pmf_where, f"[{block}][{field}]"
    text = client.pmf_text[block][field]
    try:
        pmf = _plain_pmf(text, where, label)
        if pmf is None and len(text) > MAX_LITERAL_CHARS:
            raise TraceError(
                where,
                f"not a plain {{tokens: probability}} dict, and over {MAX_LITERAL_CHARS} characters",
                field=label,
            )
        if pmf is None:
            pmf = ast.literal_eval(text)
    except TraceError:
        raise
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
        raise TraceError(
            where, f"not a Python dict literal: {str(exc).splitlines()[0][:200]}", field=label
        ) from None
    if not isinstance(pmf, dict) or not pmf:
        raise TraceError(where, "expected a non-empty {tokens: probability} dict", field=label)
    values = np.asarray(list(pmf), dtype=object)
    probs = np.asarray(list(pmf.values()), dtype=object)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise TraceError(where, "token counts must be integers >= 1", field=label)
    if not all(isinstance(p, int | float) and not isinstance(p, bool) and p >= 0 for p in probs):
        raise TraceError(where, "probabilities must be numbers >= 0", field=label)
    order = np.argsort(values.astype(np.int64), kind="stable")
    values, probs = values.astype(np.int64)[order], probs.astype(np.float64)[order]
    total = probs.sum()
    if not abs(total - 1.0) < 1e-3:
        raise TraceError(where, f"probabilities sum to {total:.6g}, expected 1", field=label)
    cdf = np.cumsum(probs) / total
    cdf[-1] = 1.0
    return values, cdf


def _plain_pmf(text: str, where: str, label: str) -> dict[int | float, int | float] | None:
    """``text`` as ServeGen writes a PMF, ``{1: 0.25, 2: 0.75}`` (numbers only), read in one linear
    pass into the dict ``ast.literal_eval`` gives; None when it has any other form."""
    opened = _PMF_OPEN.match(text)
    if opened is None:
        return None
    pmf: dict[int | float, int | float] = {}
    pos = opened.end()
    while item := _PMF_ITEM.match(text, pos):
        key, value = _plain_number(item[1]), _plain_number(item[2])
        if key is None or value is None:
            return None
        pmf[key] = value
        if len(pmf) > MAX_PMF_ENTRIES:
            raise TraceError(where, f"more than {MAX_PMF_ENTRIES} token counts", field=label)
        pos = item.end()
    return pmf if _PMF_CLOSE.fullmatch(text, pos) else None


def _plain_number(token: str) -> int | float | None:
    """A number token as Python reads the literal (None for ``007``, which is no literal)."""
    digits = token.lstrip("+-")
    if any(c in digits for c in ".eE"):
        return float(token)
    if len(digits) > 1 and digits[0] == "0" and digits.strip("0"):
        return None
    return int(token)
