"""Experiment tracking for train.py: SB3's logger fanned out to TensorBoard and Weights & Biases.

Every scalar SB3 records (training curves) and every evaluation metric train.py
records goes through one SB3 :class:`~stable_baselines3.common.logger.Logger`; its
outputs are wrapped in :class:`Guarded`, so a tracker that fails (no network, full
disk, a W&B bug) is switched off with one warning and training carries on.
W&B's mode ``auto`` is ``$WANDB_MODE`` if set, else ``online`` with an API key
(``WANDB_API_KEY``), else ``offline`` (files under ``RUN_DIR/wandb``, to ``wandb sync``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stable_baselines3.common.logger import KVWriter, Logger, TensorBoardOutputFormat

from policies.config import LoggerConfig, TrackerMode

log = logging.getLogger(__name__)
TRACKING_FILE = "tracking.json"  # the W&B run id, so that a resumed run continues the same W&B run


def resolve_mode(mode: TrackerMode) -> str:
    if mode is not TrackerMode.auto:
        return mode.value
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env:
        return "disabled" if env in ("disabled", "dryrun-disabled") else env
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class Guarded(KVWriter):
    """A writer whose failures (at creation or later) are logged once and switch it off."""

    def __init__(self, name: str, make: Callable[[], KVWriter]) -> None:
        self.name = name
        self.inner: KVWriter | None = None
        self.guard(lambda: setattr(self, "inner", make()), "start")

    def guard(self, fn: Callable[[], Any], what: str) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a tracker must never stop training
            log.warning(
                "%s tracker failed to %s and is switched off: %s: %s",
                self.name,
                what,
                type(exc).__name__,
                exc,
            )
            self.inner = None

    def write(
        self, key_values: dict[str, Any], key_excluded: dict[str, tuple[str, ...]], step: int = 0
    ) -> None:
        if self.inner is not None:
            inner = self.inner
            self.guard(lambda: inner.write(key_values, key_excluded, step), "write")

    def close(self) -> None:
        if self.inner is not None:
            inner = self.inner
            self.guard(inner.close, "close")
            self.inner = None


class WandbWriter(KVWriter):
    """Numeric SB3 log values -> ``run.log(..., step=timesteps)``."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def write(
        self, key_values: dict[str, Any], key_excluded: dict[str, tuple[str, ...]], step: int = 0
    ) -> None:
        data = {k: v for k, v in key_values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if data:
            self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


def start_wandb(
    cfg: LoggerConfig, mode: str, run_dir: Path, name: str, config: dict[str, Any]
) -> WandbWriter:
    import wandb

    state_file = run_dir / TRACKING_FILE
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    run_id = state.get("wandb_run_id") or secrets.token_hex(6)
    state_file.write_text(json.dumps({"wandb_run_id": run_id}) + "\n")
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        group=cfg.group,
        tags=list(cfg.tags),
        name=name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=mode,
        config=config,
        settings=wandb.Settings(console="off", silent=True),
    )
    return WandbWriter(run)


def make_logger(cfg: LoggerConfig, run_dir: Path, name: str, config: dict[str, Any]) -> Logger:
    """The SB3 logger of one run: TensorBoard under ``run_dir/tb``, W&B per ``cfg.mode``."""
    writers: list[KVWriter] = []
    if cfg.tensorboard:
        writers.append(Guarded("tensorboard", lambda: TensorBoardOutputFormat(str(run_dir / "tb"))))
    mode = resolve_mode(cfg.mode)
    if mode != "disabled":
        writers.append(Guarded("wandb", lambda: start_wandb(cfg, mode, run_dir, name, config)))
    return Logger(folder=str(run_dir), output_formats=writers)


def close_logger(logger: Logger, summary: dict[str, Any]) -> None:
    """Put ``summary`` into the W&B run summary (if any), then close every output."""
    for writer in logger.output_formats:
        if isinstance(writer, Guarded) and isinstance(writer.inner, WandbWriter):
            run = writer.inner.run
            writer.guard(lambda run=run: run.summary.update(summary), "write the summary")
    logger.close()
