"""The vLLM plugin's settings: additional_config over CHUNKGYM_* variables, checked before any work.

Runs without vLLM (engine.vllm_backend.config imports chunkgym only).
"""

from __future__ import annotations

import pytest

from baselines import Sarathi
from chunkgym.config import ConfigError
from engine.vllm_backend.config import (
    DEFAULT_COST,
    SCHEDULER,
    PluginConfig,
    check_server,
    cost_path,
    load_plugin,
    plugin_config,
)
from envs.serving.cost_model import COST_DIR


def test_additional_config_wins_over_the_environment():
    env = {"CHUNKGYM_POLICY": "fcfs", "CHUNKGYM_SLO": "relaxed", "CHUNKGYM_LOOKAHEAD": "8"}
    conf = plugin_config({"chunkgym": {"policy": "sarathi_256"}}, env)
    assert conf == PluginConfig(policy="sarathi_256", slo="relaxed", cost=DEFAULT_COST, lookahead=8)
    assert plugin_config(None, env).policy == "fcfs"


@pytest.mark.parametrize(
    ("extra", "env", "match"),
    [
        (None, {}, r"no policy named: set \{'chunkgym': \{'policy': NAME\}\} or \$CHUNKGYM_POLICY"),
        (
            {"chunkgym": {"policy": "nope"}},
            {},
            r"policy='nope': unknown policy 'nope'; valid names: .*sarathi_512",
        ),
        (None, {"CHUNKGYM_POLICY": "../x"}, r"policy='../x': unknown policy"),
        ({"chunkgym": {"policy": "fcfs", "budget": 3}}, {}, r"budget: Key 'budget' not in 'PluginConfig'"),
        ({"chunkgym": {"policy": "fcfs", "lookahead": 0}}, {}, r"lookahead=0: must be an integer >= 1"),
        ({"chunkgym": "fcfs"}, {}, r"expected a mapping of chunkgym settings, got 'fcfs'"),
    ],
)
def test_bad_settings_fail_in_one_line_naming_key_and_value(extra, env, match):
    with pytest.raises(ConfigError, match=match) as err:
        plugin_config(extra, env)
    assert "\n" not in str(err.value) and str(err.value).startswith("vLLM additional_config['chunkgym']")


def test_load_builds_the_named_policy_and_resolves_the_slo_on_the_cost_file():
    plugin = load_plugin(PluginConfig(policy="sarathi_256"))
    assert isinstance(plugin.policy, Sarathi) and plugin.policy.budget == 256
    assert plugin.policy.name == "sarathi_256"
    assert DEFAULT_COST in plugin.cost_model.description
    strict = plugin.slo
    relaxed = load_plugin(PluginConfig(policy="fcfs", slo="relaxed")).slo
    assert 0 < strict.tpot_s < relaxed.tpot_s
    assert strict.reference_decode_s == pytest.approx(relaxed.reference_decode_s)


def test_cost_names_a_conf_file_or_a_path(tmp_path):
    assert cost_path(DEFAULT_COST) == COST_DIR / f"{DEFAULT_COST}.yaml"
    own = tmp_path / "mine.yaml"
    own.write_text((COST_DIR / f"{DEFAULT_COST}.yaml").read_text())
    assert cost_path(str(own)) == own
    assert load_plugin(PluginConfig(policy="fcfs", cost=str(own))).cost_model.description.startswith("mine:")
    with pytest.raises(
        ConfigError, match=r"chunkgym cost='nope': cost coefficient file not found: .*nope.yaml"
    ):
        load_plugin(PluginConfig(policy="fcfs", cost="nope"))
    with pytest.raises(ConfigError, match=r"chunkgym: unknown slo 'tight'"):
        load_plugin(PluginConfig(policy="fcfs", slo="tight"))


def test_a_servers_flags_load_the_plugin_the_scheduler_will():
    plugin = check_server(
        SCHEDULER, {"chunkgym": {"policy": "sarathi_512", "cost": "cpu__vllm_small__tp1"}}, "fcfs", {}
    )
    assert plugin is not None and isinstance(plugin.policy, Sarathi) and plugin.policy.budget == 512
    assert plugin.cost_model.description.startswith("cpu__vllm_small__tp1:")
    from_env = check_server(SCHEDULER, {}, "fcfs", {"CHUNKGYM_POLICY": "sarathi_256"})
    assert from_env is not None and from_env.policy.name == "sarathi_256"


def test_flags_without_the_plugin_are_not_its_to_check():
    assert check_server(None, {}, "priority", {"CHUNKGYM_POLICY": "nope"}) is None
    assert check_server("mine.Scheduler", {"chunkgym": {"policy": "nope"}}, "priority", {}) is None


@pytest.mark.parametrize(
    ("scheduler_cls", "extra", "policy", "env", "match"),
    [
        (SCHEDULER, {"chunkgym": {"policy": "nope"}}, "fcfs", {}, r"policy='nope': unknown policy 'nope'"),
        (SCHEDULER, {}, "fcfs", {"CHUNKGYM_POLICY": "nope"}, r"policy='nope': unknown policy 'nope'"),
        (SCHEDULER, {}, "fcfs", {}, r"no policy named"),
        (SCHEDULER, {"chunkgym": {"policy": "fcfs", "cost": "nope"}}, "fcfs", {}, r"cost='nope'"),
        (
            SCHEDULER,
            {"chunkgym": {"policy": "fcfs"}},
            "priority",
            {},
            r"--scheduling-policy priority: .* fcfs",
        ),
        (None, {"chunkgym": {"policy": "fcfs"}}, "fcfs", {}, r"no --scheduler-cls: add --scheduler-cls "),
    ],
)
def test_bad_server_flags_fail_in_one_line(scheduler_cls, extra, policy, env, match):
    with pytest.raises(ConfigError, match=match) as err:
        check_server(scheduler_cls, extra, policy, env)
    assert "\n" not in str(err.value)
