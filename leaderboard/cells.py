"""The cells of a received results file, checked as the grid builder checks its options.

A results file (``evaluate.py validate=`` or ``results=``) may come from anyone, so its cells are
data that names data, never files: a ``cost_model`` cell is a cost model's name (``calibrated``,
``roofline``, optionally ``:<engine overhead profile>``) or a coefficient file in ``conf/cost``, a
``workload`` cell the name of a ``conf/workload`` file, and a model or hardware cell a name in
``conf/model`` or ``conf/hardware``.  A cell may name any other file only when the user named it
too (:class:`AllowedPaths`: ``allow_paths=``, or ``cost_model=PATH`` on the command line); nothing
else is opened, so a row cannot make a tool read, and quote in an error, a file the user never
chose.  Every check happens before any work starts and fails with one line naming the row and the
column; a cell is shown by :func:`shown` (``repr``, cut short), so a newline or a megabyte in a
cell never spreads the message over lines.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from baselines.routers import router_names
from chunkgym.config import LOAD_SCALE, SEED, Rule
from envs.serving.cost_model import COST_DIR
from envs.serving.fleet import MAX_SERVERS
from envs.serving.setup import split_cost_model
from envs.serving.specs import hardware_names, model_names
from envs.serving.workload import FILE_PREFIX, workload_names

FLEET_REPLICAS = Rule(lambda v: 1 <= v <= MAX_SERVERS, f"an integer in 1..{MAX_SERVERS}")
COST_NAMES = ("calibrated", "roofline")
LENGTH_SCALED = re.compile(r".+/len[0-9.e+-]+")
"""An engine replay's workload label, ``<workload>/len<length_scale>`` (engine/replay.py)."""
"""Cost models by name; anything else is a coefficient file's path."""
ROW_KEY = ("backend", "policy", "workload", "load_scale", "seed", "fleet_replicas", "fleet_router")
"""What makes a row one run: the board pools rows that share a key, so a results file holds each once.
A row without the fleet columns (a file made before fleets) is one server; at one server the router
is ignored, and keyed as none."""
SHOWN_CHARS = 80
SHOWN_PLACES = 3


def shown(value: object) -> str:
    """``value`` for a one-line message: its ``repr`` (newlines and control characters escaped), cut short."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}..."


@dataclass(frozen=True)
class AllowedPaths:
    """Paths the user named on the command line, which cells of a received results file may name too.

    An entry allows itself and, when it is a folder, every path inside it (links resolved, so a
    link inside an allowed folder that leaves it is not allowed).  A ``file:`` prefix and a
    cost model's ``:<profile>`` suffix are dropped, so ``allow_paths=[file:t.jsonl]`` and
    ``cost_model=fit.yaml:vllm`` allow what they name.
    """

    entries: tuple[str, ...] = ()

    @classmethod
    def of(cls, entries: Iterable[str | None]) -> AllowedPaths:
        bases = (split_cost_model(entry.removeprefix(FILE_PREFIX))[0] for entry in entries if entry)
        return cls(tuple(base for base in bases if base not in COST_NAMES))

    def allows(self, path: str) -> bool:
        """Whether the file ``path`` (as a cell spells it) is one the user named.

        A relative path that the working folder does not hold is looked up elsewhere (the data
        folder, for a trace), so it is allowed only when spelled as an entry spells it.
        """
        if path in self.entries:
            return True
        p = Path(os.path.expanduser(path))
        if not p.is_absolute():
            p = Path.cwd() / p
            if not os.path.lexists(p):
                return False
        real = p.resolve()
        for entry in self.entries:
            allowed = Path(os.path.expanduser(entry)).resolve()
            if real == allowed or allowed in real.parents:
                return True
        return False


NO_PATHS = AllowedPaths()


def check_named(value: object, kind: str, names: Sequence[str]) -> str:
    """``value`` if it is one of ``names`` (a ``conf/<kind>`` name): never turned into a path otherwise."""
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"unknown {kind} {shown(value)}; valid names: {', '.join(names)}")
    return value


def check_model(value: object) -> str:
    return check_named(value, "model", model_names())


def check_hardware(value: object) -> str:
    return check_named(value, "hardware", hardware_names())


def check_workload(value: object, allowed: AllowedPaths | None) -> str:
    """A workload's name, or ``file:PATH``; with ``allowed``, PATH must be one the user allowed
    (``None``: the file is never opened, as when a board is only rendered)."""
    if isinstance(value, str) and value.startswith(FILE_PREFIX) and len(value) > len(FILE_PREFIX):
        if allowed is not None and not allowed.allows(value[len(FILE_PREFIX) :]):
            raise ValueError(
                f"{shown(value)} names a trace file that was not allowed; allow_paths=[PATH] on the "
                "command line lets rows read a file or folder you trust"
            )
        return value
    if isinstance(value, str) and LENGTH_SCALED.fullmatch(value) and as_float(value.rsplit("/len", 1)[1]):
        check_workload(value.rsplit("/len", 1)[0], allowed)  # an engine replay's lighter requests
        return value
    if not isinstance(value, str) or value not in workload_names():
        raise ValueError(
            f"unknown workload {shown(value)}; valid names: {', '.join(workload_names())}, or {FILE_PREFIX}PATH"
        )
    return value


def check_cost_model(value: object, allowed: AllowedPaths) -> str:
    """A cost model's name (``calibrated``, ``roofline``, ``calibrated:<profile>``), a file in
    ``conf/cost``, or a coefficient file the user allowed."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{shown(value)} is not a cost model")
    base = split_cost_model(value)[0]
    if base in COST_NAMES:
        return value
    real = Path(os.path.expanduser(base)).resolve()
    if COST_DIR.resolve() in real.parents or allowed.allows(base):
        return value
    raise ValueError(
        f"{shown(value)} is neither {' nor '.join(COST_NAMES)} nor a file in {COST_DIR}; allow_paths=[PATH] "
        "(or cost_model=PATH) on the command line lets rows read a file you trust"
    )


def as_int(value: object) -> int | None:
    """``value`` as an integer (text, a JSON or numpy integer, an integral float); None if it is not one."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return int(value) if math.isfinite(value) and float(value).is_integer() else None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:  # not digits, or past Python's digit limit
            return None
    return None


def as_float(value: object) -> float | None:
    """``value`` as a float (text, a JSON or numpy number); None if it is not a number."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | float | np.integer | np.floating):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def check_number(column: str, value: object, rule: Rule, integer: bool = False) -> Any:
    """``value`` converted (:func:`as_int` or :func:`as_float`) and within ``rule``."""
    number = as_int(value) if integer else as_float(value)
    if number is None or not rule.test(number):
        raise ValueError(f"column {column}: {shown(value)} is not {rule.want}")
    return number


def row_key(row: Mapping[Any, Any]) -> tuple[Any, ...]:
    """The row's :data:`ROW_KEY`, numbers as numbers (``1`` and ``1.0`` are one load)."""
    return (
        str(row["backend"]),
        str(row["policy"]),
        str(row["workload"]),
        check_number("load_scale", row["load_scale"], LOAD_SCALE),
        check_number("seed", row["seed"], SEED, integer=True),
        *fleet_key(row),
    )


def fleet_key(row: Mapping[Any, Any]) -> tuple[int, str]:
    """The row's ``(fleet_replicas, fleet_router)``, checked: (1, "") without the columns or at one server."""
    replicas = row.get("fleet_replicas")
    if replicas in (None, "") or (isinstance(replicas, float) and math.isnan(replicas)):
        return 1, ""
    n = check_number("fleet_replicas", replicas, FLEET_REPLICAS, integer=True)
    if n == 1:
        return 1, ""
    router = row.get("fleet_router")
    if router not in router_names():
        raise ValueError(f"column fleet_router: {shown(router)} is not one of {', '.join(router_names())}")
    return n, str(router)


def check_unique(keys: Sequence[tuple[tuple[Any, ...], str]], columns: Sequence[str] = ROW_KEY) -> None:
    """Refuse rows that repeat a key (values of ``columns``), naming the first repeated key's rows:
    pooled as seeds, a copied row would shrink a confidence interval it never measured."""
    seen: dict[tuple[Any, ...], list[str]] = {}
    for key, where in keys:
        seen.setdefault(key, []).append(where)
    for key, places in seen.items():
        if len(places) > 1:
            more = f" and {len(places) - SHOWN_PLACES} more" if len(places) > SHOWN_PLACES else ""
            run = ", ".join(f"{c}={shown(v)}" for c, v in zip(columns, key, strict=True))
            raise ValueError(
                f"{', '.join(places[:SHOWN_PLACES])}{more} repeat one run ({run}): "
                "a results file holds each run once"
            )
