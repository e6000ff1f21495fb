"""One command-line convention for every tool: Hydra ``key=value`` overrides checked against a dataclass.

``train.py`` and ``evaluate.py`` compose YAML groups from ``conf/``; the smaller tools
(benchmarks, calibration, the engine replay) have a flat dataclass of options and no
YAML of their own.  :func:`hydra_cli` gives them the same override syntax and the same
up-front type checking without Hydra's run folders or log files::

    @dataclass
    class Options:
        seeds: list[int] = field(default_factory=lambda: [0])  # which seeds to run

    @hydra_cli(Options)
    def main(opts: Options) -> None: ...

    python bench/headroom.py seeds=[0,1] n_jobs=2
    python bench/headroom.py --help              # Hydra lists every option with its default
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")

# Keep Hydra out of the working tree: no run folder, no .hydra/ copy, no log files.
_QUIET = (
    "hydra.run.dir=.",
    "hydra.output_subdir=null",
    "hydra/job_logging=disabled",
    "hydra/hydra_logging=disabled",
)


def hydra_cli(schema: type[T], name: str | None = None) -> Callable[[Callable[[T], Any]], Callable[[], Any]]:
    """Decorate ``main(opts)`` so that it reads ``key=value`` overrides of ``schema`` from ``sys.argv``.

    An unknown key or a value of the wrong type stops the command before ``main`` runs,
    with Hydra's one-line message naming the key.  ``name`` is the ConfigStore entry
    (default: the schema's class name), unique per tool.
    """
    config_name = name or schema.__name__
    ConfigStore.instance().store(name=config_name, node=schema)

    def decorate(main: Callable[[T], Any]) -> Callable[[], Any]:
        @hydra.main(version_base="1.3", config_path=None, config_name=config_name)
        def entry(cfg: DictConfig) -> Any:
            opts = OmegaConf.to_object(cfg)
            assert isinstance(opts, schema)
            return main(opts)

        @functools.wraps(main)
        def run() -> Any:
            user = sys.argv[1:]
            sys.argv = [sys.argv[0], *user, *_QUIET]
            return entry()

        return run

    return decorate
