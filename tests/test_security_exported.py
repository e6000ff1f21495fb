"""Exported-policy manifests: layer sizes checked before any allocation; hashes of any type checked alike."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from envs import ENV_ID_V0 as ENV_ID
from envs.actions import NVEC
from envs.chunked_prefill import version_of
from policies import exported
from policies.export import write_export
from policies.exported import ExportError, PolicyNet, load_policy
from tests.mutations import mutated_folders

N_FEATURES = len(version_of(ENV_ID).feature_names)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("export")
    write_export(PolicyNet([N_FEATURES, 16], NVEC), ENV_ID, directory, {})
    return directory


@pytest.fixture
def copy(original, tmp_path):
    shutil.copytree(original, tmp_path / "e")
    return tmp_path / "e"


def _edit(directory, fn) -> None:
    path = directory / "policy.json"
    spec = json.loads(path.read_text())
    fn(spec)
    path.write_text(json.dumps(spec))


@pytest.mark.parametrize(
    "sizes",
    [
        [True, 16],  # booleans are not layer sizes
        [N_FEATURES, True],
        [N_FEATURES, 16.0],
        [N_FEATURES, 10**12],  # would allocate terabytes
        [N_FEATURES, 0],
        [N_FEATURES] + [8] * 40,  # too deep
        [N_FEATURES],
        "64",
    ],
)
def test_layer_sizes_are_bounded_integers_checked_before_allocation(copy, monkeypatch, sizes):
    _edit(copy, lambda s: s["network"].__setitem__("sizes", sizes))

    def no_allocation(*args, **kwargs):
        raise AssertionError("a network was built from an unchecked manifest")

    monkeypatch.setattr(exported, "build_net", no_allocation)
    with pytest.raises(
        ExportError, match=r"policy.json: field 'network' must hold sizes \(2 to 17 integers in 1..4096\)"
    ):
        load_policy(copy)


@pytest.mark.parametrize("value", [12345, None, ["a"], {"sha": "x"}, True, "0" * 64])
def test_a_hash_of_the_wrong_type_gets_the_wrong_hash_error(copy, value):
    _edit(copy, lambda s: s["files"].__setitem__("policy.safetensors", value))
    if value is None:  # JSON null: no hash recorded
        with pytest.raises(ExportError, match=r"policy.json: no SHA-256 recorded for policy.safetensors"):
            load_policy(copy)
        return
    with pytest.raises(
        ExportError, match=r"policy.safetensors: SHA-256 [0-9a-f]{16}\.\.\. does not match policy.json"
    ):
        load_policy(copy)


def test_an_oversized_manifest_is_refused_before_parsing(copy):
    (copy / "policy.json").write_text('{"pad": "' + "x" * (2 << 20) + '"}')
    with pytest.raises(ExportError, match=r"policy.json: \d+ bytes; a policy manifest is under 1048576"):
        load_policy(copy)


WRONG_VALUES = [None, True, 0, -1, 1e308, "x", [], {}, [None], {"a": 1}, "obs_mean"]


def test_every_field_set_to_a_wrong_value_gives_an_export_error(original, tmp_path):
    """Each field (nested ones too) x 11 wrong values: always ExportError, never another exception."""
    cases, escaped = 0, []
    others = ("policy.safetensors", "policy.pt2")
    for path, value, directory in mutated_folders(original, "policy.json", others, WRONG_VALUES, tmp_path):
        cases += 1
        try:
            load_policy(directory)
            escaped.append((path, value, "loaded"))
        except ExportError:
            pass
        except Exception as exc:  # noqa: BLE001 - the point is to catch any other kind
            escaped.append((path, value, repr(exc)))
    # some values are legal for some fields (e.g. a note): they may load, they must not crash
    crashes = [e for e in escaped if e[2] != "loaded"]
    assert cases > 200 and not crashes, crashes[:5]
