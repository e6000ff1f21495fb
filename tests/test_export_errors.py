"""Tampered, corrupted or mismatched export directories fail with errors naming the file and the problem."""

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from envs import ENV_ID_V0, ENV_ID_V1
from envs.actions import NVEC
from envs.features import FEATURE_NAMES_V0
from policies.export import write_export
from policies.exported import ExportError, PolicyNet, load_policy, load_program

N_FEATURES = len(FEATURE_NAMES_V0)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("export")
    write_export(PolicyNet([N_FEATURES, 64, 64], NVEC), ENV_ID_V0, directory, {"note": "untrained"})
    return directory


@pytest.fixture
def copy(exported, tmp_path):
    target = tmp_path / "export"
    shutil.copytree(exported, target)
    return target


def _edit_spec(directory, edit):
    path = directory / "policy.json"
    spec = json.loads(path.read_text())
    edit(spec)
    path.write_text(json.dumps(spec))


def _rehash(directory, name):
    """Record a changed file's new hash, as a careless hand edit would (so deeper checks must catch it)."""
    digest = hashlib.sha256((directory / name).read_bytes()).hexdigest()
    _edit_spec(directory, lambda s: s["files"].update({name: digest}))


def test_untouched_export_loads(exported):
    assert load_policy(exported).spec["feature_set"] == "features_v0"
    load_program(exported)


def test_corrupted_weights_file(copy):
    data = bytearray((copy / "policy.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (copy / "policy.safetensors").write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"policy\.safetensors: SHA-256 .* does not match policy\.json"):
        load_policy(copy)


def test_program_is_rebuilt_from_the_weights_never_read_from_policy_pt2(copy):
    path = copy / "policy.pt2"
    path.write_bytes(path.read_bytes()[:1000])  # truncated: torch.export.load would fail on it
    obs = torch.randn(64, N_FEATURES)
    mask = torch.ones(64, sum(NVEC), dtype=torch.bool)
    expected = load_policy(copy).act(obs.numpy(), mask.numpy())
    assert (load_program(copy).module()(obs, mask).numpy() == expected).all()


def test_unreadable_weights_even_with_matching_hash(copy):
    (copy / "policy.safetensors").write_bytes(b"not a safetensors file")
    _rehash(copy, "policy.safetensors")
    with pytest.raises(ExportError, match=r"policy\.safetensors: unreadable safetensors file"):
        load_policy(copy)


def test_wrong_feature_count(copy):
    _edit_spec(copy, lambda s: s["feature_names"].pop())
    with pytest.raises(ExportError, match=rf"policy\.json: field 'feature_names' is .* but {ENV_ID_V0} has"):
        load_policy(copy)


def test_unknown_env_version(copy):
    _edit_spec(copy, lambda s: s.update(env_id="chunkgym/ChunkedPrefill-v9", env_version=9))
    with pytest.raises(
        ExportError, match=r"field 'env_id': env 'chunkgym/ChunkedPrefill-v9' is not registered"
    ):
        load_policy(copy)


def test_policy_of_one_env_version_claiming_another(copy):
    _edit_spec(copy, lambda s: s.update(env_id=ENV_ID_V1, env_version=1))
    with pytest.raises(
        ExportError, match=rf"field 'feature_set' is 'features_v0', but {ENV_ID_V1} has 'features_v1'"
    ):
        load_policy(copy)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("nvec", [n + 1 for n in NVEC]),
        ("budget_levels", [64, 128]),
        ("allocation_rules", ["fcfs"]),
        ("env_version", 3),
    ],
)
def test_mismatched_action_space(copy, field, value):
    _edit_spec(copy, lambda s: s.update({field: value}))
    with pytest.raises(ExportError, match=f"field '{field}' is"):
        load_policy(copy)


def test_tensor_of_wrong_shape(copy):
    tensors = load_file(copy / "policy.safetensors")
    tensors["body.0.weight"] = tensors["body.0.weight"][:, :-1].contiguous()
    save_file(tensors, copy / "policy.safetensors")
    _rehash(copy, "policy.safetensors")
    with pytest.raises(
        ExportError,
        match=rf"tensor 'body\.0\.weight' is torch\.float32\[64, {N_FEATURES - 1}\], expected .*\[64, {N_FEATURES}\]",
    ):
        load_policy(copy)


def test_normalisation_disagreeing_with_the_weights_file(copy):
    _edit_spec(copy, lambda s: s["normalisation"]["obs_mean"].__setitem__(0, 0.5))
    with pytest.raises(ExportError, match=r"normalisation 'obs_mean' differs"):
        load_policy(copy)


def test_not_json(copy):
    (copy / "policy.json").write_text("{not json")
    with pytest.raises(ExportError, match=r"policy\.json: not valid JSON"):
        load_policy(copy)


def test_missing_files(copy, tmp_path):
    (copy / "policy.safetensors").unlink()
    with pytest.raises(ExportError, match=r"policy\.safetensors: file not found"):
        load_policy(copy)
    with pytest.raises(ExportError, match=r"policy\.json: file not found"):
        load_policy(tmp_path / "nothing")
