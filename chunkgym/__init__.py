"""chunkgym: shared paths and the guard against same-named PyPI packages.

The repository ships top-level packages named ``envs``, ``baselines``, ``policies``,
``engine`` and ``calibration``.  ``envs`` and ``baselines`` also exist as unrelated
packages on PyPI; if one of those shadows ours, :func:`require_own_packages` fails
loudly instead of letting an import resolve to the wrong code.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

__version__ = "0.1.0"

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository root: configs, data paths and artefacts resolve relative to it."""

OWN_PACKAGES = ("envs", "baselines", "policies", "engine", "calibration")

DATA_ENV_VAR = "CHUNKGYM_DATA"
SHIPPED_DATA = REPO_ROOT / "data"
"""The data the repository ships (the Azure LLM inference 2023 traces), laid out like a data folder."""


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """Resolve ``path`` against the repository root unless it is absolute."""
    p = Path(os.path.expanduser(os.fspath(path)))
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


def default_data_root() -> Path:
    """The per-user cache: ``$XDG_CACHE_HOME/chunkgym/data``, else ``~/.cache/chunkgym/data``.

    A cache outside the clone, so fetched traces survive a fresh clone and are shared by a
    user's clones. As the XDG base-directory spec asks, a relative ``$XDG_CACHE_HOME`` is ignored.
    """
    cache = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
    return base / "chunkgym" / "data"


def data_root(path: str | os.PathLike[str] | None = None) -> Path:
    """The data folder: ``path`` if given, else ``$CHUNKGYM_DATA``, else :func:`default_data_root`.

    Relative paths resolve against the repository root, not the working directory,
    so Hydra's run-directory changes never move the data.
    """
    if path is None:
        path = os.environ.get(DATA_ENV_VAR) or default_data_root()
    return resolve_path(path)


def data_file(relative: str | os.PathLike[str], path: str | os.PathLike[str] | None = None) -> Path:
    """``relative`` under the data folder, else the repository's shipped copy, else the data-folder path.

    So the shipped Azure traces work on a fresh clone with an empty data folder, and a data folder
    that holds them too (or a newer copy) takes precedence.
    """
    wanted = data_root(path) / relative
    shipped = SHIPPED_DATA / relative
    return shipped if not wanted.exists() and shipped.exists() else wanted


def require_own_packages() -> None:
    """Fail with a clear message if a top-level name resolves to a foreign package."""
    for name in OWN_PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(
                f"chunkgym could not import its package {name!r} ({exc}). Install chunkgym with "
                f"`pip install -e .` from the repository root ({REPO_ROOT})."
            ) from exc
        if not getattr(module, "__chunkgym__", False):
            where = getattr(module, "__file__", None) or list(getattr(module, "__path__", []))
            raise ImportError(
                f"`import {name}` resolved to {where}, which is not chunkgym's {name!r} package "
                f"(expected under {REPO_ROOT}). An unrelated PyPI package named {name!r} is "
                f"shadowing it: `pip uninstall {name}` and install chunkgym with `pip install -e .` "
                f"from the repository root."
            )


from chunkgym import registration  # noqa: E402, F401  (registers the envs: `import chunkgym` is enough)
