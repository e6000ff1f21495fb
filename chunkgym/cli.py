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
the value; :func:`precheck` does the same for ``train.py``, ``evaluate.py`` and ``advise.py``, and
checks and locks their run folder before Hydra writes into it.

Every known input error (:data:`INPUT_ERRORS`: a bad config or override, a received file refused,
missing data, a refused or busy output folder) ends a tool with one line on stderr and exit code 2
(:func:`one_line_errors`); a traceback means a bug.  Received options files and overrides are data:
an interpolation that calls a resolver other than :data:`ALLOWED_RESOLVERS` (``${oc.env:...}`` reads
the environment, ``${oc.decode:...}`` parses) is refused; plain ``${key}`` references stay.
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
from chunkgym.io import FolderLockedError, OutputFolderError, check_output_folder, lock_for_process
from chunkgym.received import ReceivedFileError, parse_yaml, read_text, write_target

T = TypeVar("T")

CONFIG_FILE_KEY = "config"
"""``config=PATH``: a YAML file of options merged over the schema's defaults, under the other overrides."""

INPUT_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    ReceivedFileError,
    MissingDataError,
    OutputFolderError,
    FolderLockedError,
)
"""Errors of the input, not of the code: one line and exit code 2 (a tool adds its own)."""
INPUT_ERROR_CODE = 2  # 1 stays evaluate.py validate='s code for values that do not reproduce
ALLOWED_RESOLVERS = frozenset({"now"})
"""Resolvers an override or options file may call: the date of Hydra's run folders, nothing that reads."""
MAX_OPTIONS_BYTES = 1 << 20

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


def _compose(
    config_dir: str | None, config_name: str, overrides: Sequence[str], with_hydra: bool = False
) -> Any:
    """Hydra's composition of ``overrides`` (with its ``hydra`` node: ``with_hydra``), its errors as one
    :class:`ConfigError` line."""
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
            return hydra.compose(config_name, overrides=list(overrides), return_hydra_config=with_hydra)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(describe(exc)) from None


def _tool() -> str:
    """The command as typed: ``sarathi_capacity.py``, or ``python -m calibration`` for a package."""
    path = Path(sys.argv[0])
    return f"python -m {path.parent.name}" if path.name == "__main__.py" else path.name


def _is_hydra_flag(args: Sequence[str]) -> bool:
    """``--help``, ``--cfg``, ``-m`` sweeps: left to Hydra (each sweep job checks its own config)."""
    return any(a.startswith("-") for a in args)


class InputExit(SystemExit):
    """The exit of a tool on a known input error: its one line (``str``) and exit code 2.

    Python prints nothing for an integer exit code, so :meth:`show` prints the line (once).
    """

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.code = INPUT_ERROR_CODE
        self.shown = False

    def show(self) -> InputExit:
        if not self.shown:
            print(self, file=sys.stderr, flush=True)
            self.shown = True
        return self


def fail(exc: BaseException | str, tool: str | None = None) -> InputExit:
    """The exit for input error ``exc``: ``TOOL: error: MESSAGE`` on one line, exit code 2."""
    return InputExit(f"{tool or _tool()}: error: {' '.join(str(exc).split())}")


def one_line_errors(
    *errors: type[BaseException], tool: str | None = None
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate an entry point: :data:`INPUT_ERRORS`, ``errors`` and :class:`InputExit` end it with
    one line on stderr and exit code 2; anything else is a bug and keeps its traceback."""

    def decorate(main: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> T:
            try:
                return main(*args, **kwargs)
            except InputExit as exc:
                raise exc.show() from None
            except (*INPUT_ERRORS, *errors) as exc:
                raise fail(exc, tool).show() from None

        return run

    return decorate


def resolvers_in(text: str) -> list[str]:
    """The resolvers an OmegaConf string calls (``${oc.env:X}`` -> ``oc.env``); ConfigError if it
    does not parse (a value OmegaConf would fail on anyway)."""
    if "${" not in text:
        return []
    from omegaconf import grammar_parser
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

    try:
        tree = grammar_parser.parse(text, parser_rule="configValue")
    except GrammarParseError as exc:
        raise ConfigError(f"{text[:200]!r}: not a valid interpolation ({exc})") from None
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext):
            found.append(node.resolverName().getText())
        stack.extend(getattr(node, "children", None) or [])
    return found


def refuse_resolvers(values: Any, source: str) -> None:
    """ConfigError naming ``source`` and the value when a string in ``values`` (nested lists and
    mappings too) calls a resolver outside :data:`ALLOWED_RESOLVERS`."""
    stack = [values]
    while stack:
        value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend([*value.keys(), *value.values()])
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            refused = sorted(set(resolvers_in(value)) - ALLOWED_RESOLVERS)
            if refused:
                raise ConfigError(
                    f"{source}: {value[:200]!r} calls the resolver(s) {', '.join(refused)}; only "
                    f"{', '.join(sorted(ALLOWED_RESOLVERS))} and plain ${{key}} references are allowed"
                )


def _refuse_resolver_overrides(args: Sequence[str]) -> None:
    for arg in args:
        if not arg.startswith("-"):
            refuse_resolvers(arg.partition("=")[2], f"override {arg.partition('=')[0]}")


def precheck(
    config_dir: str,
    config_name: str,
    cls: type[T],
    rules: Mapping[str, Rule] | None = None,
    then: Callable[[T], Any] | None = None,
) -> None:
    """Compose ``sys.argv``'s overrides once and check them into ``cls`` (and by ``then``, which
    raises ValueError); exit with one line (code 2) if they fail, before Hydra makes a run folder.

    Then the run folder (``hydra.run.dir``) is checked (:func:`chunkgym.io.check_output_folder`)
    and locked for the rest of the process, and pinned in ``sys.argv`` so that Hydra writes into
    the folder locked (its ``${now:...}`` read once), before Hydra writes anything there.
    """
    args = sys.argv[1:]
    try:
        _refuse_resolver_overrides(args)
        if _is_hydra_flag(args):
            return
        from omegaconf import OmegaConf, open_dict

        cfg = _compose(config_dir, config_name, args, with_hydra=True)
        run_dir = str(OmegaConf.select(cfg, "hydra.run.dir", throw_on_missing=True))
        with open_dict(cfg):
            del cfg["hydra"]
        conf = to_object(cfg, cls, "", rules)
        if then is not None:
            then(conf)
        key = "output_dir" if hasattr(conf, "output_dir") else "hydra.run.dir"
        folder = check_output_folder(run_dir, key)
        lock_for_process(folder, _tool())
        _refuse_links_hydra_writes(folder)
    except (
        ValueError,
        MissingDataError,
        FolderLockedError,
    ) as exc:  # ValueError: ConfigError, ReceivedFileError, ...
        raise fail(exc).show() from None
    quoted = str(folder).replace("\\", "\\\\").replace("'", "\\'")
    sys.argv = [
        sys.argv[0],
        *(a for a in args if not a.startswith("hydra.run.dir=")),
        f"hydra.run.dir='{quoted}'",
    ]


HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")
"""What Hydra writes into a run folder (with the job's log), by ``open``: links there would redirect it."""


def _refuse_links_hydra_writes(folder: Path) -> None:
    """ReceivedFileError if a file Hydra is about to write in ``folder`` is a link (or leaves it)."""
    for name in (".hydra", f"{Path(sys.argv[0]).stem}.log", *HYDRA_FILES):
        write_target(folder / name, folder)


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
        if not Path(path).exists():
            raise ConfigError(f"{CONFIG_FILE_KEY}={os.fspath(path)}: no such file")
        text = read_text(path, MAX_OPTIONS_BYTES)  # a regular file within budget
        data = parse_yaml(text, str(path))  # no aliases, bounded nesting
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of options, got {type(data).__name__}")
        refuse_resolvers(data, str(path))
        try:  # OmegaConf's own YAML reading, as for conf/ (1e-3 is a float there)
            node = cast(
                DictConfig, OmegaConf.merge(node, OmegaConf.create(text))
            )  # a merge keeps node's kind
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

    Overrides apply in order, so a tool's own presets go first and the user's win; one that calls a
    resolver outside :data:`ALLOWED_RESOLVERS` is refused.
    """
    from hydra.core.config_store import ConfigStore

    config_name = name or cls.__name__
    _refuse_resolver_overrides(args)
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
                _refuse_resolver_overrides(args)
                if _is_hydra_flag(args):
                    return _hydra_main(cls, config_name, args, default_file, rules, main)
                opts = load_options(cls, args, default_file, rules, config_name)
                return main(opts)
            except INPUT_ERRORS as exc:  # one line naming the key, the file (and the fetch command)
                raise fail(exc).show() from None

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
    @one_line_errors()  # each sweep job's bad input: one line, exit code 2
    def entry(cfg: DictConfig) -> Any:
        return main(to_object(cfg, cls, "", rules))

    sys.argv = [sys.argv[0], *rest, *_QUIET]
    return entry()
