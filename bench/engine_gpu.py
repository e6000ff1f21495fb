"""One GPU, plain PyTorch: a measured device-only cost file, then (optionally) the engine's sim-to-real replay.

    python bench/engine_gpu.py                            # device profile of llama3_8b on replay.hardware (h200)
    python bench/engine_gpu.py replay.hardware=h100_80gb profile_model=llama2_7b out=DIR
    python bench/engine_gpu.py sim_to_real=true "policies=[sarathi_512,fcfs]"   # then the engine replay too
    python bench/engine_gpu.py dry_run=true               # print the resolved replay config and exit (no GPU needed)
    python bench/engine_gpu.py smoke=true replay.device=cpu replay.dtype=float32 replay.hardware=cpu  # format check

First, always: one decoder layer's ops over Vidur's token grid and attention's prefill and decode
grids, timed with CUDA events on ``replay.device`` in ``replay.dtype`` (:mod:`calibration.from_torch`),
fitted as the published tables are, and written as ``<replay.hardware>__<profile_model>__tp1.yaml``
(``device_only: true``) under ``out``: about a minute on an H200 for an 8B model; copy it to
``conf/cost`` to use it.  Its JSON line reports the fit errors and the batch-1 decode it predicts
with the default engine overhead profile.  Then, with ``sim_to_real=true``, the measurement of
bench/sim_to_real.py (engine/sim_to_real.py) on the GPU: profiles the engine over the composition
grid, replays the slice per policy in real time and in the simulator, and prints its JSON object
last (about 5 more minutes on one H200).  ``replay`` picks the ``conf/replay`` file (default
``gpu_replay``), ``replay.KEY=VALUE`` overrides one of its keys, and ``policies`` replaces the
file's own list.  Tests run the ``smoke`` profile on the CPU; CI never needs a GPU.

On a machine that holds PyTorch and its scientific stack (numpy, pandas, scipy, pyyaml, tqdm) but
not this project's other needs and cannot install them (a GPU node without network access, say),
the script needs five pure-Python packages more: hydra-core, omegaconf, antlr4-python3-runtime,
gymnasium and farama-notifications (under 1 MB; tests/test_gpu_profile.py runs the smoke profile
with everything else hidden).
Carry them as wheels of the versions this checkout's environment holds, built here::

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        -d .whl hydra-core==1.3.8 omegaconf==2.3.1 gymnasium==1.4.0 farama-notifications==0.0.6
    pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3      # an sdist only on PyPI

and there, from the checkout's root::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=.:/tmp/site python3 bench/engine_gpu.py replay.hardware=h200 out=$OUT/profile
"""

import dataclasses
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from calibration import from_torch
from chunkgym.cli import hydra_cli
from engine.calibrate import store_replay_configs
from engine.replay import ReplayConfig
from engine.sim_to_real import DEFAULT_POLICIES
from engine.sim_to_real import main as sim_to_real
from envs.serving.cost_model import load_cost_model, read_cost_file
from envs.serving.specs import load_hardware


@dataclass
class Options:
    """``bench/engine_gpu.py``'s options."""

    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"replay": "gpu_replay"}])
    replay: ReplayConfig = field(default_factory=ReplayConfig)  # a conf/replay file: replay=<name>
    policies: list[str] = field(default_factory=lambda: list(DEFAULT_POLICIES))  # replaces replay.policies
    out: str = "outputs/sim_to_real"  # the device profile, and the replay's profile, results and iterations
    repeats: int = 5  # profiling repeats per composition (median)
    warmup: int = 1
    dry_run: bool = False  # print the resolved replay config and exit
    profile_model: str = "llama3_8b"  # conf/model whose device cost file is measured
    smoke: bool = False  # the device profile on a tiny model (a format check, seconds on a CPU)
    sim_to_real: bool = False  # after the device profile, the engine replay against the simulator


def resolved(opts: Options) -> ReplayConfig:
    """The replay config this invocation runs: the chosen file, its overrides, and ``policies``."""
    return dataclasses.replace(opts.replay, policies=list(opts.policies))


def device_profile(opts: Options, conf: ReplayConfig) -> dict[str, Any]:
    """Measure and write the device-only cost file; what the JSON line reports about it."""
    start = time.perf_counter()
    torch_opts = from_torch.Options(
        hardware=conf.hardware,
        model=opts.profile_model,
        out=opts.out,
        device=conf.device,
        dtype=conf.dtype or ("bfloat16" if conf.device.startswith("cuda") else "float32"),
        smoke=opts.smoke,
    )
    path = from_torch.run(torch_opts)
    data = read_cost_file(path)
    report: dict[str, Any] = {"cost_file": str(path), "device_profile_s": time.perf_counter() - start}
    report.update({k: v for k, v in data["fit"].items() if isinstance(v, float)})
    cost = load_cost_model(from_torch.profiled_model(torch_opts), load_hardware(conf.hardware), 1, path=path)
    report["decode_1x1024_ms"] = cost.iteration_time(1, 1024, (), ()) * 1e3
    report["prefill_512_ms"] = cost.iteration_time(0, 0, (512,), (0,)) * 1e3
    return report


def run(opts: Options) -> None:
    conf = resolved(opts)
    if opts.dry_run:
        print(json.dumps(dataclasses.asdict(conf)))
        return
    if conf.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(
            "bench/engine_gpu.py: no CUDA device here; run it on a GPU machine (or replay.device=cpu to try it)"
        )
    print(json.dumps(device_profile(opts, conf)), flush=True)
    if not opts.sim_to_real:
        return
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
