"""Workloads: named request streams with time-disjoint splits, seeded windows and load scaling.

A workload is one ``conf/workload/NAME.yaml`` (:class:`WorkloadSpec`) or any supported trace file
(``file:PATH``), or a mix of such sources as tenants (``format: mix``, docs/tenants.md). It hands out :class:`Trace` objects: a whole split (train/val/test = 60/20/20 of
the source by time, by row for length-only files) or a seeded window of one. Times are seconds,
rebased to the window start and divided by ``rate_scale * load_scale``, so load scaling compresses
or stretches inter-arrival times and nothing else. Same (spec, split, seed, load_scale) -> the same
arrays, bit for bit. Run ``python -m envs.serving.workload [names=[...]] [split=S] [seed=N]`` for per-workload window statistics
(and the median cost of one ``window()`` call).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

import chunkgym
from chunkgym.cli import hydra_cli
from chunkgym.config import from_mapping
from chunkgym.data import FETCH_COMMAND
from envs.serving.specs import CONF_DIR
from envs.serving.workloads import synthetic
from envs.serving.workloads.files import link_problem, read_rows, sniff_format
from envs.serving.workloads.lengths import LengthSource
from envs.serving.workloads.mix import MixSource, Tenant
from envs.serving.workloads.renewal import Renewal, check_seed
from envs.serving.workloads.servegen import ServeGenSource, load_day
from envs.serving.workloads.spec import TenantSpec, WorkloadSpec
from envs.serving.workloads.timed import TimedSource, infer_slot_s
from envs.serving.workloads.trace import SPLITS, MissingTraceError, Source, Trace, TraceError

__all__ = [
    "SPLITS",
    "TenantSpec",
    "Trace",
    "TraceError",
    "Workload",
    "WorkloadSpec",
    "load_workload",
    "workload_names",
]

log = logging.getLogger(__name__)
WORKLOAD_DIR = CONF_DIR / "workload"
FILE_PREFIX = "file:"
DEFAULT_FILE_RATE = 4.0
"""Requests/s of the Poisson arrivals paired with a length-only file opened by path."""


def workload_names() -> list[str]:
    """Names of the workloads in ``conf/workload``."""
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.yaml"))


def load_workload(name_or_path: str, data_root: str | os.PathLike[str] | None = None) -> Workload:
    """``"NAME"`` (a config in ``conf/workload``) or ``"file:PATH"`` (any supported trace file)."""
    if name_or_path.startswith(FILE_PREFIX):
        return Workload.from_path(name_or_path[len(FILE_PREFIX) :], data_root)
    return Workload.from_name(name_or_path, data_root)


class Workload:
    """One workload's request source; parsing is cached per file, windows are cheap."""

    def __init__(self, spec: WorkloadSpec, data_root: str | os.PathLike[str] | None = None):
        if not isinstance(spec, WorkloadSpec):
            raise TypeError(f"expected a WorkloadSpec, got {type(spec).__name__}")
        self.spec = spec
        self._source: Source = _open_source(spec, data_root)
        self.source: str = self._source.source

    @classmethod
    def from_name(cls, name: str, data_root: str | os.PathLike[str] | None = None) -> Workload:
        path = WORKLOAD_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown workload {name!r}; valid names: {', '.join(workload_names())}")
        spec = from_mapping(WorkloadSpec, yaml.safe_load(path.read_text()), str(path))
        if spec.name != name:
            raise ValueError(f"{path}: field 'name' is {spec.name!r}, expected the file's name {name!r}")
        return cls(spec, data_root)

    @classmethod
    def from_path(cls, path: str, data_root: str | os.PathLike[str] | None = None) -> Workload:
        """Any supported trace file, its format inferred from content; relative paths are tried
        against the working directory, then the data root."""
        resolved = _find_file(path, data_root)
        fmt = sniff_format(resolved)
        extra: dict[str, Any] = {}
        if fmt == "lengths":
            extra["base_rate"] = DEFAULT_FILE_RATE
        elif fmt == "mooncake":
            times = read_rows(resolved, fmt).times
            assert times is not None, "Mooncake rows are timestamped"
            extra["slot_jitter_s"] = infer_slot_s(times)
        spec = WorkloadSpec(name=f"{FILE_PREFIX}{path}", format=fmt, path=str(resolved), **extra)
        return cls(spec, data_root)

    @property
    def seeded_arrivals(self) -> bool:
        """Whether ``split(..., seed)`` depends on the seed: generated arrivals (length-only files,
        ServeGen) or slot jitter. A timed file's own rows (Azure, unjittered Mooncake) do not, so a
        ``file:`` trace used whole gives the same run for every seed; a mix's split depends on the
        seed where one of its tenants' does."""
        if isinstance(self._source, MixSource):
            return self._source.seeded
        return self.spec.format in ("lengths", "servegen") or self.spec.slot_jitter_s > 0

    def split(self, split: str, seed: int = 0, load_scale: float = 1.0) -> Trace:
        """The whole ``split`` ("train", "val", "test" or "all")."""
        return self._scaled(self._source.extract(split, check_seed(seed), None), load_scale)

    def window(self, split: str, seed: int, load_scale: float = 1.0, window_s: float | None = None) -> Trace:
        """``window_s`` trace seconds of ``split`` (default ``spec.window_s``) at a ``seed``-chosen
        start; the whole split when it is shorter."""
        window_s = self.spec.window_s if window_s is None else float(window_s)
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        trace = self._scaled(self._source.extract(split, check_seed(seed), window_s), load_scale)
        if not len(trace):  # its metrics would all be NaN: say so where it happens
            log.warning(
                "workload %r: the %s window for seed %d (window_s %g) holds no requests",
                self.spec.name,
                split,
                seed,
                window_s,
            )
        return trace

    def _scaled(self, trace: Trace, load_scale: float) -> Trace:
        if not (load_scale > 0 and math.isfinite(load_scale)):
            raise ValueError(f"load_scale must be a positive number, got {load_scale!r}")
        factor = self.spec.rate_scale * load_scale
        trace = dataclasses.replace(trace, arrival_s=trace.arrival_s / factor, span_s=trace.span_s / factor)
        return trace.scale_lengths(self.spec.length_scale)

    def __repr__(self) -> str:
        return f"Workload({self.spec.name!r}, source={self.source!r})"


def _find_file(path: str, root: str | os.PathLike[str] | None) -> Path:
    p = Path(path).expanduser()
    tried = (
        [p] if p.is_absolute() else [Path.cwd() / p, chunkgym.data_root(root) / p, chunkgym.SHIPPED_DATA / p]
    )
    for candidate in tried:
        if candidate.exists():
            return candidate.resolve()
        if problem := link_problem(candidate):
            raise TraceError(candidate, problem)
    raise TraceError(path, f"trace file not found (tried {', '.join(map(str, tried))})")


def _open_source(spec: WorkloadSpec, root: str | os.PathLike[str] | None) -> Source:
    """The split/window provider for ``spec``: a file reader, or the synthetic stand-in."""
    if spec.format == "synthetic":
        return _synthetic(spec, spec.base_rate or None)
    if spec.format == "mix":
        return _mix(spec, root)
    base = chunkgym.data_root(root)
    path = Path(spec.path).expanduser()
    path = path if path.is_absolute() else chunkgym.data_file(path, root)
    if not path.exists():
        if spec.allow_synthetic:
            return _synthetic(spec, None)
        raise MissingTraceError(
            path,
            f"data file of workload {spec.name!r} not found (data root {base}). Run `{FETCH_COMMAND}` "
            f"(or `{FETCH_COMMAND} --from DIR` from a local copy), point {chunkgym.DATA_ENV_VAR} or data_root "
            f"at the data folder, or set allow_synthetic: true to use the synthetic stand-in fitted on Azure conv",
        )
    source = f"file:{path}"
    if spec.format == "servegen":
        return ServeGenSource(spec.name, source, load_day(path))
    rows = read_rows(path, spec.format)
    if spec.format == "lengths":
        cv = spec.burstiness_cv if spec.arrival_process == "gamma" else 1.0
        return LengthSource(spec.name, source, rows, Renewal.from_rate(spec.base_rate, cv))
    return TimedSource(spec.name, source, rows, spec.slot_jitter_s)


def _mix(spec: WorkloadSpec, root: str | os.PathLike[str] | None) -> MixSource:
    """The tenants' sources opened (each a workload name or ``file:PATH``; mixes do not nest)."""
    tenants, seeded = [], False
    for i, tenant in enumerate(spec.tenants):
        workload = load_workload(tenant.source, root)
        if isinstance(workload._source, MixSource):
            raise ValueError(
                f"workload {spec.name!r}: tenants[{i}].source {tenant.source!r} is a mix; mixes do not nest"
            )
        tenants.append(Tenant(tenant, workload._source, workload.spec.length_scale))
        seeded = seeded or workload.seeded_arrivals
    return MixSource(spec.name, spec.base_rate, tenants, seeded)


def _synthetic(spec: WorkloadSpec, rate: float | None) -> TimedSource:
    fit = synthetic.AZURE_CONV_FIT
    rows = synthetic.generate(fit, rate)
    return TimedSource(spec.name, f"synthetic:{fit.name}", rows, 0.0, fit.span_s)


def window_stats(trace: Trace) -> dict[str, float]:
    """Requests, span, mean rate, burstiness and length statistics of one trace.

    ``interarrival_cv``: standard deviation over mean of the gaps between arrivals (1 for Poisson
    arrivals, above 1 for bursts); ``prompt_log_std``: the spread of log prompt lengths (what the
    ``prompt_log_spread`` feature of ``ChunkedPrefill-v4`` estimates online)."""
    p, o = trace.prompt_len, trace.output_len
    gaps = np.diff(trace.arrival_s)
    return {
        "requests": len(trace),
        "span_s": trace.span_s,
        "rate": len(trace) / trace.span_s,
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else 0.0,
        "prompt_log_std": float(np.log1p(p).std()),
        "prompt_p50": float(np.percentile(p, 50)),
        "prompt_p99": float(np.percentile(p, 99)),
        "output_p50": float(np.percentile(o, 50)),
        "output_p99": float(np.percentile(o, 99)),
    }


@dataclasses.dataclass
class StatsOptions:
    """``python -m envs.serving.workload KEY=VALUE ...``: one window's statistics per workload."""

    names: list[str] = dataclasses.field(default_factory=list)  # names or file:PATH; empty: every config
    split: str = "test"
    seed: int = 0
    load_scale: float = 1.0


@hydra_cli(StatsOptions, "workload_stats")
def main(opts: StatsOptions) -> None:
    if opts.split not in SPLITS:
        raise SystemExit(f"workload: error: split={opts.split!r}: must be one of {', '.join(SPLITS)}")
    columns = (
        "requests | span s | req/s | interarrival CV | prompt p50 | prompt p99 | log-prompt std | "
        "output p50 | output p99 | window() ms"
    )
    print(f"| workload | source | {columns} |")
    print("|---|---|" + "---:|" * 10)
    for name in opts.names or workload_names():
        workload = load_workload(name)
        s = window_stats(workload.window(opts.split, opts.seed, opts.load_scale))
        ms = []
        for seed in range(opts.seed + 1, opts.seed + 21):
            start = time.perf_counter()
            workload.window(opts.split, seed, opts.load_scale)
            ms.append(1e3 * (time.perf_counter() - start))
        print(
            f"| {name} | {workload.source} | {s['requests']} | {s['span_s']:.1f} | {s['rate']:.2f} | "
            f"{s['interarrival_cv']:.2f} | {s['prompt_p50']:.0f} | {s['prompt_p99']:.0f} | "
            f"{s['prompt_log_std']:.2f} | {s['output_p50']:.0f} | {s['output_p99']:.0f} | "
            f"{np.median(ms):.2f} |"
        )


if __name__ == "__main__":
    main()
