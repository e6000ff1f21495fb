"""Where a result came from: the git commit and a stable hash of the configuration."""

from __future__ import annotations

import hashlib
import json
import subprocess
from functools import lru_cache
from typing import Any

from chunkgym import REPO_ROOT


@lru_cache(maxsize=1)
def git_commit() -> str:
    """The repository's HEAD commit, with ``-dirty`` if tracked files changed; ``unknown`` outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def config_hash(config: Any) -> str:
    """First 12 hex digits of the SHA-256 of ``config`` as canonical JSON (sorted keys)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
