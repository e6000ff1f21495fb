"""Every env version under the libraries' own conventions: Gymnasium's wrappers and vector envs,
SB3's Monitor and PPO, sb3-contrib's MaskablePPO, a CleanRL-style loop; masks, renders, imports."""

import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from sb3_contrib import MaskablePPO
from sb3_contrib.common.maskable.utils import get_action_masks
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv

import envs
from envs.render import DECODE_RGB, PREFILL_RGB, TIMELINE_HEIGHT, TIMELINE_ITERATIONS, timeline_image
from envs.serving.simulator import IterationLog

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:.*ChunkedPrefill-v[012] is out of date"),
]
ROOT = Path(__file__).resolve().parent.parent
IDS = [envs.ENV_ID_V0, envs.ENV_ID_V1, envs.ENV_ID_V2, envs.ENV_ID_V3, envs.ENV_ID_V4]
# max_steps truncates v0's long episodes, so every test sees episodes end
KW = dict(
    workloads=["synthetic_azure_conv"], cost_model="roofline", window_s=2.0, load_scale=2.0, max_steps=24
)
PPO_KW = dict(n_steps=32, batch_size=32, n_epochs=1, seed=0, device="cpu", policy_kwargs={"net_arch": [8]})


def _masked_sample(rng: np.random.Generator, mask: np.ndarray, nvec: np.ndarray) -> np.ndarray:
    parts = np.split(mask, np.cumsum(nvec)[:-1])
    return np.array([rng.choice(np.flatnonzero(p)) for p in parts])


@pytest.mark.parametrize("env_id", IDS)
def test_record_episode_statistics_owns_info_episode_and_ours_is_serving(env_id):
    env = gym.wrappers.RecordEpisodeStatistics(gym.make(env_id, **KW))
    rng = np.random.default_rng(0)
    _, info = env.reset(seed=0)
    total, steps, trunc = 0.0, 0, False
    while not trunc:
        _, reward, term, trunc, info = env.step(
            _masked_sample(rng, info["action_mask"], env.action_space.nvec)
        )
        assert not term
        total, steps = total + reward, steps + 1
    assert info["episode"]["r"] == pytest.approx(total) and info["episode"]["l"] == steps
    assert info["serving"]["requests"] == info["requests"] and "goodput_rps" in info["serving"]


@pytest.mark.parametrize("env_id", IDS)
def test_cleanrl_style_loop_over_make_vec(env_id):
    venv = gym.wrappers.vector.RecordEpisodeStatistics(
        gym.make_vec(env_id, num_envs=2, vectorization_mode="sync", **KW)
    )
    nvec = venv.single_action_space.nvec
    rng = np.random.default_rng(0)
    obs, infos = venv.reset(seed=0)
    returns, finished = np.zeros(2), 0
    for _ in range(120):
        assert infos["action_mask"].shape == (2, nvec.sum()) and infos["action_mask"].dtype == bool
        actions = np.stack([_masked_sample(rng, m, nvec) for m in infos["action_mask"]])
        obs, rewards, terms, truncs, infos = venv.step(actions)
        assert venv.single_observation_space.contains(obs[0]) and not terms.any()
        returns += rewards
        if "episode" in infos:
            for i in np.flatnonzero(infos["_episode"]):
                assert infos["episode"]["r"][i] == pytest.approx(returns[i])
                assert infos["_serving"][i] and infos["serving"]["requests"][i] == infos["requests"][i]
                finished += 1
        returns[truncs] = 0.0  # next-step autoreset: the reset step pays nothing
    assert finished >= 2


@pytest.mark.parametrize("env_id", IDS)
def test_monitor_and_ppo_with_and_without_monitor(env_id):
    env = Monitor(gym.make(env_id, **KW))
    _, info = env.reset(seed=0)
    trunc = False
    while not trunc:
        _, _, _, trunc, info = env.step(np.zeros(2, dtype=np.int64))
    assert set(info["episode"]) == {"r", "l", "t"} and info["serving"]["requests"] > 0
    model = PPO("MlpPolicy", DummyVecEnv([lambda: Monitor(gym.make(env_id, **KW))]), **PPO_KW).learn(64)
    assert model.ep_info_buffer and all("r" in ep for ep in model.ep_info_buffer)
    bare = PPO("MlpPolicy", DummyVecEnv([lambda: gym.make(env_id, **KW)]), **PPO_KW).learn(64)
    assert not bare.ep_info_buffer  # no Monitor, no episode records (and no KeyError 'r')


@pytest.mark.parametrize("env_id", IDS)
def test_maskable_ppo_with_make_vec_env(env_id):
    venv = make_vec_env(env_id, n_envs=2, seed=0, env_kwargs=KW)
    model = MaskablePPO("MlpPolicy", venv, **PPO_KW).learn(64)
    assert model.ep_info_buffer
    masks = get_action_masks(venv)
    assert masks.shape == (2, venv.action_space.nvec.sum())
    obs = venv.reset()
    masks = get_action_masks(venv)
    actions, _ = model.predict(obs, action_masks=masks)
    n = venv.action_space.nvec[0]
    for mask, (level, rule) in zip(masks, actions, strict=True):
        assert mask[level] and mask[n + rule]


@pytest.mark.parametrize("env_id", IDS)
def test_action_mask_through_make_and_in_every_info(env_id):
    env = gym.make(env_id, **KW)
    spec = env.unwrapped.actions
    _, info = env.reset(seed=1)
    for _ in range(30):
        mask = info["action_mask"]
        assert mask.dtype == bool and mask.shape == (sum(spec.nvec),)
        np.testing.assert_array_equal(mask, spec.mask(env.unwrapped.sim.view))
        assert env.action_masks() is mask and env.get_wrapper_attr("action_masks")() is mask
        _, _, _, trunc, info = env.step(np.array([8, 1]))
        if trunc:
            break
    assert gym.make(env.spec).action_masks is not None  # the spec, wrappers included, recreates the env


@pytest.mark.parametrize("env_id", IDS)
def test_render_modes(env_id):
    assert gym.make(env_id, render_mode=None, **KW).render_mode is None
    assert gym.spec(env_id).make(**KW).metadata["render_modes"] == ["ansi", "rgb_array"]
    text = gym.make(env_id, render_mode="ansi", **KW)
    image = gym.make(env_id, render_mode="rgb_array", **KW)
    for env in (text, image):
        env.reset(seed=2)
        for _ in range(20):
            if env.step(np.array([8, 0]))[3]:
                break
    line = text.render()
    assert (
        isinstance(line, str) and "\n" not in line and f"of {len(text.unwrapped.sim.core.requests)}" in line
    )
    frame = image.render()
    assert frame.shape == (TIMELINE_HEIGHT, TIMELINE_ITERATIONS, 3) and frame.dtype == np.uint8
    assert (frame != 255).any()


def test_timeline_stacks_decode_under_prefill_scaled_to_the_largest_batch():
    log = IterationLog()
    for decode, prefill in ((10, 30), (0, 40), (30, 0)):
        log.append(0.0, 0.01, decode, prefill, 1, 0)
    frame = timeline_image(log)
    columns = frame[:, -3:]  # newest on the right; 96 px = 40 tokens
    decode_px = (columns == DECODE_RGB).all(axis=2).sum(axis=0)
    prefill_px = (columns == PREFILL_RGB).all(axis=2).sum(axis=0)
    assert decode_px.tolist() == [24, 0, 72] and prefill_px.tolist() == [72, 96, 0]
    assert (columns[-decode_px[0] :, 0] == DECODE_RGB).all()  # decodes at the bottom
    assert (frame[:, :-3] == 255).all()


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_chunkgym_registers_the_envs():
    code = (
        "import gymnasium as gym; "
        "env = gym.make('chunkgym:chunkgym/ChunkedPrefill-v1', workloads=['synthetic_azure_conv'], cost_model='roofline'); "
        "print(type(env.unwrapped).__name__, env.unwrapped.version.number)"
    )
    done = _python(code, ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ChunkedPrefillEnv", "1"]


def test_a_folder_named_chunkgym_in_the_working_directory_fails_clearly(tmp_path):
    """Python started in the folder that holds a clone named ``chunkgym``: the clone shadows the package."""
    (tmp_path / "chunkgym").mkdir()
    packages = tmp_path / "site"
    packages.mkdir()
    (packages / "envs").symlink_to(ROOT / "envs")  # envs found elsewhere on the path, as the installed one is
    done = _python("import envs", tmp_path, PYTHONPATH=str(packages))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("ImportError: `import chunkgym` found the folder")
        and str(tmp_path / "chunkgym") in last
    )
    assert "Start Python in another folder" in last
