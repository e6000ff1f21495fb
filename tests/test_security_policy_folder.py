"""An exported policy folder is read inside itself, within a budget, and only if it can serve sensibly.

Each test plants one thing in a copy of an export (a link, a FIFO, a sparse 8 GiB weights file,
a normalisation that loads but serves nonsense) and asserts the one-line ExportError naming the
file, how fast it came, and that files outside the folder were neither read nor changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from envs import ENV_ID_V0 as ENV_ID
from envs.actions import NVEC
from envs.chunked_prefill import version_of
from policies.export import write_export
from policies.exported import MAX_WEIGHT, ExportError, PolicyNet, load_policy
from policies.registry import make_policy, policy_env_id

N_FEATURES = len(version_of(ENV_ID).feature_names)


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("export")
    write_export(PolicyNet([N_FEATURES, 16], NVEC), ENV_ID, directory, {})
    return directory


@pytest.fixture
def folder(original, tmp_path) -> Path:
    shutil.copytree(original, tmp_path / "p")
    return tmp_path / "p"


@pytest.fixture
def outside(tmp_path) -> Path:
    path = tmp_path / "elsewhere.bin"
    path.write_bytes(b"not yours" * 100)
    return path


def one_line(exc: pytest.ExceptionInfo, name: str) -> str:
    message = str(exc.value)
    assert "\n" not in message and name in message, message
    return message


def rewrite_tensor(folder: Path, name: str, value: float) -> None:
    """Set a tensor of the weights file (and its copy in policy.json), rehashed as a careful forger would."""
    tensors = load_file(folder / "policy.safetensors")
    tensors[name].fill_(value) if name.startswith("obs_") else tensors[name].view(-1)[0].fill_(value)
    save_file(tensors, folder / "policy.safetensors")
    spec = json.loads((folder / "policy.json").read_text())
    if name in spec["normalisation"]:
        t = tensors[name]
        spec["normalisation"][name] = t.tolist() if t.dim() else float(t)
    spec["files"]["policy.safetensors"] = hashlib.sha256(
        (folder / "policy.safetensors").read_bytes()
    ).hexdigest()
    (folder / "policy.json").write_text(json.dumps(spec))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("obs_var", -1.0),
        ("obs_var", 0.0),
        ("obs_epsilon", 0.0),
        ("obs_epsilon", -1e-8),
        ("obs_clip", 0.0),
        ("obs_clip", -10.0),
        ("head.weight", MAX_WEIGHT * 10),
        ("body.0.bias", -1e30),
    ],
)
def test_a_normalisation_or_weight_that_serves_nonsense_is_refused(folder, name, value):
    rewrite_tensor(folder, name, value)
    with pytest.raises(ExportError) as exc:
        load_policy(folder)
    assert f"policy.safetensors: tensor '{name}'" in one_line(exc, "policy.safetensors")


def test_the_export_refuses_to_write_what_loading_refuses(tmp_path):
    net = PolicyNet([N_FEATURES, 16], NVEC)
    with torch.no_grad():
        net.obs_var[0] = -1.0
    with pytest.raises(ExportError, match="tensor 'obs_var' must be > 0"):
        write_export(net, ENV_ID, tmp_path / "e", {})
    assert not (tmp_path / "e").exists()


def test_a_sparse_8_gib_weights_file_is_refused_before_a_byte_is_read(folder):
    with open(folder / "policy.safetensors", "r+b") as f:
        f.truncate(8 << 30)
    start = time.perf_counter()
    with pytest.raises(ExportError) as exc:
        load_policy(folder)
    assert time.perf_counter() - start < 1.0
    assert re.search(
        r"policy.safetensors: 8589934592 bytes; this network's weights file is under \d+$",
        one_line(exc, "policy"),
    )


@pytest.mark.parametrize("name", ["policy.json", "policy.safetensors"])
def test_a_link_out_of_the_folder_is_refused_and_its_target_untouched(folder, outside, name):
    shutil.copy(folder / name, outside)  # a link to a perfect copy: refused all the same
    before = hashlib.sha256(outside.read_bytes()).hexdigest()
    (folder / name).unlink()
    (folder / name).symlink_to(outside)
    loads = [load_policy, lambda d: make_policy(f"learned:{d}")]
    if name == "policy.json":  # the env id comes from the manifest only
        loads.append(lambda d: policy_env_id(f"learned:{d}", "x"))
    for load in loads:
        with pytest.raises(ExportError) as exc:
            load(folder)
        assert "is a symbolic link" in one_line(exc, name)
    assert hashlib.sha256(outside.read_bytes()).hexdigest() == before


@pytest.mark.parametrize("name", ["policy.json", "policy.safetensors"])
def test_a_fifo_is_refused_without_blocking(folder, name):
    (folder / name).unlink()
    os.mkfifo(folder / name)
    signal.alarm(10)  # a blocking open would hang the test: fail it instead
    try:
        with pytest.raises(ExportError) as exc:
            load_policy(folder)
    finally:
        signal.alarm(0)
    assert "FIFO" in one_line(exc, name)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[" * 5000 + "]" * 5000, "nested deeper than 64 levels"),
        ('{"format_version": ' + "1" * 5000 + "}", "not a readable JSON document"),
        ("\xff\xfe{}", "not valid JSON"),
    ],
)
def test_a_manifest_that_breaks_the_json_parser_is_one_line(folder, text, message):
    (folder / "policy.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ExportError) as exc:
        load_policy(folder)
    assert message in one_line(exc, "policy.json")


def test_a_weights_file_larger_than_its_network_is_refused(folder):
    with open(folder / "policy.safetensors", "ab") as f:
        f.write(b"\0" * (1 << 20))
    with pytest.raises(
        ExportError, match=r"policy.safetensors: \d+ bytes; this network's weights file is under"
    ):
        load_policy(folder)
