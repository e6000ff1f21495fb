"""The engine on one GPU: profile, fit, and replay one slice on the engine and in the simulator.

    python bench/engine_gpu.py              # conf/engine/gpu_replay.yaml: Llama-3.2-1B shapes, bf16, cuda
    python bench/engine_gpu.py out=DIR hardware=h100_80gb "policies=[sarathi_512,fcfs]" model=llama3_8b
    python bench/engine_gpu.py --dry-run             # print the resolved config and exit (no GPU needed)

The same measurement as bench/sim_to_real.py (engine/sim_to_real.py), on ``device: cuda``: profiles
the model over the composition grid, writes ``<hardware>__<model>__tp1.yaml`` under ``out``, replays
the slice per policy in real time and in the simulator with that profile, and prints one JSON
object last (per-iteration latency MAPE, TTFT P50/P99 and TBT P99 relative errors).  About 5 minutes
on one H200 with the default config.  Tests never run it.
"""

import argparse
import dataclasses
import json
import sys

import torch

from chunkgym import REPO_ROOT
from engine.sim_to_real import main, options

CONFIG = REPO_ROOT / "conf/engine/gpu_replay.yaml"


def resolved(argv: list[str]) -> dict:
    """The config this invocation would run (its KEY=VALUE arguments over :data:`CONFIG`)."""
    return dataclasses.asdict(options(argv, CONFIG))


if __name__ == "__main__":
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--dry-run", action="store_true")
    known, rest = pre.parse_known_args()
    conf = resolved(rest)
    if known.dry_run:
        print(json.dumps(conf))
        sys.exit(0)
    if conf["device"].startswith("cuda") and not torch.cuda.is_available():
        sys.exit(
            "bench/engine_gpu.py: no CUDA device here; run it on a GPU machine (or device=cpu to try it)"
        )
    main(rest if any(a.startswith("config=") for a in rest) else [f"config={CONFIG}", *rest])
