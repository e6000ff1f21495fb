"""chunkgym/ChunkedPrefill-v1 (and v2, v1 with the stop admission): decision-level steps, the earlier-credit reward, common inputs."""

import re

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import envs
from envs.actions import NUM_LEVELS
from envs.chunked_prefill import ChunkedPrefillEnv
from envs.features import FEATURE_NAMES_V1

KW = dict(workloads=["synthetic_azure_conv"], cost_model="roofline", window_s=20.0, load_scale=2.0)


def make_env(**kw) -> ChunkedPrefillEnv:
    return ChunkedPrefillEnv(version=1, **{**KW, **kw})


def _rollout(env, seed):
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    total, trunc, info = 0.0, False, {}
    while not trunc:
        m = env.action_masks()
        a = (rng.choice(np.flatnonzero(m[:NUM_LEVELS])), rng.choice(np.flatnonzero(m[NUM_LEVELS:])))
        obs, r, term, trunc, info = env.step(np.array(a))
        assert not term and env.observation_space.contains(obs)
        total += r
    return total, info


@pytest.mark.parametrize("env_id", [envs.ENV_ID_V1, envs.ENV_ID_V2])
def test_registered_with_its_spaces_and_passes_both_checkers(env_id):
    env = gym.make(env_id, **KW)
    assert env.action_space.nvec.tolist() == [9, 4]
    assert env.observation_space.shape == (len(FEATURE_NAMES_V1),)
    check_env(env.unwrapped)
    sb3_check_env(env.unwrapped, warn=True)


def test_every_step_is_a_decision():
    env = make_env()
    env.reset(seed=0)
    for _ in range(300):
        assert env.sim.core.queue, "a step was offered with nothing to decide"
        if env.step(np.array([3, 1]))[3]:
            break


def test_return_is_good_minus_bad_although_credit_comes_at_the_first_token():
    env = make_env()
    for seed in range(3):
        total, info = _rollout(env, seed)
        assert info["good"] + info["bad"] == info["requests"]
        assert total == info["good"] - info["bad"]


def test_common_inputs_replay_the_same_episode_sequence_across_envs():
    kw = {**KW, "workloads": ["synthetic_azure_conv", "synthetic_azure_conv"], "load_scale": (1.0, 3.0)}
    a, b = make_env(input_seed=5, **kw), make_env(input_seed=5, **kw)
    c = make_env(**kw)
    a.reset(seed=1), b.reset(seed=2), c.reset(seed=1)
    for _ in range(3):
        assert a.load == b.load
        np.testing.assert_array_equal(a.sim.trace.arrival_s, b.sim.trace.arrival_s)
        a.reset(), b.reset()
    assert a.load != c.load or not np.array_equal(a.sim.trace.arrival_s, c.sim.trace.arrival_s)


def test_workload_loads_give_each_workload_its_own_load_range():
    kw = {**KW, "workloads": ["synthetic_azure_conv", "azure_conv"], "load_scale": (1.0, 3.0)}
    env = make_env(workload_loads={"azure_conv": (5.0, 6.0)}, **kw)
    assert env.load_ranges == {"synthetic_azure_conv": (1.0, 3.0), "azure_conv": (5.0, 6.0)}
    env.reset(seed=0)
    seen = set()
    for _ in range(12):
        lo, hi = (5.0, 6.0) if env.workload.spec.name == "azure_conv" else (1.0, 3.0)
        assert lo <= env.load <= hi
        seen.add(env.workload.spec.name)
        env.reset()
    assert seen == {"synthetic_azure_conv", "azure_conv"}
    plain, same = make_env(**kw), make_env(workload_loads={}, **kw)  # no overrides: the same episodes
    plain.reset(seed=3), same.reset(seed=3)
    assert (plain.workload.spec.name, plain.load) == (same.workload.spec.name, same.load)


@pytest.mark.parametrize(
    ("loads", "message"),
    [
        ({"sharegpt_poisson": (1.0, 2.0)}, "workload_loads names ['sharegpt_poisson'], which are not among"),
        (
            {"synthetic_azure_conv": (2.0, 1.0)},
            "workload_loads[synthetic_azure_conv] must be positive and ordered",
        ),
        ({"synthetic_azure_conv": 0.0}, "workload_loads[synthetic_azure_conv] must be positive and ordered"),
    ],
)
def test_bad_workload_loads_are_named(loads, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_env(workload_loads=loads)
