"""The request stream a workload hands out, the error bad trace files raise, and the split table."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from chunkgym.data import MissingDataError
from envs.serving.slo_classes import slo_class_names

T = TypeVar("T")
DEFAULT_TENANT = "default"
"""The tenant of every request of a trace that names none."""

SPLITS: dict[str, tuple[float, float]] = {
    "train": (0.0, 0.6),
    "val": (0.6, 0.8),
    "test": (0.8, 1.0),
    "all": (0.0, 1.0),
}
"""Fractions of a source (its time span, or its rows for length-only files) each split covers."""


class TraceError(ValueError):
    """A trace file that cannot be read as requests; the message names file, line and field."""

    def __init__(self, path: object, message: str, line: int | None = None, field: str | None = None):
        self.path, self.line, self.field = str(path), line, field
        where = self.path if line is None else f"{self.path}:{line}"
        what = "" if field is None else f"field {field!r}: "
        super().__init__(f"{where}: {what}{message}")


class MissingTraceError(TraceError, MissingDataError):
    """A workload's trace file the data folder lacks (tools print one line naming the fetch command)."""


MAX_LABEL_CHARS = 64
"""Longest tenant or SLO-class label: room for an account id or a UUID, not for a payload."""


def label_problem(value: object) -> str | None:
    """Why ``value`` cannot be a tenant or SLO-class label (non-empty printable text of at most
    :data:`MAX_LABEL_CHARS` characters, no surrounding whitespace), else None."""
    if not isinstance(value, str):
        return f"expected text, got {type(value).__name__}"
    shown = value if len(value) <= MAX_LABEL_CHARS else f"{value[:MAX_LABEL_CHARS]}..."
    if not value:
        return "empty label; expected non-empty text"
    if len(value) > MAX_LABEL_CHARS:
        return f"label {shown!r} is {len(value)} characters, over the limit of {MAX_LABEL_CHARS}"
    if not value.isprintable():
        return f"label {shown!r} holds characters that are not printable"
    if value != value.strip():
        return f"label {shown!r} starts or ends with whitespace"
    return None


def class_problem(value: str) -> str | None:
    """Why the label ``value`` names no SLO class in ``conf/slo_class``, else None."""
    names = slo_class_names()
    return None if value in names else f"unknown slo_class {value!r}; valid names: {', '.join(names)}"


def split_fractions(split: str) -> tuple[float, float]:
    """The (start, stop) fraction of ``split``; unknown names raise with the valid ones."""
    try:
        return SPLITS[split]
    except KeyError:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}") from None


def _frozen(a: np.ndarray, dtype: type) -> np.ndarray:
    """A read-only view: traces share arrays with the parsed-file cache, so nobody may write them."""
    view: np.ndarray = np.asarray(a, dtype=dtype).view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True, eq=False)
class Trace:
    """A request stream, arrivals sorted, times in seconds from the window start (first arrival may be > 0).

    ``offset_s`` and ``first_row`` record where the stream came from so results can name it:
    the source time (trace seconds, before rate scaling) of this stream's time zero, and the
    source row of its first request (-1 where requests are generated, not file rows).
    ``tenant`` and ``slo_class`` label each request (in trace order) with who sent it and the
    class (``conf/slo_class``) it is judged by; None: every request is tenant ``default``
    (:data:`DEFAULT_TENANT`), judged by the run's SLO.
    """

    name: str
    source: str
    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    hash_ids: tuple[np.ndarray, ...] | None
    hash_block_tokens: int
    span_s: float
    offset_s: float = 0.0
    first_row: int = 0
    tenant: tuple[str, ...] | None = None
    slo_class: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        arrival = _frozen(self.arrival_s, np.float64)
        prompt = _frozen(self.prompt_len, np.int64)
        output = _frozen(self.output_len, np.int64)
        object.__setattr__(self, "arrival_s", arrival)
        object.__setattr__(self, "prompt_len", prompt)
        object.__setattr__(self, "output_len", output)
        n = len(arrival)
        if arrival.ndim != 1 or len(prompt) != n or len(output) != n:
            raise ValueError(f"trace {self.name!r}: arrival/prompt/output lengths differ")
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise ValueError(f"trace {self.name!r}: {len(self.hash_ids)} hash-id lists for {n} requests")
        if (self.hash_ids is None) != (self.hash_block_tokens == 0):
            raise ValueError(
                f"trace {self.name!r}: hash_block_tokens must be 0 exactly when hash_ids is None"
            )
        if n:
            if not (arrival[0] >= 0 and np.all(np.diff(arrival) >= 0)):
                raise ValueError(f"trace {self.name!r}: arrivals must be non-negative and non-decreasing")
            if arrival[-1] > self.span_s:
                raise ValueError(f"trace {self.name!r}: span {self.span_s} s < last arrival {arrival[-1]} s")
            if prompt.min() < 1 or output.min() < 1:
                raise ValueError(f"trace {self.name!r}: prompt and output lengths must be >= 1")
        for field in ("tenant", "slo_class"):
            self._check_labels(field)

    def _check_labels(self, field: str) -> None:
        labels = getattr(self, field)
        if labels is None:
            return
        labels = tuple(labels)
        object.__setattr__(self, field, labels)
        if len(labels) != len(self):
            raise ValueError(f"trace {self.name!r}: {len(labels)} {field} labels for {len(self)} requests")
        for value in set(labels):  # few distinct values however long the trace
            problem = label_problem(value) or (class_problem(value) if field == "slo_class" else None)
            if problem:
                raise ValueError(f"trace {self.name!r}: field {field!r}: {problem}")

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __reduce__(self) -> tuple[Callable[..., Trace], tuple[object, ...]]:
        # Pickled once per capacity probe, to a pool worker: Mooncake's thousand small hash-id
        # arrays pickle about ten times slower than one array and their lengths.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "hash_ids"}
        if self.hash_ids is None:
            return _unpickle, (fields, None, None)
        lengths = np.fromiter(map(len, self.hash_ids), np.int64, len(self.hash_ids))
        flat = np.concatenate(self.hash_ids) if self.hash_ids else np.zeros(0, np.int64)
        return _unpickle, (fields, flat, lengths)

    def scale_lengths(self, factor: float) -> Trace:
        """Prompt and output lengths divided by ``factor`` (rounded, at least 1 token), times unchanged.

        For small models on small devices (CPU replays of the real engine): the same arrival
        pattern with proportionally lighter requests.  Prefix hash ids describe the original
        token blocks, so a trace that has them cannot be scaled.
        """
        if factor == 1.0:
            return self
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"trace {self.name!r}: length factor must be a positive number, got {factor!r}")
        if self.hash_ids is not None:
            raise ValueError(f"trace {self.name!r}: prefix hash ids do not survive length scaling")

        def shrink(lengths: np.ndarray) -> np.ndarray:
            return np.maximum(1, np.rint(lengths / factor)).astype(np.int64)

        return dataclasses.replace(
            self,
            name=f"{self.name}/len{factor:g}",
            prompt_len=shrink(self.prompt_len),
            output_len=shrink(self.output_len),
        )

    def slice(self, start: int, stop: int) -> Trace:
        """Requests ``[start, stop)`` in the same time base (same span and offset)."""
        start, stop, _ = slice(start, stop).indices(len(self))
        first = self.first_row + start if self.first_row >= 0 else -1
        return dataclasses.replace(
            self,
            arrival_s=self.arrival_s[start:stop],
            prompt_len=self.prompt_len[start:stop],
            output_len=self.output_len[start:stop],
            hash_ids=_part(self.hash_ids, start, stop),
            first_row=first,
            tenant=_part(self.tenant, start, stop),
            slo_class=_part(self.slo_class, start, stop),
        )

    def tenants(self) -> tuple[str, ...]:
        """Each request's tenant, :data:`DEFAULT_TENANT` where the trace names none."""
        return self.tenant if self.tenant is not None else (DEFAULT_TENANT,) * len(self)


def _part(values: tuple[T, ...] | None, start: int, stop: int) -> tuple[T, ...] | None:
    return None if values is None else values[start:stop]


def _unpickle(fields: dict[str, Any], flat: np.ndarray | None, lengths: np.ndarray | None) -> Trace:
    """:meth:`Trace.__reduce__`'s inverse: the hash ids as read-only views of the one array."""
    hashes: tuple[np.ndarray, ...] | None = None
    if flat is not None and lengths is not None:
        flat.flags.writeable = False
        hashes = tuple(np.split(flat, np.cumsum(lengths)[:-1])) if len(lengths) else ()
    return Trace(hash_ids=hashes, **fields)


class Source(Protocol):
    """What a workload reads from: whole splits or windows, in trace seconds (before rate scaling)."""

    source: str

    def extract(self, split: str, seed: int, window_s: float | None) -> Trace:
        """The split (``window_s`` None) or a seeded window of it, rebased to its start."""
        ...

    def mean_rate(self, split: str) -> float:
        """Requests per trace second over ``split``: what a mix scales to its tenant's share."""
        ...
