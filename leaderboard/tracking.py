"""Upload a finished leaderboard to Weights & Biases; a tracker failure never fails the evaluation."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

log = logging.getLogger(__name__)
MODES = ("online", "offline", "disabled")


def upload(
    mode: str,
    project: str,
    entity: str | None,
    name: str | None,
    tags: Sequence[str],
    config: Mapping[str, Any],
    tables: Mapping[str, pd.DataFrame],
    images: Sequence[Path],
    out_dir: Path,
) -> bool:
    """Log ``tables`` as W&B tables and ``images`` under their file stems; True when uploaded.

    ``mode="disabled"`` does nothing; any error is logged as a warning and returns False, since
    the evaluation's files are already complete when this runs.
    """
    if mode not in MODES:
        raise ValueError(f"logger.mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "disabled":
        return False
    try:
        import wandb

        run = wandb.init(
            project=project,
            entity=entity,
            name=name,
            tags=list(tags),
            mode=mode,
            dir=str(out_dir),
            job_type="evaluate",
            config=dict(config),
        )
        try:
            run.log(
                {
                    **{key: wandb.Table(dataframe=frame) for key, frame in tables.items()},
                    **{path.stem: wandb.Image(str(path)) for path in images},
                }
            )
        finally:
            run.finish()
    except Exception as exc:  # the tracker is optional: never lose an evaluation to it
        log.warning(
            "W&B upload failed (%s: %s); the evaluation's files are complete", type(exc).__name__, exc
        )
        return False
    return True
