"""One way to read config: a mapping checked into a dataclass, with one-line errors naming the key.

Every config source goes through here: the spec files (``conf/model``, ``conf/hardware``,
``conf/slo``, ``conf/workload``), a results row's columns, and the Hydra compositions of
``train.py``, ``evaluate.py`` and the smaller tools.  Types follow OmegaConf, the rules Hydra
applies to command-line overrides, so a YAML file and an override of the same key accept
the same values; value ranges are :class:`Rule` s keyed by the full dotted key, checked
by :func:`check` before any work starts.  Every error is a :class:`ConfigError`: one line,
naming the source, the key as typed and the value.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")


class ConfigError(ValueError):
    """Bad config: the message is one line, ``SOURCE: KEY...``."""


@dataclass(frozen=True)
class Rule:
    """A range a value must lie in, and how the error says so."""

    test: Callable[[Any], bool]
    want: str


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


POSITIVE = Rule(lambda v: _finite(v) and v > 0, "a positive finite number")
NON_NEGATIVE = Rule(lambda v: _finite(v) and v >= 0, "a finite number >= 0")
AT_LEAST_ONE = Rule(lambda v: isinstance(v, int) and v >= 1, "an integer >= 1")
NON_EMPTY = Rule(lambda v: len(v) > 0, "a non-empty list")

# Ranges of the numbers every tool shares: values past them are typos or attacks (1e20 GPUs, a
# 1e-300 load, a window of centuries), never a setting anyone runs, and they cost unbounded time.
MAX_SEED = 2**32 - 1  # numpy's SeedSequence words and SB3's seeding take 32-bit seeds
TP = Rule(lambda v: _integer(v) and 1 <= v <= 64, "an integer in [1, 64]")
LOAD_SCALE = Rule(lambda v: _finite(v) and 1e-3 <= v <= 1e3, "a finite load scale in [0.001, 1000]")
WINDOW_S = Rule(
    lambda v: v is None or (_finite(v) and 1 <= v <= 30 * 86400), "null or seconds in [1, 2592000] (30 days)"
)
SEED = Rule(lambda v: _integer(v) and 0 <= v <= MAX_SEED, f"an integer in [0, {MAX_SEED}]")


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def each(rule: Rule) -> Rule:
    """``rule`` for every element of a list (``load_scales``, ``seeds``)."""
    return Rule(lambda values: all(rule.test(v) for v in values), f"a list of which each is {rule.want}")


def prefixed(prefix: str, rules: Mapping[str, Rule]) -> dict[str, Rule]:
    """``rules`` of a nested dataclass, keyed from the enclosing config's root."""
    return {f"{prefix}.{key}": rule for key, rule in rules.items()}


def check(obj: Any, rules: Mapping[str, Rule], source: str, at: str = "") -> None:
    """Raise :class:`ConfigError` for the first value of ``obj`` (dotted keys) outside its rule.

    ``at``: where ``obj`` sits in the config the user typed (``serving``), for the message.
    """
    for key, rule in rules.items():
        value = obj
        for part in key.split("."):
            value = getattr(value, part)
        if not rule.test(value):
            name = f"{at}.{key}" if at else key
            raise ConfigError(f"{_at(source)}{name}={value!r}: must be {rule.want}")


def schema(cls: type) -> DictConfig:
    """``cls`` as a typed OmegaConf node that YAML groups and overrides can merge into.

    OmegaConf makes the nodes of frozen dataclasses (the spec classes) read-only; here
    they stay typed (unknown keys and wrong types still fail) but writable.
    """
    node: DictConfig = OmegaConf.structured(cls)
    _writable(node, cls)
    return node


def _writable(node: DictConfig, cls: type) -> None:
    OmegaConf.set_readonly(node, False)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if not (dataclasses.is_dataclass(kind) and isinstance(kind, type)):
            continue
        if OmegaConf.is_missing(node, f.name) and kind.__dataclass_params__.frozen:  # type: ignore[attr-defined]  # set on every dataclass, not in its stubs
            node[f.name] = OmegaConf.structured(kind)  # a typed node to merge into, not a read-only one
        if not OmegaConf.is_missing(node, f.name):
            _writable(node[f.name], kind)


def from_mapping(cls: type[T], data: Any, source: str, rules: Mapping[str, Rule] | None = None) -> T:
    """Build ``cls`` from a mapping (a YAML file, a JSON column), checking types, then ``rules``.

    The dataclass's own ``__post_init__`` checks run too; their message is prefixed by ``source``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{_at(source)}expected a mapping of {cls.__name__} fields, got {type(data).__name__}"
        )
    try:
        out = OmegaConf.to_object(OmegaConf.merge(schema(cls), data))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{_at(source)}{one_line(exc)}") from None
    except (TypeError, ValueError) as exc:  # the dataclass's own checks
        raise ConfigError(f"{_at(source)}{exc}") from None
    check(out, rules or {}, source)
    return cast(T, out)  # to_object of a structured node of cls is a cls


def to_object(cfg: DictConfig, cls: type[T], source: str, rules: Mapping[str, Rule] | None = None) -> T:
    """A Hydra composition as ``cls``: no key outside the schema (``+key=`` bypasses it), then ``rules``."""
    extra = unknown_keys(cfg)
    if extra:
        raise ConfigError(
            f"{_at(source)}unknown config key(s) {extra}: not in the schema ({cls.__qualname__})"
        )
    try:
        out = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{_at(source)}{one_line(exc)}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{_at(source)}{exc}") from None
    if not isinstance(out, cls):
        raise ConfigError(
            f"{_at(source)}expected a config of type {cls.__qualname__}, got {type(out).__name__}"
        )
    check(out, rules or {}, source)
    return out


def _at(source: str) -> str:
    return f"{source}: " if source else ""


def one_line(exc: OmegaConfBaseException) -> str:
    """OmegaConf's message (first line) after the full key it concerns."""
    msg = str(getattr(exc, "msg", None) or exc).splitlines()[0]
    key = getattr(exc, "full_key", None)
    return f"{key}: {msg}" if key else msg


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys that a ``+key=value`` override added to a typed node (Hydra lets ``+`` bypass the schema)."""
    kind = OmegaConf.get_type(node)
    names: Container[object] = (
        {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else node.keys()
    )
    out = []
    for key in node.keys():
        if key not in names:
            out.append(f"{prefix}{key!s}")
        elif not OmegaConf.is_missing(node, key) and OmegaConf.is_dict(node[key]):
            out += unknown_keys(node[key], f"{prefix}{key!s}.")
    return out
