"""Experiment tracking, for train.py and evaluate.py alike: TensorBoard and Weights & Biases.

Training: SB3 records every scalar (training curves, evaluation metrics) through one SB3
:class:`~stable_baselines3.common.logger.Logger` that writes TensorBoard events under
``RUN_DIR/tb``; W&B reads those events itself (``sync_tensorboard=True``), and the exported
policy folder is logged as a W&B model artefact.  Evaluation: the finished leaderboard
tables and plots are uploaded once.  A tracker that fails (no network, full disk, a W&B bug)
is switched off with one warning; training or evaluation carries on.

``mode`` ``auto`` is ``$WANDB_MODE`` if set, else ``online`` with an API key
(``WANDB_API_KEY``), else ``offline`` (files under ``RUN_DIR/wandb``, to ``wandb sync``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from stable_baselines3.common.logger import KVWriter, Logger, TensorBoardOutputFormat

from chunkgym.io import atomic_write_text
from chunkgym.received import ReceivedFileError, load_json, write_target

log = logging.getLogger(__name__)
TRACKING_FILE = "tracking.json"  # the W&B run id, so that a resumed run continues the same W&B run
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what W&B accepts as a run id
TRACKER_FOLDERS = ("tb", "wandb")  # written into by TensorBoard and W&B themselves, by path


class TrackerMode(Enum):
    auto = "auto"  # $WANDB_MODE if set, else online with WANDB_API_KEY, else offline
    online = "online"
    offline = "offline"
    disabled = "disabled"

    def __str__(self) -> str:
        return str(self.value)


@dataclass
class LoggerConfig:
    """The ``logger`` group (``conf/logger``) of train.py and evaluate.py."""

    mode: TrackerMode = TrackerMode.auto
    project: str = "chunkgym"
    entity: str | None = None
    group: str | None = None  # null: train.py's sweep folder name in a sweep (-m), else none
    name: str | None = None  # the experiment part of train.py's run name; evaluate.py's run name
    tags: list[str] = field(default_factory=list)
    tensorboard: bool = True  # train.py; W&B reads the TensorBoard events, so it turns them on too


def resolve_mode(mode: TrackerMode) -> str:
    if mode is not TrackerMode.auto:
        return str(mode)
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env:
        return "disabled" if env in ("disabled", "dryrun-disabled") else env
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _guard(name: str, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, None)`` after one warning: a tracker must never stop the work."""
    try:
        return True, fn()
    except Exception as exc:  # noqa: BLE001
        log.warning(
            "%s tracker failed to %s and is switched off: %s: %s", name, what, type(exc).__name__, exc
        )
        return False, None


class Guarded(KVWriter):
    """A writer whose failures (at creation or later) are logged once and switch it off."""

    def __init__(self, name: str, make: Callable[[], KVWriter]) -> None:
        self.name = name
        self.inner: KVWriter | None = _guard(name, "start", make)[1]

    def write(
        self, key_values: dict[str, Any], key_excluded: dict[str, tuple[str, ...]], step: int = 0
    ) -> None:
        inner = self.inner
        if (
            inner is not None
            and not _guard(self.name, "write", lambda: inner.write(key_values, key_excluded, step))[0]
        ):
            self.inner = None

    def close(self) -> None:
        inner, self.inner = self.inner, None
        if inner is not None:
            _guard(self.name, "close", inner.close)


def wandb_run_id(run_dir: Path) -> str:
    """The run folder's W&B run id (``tracking.json``), made and saved on the first start.

    The file is read inside the run folder as a regular file and replaced, never written through a
    link; a bad one is a :class:`~chunkgym.received.ReceivedFileError` (not a tracker failure).
    """
    state_file = run_dir / TRACKING_FILE
    state = load_json(state_file, run_dir) if state_file.exists() or state_file.is_symlink() else {}
    run_id = state.get("wandb_run_id") if isinstance(state, dict) else None
    if run_id is not None and not (isinstance(run_id, str) and RUN_ID.fullmatch(run_id)):
        raise ReceivedFileError(
            f"{state_file}: field 'wandb_run_id' must be a W&B run id, got {str(run_id)[:80]!r}"
        )
    run_id = run_id or secrets.token_hex(6)
    atomic_write_text(state_file, json.dumps({"wandb_run_id": run_id}) + "\n", run_dir)
    return run_id


def start_wandb(
    cfg: LoggerConfig,
    mode: str,
    run_dir: Path,
    name: str,
    group: str | None,
    config: dict[str, Any],
    run_id: str,
) -> Any:
    """A W&B run (``run_id``) that mirrors the TensorBoard events written under ``run_dir`` from now on."""
    import wandb

    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        group=group,
        tags=list(cfg.tags),
        name=name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=mode,  # type: ignore[arg-type]  # $WANDB_MODE as given: wandb.init checks it
        config=config,
        job_type="train",
        sync_tensorboard=True,
        settings=wandb.Settings(console="off", silent=True),
    )


class TrainingTracker:
    """One training run's outputs: the SB3 logger (TensorBoard) and, per ``cfg.mode``, a W&B run."""

    def __init__(
        self, cfg: LoggerConfig, run_dir: Path, name: str, config: dict[str, Any], group: str | None = None
    ) -> None:
        mode = resolve_mode(cfg.mode)
        self.run: Any = None
        for folder in TRACKER_FOLDERS:  # a link planted there would take the trackers' writes elsewhere
            write_target(run_dir / folder, run_dir)
        if mode != "disabled":  # before the TensorBoard writer exists, so that W&B sees its events
            run_id = wandb_run_id(run_dir)
            self.run = _guard(
                "wandb", "start", lambda: start_wandb(cfg, mode, run_dir, name, group, config, run_id)
            )[1]
        writers: list[KVWriter] = []
        if cfg.tensorboard or self.run is not None:
            writers.append(Guarded("tensorboard", lambda: TensorBoardOutputFormat(str(run_dir / "tb"))))
        self.logger = Logger(folder=str(run_dir), output_formats=writers)

    def log_model(self, folder: Path, metadata: Mapping[str, Any]) -> None:
        """The exported policy folder as a W&B model artefact (``policy-RUN_ID``)."""
        run = self.run
        if run is None:
            return

        def log_artifact() -> None:
            import wandb

            artifact = wandb.Artifact(f"policy-{run.id}", type="model", metadata=dict(metadata))
            artifact.add_dir(str(folder))
            run.log_artifact(artifact)

        if not _guard("wandb", "log the model", log_artifact)[0]:
            self.run = None

    def close(self, summary: dict[str, Any]) -> None:
        """Put ``summary`` into the W&B run summary (if any), then close every output."""
        self.logger.close()
        run, self.run = self.run, None
        if run is not None and _guard("wandb", "write the summary", lambda: run.summary.update(summary))[0]:
            _guard("wandb", "finish", run.finish)


def upload(
    cfg: LoggerConfig,
    config: Mapping[str, Any],
    tables: Mapping[str, Any],
    images: Sequence[Path],
    out_dir: Path,
) -> bool:
    """evaluate.py: log ``tables`` (DataFrames) as W&B tables and ``images`` under their file stems.

    True when uploaded; a disabled logger does nothing, and any error is one warning (the
    evaluation's files are already complete when this runs).
    """
    mode = resolve_mode(cfg.mode)
    if mode == "disabled":
        return False

    def send() -> None:
        import wandb

        run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            name=cfg.name,
            tags=list(cfg.tags),
            mode=mode,  # type: ignore[arg-type]  # $WANDB_MODE as given: wandb.init checks it
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

    return _guard("wandb", "upload the leaderboard", send)[0]
