"""Small builders for simulator tests: hand-made traces on a fixed, uncalibrated cost model."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from envs.serving.core import ServingConfig
from envs.serving.loop import SimResult
from envs.serving.setup import ServingSetup
from envs.serving.simulator import Simulator
from envs.serving.workloads.trace import Trace


def make_trace(arrivals, prompts, outputs, hashes=None, unit: int = 0, span: float | None = None) -> Trace:
    arrivals = np.asarray(arrivals, dtype=np.float64)
    return Trace(
        name="test",
        source="test",
        arrival_s=arrivals,
        prompt_len=np.asarray(prompts, dtype=np.int64),
        output_len=np.asarray(outputs, dtype=np.int64),
        hash_ids=None if hashes is None else tuple(np.asarray(h, dtype=np.int64) for h in hashes),
        hash_block_tokens=unit,
        span_s=span if span is not None else (float(arrivals[-1]) + 1.0 if len(arrivals) else 1.0),
    )


def make_setup(model: str = "llama3_8b", hardware: str = "h100_80gb", **serving) -> ServingSetup:
    """The roofline v0 cost model: fixed numbers, independent of calibration files."""
    return ServingSetup.from_names(model, hardware, 1, "strict", "roofline", ServingConfig(**serving))


def make_sim(trace: Trace, **kw) -> Simulator:
    return make_setup(**kw).simulator(trace)


def same_run(a: SimResult, b: SimResult) -> bool:
    """Two runs that served every token at the same time and agree on every metric but wall time."""
    if a.token_times.keys() != b.token_times.keys():
        return False
    if not all(np.array_equal(a.token_times[k], b.token_times[k]) for k in a.token_times):
        return False
    keys = [k for k in a.metrics if k != "sim_wall_s"]
    return all(
        a.metrics[k] == b.metrics[k] or (np.isnan(a.metrics[k]) and np.isnan(b.metrics[k])) for k in keys
    )


BASE_NS = int(np.datetime64("2023-11-16T18:15:00", "ns").astype(np.int64))


def write_azure(path: Path, times_ns: np.ndarray, prompts: np.ndarray, outputs: np.ndarray) -> Path:
    """An Azure-format CSV (TIMESTAMP, ContextTokens, GeneratedTokens) with exact 100 ns stamps."""
    stamps = (BASE_NS + times_ns).astype("datetime64[ns]")
    rows = [
        f"{str(s).replace('T', ' ')[:27]},{p},{o}" for s, p, o in zip(stamps, prompts, outputs, strict=True)
    ]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return path
