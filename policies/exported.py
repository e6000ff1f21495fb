"""Run an exported policy without SB3: ``policy.json`` + ``policy.safetensors`` -> a scheduler.

An export directory (written by :mod:`policies.export`) holds:

* ``policy.json``: env id and version, feature function and names, action space (nvec,
  budget levels, allocation rules; from v3 the modes and allocations by name too), network shape, observation normalisation, the
  SHA-256 of the other two files, and provenance (config hash, git commit, steps);
* ``policy.safetensors``: the weights of :class:`PolicyNet`, normalisation included;
* ``policy.pt2``: the same module as a ``torch.export`` program.

:func:`load_policy` reads only the JSON and the safetensors file, so loading never
unpickles anything; every field, file hash and tensor shape is checked against the env
the policy was trained on (any registered ``chunkgym/ChunkedPrefill-v*``, as this code
defines it), and a mismatch names the file and what is wrong.  The result is an
:class:`~envs.serving.scheduling.Policy`, so the simulator, ``evaluate.py`` and the
real engine run it unchanged.  Per decision it computes the features, normalises
them, runs the MLP in numpy (on one row, torch's per-op dispatch would cost more than
the arithmetic) and hands the masked-argmax action to the env's planner;
``bench/policy_latency.py`` measures each stage.
:func:`load_program` gives the ``torch.export`` program of ``policy.pt2`` rebuilt from the
verified safetensors weights: ``torch.export.load`` unpickles part of the archive, and the
hash in ``policy.json`` sits in the same folder, so it protects nothing against a crafted
folder; ``policy.pt2`` is written for deployment tools and never read by this code.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gymnasium.envs.registration import parse_env_id
from safetensors import SafetensorError
from safetensors.torch import load
from torch import nn

from chunkgym.received import ReceivedFileError, open_regular, parse_json, read_bytes
from envs.chunked_prefill import version_of
from envs.serving.scheduling import Plan, Policy, ServingView

FORMAT = "chunkgym-policy"
FORMAT_VERSION = 1
SPEC_FILE = "policy.json"
WEIGHTS_FILE = "policy.safetensors"
PROGRAM_FILE = "policy.pt2"
ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}
MAX_LAYERS = 16
MAX_WIDTH = 4096
"""Bounds on ``network.sizes`` checked before anything is allocated (the shipped nets: 3 layers, 26-256)."""
MAX_SPEC_BYTES = 1 << 20
MAX_HEADER_BYTES = 1 << 16
"""Room for the safetensors header (names, shapes, offsets: about 1 KB for the shipped nets)."""
MAX_WEIGHT = 1e6
"""Largest magnitude of a layer's weight or bias (the shipped nets' are below 1): past it, the
logits saturate and one action wins whatever the state, which no training run produces."""
POSITIVE_NORMALISATION = ("obs_var", "obs_epsilon", "obs_clip")
"""Normalisation tensors that must be > 0: a variance or epsilon <= 0 makes NaN or infinite
features, a clip <= 0 flattens every feature to one value, and the policy then serves nonsense."""


class ExportError(ReceivedFileError):
    """An export directory that this code cannot run: one line naming the file and the problem
    (``ExportError(message)`` keeps a :class:`ReceivedFileError`'s line, which already names it)."""

    def __init__(self, path: Path | str, problem: str | None = None) -> None:
        super().__init__(str(path) if problem is None else f"{path}: {problem}")


def read_artefact(directory: Path, name: str, max_bytes: int, what: str) -> bytes:
    """File ``name`` of an export directory, read once: a regular file inside the directory (not a
    link, FIFO or device), refused by its apparent size before a byte is read or hashed."""
    path = directory / name
    if not os.path.lexists(path):
        hint = " (not an exported policy directory?)" if name == SPEC_FILE else ""
        raise ExportError(path, f"file not found{hint}")
    try:
        fd, size = open_regular(name, directory)
        os.close(fd)
        if size > max_bytes:
            raise ExportError(path, f"{size} bytes; {what} is under {max_bytes}")
        return read_bytes(name, max_bytes, directory)
    except ExportError:
        raise
    except ReceivedFileError as exc:
        raise ExportError(str(exc)) from None


class PolicyNet(nn.Module):
    """``forward(obs float32[N, F], mask bool[N, sum(nvec)]) -> int64[N, len(nvec)]``.

    Normalises like SB3's VecNormalize (float64, then clipped and cast to float32),
    runs the policy MLP and returns each action dimension's argmax over its logits,
    invalid entries masked out when ``masked`` (PPO trained without masks ignores it:
    the env maps an invalid action to the valid one with the same plan, and so does
    :func:`envs.actions.action_plan`).
    """

    obs_mean: torch.Tensor  # buffers, registered in __init__
    obs_var: torch.Tensor
    obs_epsilon: torch.Tensor
    obs_clip: torch.Tensor

    def __init__(
        self, sizes: Sequence[int], nvec: Sequence[int], activation: str = "tanh", masked: bool = True
    ) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"sizes must list the input and at least one hidden layer, got {sizes}")
        n_features = sizes[0]
        self.register_buffer("obs_mean", torch.zeros(n_features, dtype=torch.float64))
        self.register_buffer("obs_var", torch.ones(n_features, dtype=torch.float64))
        self.register_buffer("obs_epsilon", torch.tensor(1e-8, dtype=torch.float64))
        self.register_buffer("obs_clip", torch.tensor(10.0, dtype=torch.float64))
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
            layers += [nn.Linear(fan_in, fan_out), ACTIVATIONS[activation]()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(sizes[-1], sum(nvec))
        self.nvec = tuple(int(n) for n in nvec)
        self.masked = masked

    def normalise(self, obs: torch.Tensor) -> torch.Tensor:
        x = (obs.to(torch.float64) - self.obs_mean) / torch.sqrt(self.obs_var + self.obs_epsilon)
        return torch.clamp(x, -self.obs_clip, self.obs_clip).to(torch.float32)

    def forward(self, obs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(self.normalise(obs)))
        if self.masked:
            logits = logits.masked_fill(~mask, float("-inf"))
        return torch.stack([part.argmax(dim=1) for part in logits.split(self.nvec, dim=1)], dim=1)


class ExportedPolicy(Policy):
    """A trained policy as a scheduler: features -> normalise -> MLP -> masked argmax -> plan.

    Features, mask and planner are those of the env version named by ``spec["env_id"]``,
    so the policy observes and acts exactly as it did in training.
    """

    def __init__(self, net: PolicyNet, spec: dict[str, Any]) -> None:
        self.net = net.eval()
        self.spec = spec
        self.name = "learned"
        self.version = version = version_of(spec["env_id"])
        self.features = version.features
        self.actions = version.actions
        self.masked = net.masked
        state = {k: v.detach().numpy() for k, v in net.state_dict().items()}
        self._mean = state["obs_mean"]
        self._std = np.sqrt(state["obs_var"] + state["obs_epsilon"])
        self._clip = float(state["obs_clip"])
        linears = [m for m in net.body if isinstance(m, nn.Linear)] + [net.head]
        self._weights = [(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy()) for m in linears]
        self._act = np.tanh if isinstance(net.body[1], nn.Tanh) else _relu

    def act_one(self, obs: np.ndarray, mask: np.ndarray | None) -> tuple[int, int]:
        """The action for one observation (numpy; same arithmetic as :class:`PolicyNet`)."""
        x = (obs.astype(np.float64) - self._mean) / self._std
        h = np.minimum(np.maximum(x, -self._clip), self._clip).astype(np.float32)
        *hidden, (w_out, b_out) = self._weights
        for w, b in hidden:
            h = self._act(w @ h + b)
        logits = w_out @ h + b_out
        if self.masked:
            assert mask is not None, "a masked policy is always given the mask (plan())"
            logits[~mask] = -np.inf
        split = self.net.nvec[0]  # budget levels (v0-v2) or modes (v3), then rules or allocations
        return int(logits[:split].argmax()), int(logits[split:].argmax())

    def act(self, obs: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Actions for a batch, through the torch module (what ``policy.pt2`` computes)."""
        with torch.inference_mode():
            actions: np.ndarray = self.net(
                torch.as_tensor(obs, dtype=torch.float32), torch.as_tensor(mask)
            ).numpy()
        return actions

    def decide(self, view: ServingView) -> tuple[tuple[int, int], Any]:
        """The action taken in ``view``'s state, and that state's valid actions (for the planner)."""
        obs, valid, mask = self.version.observe(view)  # as the env observes the state
        return self.act_one(obs, mask if self.masked else None), valid

    def plan(self, view: ServingView) -> Plan:
        (level, rule), valid = self.decide(view)
        return self.actions.plan(view, level, rule, valid)


def _relu(x: np.ndarray) -> np.ndarray:
    y: np.ndarray = np.maximum(x, 0, out=x)
    return y


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def env_contract(env_id: Any) -> dict[str, Any]:
    """What an export for ``env_id`` must agree with: that env's version, features and actions here."""
    version = version_of(env_id)
    return {
        "env_id": env_id,
        "env_version": parse_env_id(env_id)[2],
        "feature_set": version.features.__name__,
        "feature_names": list(version.feature_names),
        "nvec": list(version.actions.nvec),
        **version.actions.describe(),
    }


def read_spec(directory: str | Path) -> dict[str, Any]:
    """Parse and validate ``policy.json`` against the env it names, as this code defines that env."""
    path = Path(directory) / SPEC_FILE
    data = read_artefact(Path(directory), SPEC_FILE, MAX_SPEC_BYTES, "a policy manifest")
    try:
        spec = parse_json(data.decode("utf-8"), str(path))
    except UnicodeDecodeError as exc:
        raise ExportError(path, f"not valid JSON (not UTF-8 at byte {exc.start})") from None
    except ReceivedFileError as exc:
        raise ExportError(str(exc)) from None
    if not isinstance(spec, dict):
        raise ExportError(path, f"expected a JSON object, got {type(spec).__name__}")
    if spec.get("format") != FORMAT or spec.get("format_version") != FORMAT_VERSION:
        raise ExportError(
            path,
            f"format is {spec.get('format')!r} version {spec.get('format_version')!r}; "
            f"this code reads {FORMAT!r} version {FORMAT_VERSION}",
        )
    try:
        contract = env_contract(spec.get("env_id"))
    except ValueError as exc:
        raise ExportError(path, f"field 'env_id': {exc}") from None
    for key, expected in contract.items():
        if key not in spec:
            raise ExportError(path, f"missing field {key!r}")
        if spec[key] != expected:
            raise ExportError(path, f"field {key!r} is {spec[key]!r}, but {spec['env_id']} has {expected!r}")
    net: Any = spec.get("network")  # JSON, checked below
    sizes = net.get("sizes") if isinstance(net, dict) else None
    if (
        not isinstance(sizes, list)
        or not 2 <= len(sizes) <= MAX_LAYERS + 1
        or not all(_json_int(s) and 1 <= s <= MAX_WIDTH for s in sizes)
        or not isinstance(net.get("activation"), str)
        or net["activation"] not in ACTIVATIONS
        or not isinstance(net.get("masked"), bool)
    ):
        raise ExportError(
            path,
            f"field 'network' must hold sizes (2 to {MAX_LAYERS + 1} integers in 1..{MAX_WIDTH}), "
            f"activation in {sorted(ACTIVATIONS)} and masked (bool), got {str(net)[:200]}",
        )
    if net["sizes"][0] != len(spec["feature_names"]):
        raise ExportError(
            path, f"network input size {net['sizes'][0]} != {len(spec['feature_names'])} features"
        )
    if not isinstance(spec.get("files"), dict):
        raise ExportError(path, "missing field 'files' (SHA-256 of the artefacts)")
    return spec


def verified_bytes(directory: str | Path, spec: dict[str, Any], name: str, max_bytes: int) -> bytes:
    """Artefact ``name``, read once (:func:`read_artefact`) and checked against its hash in policy.json."""
    path = Path(directory) / name
    expected = spec["files"].get(name)
    if expected is None:
        raise ExportError(Path(directory) / SPEC_FILE, f"no SHA-256 recorded for {name}")
    data = read_artefact(Path(directory), name, max_bytes, "this network's weights file")
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:  # a recorded value of the wrong type never equals the hex digest
        raise ExportError(
            path,
            f"SHA-256 {actual[:16]}... does not match policy.json ({str(expected)[:16]!r}...): "
            "the file is corrupted or was changed after export",
        )
    return data


def weights_bytes(spec: dict[str, Any]) -> int:
    """The most bytes the weights file of ``spec``'s network can hold: its tensors (float32
    layers, float64 normalisation) and a header; known before the file is opened."""
    sizes, outputs = spec["network"]["sizes"], sum(spec["nvec"])
    layers = [*zip(sizes[:-1], sizes[1:], strict=True), (sizes[-1], outputs)]
    return (
        4 * sum(fan_in * fan_out + fan_out for fan_in, fan_out in layers)
        + 8 * (2 * sizes[0] + 2)
        + MAX_HEADER_BYTES
    )


def check_values(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse weights that load but serve nonsense: a normalisation tensor <= 0
    (:data:`POSITIVE_NORMALISATION`) or a layer weight past :data:`MAX_WEIGHT` in magnitude."""
    for name, tensor in tensors.items():
        if name in POSITIVE_NORMALISATION:
            low = float(tensor.min())
            if not low > 0:
                raise ExportError(path, f"tensor {name!r} must be > 0 everywhere, holds {low!r}")
        elif not name.startswith("obs_") and tensor.numel():
            high = float(tensor.abs().max())
            if not high <= MAX_WEIGHT:
                raise ExportError(
                    path, f"tensor {name!r} holds {high:.3g}, past the sane magnitude {MAX_WEIGHT:g}"
                )


def _json_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def build_net(spec: dict[str, Any]) -> PolicyNet:
    net = spec["network"]
    return PolicyNet(net["sizes"], spec["nvec"], net["activation"], net["masked"])


def load_policy(directory: str | Path) -> ExportedPolicy:
    """An exported policy as a :class:`~envs.serving.scheduling.Policy` (no SB3, no pickle)."""
    directory = Path(directory)
    spec = read_spec(directory)
    path = directory / WEIGHTS_FILE
    data = verified_bytes(directory, spec, WEIGHTS_FILE, weights_bytes(spec))
    try:
        tensors = load(data)
    except SafetensorError as exc:
        raise ExportError(path, f"unreadable safetensors file ({str(exc).splitlines()[0][:200]})") from None
    net = build_net(spec)
    expected = net.state_dict()
    if set(tensors) != set(expected):
        raise ExportError(path, f"tensors {sorted(tensors)}, expected {sorted(expected)}")
    for name, want in expected.items():
        got = tensors[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ExportError(
                path,
                f"tensor {name!r} is {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}",
            )
        if not torch.isfinite(got).all():
            raise ExportError(path, f"tensor {name!r} holds NaN or infinite values")
    check_values(path, tensors)
    net.load_state_dict(tensors)
    norm = spec.get("normalisation")
    if not isinstance(norm, dict):
        raise ExportError(path.with_name(SPEC_FILE), f"field 'normalisation' must be an object, got {norm!r}")
    for key in ("obs_mean", "obs_var", "obs_epsilon", "obs_clip"):
        if key not in norm or not _same_values(norm[key], tensors[key]):
            raise ExportError(path, f"normalisation {key!r} differs between {SPEC_FILE} and {WEIGHTS_FILE}")
    return ExportedPolicy(net, spec)


def _same_values(recorded: Any, tensor: torch.Tensor) -> bool:
    """Whether a JSON value equals ``tensor`` element for element (a ragged list never does)."""
    try:
        return bool(np.array_equal(np.asarray(recorded), tensor.numpy()))
    except ValueError:
        return False


def export_program(net: PolicyNet) -> torch.export.ExportedProgram:
    """``net`` as a ``torch.export`` program with a dynamic batch dimension."""
    n_features = net.obs_mean.shape[0]
    batch = torch.export.Dim("N", min=1, max=1 << 20)
    example = (torch.zeros(2, n_features), torch.ones(2, sum(net.nvec), dtype=torch.bool))
    return torch.export.export(net, example, dynamic_shapes={"obs": {0: batch}, "mask": {0: batch}})


def load_program(directory: str | Path) -> torch.export.ExportedProgram:
    """The export's ``torch.export`` program, rebuilt from its safetensors weights (never unpickled).

    Call ``.module()(obs, mask)`` to run it; it is the program ``policy.pt2`` holds.
    """
    return export_program(load_policy(directory).net)
