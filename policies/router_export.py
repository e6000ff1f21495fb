"""A learned router as files (safetensors + JSON, no pickle) and as a :class:`~envs.serving.routing.Router`.

The network scores each server alone, from that server's features of
:func:`envs.fleet_routing.routing_features`, the same features' mean over the fleet, and the
arrival's prompt length; the arrival goes to the highest score (ties: the lowest index).  One
network so serves any number of servers, and renumbering the servers renumbers its choices.

An export directory holds ``router.safetensors`` (the layers' weights and biases, float32) and
``router.json`` (format, sizes, activation, the weights file's SHA-256, provenance), written
atomically; :func:`load_router` reads both as received files (contained, size-capped, hash
checked, shapes and finiteness checked) and fails with one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save_file

from baselines.routers import make_router
from chunkgym import REPO_ROOT, resolve_path
from chunkgym.io import atomic_path, atomic_write_text
from chunkgym.received import MiB, ReceivedFileError, load_json, read_bytes
from envs.fleet_routing import SERVER_FEATURES, routing_features
from envs.serving.request import Request
from envs.serving.routing import ServerView

FORMAT = "chunkgym-router"
FORMAT_VERSION = 1
SPEC_FILE = "router.json"
WEIGHTS_FILE = "router.safetensors"
MAX_WEIGHTS_BYTES = 16 * MiB
MAX_LAYERS = 8
MAX_WIDTH = 1024
ACTIVATIONS = ("tanh", "relu")
N_INPUTS = 2 * len(SERVER_FEATURES) + 1
"""A server's features, their fleet mean, the prompt length."""
LEARNED_ROUTER = "learned_router"
LEARNED_ROUTER_PREFIX = "learned_router:"
SHIPPED_ROUTER = REPO_ROOT / "policies" / "artifacts" / LEARNED_ROUTER


def scorer_inputs(features: np.ndarray) -> np.ndarray:
    """The network's rows, one per server, from an observation of :func:`routing_features`."""
    k = len(SERVER_FEATURES)
    per_server = features[:-1].reshape(-1, k)
    mean = np.broadcast_to(per_server.mean(axis=0), per_server.shape)
    prompt = np.full((len(per_server), 1), features[-1], features.dtype)
    return np.concatenate([per_server, mean, prompt], axis=1)


def scores(layers: Sequence[tuple[np.ndarray, np.ndarray]], activation: str, rows: np.ndarray) -> np.ndarray:
    """The MLP ``layers`` (weight ``[out, in]``, bias ``[out]``) on ``rows``: one score per row."""
    x = rows.astype(np.float32)
    for i, (w, b) in enumerate(layers):
        x = x @ w.T + b
        if i < len(layers) - 1:
            x = np.tanh(x) if activation == "tanh" else np.maximum(x, 0.0)
    return x[:, 0]


class LearnedRouter:
    """A router network (see the module docstring) as a :class:`~envs.serving.routing.Router`."""

    reads_state = True

    def __init__(self, layers: Sequence[tuple[np.ndarray, np.ndarray]], activation: str, name: str) -> None:
        self.layers = [(np.asarray(w, np.float32), np.asarray(b, np.float32)) for w, b in layers]
        self.activation = activation
        self.name = name

    def reset(self, servers: int, seed: int) -> None:
        pass

    def route(self, req: Request, servers: Sequence[ServerView]) -> int:
        return int(
            np.argmax(scores(self.layers, self.activation, scorer_inputs(routing_features(req, servers))))
        )


def write_router(router: LearnedRouter, directory: str | Path, provenance: dict[str, Any]) -> dict[str, Any]:
    """Write ``router``'s two files into ``directory``; returns the manifest (``router.json``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, (w, b) in enumerate(router.layers):
        tensors[f"layers.{i}.weight"] = np.ascontiguousarray(w, np.float32)
        tensors[f"layers.{i}.bias"] = np.ascontiguousarray(b, np.float32)
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp))
    spec = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "inputs": [*SERVER_FEATURES, *(f"fleet_mean_{f}" for f in SERVER_FEATURES), "prompt_len"],
        "sizes": [N_INPUTS] + [int(w.shape[0]) for w, _ in router.layers],
        "activation": router.activation,
        "files": {WEIGHTS_FILE: hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()},
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **provenance,
    }
    atomic_write_text(directory / SPEC_FILE, json.dumps(spec, indent=2) + "\n")
    return spec


def _sizes(spec: Any, source: Path) -> list[int]:
    if not isinstance(spec, dict):
        raise ReceivedFileError(f"{source}: expected a JSON object, got {type(spec).__name__}")
    if spec.get("format") != FORMAT or spec.get("format_version") != FORMAT_VERSION:
        raise ReceivedFileError(
            f"{source}: format is {spec.get('format')!r} version {spec.get('format_version')!r}; "
            f"this code reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    sizes = spec.get("sizes")
    if (
        not isinstance(sizes, list)
        or not 2 <= len(sizes) <= MAX_LAYERS + 1
        or not all(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= MAX_WIDTH for s in sizes)
        or sizes[0] != N_INPUTS
        or sizes[-1] != 1
    ):
        raise ReceivedFileError(
            f"{source}: field 'sizes' must list {N_INPUTS} inputs, up to {MAX_LAYERS} layer widths in "
            f"1..{MAX_WIDTH} and 1 output, got {str(sizes)[:80]}"
        )
    if spec.get("activation") not in ACTIVATIONS:
        raise ReceivedFileError(
            f"{source}: field 'activation' must be one of {ACTIVATIONS}, got {spec.get('activation')!r}"
        )
    return sizes


def load_router(directory: str | Path, name: str = LEARNED_ROUTER) -> LearnedRouter:
    """The router exported in ``directory`` (see the module docstring); one line naming the file otherwise."""
    directory = Path(directory)
    spec_path = directory / SPEC_FILE
    spec = load_json(spec_path, directory, max_bytes=MiB)
    sizes = _sizes(spec, spec_path)
    files = spec.get("files")
    expected = files.get(WEIGHTS_FILE) if isinstance(files, dict) else None
    path = directory / WEIGHTS_FILE
    data = read_bytes(path, MAX_WEIGHTS_BYTES, directory)
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise ReceivedFileError(
            f"{path}: SHA-256 {actual[:16]}... does not match {SPEC_FILE} ({str(expected)[:16]!r}...)"
        )
    try:
        tensors = load_tensors(data)
    except (SafetensorError, ValueError) as exc:
        raise ReceivedFileError(
            f"{path}: unreadable safetensors data ({str(exc).splitlines()[0][:120]})"
        ) from None
    layers = []
    want: dict[str, tuple[int, ...]] = {}
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        want[f"layers.{i}.weight"] = (n_out, n_in)
        want[f"layers.{i}.bias"] = (n_out,)
    if set(tensors) != set(want):
        raise ReceivedFileError(f"{path}: tensors {sorted(tensors)[:8]}, expected {sorted(want)}")
    for key, shape in want.items():
        t = tensors[key]
        if t.shape != shape or t.dtype != np.float32 or not np.isfinite(t).all():
            raise ReceivedFileError(
                f"{path}: tensor {key!r} must be finite float32{list(shape)}, got {t.dtype}{list(t.shape)}"
            )
    for i in range(len(sizes) - 1):
        layers.append((tensors[f"layers.{i}.weight"], tensors[f"layers.{i}.bias"]))
    return LearnedRouter(layers, spec["activation"], name)


def router_dir(name: str) -> Path | None:
    """The export directory a learned router's name stands for (``learned_router``: the shipped one;
    ``learned_router:PATH``), else None."""
    if name == LEARNED_ROUTER:
        return SHIPPED_ROUTER
    if name.startswith(LEARNED_ROUTER_PREFIX):
        return Path(resolve_path(name.removeprefix(LEARNED_ROUTER_PREFIX)))
    return None


def make_any_router(name: str) -> Any:
    """A fresh router by name: a baseline of ``baselines.routers``, ``learned_router`` or
    ``learned_router:PATH``."""
    directory = router_dir(name)
    return make_router(name) if directory is None else load_router(directory, name)
