"""chunkgym.cli and chunkgym.config: one override convention, one validation helper, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from chunkgym import REPO_ROOT
from chunkgym.cli import hydra_cli, load_options
from chunkgym.config import AT_LEAST_ONE, ConfigError, from_mapping, prefixed
from envs.serving.core import ServingConfig
from envs.serving.setup import SERVING_RULES, serving_config
from envs.serving.specs import HardwareSpec


@dataclass
class Options:
    seeds: list[int] = field(default_factory=lambda: [0])
    steps: int = 10
    serving: ServingConfig = field(default_factory=ServingConfig)


RULES = {"steps": AT_LEAST_ONE, **prefixed("serving", SERVING_RULES)}


def test_overrides_a_config_file_and_presets_apply_in_order(tmp_path):
    path = tmp_path / "opts.yaml"
    path.write_text("steps: 7\nseeds: [4]\nserving: {num_blocks: 99}\n")
    assert load_options(Options, []).steps == 10
    opts = load_options(Options, [f"config={path}", "seeds=[1,2]"], rules=RULES)
    assert (opts.steps, opts.seeds, opts.serving.num_blocks) == (7, [1, 2], 99)
    assert load_options(Options, ["steps=3", "steps=5"]).steps == 5, "the last override wins"
    assert load_options(Options, [], default_file=path).steps == 7


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["+nope=1"], "unknown config key(s) ['nope']"),
        (["steps=0"], "steps=0: must be an integer >= 1"),
        (
            ["steps=many"],
            "Error merging override steps=many: Value 'many' of type 'str' could not be converted",
        ),
        (["serving.block_size=0"], "serving.block_size=0: must be an integer >= 1"),
        (["config=/no/such.yaml"], "config=/no/such.yaml: no such file"),
    ],
)
def test_a_bad_override_is_one_line_naming_key_and_value(args, line):
    with pytest.raises(ConfigError) as info:
        load_options(Options, args, rules=RULES)
    assert str(info.value).startswith(line) and "\n" not in str(info.value)


def test_a_decorated_main_exits_with_the_line_before_running():
    ran = []
    main = hydra_cli(Options, "test_cli_options", RULES)(ran.append)
    main(["steps=2"])
    assert ran and ran[0].steps == 2
    with pytest.raises(SystemExit, match=r"error: steps=-1: must be an integer >= 1$"):
        main(["steps=-1"])
    assert len(ran) == 1


def test_spec_files_and_overrides_share_the_type_rules(tmp_path):
    spec = from_mapping(HardwareSpec, {"name": "x", "peak_flops": "1.0e12", "hbm_bandwidth": 1,
                                       "memory_gib": 8, "interconnect_bandwidth": 2.0}, "f.yaml")  # fmt: skip
    assert spec.peak_flops == 1e12 and isinstance(spec.hbm_bandwidth, float)
    with pytest.raises(ConfigError, match=r"^f.yaml: peak_flops: Value 'fast'"):
        from_mapping(HardwareSpec, {"name": "x", "peak_flops": "fast"}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: expected a mapping"):
        from_mapping(HardwareSpec, ["x"], "f.yaml")
    with pytest.raises(ConfigError, match=r"serving.lookahead=0: must be an integer >= 1"):
        serving_config({"lookahead": 0})
    with pytest.raises(ConfigError, match=r"serving: block_sise: Key 'block_sise' not in 'ServingConfig'"):
        serving_config({"block_sise": 8})


@pytest.mark.slow
def test_every_small_tool_lists_its_options_and_rejects_unknown_keys():
    env = {"PYTHONPATH": str(REPO_ROOT)}
    for tool in (
        "bench/sim_speed.py",
        "bench/headroom.py",
        "bench/admission_ablation.py",
        "bench/constant_actions.py",
    ):
        help_ = subprocess.run([sys.executable, tool, "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                               env=env, timeout=120)  # fmt: skip
        assert help_.returncode == 0 and "== Config ==" in help_.stdout, help_.stderr
        bad = subprocess.run([sys.executable, tool, "+nope=1"], cwd=REPO_ROOT, capture_output=True, text=True,
                             env=env, timeout=120)  # fmt: skip
        assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
            f"{tool.split('/')[1]}: error: unknown config key(s) ['nope']: not in the schema (Options)"
        ]
