"""The engine on one GPU: profile, fit, and replay one slice on the engine and in the simulator.

    python bench/engine_gpu.py              # conf/engine/gpu_replay.yaml: Llama-3.2-1B shapes, bf16, cuda
    python bench/engine_gpu.py out=DIR replay.hardware=h100_80gb "policies=[sarathi_512,fcfs]" replay.model=llama3_8b
    python bench/engine_gpu.py dry_run=true             # print the resolved replay config and exit (no GPU needed)

The same measurement as bench/sim_to_real.py (engine/sim_to_real.py), on ``device: cuda``: profiles
the model over the composition grid, writes ``<hardware>__<model>__tp1.yaml`` under ``out``, replays
the slice per policy in real time and in the simulator with that profile, and prints one JSON
object last (per-iteration latency MAPE, TTFT P50/P99 and TBT P99 relative errors).  ``replay``
picks the ``conf/engine`` file (default ``gpu_replay``), ``replay.KEY=VALUE`` overrides one of its
keys, and ``policies`` (the compared policies) replaces the file's own list.  About 5 minutes on
one H200 with the default config.  Tests never run it.
"""

import dataclasses
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from calibration.from_engine import store_replay_configs
from chunkgym.cli import hydra_cli
from engine.replay import ReplayConfig
from engine.sim_to_real import DEFAULT_POLICIES
from engine.sim_to_real import main as sim_to_real


@dataclass
class Options:
    """``bench/engine_gpu.py``'s options."""

    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"replay": "gpu_replay"}])
    replay: ReplayConfig = field(default_factory=ReplayConfig)  # a conf/engine file: replay=<name>
    policies: list[str] = field(default_factory=lambda: list(DEFAULT_POLICIES))  # replaces replay.policies
    out: str = "outputs/sim_to_real"  # profile, results and iterations go here
    repeats: int = 5  # profiling repeats per composition (median)
    warmup: int = 1
    dry_run: bool = False  # print the resolved replay config and exit


def resolved(opts: Options) -> ReplayConfig:
    """The replay config this invocation runs: the chosen file, its overrides, and ``policies``."""
    return dataclasses.replace(opts.replay, policies=list(opts.policies))


def run(opts: Options) -> None:
    conf = resolved(opts)
    if opts.dry_run:
        print(json.dumps(dataclasses.asdict(conf)))
        return
    if conf.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(
            "bench/engine_gpu.py: no CUDA device here; run it on a GPU machine (or replay.device=cpu to try it)"
        )
    with tempfile.TemporaryDirectory() as tmp:  # the checked config, handed over whole
        path = Path(tmp) / "replay.yaml"
        OmegaConf.save(OmegaConf.structured(conf), path)
        argv = [f"out={opts.out}", f"repeats={opts.repeats}", f"warmup={opts.warmup}"]
        argv += [f"config={path}", f"policies={json.dumps(conf.policies)}"]
        sim_to_real(argv)


store_replay_configs()
main = hydra_cli(Options, name="bench_engine_gpu")(run)

if __name__ == "__main__":
    main()
