"""The learned router: its export (safetensors + JSON) loads as the same router and refuses tampered
files in one line; its scorer treats servers alike; ``train.py +experiment=learned_router`` trains,
evaluates and exports one end to end."""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from chunkgym import REPO_ROOT
from chunkgym.received import ReceivedFileError
from envs.fleet_routing import SERVER_FEATURES
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.registry import make_policy
from policies.router_export import (
    N_INPUTS,
    SPEC_FILE,
    WEIGHTS_FILE,
    LearnedRouter,
    load_router,
    make_any_router,
    scorer_inputs,
    scores,
    write_router,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_router(seed: int = 0, sizes: tuple[int, ...] = (N_INPUTS, 8, 1)) -> LearnedRouter:
    rng = np.random.default_rng(seed)
    layers = [
        (rng.normal(size=(b, a)).astype(np.float32), rng.normal(size=b).astype(np.float32))
        for a, b in zip(sizes, sizes[1:], strict=False)
    ]
    return LearnedRouter(layers, "tanh", "learned_router")


def served(router) -> dict:
    trace = load_workload("synthetic_azure_conv").window("test", 0, 6.0, 20.0)
    fleet = ServingSetup.from_names().fleet(trace, 4, functools.partial(make_policy, "sarathi_512"), router)
    return {k: v for k, v in fleet.run().metrics.items() if k != "sim_wall_s"}


def test_an_exported_router_loads_as_the_same_router(tmp_path):
    router = random_router(1)
    spec = write_router(router, tmp_path, {"workloads": ["x"]})
    assert spec["sizes"] == [N_INPUTS, 8, 1] and set(spec["files"]) == {WEIGHTS_FILE}
    loaded = load_router(tmp_path)
    for (w, b), (w2, b2) in zip(router.layers, loaded.layers, strict=True):
        assert np.array_equal(w, w2) and np.array_equal(b, b2)
    assert served(loaded) == served(router)
    assert served(router) != served(random_router(2)) or served(router) == served(
        make_any_router("round_robin")
    )


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 9), st.integers(0, 2**16))
def test_renumbering_the_servers_renumbers_the_scores(servers, seed):
    rng = np.random.default_rng(seed)
    obs = rng.uniform(size=len(SERVER_FEATURES) * servers + 1).astype(np.float32)
    perm = rng.permutation(servers)
    permuted = np.concatenate([obs[:-1].reshape(servers, -1)[perm].ravel(), obs[-1:]])
    router = random_router(seed % 7)
    a = scores(router.layers, "tanh", scorer_inputs(obs))
    b = scores(router.layers, "tanh", scorer_inputs(permuted))
    assert np.allclose(a[perm], b, atol=1e-6)


def _export(tmp_path: Path) -> Path:
    write_router(random_router(), tmp_path, {})
    return tmp_path


def _rehash(directory: Path) -> None:
    spec = json.loads((directory / SPEC_FILE).read_text())
    spec["files"][WEIGHTS_FILE] = hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()
    (directory / SPEC_FILE).write_text(json.dumps(spec))


def _flip_a_byte(d: Path) -> None:
    data = bytearray((d / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 1
    (d / WEIGHTS_FILE).write_bytes(bytes(data))


def _nan_weights(d: Path) -> None:
    tensors = {
        "layers.0.weight": np.full((8, N_INPUTS), np.nan, np.float32),
        "layers.0.bias": np.zeros(8, np.float32),
    }
    tensors.update(
        {"layers.1.weight": np.zeros((1, 8), np.float32), "layers.1.bias": np.zeros(1, np.float32)}
    )
    save_file(tensors, str(d / WEIGHTS_FILE))
    _rehash(d)


def _wrong_shape(d: Path) -> None:
    tensors = {"layers.0.weight": np.zeros((8, 3), np.float32), "layers.0.bias": np.zeros(8, np.float32)}
    tensors.update(
        {"layers.1.weight": np.zeros((1, 8), np.float32), "layers.1.bias": np.zeros(1, np.float32)}
    )
    save_file(tensors, str(d / WEIGHTS_FILE))
    _rehash(d)


def _spec_edit(**fields):
    def edit(d: Path) -> None:
        spec = json.loads((d / SPEC_FILE).read_text())
        spec.update(fields)
        (d / SPEC_FILE).write_text(json.dumps(spec))

    return edit


def _garbage_weights(d: Path) -> None:
    (d / WEIGHTS_FILE).write_bytes(b"\xff" * 64)
    _rehash(d)


def _linked_spec(d: Path) -> None:
    (d / "elsewhere.json").write_text((d / SPEC_FILE).read_text())
    (d / SPEC_FILE).unlink()
    (d / SPEC_FILE).symlink_to(d / "elsewhere.json")


def _deep_json(d: Path) -> None:
    (d / SPEC_FILE).write_text("[" * 10000 + "]" * 10000)


def _not_json(d: Path) -> None:
    (d / SPEC_FILE).write_text("{sizes: [11, 8, 1]")


@pytest.mark.parametrize(
    "tamper, words",
    [
        (_flip_a_byte, "SHA-256"),
        (_nan_weights, "finite float32"),
        (_wrong_shape, "finite float32"),
        (_garbage_weights, "unreadable safetensors"),
        (_spec_edit(sizes=[N_INPUTS, 10**9, 1]), "field 'sizes'"),
        (_spec_edit(sizes=[N_INPUTS, 8, 2]), "field 'sizes'"),
        (_spec_edit(activation="eval"), "field 'activation'"),
        (_spec_edit(format="chunkgym-policy"), "format"),
        (_linked_spec, "symbolic link"),
        (_deep_json, "nested deeper"),
        (_not_json, "not valid JSON"),
    ],
)
def test_a_tampered_export_is_refused_in_one_line_naming_the_file(tmp_path, tamper, words):
    directory = _export(tmp_path)
    tamper(directory)
    with pytest.raises(ReceivedFileError) as err:
        load_router(directory)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert str(directory) in str(err.value)


def test_router_names_resolve_to_baselines_or_learned_routers_and_nothing_else(tmp_path):
    assert make_any_router("prefix_affinity").name == "prefix_affinity"
    write_router(random_router(), tmp_path, {})
    assert isinstance(make_any_router(f"learned_router:{tmp_path}"), LearnedRouter)
    with pytest.raises(ValueError, match="is not a router") as err:
        make_any_router("../../etc/passwd")
    assert "\n" not in str(err.value)


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "train.py",
            "+experiment=learned_router",
            "env.workloads=[]",
            "env.window_s=20",
            "algo.bc_steps=200",
            "algo.bc_epochs=2",
            "eval.seeds=[0]",
            "eval.window_s=20",
            f"hydra.run.dir={tmp_path / 'run'}",
            *overrides,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.needs_data("mooncake")
def test_train_learned_router_end_to_end_exports_a_loadable_router(tmp_path):
    proc = _train(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 200 and 0 <= summary["agreement"] <= 1
    assert set(summary["val"]) >= {"mooncake_conv/learned_router", "mooncake_conv/least_outstanding_tokens"}
    router = load_router(summary["export_dir"])
    assert json.loads((Path(summary["export_dir"]) / SPEC_FILE).read_text())["workloads"] == ["mooncake_conv"]
    assert served(router)["slo_attainment"] > 0


def test_train_learned_router_refuses_ppo_steps_in_one_line(tmp_path):
    proc = _train(tmp_path, "workload=synthetic_azure_conv", "algo.total_timesteps=100")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "algo.total_timesteps=100" in proc.stderr.strip().splitlines()[-1]
