"""chunkgym/ChunkedPrefill-v6: v4 for many tenants and SLO classes (who waits in the observation, the
class-weighted reward)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import envs
from envs.chunked_prefill import VERSIONS, ChunkedPrefillEnv
from envs.features import CLASSES_V6, FEATURE_NAMES_V4, FEATURE_NAMES_V6
from envs.serving.slo_classes import load_slo_class

KW = {"cost_model": "roofline", "window_s": 30.0, "load_scale": 1.5, "reward_scale": 1.0}


def _episode(env: gym.Env, action, seed: int = 0):
    obs, info = env.reset(seed=seed)
    observations, rewards, infos = [obs], [], [info]
    done = False
    while not done:
        obs, reward, terminated, truncated, info = env.step(action)
        observations.append(obs)
        rewards.append(reward)
        infos.append(info)
        done = terminated or truncated
    return np.array(observations), np.array(rewards), infos


def test_registered_with_its_spaces_and_passes_both_checkers():
    env = gym.make(envs.ENV_ID_V6, workloads=["mix_flood"], **KW)
    assert env.observation_space.shape == (len(FEATURE_NAMES_V6),) == (41,)
    assert FEATURE_NAMES_V6[: len(FEATURE_NAMES_V4)] == FEATURE_NAMES_V4
    assert tuple(env.action_space.nvec) == tuple(VERSIONS[4].actions.nvec)
    assert VERSIONS[6].workloads == ("mix_chat_batch", "mix_agent")  # mix_flood held out
    check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(env.unwrapped, warn=True)


def test_the_return_is_the_class_weighted_verdicts():
    """Each request nets +w or -w, its class's weight: the return is 2 x weighted good - sum of w."""
    env = ChunkedPrefillEnv(version=6, workloads=["mix_flood"], **KW)
    _, rewards, infos = _episode(env, (3, 0))
    sim = env.sim
    assert sim is not None
    out = sim.result().outcomes
    weights = np.array([load_slo_class(r.slo_class).weight for r in sim.core.requests])
    assert len(set(weights.tolist())) > 1  # interactive and standard tenants: the weights differ
    expected = float(np.where(out.good, weights, -weights).sum())
    assert rewards.sum() == pytest.approx(expected, rel=1e-12)
    assert infos[-1]["good"] == int(out.good.sum())


def test_the_class_features_say_who_waits():
    env = ChunkedPrefillEnv(version=6, workloads=["mix_flood"], **KW)
    observations, _, _ = _episode(env, (0, 0))  # 64-token budget: prompts pile up
    extra = observations[:, len(FEATURE_NAMES_V4) :]
    k = len(CLASSES_V6)
    shares, slacks, tenants, top = extra[:, :k], extra[:, k : 2 * k], extra[:, 2 * k], extra[:, 2 * k + 1]
    waiting = top > 0
    assert waiting.any()
    # mix_flood has interactive and standard tenants, no batch: shares of those two sum to 1.
    assert np.allclose(shares[waiting, 0] + shares[waiting, 1], 1.0, atol=1e-6)
    assert not shares[:, 2].any() and np.all(slacks[:, 2] == 1.0)
    assert (slacks[waiting, :2] < 1.0).any() and np.all(slacks >= -1.0)
    assert tenants[waiting].max() > tenants[waiting].min() >= np.float32(np.log1p(1) / np.log1p(64)) - 1e-7
    assert np.all(top[waiting] >= 1 / 5 - 1e-6)  # five tenants: the largest holds at least a fifth


def test_without_tenants_v6_steps_and_pays_as_v4():
    """On a trace without labels the weights are 1 and the run SLO judges all: v4's trajectory."""
    kw = {**KW, "workloads": ["azure_conv"], "input_seed": 5}
    v4_obs, v4_rewards, v4_infos = _episode(ChunkedPrefillEnv(version=4, **kw), (2, 1))
    v6_obs, v6_rewards, v6_infos = _episode(ChunkedPrefillEnv(version=6, **kw), (2, 1))
    assert np.array_equal(v4_obs, v6_obs[:, : len(FEATURE_NAMES_V4)])
    assert np.array_equal(v4_rewards, v6_rewards)
    assert [i["now"] for i in v4_infos] == [i["now"] for i in v6_infos]
    extra = v6_obs[:, len(FEATURE_NAMES_V4) :]
    assert not extra[:, :3].any()  # no request has a class
