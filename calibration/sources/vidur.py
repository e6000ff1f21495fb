"""Reading Vidur-format profile tables: per-op compute times and collective times.

The compute format (``mlp.csv``) has one row per (num_tokens, num_tensor_parallel_workers)
measurement, columns ``time_stats.<op>.{min,max,mean,median,std}`` in milliseconds and the
model's shape columns.  The same format is what :mod:`calibration.sources.torch_ops` writes, so any
table (a Vidur GPU, or a device profiled here) goes through the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from chunkgym.data import MissingDataFile

LAYER_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
"""Non-attention ops of one decoder layer, each timed once per layer (Vidur counts ``add`` once)."""
ITERATION_OPS = ("emb",)
"""Ops run once per iteration, not per layer (the token embedding)."""
ALL_OPS = ITERATION_OPS + LAYER_OPS
STATS = ("min", "max", "mean", "median", "std")
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
KEY_COLUMNS = ("num_tokens", "num_tensor_parallel_workers")
STAT = "median"
"""Per-point statistic fitted: robust to the occasional slow repeat."""
MS = 1e-3


def op_column(op: str, stat: str = STAT) -> str:
    return f"time_stats.{op}.{stat}"


def compute_table_path(data_root: Path, profile_name: str, hf_name: str) -> Path:
    return data_root / "profiles" / "vidur" / "profiling" / "compute" / profile_name / hf_name / "mlp.csv"


def all_reduce_path(data_root: Path, profile_name: str) -> Path:
    """The DGX (NVSwitch) table: the topology the whole-request runs were measured on."""
    return (
        data_root / "profiles" / "vidur" / "profiling" / "network" / f"{profile_name}_dgx" / "all_reduce.csv"
    )


def send_recv_path(data_root: Path, folder: str) -> Path:
    return data_root / "profiles" / "vidur" / "profiling" / "network" / folder / "send_recv.csv"


def read_op_table(path: Path) -> pd.DataFrame:
    """Load a compute table, failing with the file and the missing columns if malformed."""
    table = _read_csv(path)
    required = list(KEY_COLUMNS) + [op_column(op) for op in LAYER_OPS]
    _require_columns(path, table, required)
    bad = table[required].isna().any(axis=1) | (table[[op_column(op) for op in LAYER_OPS]] <= 0).any(axis=1)
    if bad.any():
        raise ValueError(f"{path}: row {int(bad.idxmax()) + 2} has a missing or non-positive time")
    return table


@dataclass(frozen=True)
class OpTimes:
    """Times in seconds of each op against token count, one tensor-parallel degree of a table.

    Duplicate measurements of a token count are averaged.
    """

    source: str
    tp: int
    tokens: np.ndarray
    ops: dict[str, np.ndarray]

    @property
    def layer(self) -> np.ndarray:
        """One layer's non-attention time: the sum of :data:`LAYER_OPS`."""
        return np.sum([self.ops[op] for op in LAYER_OPS], axis=0)


def op_times(table: pd.DataFrame, tp: int, source: str = "", stat: str = STAT) -> OpTimes:
    rows = table[table["num_tensor_parallel_workers"] == tp]
    if rows.empty:
        degrees = sorted(table["num_tensor_parallel_workers"].unique().tolist())
        raise ValueError(f"{source}: no rows for tensor-parallel degree {tp}; present: {degrees}")
    ops = [op for op in ALL_OPS if op_column(op, stat) in rows.columns]
    grouped = rows.groupby("num_tokens")[[op_column(op, stat) for op in ops]].mean().sort_index()
    return OpTimes(
        source=source,
        tp=tp,
        tokens=grouped.index.to_numpy(dtype=np.float64),
        ops={op: grouped[op_column(op, stat)].to_numpy(dtype=np.float64) * MS for op in ops},
    )


def tensor_parallel_degrees(table: pd.DataFrame) -> list[int]:
    return sorted(int(v) for v in table["num_tensor_parallel_workers"].unique())


@dataclass(frozen=True)
class CollectiveTimes:
    """Seconds of one collective against message size in bytes, for one group size."""

    source: str
    workers: int
    size_bytes: np.ndarray
    seconds: np.ndarray


def collective_times(path: Path, workers: int, collective: str) -> CollectiveTimes:
    """Single-node rows (all ``workers`` on one node) of a Vidur network table."""
    table = _read_csv(path)
    column = op_column(collective)
    _require_columns(path, table, ["num_workers", "devices_per_node", "size", column])
    rows = table[(table["num_workers"] == workers) & (table["devices_per_node"] == workers)]
    if rows.empty:
        raise ValueError(f"{path}: no single-node rows for {workers} workers")
    grouped = rows.groupby("size")[column].mean().sort_index()
    if (grouped <= 0).any():
        raise ValueError(f"{path}: non-positive {collective} time for {workers} workers")
    return CollectiveTimes(
        str(path), workers, grouped.index.to_numpy(np.float64), grouped.to_numpy(np.float64) * MS
    )


def _read_csv(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise MissingDataFile("profile table", path)
    return pd.read_csv(path)


def _require_columns(path: Path, table: pd.DataFrame, columns: list[str]) -> None:
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}")
