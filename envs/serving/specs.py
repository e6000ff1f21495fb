"""Model shapes and hardware descriptions, read from ``conf/model`` and ``conf/hardware``.

The YAML files are the single source: Hydra composes them as config groups and the
library loads them by name through :func:`load_model` / :func:`load_hardware`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import yaml

from chunkgym import REPO_ROOT
from chunkgym.config import AT_LEAST_ONE, POSITIVE, Rule, from_mapping

T = TypeVar("T")

CONF_DIR = REPO_ROOT / "conf"
GIB = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer (Llama family: GQA attention, SwiGLU MLP)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    max_context: int
    dtype_bytes: int = 2
    hf_name: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_params(self) -> int:
        """Weights of one layer: Q/K/V/O projections and the three SwiGLU matrices."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        return h * (h + 2 * kv) + h * h + 3 * h * self.ffn_size

    @property
    def num_params(self) -> int:
        """All weights, counting the input embedding and the LM head separately."""
        return self.num_layers * self.layer_params + 2 * self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cached per token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator: peak dense BF16 FLOP/s, memory bandwidth and capacity."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_gib: float
    interconnect_bandwidth: float
    profile_name: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


MODEL_RULES: dict[str, Rule] = {
    key: AT_LEAST_ONE
    for key in (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "ffn_size",
        "vocab_size",
        "max_context",
        "dtype_bytes",
    )
}
HARDWARE_RULES: dict[str, Rule] = {
    key: POSITIVE for key in ("peak_flops", "hbm_bandwidth", "memory_gib", "interconnect_bandwidth")
}
RULES = {ModelSpec: MODEL_RULES, HardwareSpec: HARDWARE_RULES}


def _names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _load(group: str, name: str, cls: type[T]) -> T:
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown {group} {name!r}; valid names: {', '.join(_names(group))}")
    return from_mapping(cls, yaml.safe_load(path.read_text()), str(path), RULES[cls])


def load_model(name: str) -> ModelSpec:
    return _load("model", name, ModelSpec)


def load_hardware(name: str) -> HardwareSpec:
    return _load("hardware", name, HardwareSpec)


def model_names() -> list[str]:
    return _names("model")


def hardware_names() -> list[str]:
    return _names("hardware")


def kv_capacity_tokens(
    model: ModelSpec, hardware: HardwareSpec, tp: int = 1, activation_reserve_gib: float = 8.0
) -> int:
    """Tokens of KV cache that fit: memory of ``tp`` devices minus weights minus a reserve.

    The reserve stands for activations, CUDA graphs and allocator slack (vLLM profiles
    it; we take a fixed per-device amount, default 8 GiB).
    """
    free = tp * (hardware.memory_bytes - activation_reserve_gib * GIB) - model.weight_bytes
    if free <= 0:
        raise ValueError(
            f"{model.name} ({model.weight_bytes / GIB:.1f} GiB of weights) does not fit on "
            f"{tp} x {hardware.name} with a {activation_reserve_gib} GiB reserve per device"
        )
    return int(free // model.kv_bytes_per_token)
