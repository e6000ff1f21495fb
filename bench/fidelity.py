"""Fidelity of the calibrated cost model: prints the report tables, then one JSON line.

    python bench/fidelity.py [data_root=PATH]

Refits everything from the data (nothing is read from ``conf/cost``), so the numbers are
reproducible from the raw tables.  The JSON's MAPEs are fractions: ``per_layer_mape_max``
(held-out, worst (GPU, model, TP) table), ``whole_request_mape_max`` (leave-one-TP-out,
worst of prompt and token time on Llama-2-70B, A100 and H100, with the 2023 engine profile),
``modern_engine_mape_max`` (worst row of the published modern-engine measurements in
``calibration/validation/modern_engines.csv``, predicted with the default engine profile, target
0.20), and more; plus the cost of one ``iteration_time`` call in microseconds for a calibrated
model and the roofline v0.
"""

from __future__ import annotations

import json
import timeit
from dataclasses import dataclass

from calibration.from_published import calibrate
from calibration.report import markdown, summary
from chunkgym import data_root
from chunkgym.cli import hydra_cli
from envs.serving.cost_model import RooflineCostModel, roofline_params
from envs.serving.specs import load_hardware, load_model

TIMING_CALLS = 200_000


def iteration_time_us(model: RooflineCostModel) -> dict[str, float]:
    """Microseconds per call for the simulator's two shapes of call: decode-only, and mixed."""
    decode = timeit.timeit(lambda: model.iteration_time(64, 64_000, (), ()), number=TIMING_CALLS)
    chunks, contexts = [512, 128], [1024, 0]
    mixed = timeit.timeit(lambda: model.iteration_time(64, 64_000, chunks, contexts), number=TIMING_CALLS)
    return {"decode_only": decode / TIMING_CALLS * 1e6, "mixed": mixed / TIMING_CALLS * 1e6}


@dataclass
class Options:
    """``bench/fidelity.py``'s options."""

    data_root: str | None = None  # data folder; null: chunkgym.data_root()


@hydra_cli(Options, name="bench_fidelity")
def main(opts: Options) -> None:
    cal = calibrate(data_root(opts.data_root))
    print(markdown(cal))
    result = summary(cal)
    calibrated = iteration_time_us(cal.cost_model("a100_80gb", "llama2_70b", 4))
    v0 = iteration_time_us(
        RooflineCostModel(roofline_params(load_model("llama2_70b"), load_hardware("a100_80gb"), 4))
    )
    for kind in ("decode_only", "mixed"):
        result[f"iteration_time_us_calibrated_{kind}"] = round(calibrated[kind], 3)
        result[f"iteration_time_us_roofline_{kind}"] = round(v0[kind], 3)
    print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
