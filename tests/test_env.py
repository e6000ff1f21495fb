"""The Gymnasium env (v0 here, v1 in test_env_v1.py): one class for every version, API checks,
masks, determinism, reward aligned with goodput, and both versions' trajectories pinned to
those of the two classes the one class replaced."""

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import envs
from envs.actions import NUM_LEVELS
from envs.chunked_prefill import DEFAULT_VERSION, VERSIONS, ChunkedPrefillEnv, version_of
from envs.serving.levels import BUDGET_LEVELS
from envs.serving.metrics import VLLM_COLUMNS
from envs.serving.scheduling import plan_budget
from policies.config import EnvConfig
from policies.registry import make_policy

KW = dict(workload="synthetic_azure_conv", cost_model="roofline", window_s=20.0)
TRAJECTORIES = Path(__file__).parent / "fixtures" / "env_trajectories.npz"
"""Recorded at a1ae3c7 with the classes ChunkedPrefillEnv (v0) and ChunkedPrefillEnvV1 by the rollout
of :func:`_pinned_rollout` (info["episode"] read as info["serving"]; info["action_mask"] did not exist)."""
PINNED = {
    "v0": (envs.ENV_ID_V0, dict(workload="synthetic_azure_conv", window_s=2.0, load_scale=(1.0, 3.0))),
    "v1": (envs.ENV_ID_V1, dict(workloads=["synthetic_azure_conv"] * 2, window_s=4.0, load_scale=(1.0, 3.0))),
    "v1_common": (
        envs.ENV_ID_V1,
        dict(workloads=["synthetic_azure_conv"], window_scale=0.05, load_scale=(1.5, 2.5), input_seed=5),
    ),
}


KV_PRESSURE = {"num_blocks": 1500}  # prompts wait on KV, so the admission rules give different runs


def make_env(**kw) -> ChunkedPrefillEnv:
    return ChunkedPrefillEnv(**{"version": 0, **KW, **kw})


def test_registered_and_passes_both_checkers():
    env = gym.make(envs.ENV_ID_V0, **KW)
    assert isinstance(env.action_space, gym.spaces.MultiDiscrete)
    assert env.action_space.nvec.tolist() == [9, 3]
    assert env.unwrapped.version.number == 0
    check_env(env.unwrapped)
    sb3_check_env(env.unwrapped, warn=True)


def test_one_class_for_every_version_and_v4_is_the_default():
    ids = (envs.ENV_ID_V0, envs.ENV_ID_V1, envs.ENV_ID_V2, envs.ENV_ID_V3, envs.ENV_ID_V4, envs.ENV_ID_V6)
    specs = [gym.spec(env_id) for env_id in ids]
    assert {s.entry_point for s in specs} == {"envs.chunked_prefill:ChunkedPrefillEnv"}
    assert [s.kwargs["version"] for s in specs] == [0, 1, 2, 3, 4, 6]
    assert envs.ENV_ID == envs.ENV_ID_V4 and gym.spec(envs.ENV_ID).kwargs["version"] == DEFAULT_VERSION
    assert EnvConfig().id == envs.ENV_ID  # what train.py trains on
    assert (
        ChunkedPrefillEnv(cost_model="roofline", workload="synthetic_azure_conv").version.number
        == DEFAULT_VERSION
    )
    assert [version_of(i) for i in ids] == [VERSIONS[v] for v in (0, 1, 2, 3, 4, 6)]
    with pytest.raises(
        ValueError, match=r"'chunkgym/ChunkedPrefill-v9' is not registered; chunkgym envs: \["
    ):
        version_of("chunkgym/ChunkedPrefill-v9")


def _jsonable(info: dict) -> dict:
    return {
        k: _jsonable(v) if isinstance(v, dict) else v.item() if isinstance(v, np.generic) else v
        for k, v in info.items()
    }


def _pinned_rollout(env: gym.Env, seed: int, episodes: int = 2) -> dict:
    """Episodes of random valid actions; row 0 of each episode is its reset (reward NaN)."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"obs": [], "reward": [], "truncated": [], "info": []}
    n = env.action_space.nvec[0]
    for episode in range(episodes):
        obs, info = env.reset(seed=seed if episode == 0 else None)
        reward, trunc = np.nan, False
        while True:
            mask = info.pop("action_mask")
            assert mask is env.unwrapped.action_masks()  # the same array, not a copy
            for key, value in zip(rows, (obs, reward, trunc, _jsonable(info)), strict=True):
                rows[key].append(value)
            if trunc:
                break
            action = np.array([rng.choice(np.flatnonzero(mask[:n])), rng.choice(np.flatnonzero(mask[n:]))])
            obs, reward, term, trunc, info = env.step(action)
            assert not term
    return rows


@pytest.mark.parametrize("case", PINNED)
def test_trajectories_match_the_replaced_classes_bit_for_bit(case):
    env_id, kw = PINNED[case]
    got = _pinned_rollout(gym.make(env_id, cost_model="roofline", **kw), seed=11)
    with np.load(TRAJECTORIES) as recorded:
        want = {key: recorded[f"{case}/{key}"] for key in ("obs", "reward", "truncated")}
        want_info = json.loads(str(recorded[f"{case}/info"]))
    assert len(got["obs"]) == len(want["obs"]), case
    for key, expected in want.items():
        np.testing.assert_array_equal(np.array(got[key]), expected, err_msg=f"{case}: {key}")
    for row, (g, w) in enumerate(zip(got["info"], want_info, strict=True)):
        if "serving" in g:  # metrics added since the recording (vLLM's names) are new keys, nothing else
            assert set(g["serving"]) - set(w["serving"]) == set(VLLM_COLUMNS), f"{case}: row {row}"
            g = {**g, "serving": {k: g["serving"][k] for k in w["serving"]}}
        assert json.dumps(g, sort_keys=True) == json.dumps(w, sort_keys=True), f"{case}: info of row {row}"
    assert sum("serving" in info for info in got["info"]) == 2


def _random_rollout(env, seed, steps=400):
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    trace = [obs]
    rewards = []
    for _ in range(steps):
        m = env.action_masks()
        a = (rng.choice(np.flatnonzero(m[:NUM_LEVELS])), rng.choice(np.flatnonzero(m[NUM_LEVELS:])))
        obs, r, term, trunc, _ = env.step(np.array(a))
        trace.append(obs)
        rewards.append(r)
        if trunc:
            break
    return np.array(trace), np.array(rewards)


def test_same_seed_same_trajectory_bit_for_bit():
    a_obs, a_rew = _random_rollout(make_env(), seed=7)
    b_obs, b_rew = _random_rollout(make_env(), seed=7)
    np.testing.assert_array_equal(a_obs, b_obs)
    np.testing.assert_array_equal(a_rew, b_rew)
    c_obs, _ = _random_rollout(make_env(), seed=8)
    assert not np.array_equal(a_obs[: len(c_obs)], c_obs[: len(a_obs)])


@pytest.mark.parametrize("version", [0, 2])
def test_masked_actions_map_to_valid_ones_with_the_same_plan(version):
    env = make_env(version=version, load_scale=3.0, serving=KV_PRESSURE)
    spec = env.actions
    env.reset(seed=1)
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):
        view = env.sim.view
        mask = spec.mask(view)
        for level in range(NUM_LEVELS):
            for rule in range(len(spec.rules)):
                canon = spec.canonical(view, level, rule)
                assert mask[canon[0]] and mask[NUM_LEVELS + canon[1]]
                p = plan_budget(view, BUDGET_LEVELS[level], spec.rules[rule], admission=spec.admission)
                q = spec.plan(view, *canon)
                assert p.decode == q.decode
                assert [(r.rid, n) for r, n in p.chunks] == [(r.rid, n) for r, n in q.chunks]
                checked += 1
        m = env.action_masks()
        _, _, _, trunc, _ = env.step(np.array([rng.choice(np.flatnonzero(m[:9])), 0]))
        if trunc:
            break
    assert checked > 1000


def test_episode_return_equals_good_minus_bad_and_tracks_goodput():
    env = make_env(load_scale=2.0)
    env.reset(seed=3)
    total, info, trunc = 0.0, {}, False
    while not trunc:
        _, r, term, trunc, info = env.step(np.array([3, 0]))  # constant action: Sarathi at 512
        assert not term
        total += r
    ep = info["serving"]
    n = info["requests"]
    assert info["good"] + info["bad"] == n
    assert total == info["good"] - info["bad"]
    assert ep["goodput_rps"] == pytest.approx(info["good"] / env.sim.trace.span_s)
    assert total == pytest.approx(2 * ep["goodput_rps"] * env.sim.trace.span_s - n)


SKIP, STOP = "sarathi_512_skip", "sarathi_512"


@pytest.mark.parametrize("version, preset, other", [(0, SKIP, STOP), (1, SKIP, STOP), (2, STOP, SKIP)])
def test_constant_action_is_sarathi(version, preset, other):
    """(level, 0) is Sarathi at that budget, with the version's admission: v0 and v1 skip ahead,
    v2 stops at the first prompt that does not fit (Sarathi-Serve's ``sarathi_512``)."""
    env = make_env(version=version, load_scale=2.0, serving=KV_PRESSURE)
    env.reset(seed=4)
    trace = env.sim.trace
    level = BUDGET_LEVELS.index(512)
    while not env.step(np.array([level, 0]))[3]:
        pass
    env_times = env.sim.core.token_times
    ref, unlike = (env.setup.simulator(trace).run(make_policy(name)).token_times for name in (preset, other))
    # the env stops once every request is decided; compare the ones it finished
    for rid, times in env_times.items():
        np.testing.assert_array_equal(times, ref[rid])
    assert len(env_times) > 0.5 * len(trace)
    assert any(not np.array_equal(times, unlike[rid]) for rid, times in env_times.items()), (
        "rules differ here"
    )


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="azure_conv"):
        ChunkedPrefillEnv(workload="no_such_workload", cost_model="roofline")
    with pytest.raises(ValueError, match="version must be one of"):
        make_env(version=7)
    with pytest.raises(ValueError, match="workloads or workload"):
        make_env(workloads=["synthetic_azure_conv"])
    with pytest.raises(ValueError, match="render_mode must be one of"):
        make_env(render_mode="human")
    with pytest.raises(ValueError, match="load_scale"):
        make_env(load_scale=(2.0, 1.0))
