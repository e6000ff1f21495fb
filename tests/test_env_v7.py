"""chunkgym/ChunkedPrefill-v7: v4's observation, actions and reward on the prefill pool of a
disaggregated fleet (Gymnasium's checks, determinism, the goodput return, masks, the fleet it
drives, bad configurations, train.py on it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hydra import compose, initialize_config_dir
from stable_baselines3.common.env_checker import check_env as sb3_check_env

from baselines.routers import make_router
from chunkgym import REPO_ROOT
from chunkgym.config import ConfigError
from chunkgym.registration import ENV_ID_V7
from envs.actions import ACTIONS_V3
from envs.chunked_prefill import VERSIONS, ChunkedPrefillEnv, version_of
from envs.disaggregated_prefill import DECODE_POLICY, DisaggregatedPrefillEnv
from envs.features import FEATURE_NAMES_V4
from envs.serving.fleet import FleetSpec
from envs.serving.scheduling import Admission, Rule
from envs.serving.workload import Workload
from policies.config import register_configs, to_train_config
from policies.registry import make_policy
from policies.training import ValWindows, serving_setup

KW = {"workloads": ["synthetic_azure_conv"], "cost_model": "roofline", "window_s": 30.0}
ONE_ONE = FleetSpec(prefill=1, decode=1)
# Few KV blocks and a slow link: prefill servers wait for their handed-over KV to be taken.
HELD = {"fleet": FleetSpec(prefill=1, decode=1, link="eth_25g"), "serving": {"num_blocks": 600}}


def make(**kwargs) -> gym.Env:
    return gym.make(ENV_ID_V7, **{**KW, "fleet": ONE_ONE, "load_scale": 3.0, **kwargs})


def masked_random(seed: int):
    """An agent choosing uniformly among the valid actions of each state."""
    rng = np.random.default_rng(seed)
    n_modes = ACTIONS_V3.nvec[0]

    def choose(env: gym.Env, info: dict) -> np.ndarray:
        mask = info["action_mask"]
        return np.array(
            [rng.choice(np.flatnonzero(mask[:n_modes])), rng.choice(np.flatnonzero(mask[n_modes:]))]
        )

    return choose


def constant(action: tuple[int, int]):
    return lambda env, info: np.array(action)


def episode(env: gym.Env, choose, seed: int = 0) -> tuple[list, dict]:
    """Each step's (observation, reward, mask, server, now) and the last info."""
    obs, info = env.reset(seed=seed)
    steps, done = [(obs, 0.0, info["action_mask"], -1, info["now"])], False
    while not done:
        obs, reward, terminated, truncated, info = env.step(choose(env, info))
        assert not terminated
        done = truncated
        steps.append((obs, reward, info["action_mask"], info["server"], info["now"]))
    return steps, info


def test_registered_with_v4_spaces_and_passes_both_checkers():
    env = make()
    assert version_of(ENV_ID_V7) is VERSIONS[7] and VERSIONS[7].disaggregated
    assert env.observation_space.shape == (len(FEATURE_NAMES_V4),) == (33,)
    assert VERSIONS[7].features is VERSIONS[4].features and VERSIONS[7].actions is VERSIONS[4].actions
    assert tuple(env.action_space.nvec) == (17, 8)
    check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(env.unwrapped, warn=True)


def test_one_seed_gives_one_trajectory():
    env = make(fleet=FleetSpec(prefill=2, decode=1, router="least_requests"))
    first, _ = episode(env, masked_random(1), seed=7)
    again, _ = episode(env, masked_random(1), seed=7)
    other, _ = episode(
        make(fleet=FleetSpec(prefill=2, decode=1, router="least_requests")), masked_random(1), 7
    )
    assert len(first) == len(again) == len(other) > 10
    for a, b, c in zip(first, again, other, strict=True):
        for x, y, z in zip(a, b, c, strict=True):
            assert np.array_equal(x, y) and np.array_equal(x, z)
    assert {s[3] for s in first[1:]} == {0, 1}  # both prefill servers were planned


def test_v4_and_v7_draw_the_same_windows():
    """The same arguments and seed give both routes the same episodes, so their goodputs compare."""
    kw = {**KW, "workloads": ["synthetic_azure_conv", "synthetic_azure_conv"], "load_scale": (1.0, 3.0)}
    v4 = gym.make("chunkgym/ChunkedPrefill-v4", **kw)
    v7 = gym.make(ENV_ID_V7, fleet=ONE_ONE, **kw)
    for seed in (0, 1):
        _, info_4 = v4.reset(seed=seed)
        _, info_7 = v7.reset(seed=seed)
        assert info_4["load_scale"] == info_7["load_scale"] and info_4["requests"] == info_7["requests"]
        trace_4, trace_7 = v4.unwrapped.sim.trace, v7.unwrapped.fleet.trace
        assert np.array_equal(trace_4.arrival_s, trace_7.arrival_s)
        assert np.array_equal(trace_4.prompt_len, trace_7.prompt_len)


@pytest.mark.parametrize("fleet_kw", [{"fleet": ONE_ONE}, HELD], ids=["1p1d", "held_kv"])
def test_the_return_is_affine_in_the_fleets_goodput(fleet_kw):
    """Each request nets +1 or -1, wherever it was judged: return = (2 x good - requests) x scale."""
    scale = 0.25
    env = make(reward_scale=scale, **fleet_kw)
    steps, info = episode(env, masked_random(2), seed=1)
    fleet = env.unwrapped.fleet
    good, n = int(fleet.result().outcomes.good.sum()), len(fleet.requests)
    assert 0 < good < n and info["good"] == good  # some requests missed: not all +1
    assert sum(s[1] for s in steps) == (2 * good - n) * scale
    span = fleet.trace.span_s
    assert sum(s[1] for s in steps) == pytest.approx((2 * info["serving"]["goodput_rps"] * span - n) * scale)


def test_masks_are_the_planned_servers_and_ignoring_them_is_safe():
    """Every step plans a server with a prompt waiting; an invalid action runs as its valid twin."""
    env = make(**HELD)
    obs, info = env.reset(seed=1)
    twin = make(**HELD)
    twin.reset(seed=1)
    raw, n_modes, waited = np.array([3, 5]), ACTIONS_V3.nvec[0], 0  # 512 tokens, shortest_first+skip
    done = False
    while not done:
        sim = env.unwrapped.sim
        assert sim.core.queue  # a decision: a prompt waits on the server the agent plans
        mask = info["action_mask"]
        assert np.array_equal(mask, env.action_masks()) and mask[0] and mask[n_modes]
        assert np.array_equal(mask, ACTIONS_V3.mask(sim.view))
        valid = np.array(ACTIONS_V3.canonical(sim.view, *raw))
        obs, reward, _, done, info = env.step(raw)
        obs_2, reward_2, _, done_2, info_2 = twin.step(valid)
        assert np.array_equal(obs, obs_2) and reward == reward_2 and done == done_2
        waited += info["latency"] == 0.0
    assert waited > 0  # some decisions met a server waiting for its held KV


def action(mode: str, rule: Rule = Rule.FCFS, admission: Admission = Admission.STOP) -> tuple[int, int]:
    return ACTIONS_V3.action_of(mode, rule, admission)


@pytest.mark.parametrize(
    ("policy", "act", "fleet_kw"),
    [
        ("sarathi_512", action("budget_512"), {"fleet": ONE_ONE}),
        ("sarathi_1024", action("budget_1024"), HELD),
        (
            "sarathi_256",
            action("budget_256"),
            {"fleet": FleetSpec(prefill=2, decode=2, router="least_requests", decode_router="power_of_two")},
        ),
        ("adaptive_srpf", action("target_1", Rule.SHORTEST_FIRST, Admission.SKIP), HELD),
    ],
    ids=["1p1d", "held_kv", "2p2d", "adaptive_srpf"],
)
def test_a_heuristics_action_serves_what_the_fleet_serves_with_it(policy, act, fleet_kw):
    """A heuristic's constant action on every prefill server is that heuristic there (sarathi_B is
    (budget_B, fcfs+stop)): the episode's goodput is a DisaggregatedFleet run's with the heuristic on
    the prefill pool and the decode pool's policy on the decode pool, over the same window."""
    env = make(**fleet_kw)
    _, info = episode(env, constant(act))
    u = env.unwrapped
    spec = u.fleet_spec
    ref = u.setup.fleet_for(
        u.fleet.trace,
        spec,
        lambda: make_policy(policy),
        make_router(spec.router),
        make_router(spec.decode_router),
        make_decode_policy=lambda: make_policy(DECODE_POLICY),
    ).run()
    assert np.array_equal(u.fleet.result().outcomes.good, ref.outcomes.good)
    assert info["serving"]["goodput_rps"] == ref.metrics["goodput_rps"] > 0
    assert info["serving"]["goodput_per_gpu"] == ref.metrics["goodput_per_gpu"]


def test_bad_configurations_fail_in_one_line_before_any_work():
    with pytest.raises(
        ValueError, match=r"^fleet.prefill=0: chunkgym/ChunkedPrefill-v7 plans the prefill pool"
    ):
        gym.make(ENV_ID_V7, **KW)
    with pytest.raises(ValueError, match=r"^fleet.prefill=0: "):
        make(fleet=FleetSpec(replicas=4))
    with pytest.raises(ConfigError, match=r"fleet.prefill=1 and fleet.decode=0"):
        make(fleet={"prefill": 1})
    with pytest.raises(ValueError, match=r"fleet.router='nope' is not a router"):
        make(fleet={"prefill": 1, "decode": 1, "router": "nope"})
    with pytest.raises(ValueError, match=r"'no_such_policy'"):
        make(decode_policy="no_such_policy")
    with pytest.raises(
        ValueError, match=r"^version must be one of \[0, 1, 2, 3, 4, 6\], got 7 \(it plans a disagg"
    ):
        ChunkedPrefillEnv(version=7, **KW)
    with pytest.raises(ValueError, match=r"^version must be one of \[7\], got 4$"):
        DisaggregatedPrefillEnv(make_policy, make_router, fleet=ONE_ONE, version=4, **KW)


def compose_train(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=overrides)


def test_train_config_needs_a_disaggregated_fleet_for_v7_and_refuses_one_elsewhere():
    v7 = f"env.id={ENV_ID_V7}"
    cfg = to_train_config(compose_train([v7, "fleet.prefill=2", "fleet.decode=1", "fleet.link=ib_200g"]))
    assert cfg.fleet == FleetSpec(prefill=2, decode=1, link="ib_200g")
    with pytest.raises(ConfigError, match=rf"fleet.prefill=0: env.id={ENV_ID_V7} plans the prefill pool"):
        to_train_config(compose_train([v7]))
    with pytest.raises(ConfigError, match=rf"fleet.prefill=0: env.id={ENV_ID_V7}"):
        to_train_config(compose_train([v7, "fleet.replicas=4"]))
    for other in ("chunkgym/ChunkedPrefill-v4", "chunkgym/ChunkedPrefill-v6"):
        with pytest.raises(ConfigError, match=r"prefill-decode disaggregation is not simulated by this tool"):
            to_train_config(compose_train([f"env.id={other}", "fleet.prefill=1", "fleet.decode=1"]))


@pytest.mark.slow
def test_a_tiny_training_run_on_the_prefill_pool(tmp_path):
    """train.py trains v7 on the fleet it names, and evaluates the policy and the baseline there."""
    # eval.load_scale=6: over one server's capacity, so one server and the 2+1 fleet serve differently.
    fleet = [f"env.id={ENV_ID_V7}", "fleet.prefill=2", "fleet.decode=1"]
    episodes = ["+experiment=smoke", "eval.seeds=[0]", "eval.load_scale=6"]
    tiny = ["algo.total_timesteps=128", "algo.n_steps=64", "algo.batch_size=64", "algo.n_epochs=1"]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), *fleet, *episodes, *tiny, "progress=false"]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    done = subprocess.run(
        [*cmd, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["timesteps"] == 128
    spec = json.loads((run_dir / "env_spec.json").read_text())
    assert spec["env_id"] == ENV_ID_V7 and spec["observation"]["feature_set"] == "features_v4"
    baseline = summary["sarathi_512_val_goodput_rps"]
    for overrides, on_fleet in ((fleet, True), ([], False)):
        cfg = to_train_config(compose_train([*overrides, *episodes]))
        windows = ValWindows(cfg, Workload(cfg.workload, cfg.data_root), serving_setup(cfg))
        assert (windows.evaluate(lambda: make_policy("sarathi_512"))["goodput_rps"] == baseline) is on_fleet
