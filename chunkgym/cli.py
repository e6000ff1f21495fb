"""One command-line convention for every tool: Hydra ``key=value`` overrides checked against a dataclass.

``train.py`` and ``evaluate.py`` compose YAML groups from ``conf/``; the smaller tools
(benchmarks, the engine replay, the workload statistics) have a dataclass of options and no
YAML group of their own.  :func:`hydra_cli` gives them the same override syntax and the same
up-front checking without Hydra's run folders or log files; ``config=PATH`` merges a YAML file
of options (a tool may name a default one) under the other overrides::

    @dataclass
    class Options:
        seeds: list[int] = field(default_factory=lambda: [0])  # which seeds to run

    @hydra_cli(Options)
    def main(opts: Options) -> None: ...

    python bench/headroom.py seeds=[0,1] n_jobs=2
    python bench/headroom.py --help              # Hydra lists every option with its default

Every bad override (an unknown key, ``+key=`` too; a wrong type; a value outside the tool's
:class:`~chunkgym.config.Rule` s) stops the tool before any work with one line naming the key and
the value; :func:`precheck` does the same for ``train.py`` and ``evaluate.py``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from chunkgym.config import ConfigError, Rule, one_line, schema, to_object
from chunkgym.data import MissingDataError

T = TypeVar("T")

CONFIG_FILE_KEY = "config"
"""``config=PATH``: a YAML file of options merged over the schema's defaults, under the other overrides."""

# Keep Hydra out of the working tree: no run folder, no .hydra/ copy, no log files.
_QUIET = (
    "hydra.run.dir=.",
    "hydra.output_subdir=null",
    "hydra/job_logging=none",
    "hydra/hydra_logging=none",
)


def describe(exc: BaseException) -> str:
    """Hydra's and OmegaConf's (multi-line) messages and their causes, on one line."""
    parts = []
    cause: BaseException | None = exc
    while cause is not None:
        text = str(getattr(cause, "msg", None) or cause).split("Config search path:")[0]
        skip = ("full_key:", "reference_type=", "object_type=")
        lines = [line.strip() for line in text.splitlines()]
        parts.append(" ".join(line for line in lines if line and not line.startswith(skip)))
        cause = cause.__cause__
    return ": ".join(dict.fromkeys(p for p in parts if p))


def _compose(config_dir: str | None, config_name: str, overrides: Sequence[str]) -> Any:
    """Hydra's composition of ``overrides``, its errors as one :class:`ConfigError` line."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    init = (
        hydra.initialize_config_dir(config_dir, version_base="1.3")
        if config_dir
        else hydra.initialize(config_path=None, version_base="1.3")
    )
    try:
        with init:
            return hydra.compose(config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(describe(exc)) from None


def _tool() -> str:
    """The command as typed: ``sarathi_capacity.py``, or ``python -m calibration`` for a package."""
    path = Path(sys.argv[0])
    return f"python -m {path.parent.name}" if path.name == "__main__.py" else path.name


def _is_hydra_flag(args: Sequence[str]) -> bool:
    """``--help``, ``--cfg``, ``-m`` sweeps: left to Hydra (each sweep job checks its own config)."""
    return any(a.startswith("-") for a in args)


def precheck(
    config_dir: str,
    config_name: str,
    cls: type[T],
    rules: Mapping[str, Rule] | None = None,
    then: Callable[[T], Any] | None = None,
) -> None:
    """Compose ``sys.argv``'s overrides once and check them into ``cls`` (and by ``then``, which
    raises ValueError); exit with one line if they fail, before Hydra makes a run folder."""
    args = sys.argv[1:]
    if _is_hydra_flag(args):
        return
    try:
        conf = to_object(_compose(config_dir, config_name, args), cls, "", rules)
        if then is not None:
            then(conf)
    except ValueError as exc:
        raise SystemExit(f"{_tool()}: error: {exc}") from None


def _with_file(cls: type, args: Sequence[str], default_file: Path | None) -> tuple[list[str], Any]:
    """The overrides without ``config=PATH``, and ``cls``'s node with that file (else ``default_file``) merged in."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from chunkgym import resolve_path

    prefix = f"{CONFIG_FILE_KEY}="
    files = [a[len(prefix) :] for a in args if a.startswith(prefix)]
    if len(files) > 1:
        raise ConfigError(f"{CONFIG_FILE_KEY}= is given {len(files)} times")
    node = schema(cls)
    path = resolve_path(files[0]) if files else default_file
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"{CONFIG_FILE_KEY}={os.fspath(path)}: no such file")
        try:
            node = cast(DictConfig, OmegaConf.merge(node, OmegaConf.load(path)))  # a merge keeps node's kind
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{path}: {one_line(exc)}") from None
    return [a for a in args if not a.startswith(prefix)], node


def load_options(
    cls: type[T],
    args: Sequence[str],
    default_file: Path | None = None,
    rules: Mapping[str, Rule] | None = None,
    name: str | None = None,
) -> T:
    """What ``python TOOL ARGS`` reads: ``cls``'s defaults, the ``config=`` file, the overrides, checked.

    Overrides apply in order, so a tool's own presets go first and the user's win.
    """
    from hydra.core.config_store import ConfigStore

    config_name = name or cls.__name__
    rest, node = _with_file(cls, args, default_file)
    ConfigStore.instance().store(name=config_name, node=node)
    return to_object(_compose(None, config_name, rest), cls, "", rules)


def hydra_cli(
    cls: type[T],
    name: str | None = None,
    rules: Mapping[str, Rule] | None = None,
    default_file: Path | None = None,
    preset: Sequence[str] = (),
) -> Callable[[Callable[[T], Any]], Callable[..., Any]]:
    """Decorate ``main(opts)`` so that it reads ``key=value`` overrides of ``cls`` from ``sys.argv``.

    ``name`` is the ConfigStore entry (default: the class name), unique per tool;
    ``default_file`` the YAML file read when no ``config=PATH`` is given; ``preset``
    overrides applied over it, under the command line's.  Hydra is imported
    only when the command runs, so a library module may carry its own ``main``.
    """
    config_name = name or cls.__name__

    def decorate(main: Callable[[T], Any]) -> Callable[..., Any]:
        @functools.wraps(main)
        def run(argv: Sequence[str] | None = None) -> Any:
            """``argv``: the overrides (default ``sys.argv[1:]``), e.g. from a test."""
            args = [*preset, *(sys.argv[1:] if argv is None else argv)]
            try:
                if _is_hydra_flag(args):
                    return _hydra_main(cls, config_name, args, default_file, rules, main)
                opts = load_options(cls, args, default_file, rules, config_name)
            except ConfigError as exc:
                raise SystemExit(f"{_tool()}: error: {exc}") from None
            try:
                return main(opts)
            except MissingDataError as exc:  # one line naming the file and the fetch command
                raise SystemExit(f"{_tool()}: error: {exc}") from None

        return run

    return decorate


def _hydra_main(
    cls: type[T],
    config_name: str,
    args: list[str],
    default_file: Path | None,
    rules: Mapping[str, Rule] | None,
    main: Callable[[T], Any],
) -> Any:
    """Hydra's own entry point, for ``--help`` (lists every option) and ``-m`` sweeps."""
    import hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import DictConfig

    rest, node = _with_file(cls, args, default_file)
    ConfigStore.instance().store(name=config_name, node=node)

    @hydra.main(version_base="1.3", config_path=None, config_name=config_name)
    def entry(cfg: DictConfig) -> Any:
        return main(to_object(cfg, cls, "", rules))

    sys.argv = [sys.argv[0], *rest, *_QUIET]
    return entry()
