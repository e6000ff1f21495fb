"""The routing env (``chunkgym/ChunkedPrefill-v5``): Gymnasium's checks, determinism, the fleet it
drives (routing a baseline's choices through the env serves what ``Fleet.run`` serves behind that
baseline), masks, the goodput return, and the policy factory it accepts."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baselines.routers import make_router
from chunkgym.registration import ENV_ID_V5
from envs.fleet_routing import FleetRoutingEnv, servers_that_fit
from envs.serving.fleet import Fleet
from envs.serving.setup import ServingSetup
from policies.registry import make_policy

SYNTHETIC = "synthetic_azure_conv"  # no data files needed


def small_env(**kwargs) -> FleetRoutingEnv:
    args = {"replicas": 4, "workloads": [SYNTHETIC], "load_scale": 6.0, "window_s": 20.0, **kwargs}
    return FleetRoutingEnv(make_policy, **args)


def rollout(env: FleetRoutingEnv, choose, seed: int = 0) -> tuple[list, dict]:
    """Steps of one episode (obs, reward, mask) and the last info; ``choose(env, obs)`` names the server."""
    obs, info = env.reset(seed=seed)
    steps, done = [], False
    while not done:
        action = choose(env, obs)
        obs, reward, done, truncated, info = env.step(action)
        assert not truncated
        steps.append((obs.copy(), reward, info["action_mask"].copy(), info["server"]))
    return steps, info


def same_step(x: tuple, y: tuple) -> bool:
    return np.array_equal(x[0], y[0]) and x[1] == y[1] and np.array_equal(x[2], y[2]) and x[3] == y[3]


def by_router(name: str):
    router = make_router(name)
    router.reset(4, 0)

    def choose(env: FleetRoutingEnv, obs: np.ndarray) -> int:
        fleet = env.fleet
        return router.route(fleet.requests[fleet.next_arrival], fleet.views)

    return choose


def test_gymnasium_env_checker_passes():
    check_env(small_env(), skip_render_check=True)


def test_registered_id_builds_through_gym_make_with_masks_through_the_wrappers():
    env = gym.make(ENV_ID_V5, replicas=3, workloads=[SYNTHETIC], load_scale=4.0, window_s=10.0)
    obs, info = env.reset(seed=1)
    assert env.observation_space.contains(obs) and obs.shape == (16,)
    assert env.action_masks().shape == (3,) and env.action_masks().dtype == bool
    assert np.array_equal(env.action_masks(), info["action_mask"])


def test_same_seed_same_trajectory_and_other_seed_another():
    choose = lambda env, obs: int(np.argmax(obs[:-1:5] + obs[2:-1:5]))  # noqa: E731  (reads the state)
    a, info_a = rollout(small_env(), choose, seed=3)
    b, info_b = rollout(small_env(), choose, seed=3)
    c, _ = rollout(small_env(), choose, seed=4)
    assert len(a) == len(b) and all(same_step(x, y) for x, y in zip(a, b, strict=True))
    assert info_a["serving"] == {**info_b["serving"], "sim_wall_s": info_a["serving"]["sim_wall_s"]}
    assert [(s[1], s[3]) for s in a] != [(s[1], s[3]) for s in c]


@pytest.mark.parametrize("name", ["round_robin", "least_outstanding_tokens", "llmd_default", "power_of_two"])
def test_routing_a_baselines_choices_serves_what_the_fleet_serves_behind_it(name):
    env = small_env(load_scale=10.0)
    steps, info = rollout(env, by_router(name), seed=2)
    trace = env.fleet.trace
    fleet = env.setup.fleet(trace, 4, functools.partial(make_policy, "sarathi_512"), make_router(name))
    want = fleet.run()
    got = env.fleet.result()
    assert set(got.token_times) == set(want.token_times)
    assert all(np.array_equal(got.token_times[r], want.token_times[r]) for r in want.token_times)
    for key, value in want.metrics.items():
        if key != "sim_wall_s":
            assert got.metrics[key] == value or (np.isnan(value) and np.isnan(got.metrics[key])), key
    # the return is the window's (good - bad): an affine function of its goodput
    good = round(want.metrics["goodput_rps"] * trace.span_s)
    assert sum(s[1] for s in steps) == pytest.approx(2 * good - len(trace))
    assert info["good"] + info["bad"] == len(trace) == len(steps)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 3), min_size=1, max_size=64), st.integers(0, 2**16))
def test_any_actions_keep_observations_in_space_and_return_good_minus_bad(actions, seed):
    env = small_env(window_s=8.0, reward_scale=0.5)
    steps, info = rollout(env, lambda env, obs: actions[env.fleet.next_arrival % len(actions)], seed)
    assert all(env.observation_space.contains(s[0]) for s in steps)
    assert [s[3] for s in steps] == [actions[i % len(actions)] for i in range(len(steps))]
    assert sum(s[1] for s in steps) == pytest.approx(0.5 * (info["good"] - info["bad"]))


def test_a_server_whose_cache_cannot_hold_the_prompt_is_masked_and_all_when_none_can():
    small = ServingSetup.from_names(serving={"num_blocks": 64})  # 64 x 16 = 1024 tokens of KV
    big = ServingSetup.from_names()
    env = small_env()
    env.reset(seed=0)
    trace = env.fleet.trace
    servers = [
        small.fleet(trace, 1, functools.partial(make_policy, "sarathi_512"), make_router("round_robin"))
    ]
    servers.append(
        big.fleet(trace, 1, functools.partial(make_policy, "sarathi_512"), make_router("round_robin"))
    )
    fleet = Fleet(
        trace, [f.servers[0] for f in servers], [f.policies[0] for f in servers], make_router("round_robin")
    )
    long = next(r for r in fleet.requests if r.prompt_len > 1024)
    short = next(r for r in fleet.requests if r.prompt_len < 512)
    assert servers_that_fit(long, fleet).tolist() == [False, True]
    assert servers_that_fit(short, fleet).tolist() == [True, True]
    tiny = Fleet(trace, [servers[0].servers[0]], [servers[0].policies[0]], make_router("round_robin"))
    assert servers_that_fit(long, tiny).tolist() == [True]  # no server can: every one is valid


def test_a_policy_factory_outside_the_repository_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"policy_factory='os:system'") as err:
        FleetRoutingEnv("os:system", workloads=[SYNTHETIC])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown policy"):
        FleetRoutingEnv(make_policy, server_policy="no_such_policy", workloads=[SYNTHETIC])
