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
from envs.serving.fleet import LINKS, MAX_SERVERS, ONE_SERVER, FleetSpec
from envs.serving.setup import split_cost_model
from envs.serving.specs import hardware_names, model_names
from envs.serving.workload import FILE_PREFIX, workload_names

FLEET_REPLICAS = Rule(lambda v: 1 <= v <= MAX_SERVERS, f"an integer in 1..{MAX_SERVERS}")
FLEET_POOL = Rule(lambda v: 0 <= v <= MAX_SERVERS, f"an integer in 0..{MAX_SERVERS}")
COST_NAMES = ("calibrated", "roofline")
LENGTH_SCALED = re.compile(r".+/len[0-9.e+-]+")
"""An engine replay's workload label, ``<workload>/len<length_scale>`` (engine/replay.py)."""
"""Cost models by name; anything else is a coefficient file's path."""
FLEET_KEY = (
    "fleet_replicas", "fleet_router", "fleet_prefill", "fleet_decode", "fleet_link", "fleet_decode_router",
    "fleet_layerwise",
)  # fmt: skip
"""A row's fleet (:func:`fleet_columns`): colocated replicas behind a router, or prefill and decode pools."""
ROW_KEY = ("backend", "policy", "workload", "load_scale", "seed", *FLEET_KEY)
"""What makes a row one run: the board pools rows that share a key, so a results file holds each once.
A row without the fleet columns (a file made before fleets) is one server; at one server the router
is ignored, and keyed as none; a row without the pool columns (made before disaggregation) is colocated."""
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


def fleet_key(row: Mapping[Any, Any]) -> tuple[Any, ...]:
    """The row's :data:`FLEET_KEY` values, checked (:func:`row_fleet`), as :func:`fleet_columns` writes them."""
    return tuple(fleet_columns(row_fleet(row)).values())


def fleet_columns(fleet: FleetSpec) -> dict[str, Any]:
    """The :data:`FLEET_KEY` cells of a row served by ``fleet``: one server as :data:`ONE_SERVER` (no
    router), and the pools' cells (0 servers, empty names) on a colocated row, so a row made before
    fleets or before disaggregation reads back as the run it was."""
    if fleet.servers == 1:
        fleet = ONE_SERVER
    pools = fleet.disaggregated
    return {
        "fleet_replicas": fleet.replicas,
        "fleet_router": fleet.router if fleet.servers > 1 else "",
        "fleet_prefill": fleet.prefill,
        "fleet_decode": fleet.decode,
        "fleet_link": fleet.link if pools else "",
        "fleet_decode_router": fleet.decode_router if pools else "",
        "fleet_layerwise": fleet.layerwise if pools else "",
    }


def row_fleet(row: Mapping[Any, Any]) -> FleetSpec:
    """The fleet a row was served by, each fleet cell checked (:data:`ONE_SERVER` without them)."""
    prefill = _count(row, "fleet_prefill", FLEET_POOL)
    if prefill:
        replicas = _count(row, "fleet_replicas", FLEET_REPLICAS) or 1
        router, decode = _router(row, "fleet_router"), _count(row, "fleet_decode", FLEET_POOL)
        link = _named(row, "fleet_link", "link", LINKS)
        decode_router, layerwise = _router(row, "fleet_decode_router"), _flag(row, "fleet_layerwise")
        try:
            return FleetSpec(replicas, router, prefill, decode, link, decode_router, layerwise)
        except ValueError as exc:  # a shape no fleet has (fleet.decode=0 beside fleet.prefill=1)
            raise ValueError(f"fleet columns: {exc}") from None
    n = _count(row, "fleet_replicas", FLEET_REPLICAS)
    if n <= 1:
        return ONE_SERVER
    return FleetSpec(replicas=n, router=_router(row, "fleet_router"))


def _count(row: Mapping[Any, Any], column: str, rule: Rule) -> int:
    """A server count cell; 0 when the row has none (a file made before the column)."""
    value = row.get(column)
    if value in (None, "") or (isinstance(value, float) and math.isnan(value)):
        return 0
    count: int = check_number(column, value, rule, integer=True)
    return count


def _router(row: Mapping[Any, Any], column: str) -> str:
    router = row.get(column)
    if router not in router_names():
        raise ValueError(f"column {column}: {shown(router)} is not one of {', '.join(router_names())}")
    return str(router)


def _named(row: Mapping[Any, Any], column: str, kind: str, names: Sequence[str]) -> str:
    try:
        return check_named(row.get(column), kind, names)
    except ValueError as exc:
        raise ValueError(f"column {column}: {exc}") from None


def _flag(row: Mapping[Any, Any], column: str) -> bool:
    """A true/false cell as CSV (``True``), JSON (``true``) or pandas (a numpy bool) gives it back."""
    value = row.get(column)
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"column {column}: {shown(value)} is not true or false")


def fleet_label(fleet: FleetSpec) -> str:
    """How messages and the board name a fleet: ``x8 prefix_affinity``, ``2P1D eth_25g
    round_robin/least_requests`` (``layerwise`` added where it streams); empty for one server."""
    if fleet.disaggregated:
        streams = " layerwise" if fleet.layerwise else ""
        return f"{fleet.prefill}P{fleet.decode}D {fleet.link}{streams} {fleet.router}/{fleet.decode_router}"
    return f"x{fleet.replicas} {fleet.router}" if fleet.servers > 1 else ""


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
