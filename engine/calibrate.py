"""Our engine's coefficient file: profile it on this machine, fit the cost model, write ``conf/cost``.

    python -m engine.calibrate          # conf/replay/cpu_replay.yaml -> conf/cost/cpu__engine_small__tp1.yaml
    python -m engine.calibrate replay=gpu_replay replay.hardware=h200 out=DIR

``replay`` picks a ``conf/replay`` file (model, hardware, device, threads and the replay slice);
``replay.KEY=VALUE`` overrides one of its keys.  Times the engine over the composition grid
(:func:`engine.profile.profile`: median of round-robin repeats), fits the whole-iteration
form (:func:`calibration.iterations.fit`), and writes a coefficient file in the format of
:mod:`calibration.cost_files`, so ``ServingSetup.from_names(model, hardware)`` loads it like any GPU
profile.  The scheduler's own per-iteration work (policy, core, batch building; docs/engine.md),
which the profile's forward passes leave out, is measured in a 10-second real-time replay of another
window and added to ``iter_fixed`` (:func:`calibrate`).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from calibration.cost_files import CostFile, write_cost_files
from calibration.iterations import Fit, fit
from chunkgym import REPO_ROOT, resolve_path
from chunkgym.cli import hydra_cli
from engine.model import LlamaModel
from engine.profile import machine, profile
from engine.replay import ReplayConfig, build, check, scheduler_overhead
from envs.serving.cost_model import COST_DIR, CostParams
from envs.serving.specs import load_model

HEADER = (
    "# Cost-model coefficients of the real engine, measured on the machine named in `source`.\n"
    "# Written by `python -m engine.calibrate` (or bench/sim_to_real.py); do not edit. Times in seconds.\n"
)
REPLAY_CONFIGS = REPO_ROOT / "conf" / "replay"
"""Each ``<name>.yaml`` here is a choice of the ``replay`` option (``replay=<name>``)."""


def store_replay_configs() -> None:
    """Register ``conf/replay/*.yaml`` as the Hydra group ``replay``, each checked against :class:`ReplayConfig`."""
    store = ConfigStore.instance()
    for path in sorted(REPLAY_CONFIGS.glob("*.yaml")):
        node = OmegaConf.merge(OmegaConf.structured(ReplayConfig), OmegaConf.load(path))
        store.store(group="replay", name=path.stem, node=node)


def with_overhead(params: CostParams, seconds: float) -> CostParams:
    """``params`` with ``seconds`` of the engine's own scheduling work added to every iteration."""
    return dataclasses.replace(params, iter_fixed_s=params.iter_fixed_s + seconds)


def cost_file(hardware: str, model: str, result: Fit, where: str, overhead_s: float = 0.0) -> CostFile:
    """The coefficient file's content for ``result`` measured ``where``, plus ``overhead_s`` per iteration."""
    source = (
        f"measured: engine/runner.py on {where}, {result.points} batch compositions (median of repeats), "
        "whole-iteration fit by calibration/iterations.py"
        + (
            f", plus {overhead_s * 1e3:.3f} ms per iteration of scheduler work, timed in a replay"
            if overhead_s
            else ""
        )
    )
    metrics = {
        "in_sample_mape": result.in_sample_mape,
        "heldout_mape": result.heldout_mape,
        "points": result.points,
        "heldout_points": result.heldout_points,
        "scheduler_overhead_s": overhead_s,
    }
    return CostFile(hardware, model, 1, False, source, with_overhead(result.params, overhead_s), metrics)


def write(file: CostFile, out_dir: str | Path = COST_DIR) -> Path:
    """Write ``file`` as ``<out_dir>/<hardware>__<model>__tp1.yaml`` in the format of ``conf/cost``."""
    return write_cost_files([file], Path(out_dir), HEADER)[0]


@dataclass(frozen=True)
class Calibrated:
    """What :func:`calibrate` measured and wrote."""

    path: Path
    fit: Fit
    overhead_s: float
    where: str
    seconds: float


def calibrate(
    conf: ReplayConfig,
    out_dir: str | Path = COST_DIR,
    repeats: int = 5,
    warmup: int = 1,
    model: LlamaModel | None = None,
) -> Calibrated:
    """Profile ``conf``'s model on its device and threads, fit, and write the coefficient file.

    The engine's own work per iteration (policy, core, batch building), which the profile's forward
    passes leave out, is measured in a short real-time replay of another window of ``conf``'s
    workload (:func:`engine.replay.scheduler_overhead`) and added to the fixed term.
    """
    start = time.perf_counter()
    samples = profile(
        conf.model,
        conf.threads,
        repeats,
        warmup,
        seed=conf.weights_seed,
        device=conf.device,
        dtype=conf.dtype,
    )
    result = fit(samples, load_model(conf.model).num_layers)
    where = machine(conf.device, conf.threads)
    with tempfile.TemporaryDirectory() as tmp:  # its own path: setups are cached by cost-model path
        fitted = write(cost_file(conf.hardware, conf.model, result, where), tmp)
        overhead = scheduler_overhead(dataclasses.replace(conf, cost_model=str(fitted)), model or build(conf))
    path = write(cost_file(conf.hardware, conf.model, result, where, overhead), out_dir)
    return Calibrated(path, result, overhead, where, time.perf_counter() - start)


@dataclass
class Options:
    """``python -m engine.calibrate``'s options."""

    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"replay": "cpu_replay"}])
    replay: ReplayConfig = field(default_factory=ReplayConfig)  # a conf/replay file: replay=<name>
    out: str = "conf/cost"  # where the coefficient file goes
    repeats: int = 5  # timed repeats per composition (median)
    warmup: int = 1


def run(opts: Options) -> Path:
    """Check every name in the replay config, then profile, fit and write; print one summary line."""
    try:
        check(opts.replay)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"python -m engine.calibrate: error: {exc}") from exc
    done = calibrate(opts.replay, resolve_path(opts.out), opts.repeats, opts.warmup)
    print(
        f"{done.fit.points} compositions on {done.where}: in-sample MAPE {done.fit.in_sample_mape:.3f}, "
        f"held-out {done.fit.heldout_mape:.3f}; scheduler {done.overhead_s * 1e3:.3f} ms per iteration; "
        f"wrote {done.path} in {done.seconds:.0f} s"
    )
    return done.path


store_replay_configs()
main = hydra_cli(Options, name="engine_calibrate")(run)

if __name__ == "__main__":
    main()
