"""A synthetic stand-in fitted on the Azure 2023 conversation trace, for when no data is at hand.

Arrivals are a Gamma renewal stream with the trace's rate and inter-arrival CV. Prompt and output
lengths are drawn independently through piecewise-linear inverse CDFs that pass through the
trace's quantiles at :data:`QUANTILES` (their Spearman correlation in the trace is 0.07, so
independence loses little). :data:`AZURE_CONV_FIT` holds the fitted numbers; refit and print
them with ``python -m envs.serving.workloads.synthetic [path=path/to/AzureLLMInferenceTrace_conv.csv]``
(default: the file under the data root, else the copy shipped in ``data/``); ``tests/test_workload_synthetic.py`` checks they agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chunkgym import data_file
from chunkgym.cli import hydra_cli
from envs.serving.workloads.files import Rows, read_rows
from envs.serving.workloads.renewal import Renewal, rng_for

AZURE_CONV_PATH = "traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
QUANTILES = tuple(sorted({round(q, 3) for q in np.linspace(0.0, 1.0, 41)} | {0.01, 0.99, 0.999}))
"""Probabilities of the stored length quantiles: every 2.5%, plus 1%, 99% and 99.9% for the tails."""


@dataclass(frozen=True)
class SyntheticFit:
    """Arrival rate (req/s), IAT coefficient of variation, span (s) and length quantiles of a trace."""

    name: str
    rate: float
    iat_cv: float
    span_s: float
    prompt_q: tuple[float, ...]
    output_q: tuple[float, ...]


# fmt: off
AZURE_CONV_FIT = SyntheticFit(
    name="azure_conv_fit",
    rate=5.5304,
    iat_cv=1.0942,
    span_s=3501.72,
    prompt_q=(
        2.0, 29.0, 120.0, 181.0, 200.0, 207.0, 235.0, 372.0, 379.0, 387.0, 393.0,
        396.0, 400.0, 403.0, 407.0, 414.0, 428.0, 703.0, 922.0, 984.0, 1005.0, 1020.0,
        1033.6, 1045.0, 1058.0, 1071.0, 1083.0, 1097.0, 1112.0, 1130.0, 1153.0, 1189.0, 1276.9,
        1315.0, 1434.2, 1876.2, 2309.4, 2734.5, 4075.0, 4083.0, 4092.0, 4142.0, 6179.1, 14050.0,
    ),
    output_q=(
        7.0, 16.0, 28.0, 41.0, 48.0, 54.0, 60.0, 67.0, 72.0, 77.0, 82.0,
        85.0, 88.0, 91.0, 93.0, 96.0, 99.0, 103.0, 108.0, 113.0, 120.0, 129.0,
        138.6, 151.0, 162.0, 177.0, 195.1, 217.0, 373.0, 384.0, 391.0, 395.0, 396.0,
        400.0, 406.0, 411.0, 416.0, 424.0, 430.0, 451.0, 522.0, 601.0, 954.0, 1000.0,
    ),
)
# fmt: on


def fit(path: Path, name: str = "azure_conv_fit") -> SyntheticFit:
    """Fit rate, IAT CV and length quantiles on an Azure-format trace."""
    rows = read_rows(path, "azure")
    times = rows.times
    assert times is not None, "Azure files are timestamped"
    gaps = np.diff(times)
    span = float(times[-1])
    return SyntheticFit(
        name=name,
        rate=round(len(rows) / span, 4),
        iat_cv=round(float(gaps.std() / gaps.mean()), 4),
        span_s=round(span, 2),
        prompt_q=tuple(round(float(q), 1) for q in np.quantile(rows.prompt, QUANTILES)),
        output_q=tuple(round(float(q), 1) for q in np.quantile(rows.output, QUANTILES)),
    )


@functools.lru_cache(maxsize=8)
def generate(params: SyntheticFit, rate: float | None = None, seed: int = 0) -> Rows:
    """A fixed stream over ``params.span_s`` (``rate`` overrides the fitted rate); cached."""
    rng = rng_for(seed, "synthetic", params.name)
    times = Renewal.from_rate(rate or params.rate, params.iat_cv).arrivals(rng, 0.0, params.span_s)
    draw = [np.interp(rng.random(len(times)), QUANTILES, q) for q in (params.prompt_q, params.output_q)]
    prompt, output = (np.maximum(np.rint(d), 1).astype(np.int64) for d in draw)
    return Rows(f"synthetic:{params.name}", times, prompt, output)


@dataclass
class RefitOptions:
    """``python -m envs.serving.workloads.synthetic [path=PATH]``: refit on an Azure-format trace."""

    path: str | None = None  # null: the Azure conv trace under the data root, else the shipped copy


@hydra_cli(RefitOptions, "synthetic_refit")
def main(opts: RefitOptions) -> None:
    print(repr(fit(Path(opts.path) if opts.path else data_file(AZURE_CONV_PATH))))


if __name__ == "__main__":
    main()
