"""Exported policies: same actions as SB3, served by the simulator, loaded without SB3 or pickle."""

import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest
import torch
from sb3_contrib import MaskablePPO
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

import envs
from envs.actions import NUM_LEVELS
from envs.serving.setup import ServingSetup
from policies.checkpoint import NormStats
from policies.export import policy_net, write_export
from policies.exported import ExportedPolicy, load_policy, load_program
from policies.registry import make_policy, policy_names, shipped_names
from policies.training import make_env

COMMON = dict(cost_model="roofline", window_s=20.0, load_scale=(1.0, 2.0))
ENV_KW = {  # v1 takes a list of workloads
    envs.ENV_ID_V0: dict(workload="synthetic_azure_conv", **COMMON),
    envs.ENV_ID_V1: dict(workloads=["synthetic_azure_conv"], **COMMON),
}
CASES = [("maskable_ppo", envs.ENV_ID_V0), ("ppo", envs.ENV_ID_V0), ("maskable_ppo", envs.ENV_ID_V1)]
N_OBS = 1200


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _train(algo, env_id: str, steps: int = 1024):
    torch.manual_seed(0)
    venv = VecNormalize(DummyVecEnv([lambda: make_env(env_id, ENV_KW[env_id]) for _ in range(2)]))
    model = algo("MlpPolicy", venv, n_steps=128, batch_size=64, n_epochs=2, seed=0, device="cpu")
    model.learn(steps)
    return model, venv


def _observations(env_id: str, n: int = N_OBS) -> tuple[np.ndarray, np.ndarray]:
    """Observations and masks visited by a random valid policy (varied loads and states)."""
    env = gym.make(env_id, **{**ENV_KW[env_id], "load_scale": (0.5, 4.0)}).unwrapped
    rng = np.random.default_rng(1)
    obs, _ = env.reset(seed=11)
    out, masks = [], []
    while len(out) < n:
        mask = env.action_masks()
        out.append(obs)
        masks.append(mask)
        action = (
            rng.choice(np.flatnonzero(mask[:NUM_LEVELS])),
            rng.choice(np.flatnonzero(mask[NUM_LEVELS:])),
        )
        obs, _, _, truncated, _ = env.step(np.array(action))
        if truncated:
            obs, _ = env.reset()
    return np.array(out), np.array(masks)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1][-2:]}")
def trained(request, tmp_path_factory):
    algo, env_id = request.param
    masked = algo == "maskable_ppo"
    model, venv = _train(MaskablePPO if masked else PPO, env_id)
    directory = tmp_path_factory.mktemp(algo)
    write_export(policy_net(model.policy, NormStats.of(venv), masked), env_id, directory, {"algo": algo})
    return model, venv, masked, directory, env_id


def test_exported_actions_equal_sb3_deterministic_actions(trained):
    model, venv, masked, directory, env_id = trained
    obs, masks = _observations(env_id)
    kw = {"action_masks": masks} if masked else {}
    expected, _ = model.predict(venv.normalize_obs(obs), deterministic=True, **kw)
    assert len(obs) >= 1000
    assert len(np.unique(expected, axis=0)) > 1, "a constant policy would make this test vacuous"
    policy = load_policy(directory)
    np.testing.assert_array_equal(policy.act(obs, masks), expected)
    np.testing.assert_array_equal(
        np.array([policy.act_one(o, m) for o, m in zip(obs, masks, strict=True)]), expected
    )
    # the program rebuilt from the weights, and the policy.pt2 this test wrote itself (trusted here)
    for program in (load_program(directory).module(), torch.export.load(directory / "policy.pt2").module()):
        actions = program(torch.as_tensor(obs), torch.as_tensor(masks))
        assert actions.dtype == torch.int64 and tuple(actions.shape) == (len(obs), 2)
        np.testing.assert_array_equal(actions.numpy(), expected)
    if masked:  # every chosen action is valid
        rows = np.arange(len(obs))
        assert masks[rows, expected[:, 0]].all() and masks[rows, NUM_LEVELS + expected[:, 1]].all()


def test_simulator_with_export_matches_env_with_sb3(trained):
    """The same window: SB3 stepping the env, and the exported policy scheduling the simulator."""
    model, venv, masked, directory, env_id = trained
    env = gym.make(env_id, **ENV_KW[env_id]).unwrapped
    obs, _ = env.reset(seed=5)
    trace = env.sim.trace
    while True:
        kw = {"action_masks": env.action_masks()} if masked else {}
        action, _ = model.predict(venv.normalize_obs(obs), deterministic=True, **kw)
        obs, _, _, truncated, info = env.step(action)
        if truncated:
            break
    setup = ServingSetup.from_names(cost_model="roofline")
    result = setup.simulator(trace).run(make_policy(f"learned:{directory}"))
    assert result.metrics["requests"] == info["serving"]["requests"] > 0
    assert result.metrics["goodput_rps"] == info["serving"]["goodput_rps"]


def test_registry_loads_learned_directories(trained):
    policy = make_policy(f"learned:{trained[3]}")
    assert isinstance(policy, ExportedPolicy) and policy.name == f"learned:{trained[3]}"
    assert policy.spec["env_id"] == trained[4]


def test_loading_and_serving_need_neither_sb3_nor_pickle(trained):
    code = textwrap.dedent(
        f"""
        import pickle, sys
        for name in ("stable_baselines3", "sb3_contrib"):
            sys.modules[name] = None  # any import of them now fails
        def refuse(*a, **k):
            raise AssertionError("unpickling attempted")
        pickle.load = pickle.loads = refuse
        pickle.Unpickler = refuse
        from envs.serving.setup import ServingSetup
        from envs.serving.workload import load_workload
        from policies.registry import make_policy
        policy = make_policy("learned:{trained[3]}")
        trace = load_workload("synthetic_azure_conv").window("val", 0, 1.0, 20.0)
        result = ServingSetup.from_names(cost_model="roofline").simulator(trace).run(policy)
        assert result.metrics["requests"] == len(trace) > 0
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("name", ["learned", "learned_v2", "learned_cpu", "learned_vllm", "learned_tenants"])
def test_shipped_artifacts_load_by_name_and_schedule(name):
    """The artefacts in policies/artifacts are policies by name, checked against their manifests."""
    assert name in shipped_names() and name in policy_names()
    policy = make_policy(name)
    assert isinstance(policy, ExportedPolicy) and policy.name == name
    assert policy.spec["env_id"] in gym.registry
    trace = envs.serving.workload.load_workload("synthetic_azure_conv").window("val", 0, 1.0, 20.0)
    result = ServingSetup.from_names(cost_model="roofline").simulator(trace).run(policy)
    assert result.metrics["requests"] == len(trace) > 0
    assert result.metrics["finished"] + result.metrics["rejected"] == len(trace)
