"""Choose each workload's ``rate_scale``: the load that is "1x = moderate" for the defaults.

Moderate means 60% of Sarathi-512's capacity (>= 90% of requests within the strict SLO)
on the default model and hardware (Llama-3-8B, one A100-80GB, calibrated cost model),
averaged over three windows of the **val** split (the test split stays unseen):
2x is then just past that capacity and 4x well past it.

    python bench/rate_scales.py [fraction=0.6] ["seeds=[0,1,2]"] ["workloads=[azure_conv,...]"]

Prints, per workload, the capacity in native-rate multiples and the suggested
``rate_scale`` (two significant digits); the values in conf/workload/*.yaml come from it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import numpy as np

import chunkgym
from chunkgym.cli import hydra_cli
from chunkgym.config import NON_EMPTY, POSITIVE
from chunkgym.progress import Progress
from envs.serving.capacity import measure_capacity
from envs.serving.setup import ServingSetup
from envs.serving.workload import Workload, load_workload, workload_names
from policies.registry import make_policy


@dataclass
class Options:
    """``python bench/rate_scales.py KEY=VALUE ...``."""

    fraction: float = 0.6  # of Sarathi-512's capacity that is 1x
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # val windows averaged
    workloads: list[str] = field(
        default_factory=lambda: [w for w in workload_names() if not w.startswith("synthetic")]
    )


@hydra_cli(Options, "rate_scales", {"fraction": POSITIVE, "seeds": NON_EMPTY, "workloads": NON_EMPTY})
def main(args: Options) -> None:
    chunkgym.require_own_packages()
    setup = ServingSetup.from_names()
    out = {}
    for name in args.workloads:
        spec = dataclasses.replace(load_workload(name).spec, rate_scale=1.0)
        workload = Workload(spec)
        progress = Progress(f"rate_scales {name}", len(args.seeds))
        caps: list[float] = []
        for s in args.seeds:
            progress.update(len(caps), "capacity searches (one per seed)")
            caps.append(
                measure_capacity(
                    setup, workload, lambda: make_policy("sarathi_512"), "attain90", "val", s
                ).scale
            )
        cap = float(np.mean(caps))
        suggested = float(f"{args.fraction * cap:.2g}")
        out[name] = {"capacity_native_multiple": cap, "per_seed": caps, "rate_scale": suggested}
        print(
            f"{name:18s} capacity {cap:7.3f}x native (seeds {', '.join(f'{c:.3f}' for c in caps)}) -> rate_scale {suggested}"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
