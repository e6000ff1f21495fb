"""Bad-input builders for the manifest tests: every field of a JSON manifest set to every wrong value."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def field_paths(obj: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key path of nested dicts; a list of dicts contributes its first element's fields."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield (*prefix, key)
            yield from field_paths(value, (*prefix, key))
    elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
        yield from field_paths(obj[0], (*prefix, 0))


def mutated_folders(
    original: Path, manifest: str, others: Sequence[str], wrong_values: Sequence[Any], out: Path
) -> Iterator[tuple[tuple, Any, Path]]:
    """(path, value, folder): a copy of ``original`` whose ``manifest`` has that one field set to that
    value; the ``others`` files are links to the original's."""
    spec = json.loads((original / manifest).read_text())
    for i, (path, value) in enumerate((p, v) for p in field_paths(spec) for v in wrong_values):
        changed = json.loads(json.dumps(spec))
        node = changed
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        folder = out / str(i)
        folder.mkdir()
        for name in others:
            os.link(original / name, folder / name)  # a hard link: the readers refuse symbolic ones
        (folder / manifest).write_text(json.dumps(changed))
        yield path, value, folder
        shutil.rmtree(folder)
