"""ChunkedPrefill-v3: latency-target modes x (rule, admission) allocations, where every Sarathi and
adaptive heuristic is one constant action; its masks, features, exports, teachers and DAgger."""

from __future__ import annotations

import itertools
import json

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from sb3_contrib import MaskablePPO
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from chunkgym.registration import ENV_ID_V2, ENV_ID_V3, ENV_ID_V4
from envs.actions import ACTIONS_V3, NUM_LEVELS
from envs.chunked_prefill import VERSIONS, version_of
from envs.features import FEATURE_NAMES_V1, FEATURE_NAMES_V3, features_v3
from envs.serving.levels import BUDGET_LEVELS, adaptive_level
from envs.serving.scheduling import plan_budget
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies import imitation
from policies.constant import ConstantAction, action_named, constant_action, is_action_name
from policies.export import write_export
from policies.exported import ExportError, PolicyNet, load_policy
from policies.imitation import agreement, best_teacher, clone, collect, merge
from policies.registry import make_policy
from policies.training import make_env
from tests.test_vllm_view import _state as vllm_state

KV_PRESSURE = {"num_blocks": 1500}  # prompts wait on KV, so stop and skip admission differ
ENV_KW = dict(workloads=["synthetic_azure_conv"], cost_model="roofline", window_s=20.0, load_scale=(2.0, 4.0))
MIXING = [f"sarathi_{b}" for b in (128, 256, 512, 1024, 2048, 4096, 8192)]
MIXING += ["sarathi_512_skip", "vllm_v1_8192", "adaptive", "adaptive_srpf"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _key(plan) -> tuple:
    return plan.decode, tuple((r.rid, n) for r, n in plan.chunks)


def test_v3_is_registered_beside_v0_to_v2_which_are_unchanged():
    assert gym.spec(ENV_ID_V3).kwargs["version"] == 3 and version_of(ENV_ID_V3) is VERSIONS[3]
    assert (
        version_of(ENV_ID_V2).actions.nvec == (9, 4)
        and version_of(ENV_ID_V2).feature_names == FEATURE_NAMES_V1
    )
    env = gym.make(ENV_ID_V3, **ENV_KW)
    assert env.action_space.nvec.tolist() == [17, 8] and env.observation_space.shape == (30,)
    assert FEATURE_NAMES_V3[:26] == FEATURE_NAMES_V1
    check_env(env.unwrapped)


@pytest.fixture(scope="module")
def window():
    setup = ServingSetup.from_names(cost_model="roofline", serving=KV_PRESSURE)
    return setup, load_workload("synthetic_azure_conv").window("val", 0, 3.0, 30.0)


@pytest.mark.parametrize("name", MIXING)
def test_every_mixing_heuristic_is_a_constant_action_with_the_same_run(name, window):
    setup, trace = window
    want = setup.simulator(trace).run(make_policy(name))
    action = constant_action(ACTIONS_V3, make_policy(name))
    got = setup.simulator(trace).run(ConstantAction(ACTIONS_V3, action))
    for key in (
        "requests",
        "finished",
        "rejected",
        "iterations",
        "goodput_rps",
        "slo_attainment",
        "tbt_p99_s",
    ):
        assert got.metrics[key] == want.metrics[key], key
    assert want.metrics["iterations"] > 100


def test_the_heuristics_actions_are_the_documented_ones():
    assert constant_action(ACTIONS_V3, make_policy("sarathi_2048")) == (5, 0)
    assert constant_action(ACTIONS_V3, make_policy("adaptive")) == (11, 4)
    assert constant_action(ACTIONS_V3, make_policy("adaptive_srpf")) == (11, 5)
    for name in ("fcfs", "sglang_8192", "fixed_chunk_512"):  # decodes wait: no v3 action
        with pytest.raises(ValueError, match="no constant action"):
            constant_action(ACTIONS_V3, make_policy(name))


def test_the_env_stepped_with_adaptive_srpfs_action_serves_as_adaptive_srpf():
    env = gym.make(ENV_ID_V3, serving=KV_PRESSURE, **ENV_KW).unwrapped
    env.reset(seed=2)
    trace = env.sim.trace
    while not env.step(np.array([11, 5]))[3]:
        pass
    want = env.setup.simulator(trace).run(make_policy("adaptive_srpf")).metrics
    got = env.sim.result().metrics  # the episode ends once every request is decided, the run at the end
    assert (got["slo_attainment"], got["goodput_rps"]) == (want["slo_attainment"], want["goodput_rps"])
    assert 0 < want["slo_attainment"] < 1


def _raw_plan(view, mode: int, allocation: int):
    """The plan of an action taken literally (no canonical form): what the mask must not lose."""
    rule, admission = ACTIONS_V3.rules[allocation % 4], ACTIONS_V3.admissions[allocation // 4]
    if mode < NUM_LEVELS:
        return plan_budget(view, BUDGET_LEVELS[mode], rule, admission=admission)
    seconds = ACTIONS_V3.targets[mode - NUM_LEVELS].seconds(view)
    return adaptive_level(view, BUDGET_LEVELS, rule, seconds, admission)[1]


def test_masks_drop_only_actions_whose_plan_a_valid_action_gives():
    env = gym.make(ENV_ID_V3, serving=KV_PRESSURE, **ENV_KW).unwrapped
    rng = np.random.default_rng(0)
    env.reset(seed=5)
    seen = {"levels masked": 0, "admission masked": 0, "admission free": 0}
    for step in range(400):
        view, mask = env.sim.view, env.action_masks()
        modes, allocations = mask[:17], mask[17:]
        if step % 10 == 0:
            for mode in range(17):
                for allocation in range(8):
                    canon = ACTIONS_V3.canonical(view, mode, allocation)
                    assert modes[canon[0]] and allocations[canon[1]]
                    assert _key(_raw_plan(view, mode, allocation)) == _key(_raw_plan(view, *canon))
        assert modes[NUM_LEVELS:].all() == bool(view.queue)  # targets valid whenever a prompt waits
        seen["levels masked"] += not modes[:NUM_LEVELS].all()
        seen["admission masked"] += allocations[:4].any() and not allocations[4:].any()
        seen["admission free"] += allocations[4:].any()
        action = (rng.choice(np.flatnonzero(modes)), rng.choice(np.flatnonzero(allocations)))
        if env.step(np.array(action))[3]:
            env.reset()
    assert all(seen.values()), seen


def test_slo_features_tell_the_slos_apart():
    observed = {}
    for slo in ("strict", "relaxed"):
        env = gym.make(ENV_ID_V3, slo=slo, **ENV_KW).unwrapped
        obs, _ = env.reset(seed=1)
        assert np.all(np.abs(obs) <= 1) and obs.dtype == np.float32
        np.testing.assert_array_equal(obs, features_v3(env.sim.view))
        observed[slo] = obs[26:29]
    assert observed["strict"][0] == pytest.approx(np.log(5) / np.log(64), rel=1e-5)
    assert observed["relaxed"][0] == pytest.approx(np.log(25) / np.log(64), rel=1e-5)
    assert np.all(observed["relaxed"] > observed["strict"])


@pytest.fixture()
def export_dir(tmp_path):
    torch.manual_seed(0)
    net = PolicyNet([30, 16, 16], ACTIONS_V3.nvec)
    write_export(net, ENV_ID_V3, tmp_path, {"algo": "test"})
    return tmp_path


def test_an_exported_v3_policy_names_its_actions_and_runs_by_name(export_dir, window):
    spec = json.loads((export_dir / "policy.json").read_text())
    assert (
        spec["nvec"] == [17, 8]
        and spec["modes"][9] == "target_0.25"
        and spec["modes"][15] == "target_1_slack"
    )
    assert spec["allocations"][5] == "shortest_first+skip"
    policy = make_policy(f"learned:{export_dir}")
    env = gym.make(ENV_ID_V3, **ENV_KW).unwrapped
    obs, _ = env.reset(seed=3)
    for _ in range(50):
        mask = env.action_masks()
        want = policy.act(obs[None], mask[None])[0]
        assert policy.act_one(obs, mask) == tuple(want)
        assert mask[want[0]] and mask[17 + want[1]]
        obs = env.step(want)[0]
    setup, trace = window
    result = setup.simulator(trace).run(make_policy(f"learned:{export_dir}"))
    assert result.metrics["finished"] + result.metrics["rejected"] == len(trace)
    plan = policy.plan(vllm_state())  # the vLLM plug-in's view, through the same Policy interface
    assert plan.decode


def test_an_export_whose_action_names_differ_from_v3s_is_refused(export_dir):
    path = export_dir / "policy.json"
    spec = json.loads(path.read_text())
    spec["modes"][9] = "target_0.3"
    path.write_text(json.dumps(spec))
    with pytest.raises(ExportError, match="field 'modes'"):
        load_policy(export_dir)


@pytest.fixture()
def venv():
    fns = [lambda: make_env(ENV_ID_V3, ENV_KW) for _ in range(2)]
    v = VecNormalize(DummyVecEnv(fns), norm_reward=False)
    v.seed(3)
    return v


def test_a_heuristic_teacher_labels_every_state_with_its_one_action_and_dagger_follows_the_student(venv):
    torch.manual_seed(0)
    data = collect(venv, "window_best", NUM_LEVELS, 0, 400, 0.99, policies=["adaptive_srpf"])
    assert set(data["actions"][:, 0]) == {11}  # the latency target, valid at every decision
    assert set(data["actions"][:, 1]) <= {0, 1, 5}  # srpf+skip, or its canonical form under the mask
    rows = np.arange(len(data["actions"]))
    assert data["masks"][rows, 17 + data["actions"][:, 1]].all()
    model = MaskablePPO("MlpPolicy", venv, n_steps=64, batch_size=64, seed=0, device="cpu")
    fit = clone(model, data, epochs=90, batch_size=64, masked=True)
    assert fit["agreement"] >= 0.95
    own = collect(venv, "window_best", NUM_LEVELS, 0, 200, 0.99, policies=["adaptive_srpf"], student=model)
    assert set(own["actions"][:, 0]) == {11}
    assert agreement(model, own, masked=True) >= 0.9
    assert len(merge(data, own)["obs"]) == len(data["obs"]) + len(own["obs"])


def test_v3_teachers_need_in_process_envs():
    from stable_baselines3.common.vec_env import SubprocVecEnv

    v = VecNormalize(SubprocVecEnv([lambda: make_env(ENV_ID_V3, ENV_KW)]), norm_reward=False)
    try:
        with pytest.raises(ValueError, match="algo.vec_env=dummy"):
            collect(v, "constant", 3, 1, 10, 0.99)
    finally:
        v.close()


def test_the_shipped_learned_is_a_v4_policy_by_name(window):
    policy = make_policy("learned")
    assert policy.spec["env_id"] == ENV_ID_V4 and policy.name == "learned"
    setup, trace = window
    assert setup.simulator(trace).run(policy).metrics["requests"] == len(trace)
    assert policy.plan(
        vllm_state()
    ).decode  # v4's traffic features come from the vLLM view's TrafficStats too


def test_window_best_keeps_the_incumbent_unless_another_wins_by_the_margin():
    env = gym.make(ENV_ID_V3, **{**ENV_KW, "load_scale": 3.0}).unwrapped
    env.reset(seed=2)
    candidates = [(11, 5), (12, 5), (6, 1), (7, 1)]  # adaptive_srpf first, the incumbent
    scores = [
        env.setup.simulator(env.sim.trace).run(ConstantAction(ACTIONS_V3, c)).metrics["slo_attainment"]
        for c in candidates
    ]
    best = candidates[int(np.argmax(scores))]
    gain = max(scores) - scores[0]
    assert gain > 0 and best != candidates[0], scores  # this window: another serves it better
    assert best_teacher(env, candidates) == best
    assert best_teacher(env, candidates, margin=gain / 2) == best
    assert best_teacher(env, candidates, margin=gain) == candidates[0]


def test_a_constant_action_is_named_by_its_policy_name_and_a_bad_name_lists_the_valid_ones():
    for action in [(0, 0), (11, 5), (16, 7), (6, 4)]:
        assert action_named(ACTIONS_V3, ConstantAction(ACTIONS_V3, action).name) == action
    assert is_action_name("target_1_slack__shortest_first+skip") and not is_action_name("adaptive_srpf")
    with pytest.raises(ValueError, match="modes budget_64, .*allocations fcfs\\+stop"):
        action_named(ACTIONS_V3, "target_3__fcfs+stop")


def test_window_best_takes_constant_actions_by_name_and_labels_with_them(venv):
    name = "target_2_slack__shortest_first+skip"
    data = collect(venv, "window_best", NUM_LEVELS, 0, 200, 0.99, policies=[name])
    assert set(data["actions"][:, 0]) == {16}  # the only candidate (no budget level is >= NUM_LEVELS)
    assert set(data["actions"][:, 1]) <= {0, 1, 5}  # srpf+skip, or its canonical form under the mask
    with pytest.raises(ValueError, match="need a v3 env"):
        v2 = VecNormalize(DummyVecEnv([lambda: make_env(ENV_ID_V2, ENV_KW)]), norm_reward=False)
        collect(v2, "window_best", NUM_LEVELS - 1, 0, 10, 0.99, policies=[name])


def test_period_best_chooses_again_each_period_and_labels_with_its_candidates(venv, monkeypatch):
    """period_best asks the oracle's rollout once per env and period (from the state reached), and
    every label is a candidate's mode (adaptive_srpf's target 11, target_2_slack 16)."""
    chosen: list[tuple[int, float, int]] = []
    real = imitation.best_for_period

    def spy(sim, candidates, period_s, horizon_s, margin):
        assert (period_s, horizon_s, margin) == (2.0, 6.0, 0.0) and len(candidates) == 2
        chosen.append((id(sim), sim.core.now, best := real(sim, candidates, period_s, horizon_s, margin)))
        return best

    monkeypatch.setattr(imitation, "best_for_period", spy)
    names = ["adaptive_srpf", "target_2_slack__shortest_first+skip"]
    data = collect(venv, "period_best", NUM_LEVELS, 0, 400, 0.99, policies=names, period_s=2.0, horizon_s=6.0)
    assert set(data["actions"][:, 0]) <= {11, 16}
    assert {c for _, _, c in chosen} == {0, 1}, "the window must make both candidates win somewhere"
    for sim_id in {s for s, _, _ in chosen}:
        times = [t for s, t, _ in chosen if s == sim_id]
        assert all(b - a >= 2.0 or b < a for a, b in itertools.pairwise(times)), times  # b < a: a new window
    with pytest.raises(ValueError, match="use a v3 or later env"):
        v2 = VecNormalize(DummyVecEnv([lambda: make_env(ENV_ID_V2, ENV_KW)]), norm_reward=False)
        collect(v2, "period_best", NUM_LEVELS, 0, 10, 0.99, policies=names)
    with pytest.raises(ValueError, match="period_s <= horizon_s"):
        collect(venv, "period_best", NUM_LEVELS, 0, 10, 0.99, policies=names, period_s=9.0, horizon_s=3.0)


def test_the_constant_teacher_refuses_the_no_budget_level_of_window_best(venv):
    with pytest.raises(ValueError, match="constant teacher needs a budget level 0..8, got 9"):
        collect(venv, "constant", NUM_LEVELS, 0, 10, 0.99)
