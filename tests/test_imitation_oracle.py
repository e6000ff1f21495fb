"""The behaviour-cloning teacher (policies/imitation.py) and the hindsight oracle (policies/oracle.py)."""

from __future__ import annotations

import functools
import logging

import gymnasium as gym
import numpy as np
import pytest
import torch
from sb3_contrib import MaskablePPO
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

import envs
from baselines import Adaptive, Sarathi
from envs.actions import ACTIONS_V3, NUM_LEVELS
from envs.serving.capacity import CapacityQuery, measure_capacities
from envs.serving.early import Attain90Stop
from envs.serving.levels import BUDGET_LEVELS
from envs.serving.scheduling import Rule
from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.constant import ConstantAction, action_named
from policies.imitation import best_teacher, clone, collect, teacher_labels, teacher_policy, workload_best
from policies.oracle import best_for_period, oracle_run
from policies.registry import make_policy
from policies.training import make_env

ENV_KW = dict(workloads=["synthetic_azure_conv"], cost_model="roofline", window_s=20.0, load_scale=(1.0, 3.0))


def mask_row(top_level: int, rules_valid: bool) -> np.ndarray:
    """A v1 mask: budget levels 0..top_level valid; every rule or FCFS only."""
    levels = np.arange(NUM_LEVELS) <= top_level
    rules = np.array([True, rules_valid, rules_valid, rules_valid])
    return np.concatenate([levels, rules])


def test_teacher_labels_are_the_valid_action_with_the_same_plan():
    masks = np.stack([mask_row(8, True), mask_row(3, True), mask_row(8, False), mask_row(1, False)])
    labels = teacher_labels(masks, level=5, rule=2)
    # covering level 3 < 5: the budget clamps to it; a masked rule (one prompt waiting) becomes FCFS
    assert labels.tolist() == [[5, 2], [3, 2], [5, 0], [1, 0]]
    assert labels.dtype == np.int64


@pytest.fixture()
def venv():
    fns = [lambda: make_env(envs.ENV_ID_V1, ENV_KW) for _ in range(2)]
    v = VecNormalize(DummyVecEnv(fns), norm_reward=False)
    v.seed(3)
    return v


def test_best_teacher_is_the_candidate_with_the_highest_attainment(venv):
    venv.reset()
    env = venv.venv.envs[0].unwrapped
    candidates = [(lv, r) for lv in (2, 4, 6) for r in (0, 1)] + ["adaptive_srpf"]
    chosen = best_teacher(env, candidates)
    run = env.setup.simulator(env.sim.trace).run
    scores = {
        c: run(Sarathi(BUDGET_LEVELS[c[0]], env.actions.rule_names[c[1]], "skip")) for c in candidates[:-1]
    }
    scores["adaptive_srpf"] = run(Adaptive(rule="shortest_first"))
    attain = {c: r.metrics["slo_attainment"] for c, r in scores.items()}
    assert attain[chosen] == max(attain.values())
    assert chosen == next(c for c in candidates if attain[c] == max(attain.values())), "ties: the first"


def test_collect_follows_the_masks_and_clone_learns_the_teacher(venv, caplog):
    torch.manual_seed(0)
    caplog.set_level(logging.INFO, logger="policies.imitation")
    data = collect(venv, "constant", level=3, rule=1, steps=600, gamma=0.99)
    n = len(data["obs"])
    assert n >= 600 and data["masks"].shape == (n, NUM_LEVELS + 4) and data["returns"].shape == (n,)
    rows = np.arange(n)
    assert data["masks"][rows, data["actions"][:, 0]].all(), "every label's budget level is valid"
    assert data["masks"][rows, NUM_LEVELS + data["actions"][:, 1]].all(), "every label's rule is valid"
    np.testing.assert_array_equal(data["actions"], teacher_labels(data["masks"], 3, 1))

    model = MaskablePPO("MlpPolicy", venv, n_steps=64, batch_size=64, seed=0, device="cpu")
    before = clone(model, data, epochs=0, batch_size=128, masked=True)["agreement"]
    after = clone(model, data, epochs=40, batch_size=64, masked=True)
    assert after["samples"] == n
    assert after["agreement"] >= 0.95 > before, (before, after)
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("behaviour cloning (constant): teacher rollout: 0/")  # progress from the start
    assert any(m.startswith(f"behaviour cloning: fit: 40/40 epochs on {n} samples") for m in said)


def test_a_heuristic_teacher_is_labelled_with_the_action_that_gives_its_plan(venv):
    """window_best with a heuristic as the only candidate: every label reproduces its plan."""
    data = collect(venv, "window_best", NUM_LEVELS, 0, 300, 0.99, policies=["adaptive_srpf"])
    rows = np.arange(len(data["actions"]))
    assert data["masks"][rows, data["actions"][:, 0]].all()
    assert len({tuple(a) for a in data["actions"]}) > 1, "the heuristic's budget varies with the state"
    env = gym.make(envs.ENV_ID_V1, **ENV_KW).unwrapped
    env.reset(seed=4)
    teacher = Adaptive(rule="shortest_first")
    teacher.reset(env.sim.view)
    for _ in range(100):
        view = env.sim.view
        want = teacher.plan(view)
        level, rule = env.actions.action_for(view, want)
        got = env.actions.plan(view, level, rule)
        assert (got.decode, [(r.rid, k) for r, k in got.chunks]) == (
            want.decode,
            [(r.rid, k) for r, k in want.chunks],
        )
        if env.step(np.array([level, rule]))[3]:
            break


@pytest.mark.parametrize("env_id", [envs.ENV_ID_V1, envs.ENV_ID_V2])
def test_teachers_plan_with_the_admission_of_the_envs_version(env_id):
    """Under KV pressure FCFS heuristics skip-ahead and stop admission plan differently: a teacher
    acting in v2 (stop) admits as v2 does, so every plan it makes is one of v2's actions."""
    env = gym.make(env_id, serving={"num_blocks": 600}, **ENV_KW).unwrapped
    env.reset(seed=4)
    teacher = teacher_policy(env, "adaptive")
    assert teacher.admission is env.actions.admission is teacher_policy(env, (3, 0)).admission
    teacher.reset(env.sim.view)
    steps = 0
    while not env.step(np.array(env.actions.action_for(env.sim.view, teacher.plan(env.sim.view))))[3]:
        steps += 1
    assert steps > 100
    if env_id == envs.ENV_ID_V2:  # the skip-ahead heuristic as shipped is not a v2 policy
        env.reset(seed=4)
        skip = make_policy("adaptive")
        skip.reset(env.sim.view)
        with pytest.raises(ValueError, match="no action"):
            while not env.step(np.array(env.actions.action_for(env.sim.view, skip.plan(env.sim.view))))[3]:
                pass


SRPF, BIG = "adaptive_srpf", "target_2_slack__shortest_first+skip"


def _v4_venv(slos=("strict", "relaxed")):
    fns = [functools.partial(make_env, envs.ENV_ID_V4, {**ENV_KW, "slo": slo}) for slo in slos]
    v = VecNormalize(DummyVecEnv(fns), norm_reward=False)
    v.seed(5)
    return v


def test_workload_best_labels_each_workload_and_slo_with_its_highest_capacity_candidate():
    venv = _v4_venv()
    table = workload_best(venv, NUM_LEVELS, [SRPF, BIG], seeds=[0], margin=0.0)
    assert set(table) == {("synthetic_azure_conv", "strict"), ("synthetic_azure_conv", "relaxed")}
    env = venv.venv.envs[0].unwrapped
    for row in table.values():
        assert set(row["capacity"]) == {"target_1__shortest_first+skip", BIG}  # adaptive_srpf as an action
        assert row["capacity"][row["name"]] == max(row["capacity"].values())
        assert row["action"] == action_named(env.actions, row["name"])
    strict = next(e.unwrapped for e in venv.venv.envs if e.unwrapped.setup.slo.name == "strict")
    query = CapacityQuery(
        strict.setup,
        strict.workloads[0],
        functools.partial(ConstantAction, strict.actions, action_named(strict.actions, BIG)),
        "attain90",
        "train",
        0,
        window_s=strict.window_s,
    )
    [direct] = measure_capacities([query])
    assert table["synthetic_azure_conv", "strict"]["capacity"][BIG] == direct.scale
    kept = workload_best(venv, NUM_LEVELS, [SRPF, BIG], seeds=[0], margin=0.99)  # nothing beats it by 99%
    assert {row["name"] for row in kept.values()} == {"target_1__shortest_first+skip"}


def test_workload_best_labels_are_the_one_candidate_window_best_would_give():
    """With the label fixed per workload, a rollout is labelled as window_best with that one candidate."""
    labels = {("synthetic_azure_conv", slo): action_named(ACTIONS_V3, BIG) for slo in ("strict",)}
    by_workload = collect(_v4_venv(["strict"]), "workload_best", NUM_LEVELS, 0, 300, 0.99, labels=labels)
    by_window = collect(_v4_venv(["strict"]), "window_best", NUM_LEVELS, 0, 300, 0.99, policies=[BIG])
    for key in ("obs", "masks", "actions", "returns"):
        np.testing.assert_array_equal(by_workload[key], by_window[key])
    assert len({tuple(a) for a in by_workload["actions"]}) > 1, "the target's budget follows the state"
    with pytest.raises(ValueError, match="needs its labels"):
        collect(_v4_venv(["strict"]), "workload_best", NUM_LEVELS, 0, 10, 0.99)


def test_collect_rejects_an_unknown_teacher(venv):
    with pytest.raises(ValueError, match="teacher 'oracle'"):
        collect(venv, "oracle", 3, 1, 10, 0.99)
    with pytest.raises(ValueError, match="candidates of window_best"):
        collect(venv, "constant", 3, 1, 10, 0.99, policies=["adaptive_srpf"])


@pytest.fixture(scope="module")
def small_window():
    setup = ServingSetup.from_names(cost_model="roofline")
    return setup, load_workload("synthetic_azure_conv").window("val", 0, 3.0, 30.0)


def test_an_oracle_with_one_candidate_is_that_constant_policy(small_window):
    setup, trace = small_window
    base = (512, Rule.FCFS)
    got, choices = oracle_run(setup.simulator(trace), base, budgets=[512], rules=[Rule.FCFS])
    want = setup.simulator(trace).run(Sarathi(512))
    assert {c[1:] for c in choices} == {(512, int(Rule.FCFS))}
    for key in ("requests", "finished", "goodput_rps", "slo_attainment", "tbt_p99_s", "iterations"):
        assert got.metrics[key] == want.metrics[key], key


def test_an_oracle_stopped_once_attain90_is_proven_gives_the_full_runs_answer(small_window):
    setup, trace = small_window
    args = ((512, Rule.FCFS), (256, 2048), (Rule.FCFS,), 2.0, 6.0)
    full, full_choices = oracle_run(setup.simulator(trace), *args)
    sim = setup.simulator(trace)
    proof = Attain90Stop.for_requests(len(trace))
    early, early_choices = oracle_run(sim, *args, stop=proof.watching(sim.core))
    assert early.stopped and not full.stopped
    assert len(early_choices) < len(full_choices) and early_choices == full_choices[: len(early_choices)]
    assert proof.passed(sim.core) == (full.metrics["slo_attainment"] >= 0.9)


def test_oracle_choices_are_candidates_in_time_order_and_serve_every_request(small_window):
    setup, trace = small_window
    budgets, rules = (256, 2048), (Rule.FCFS, Rule.SHORTEST_FIRST)
    result, choices = oracle_run(setup.simulator(trace), (512, Rule.FCFS), budgets, rules, horizon_s=10.0)
    times = [t for t, _, _ in choices]
    assert times == sorted(times) and len(choices) > 1
    allowed = {(512, int(Rule.FCFS))} | {(b, int(r)) for b in budgets for r in rules}
    assert {c[1:] for c in choices} <= allowed
    assert result.metrics["finished"] + result.metrics["rejected"] == len(trace)


def test_oracle_refuses_a_budget_that_is_not_an_action_level(small_window):
    setup, trace = small_window
    with pytest.raises(ValueError, match="budget 500"):
        oracle_run(setup.simulator(trace), (512, Rule.FCFS), budgets=[500])


def test_best_for_period_picks_the_best_rollout_and_leaves_the_state_alone(small_window):
    """Each candidate's score is a period of it then the first candidate to the horizon, on a fork."""
    setup, trace = small_window
    sim = setup.simulator(trace)
    sim.run_until(Sarathi(512), until_s=5.0)
    now, served = sim.core.now, sim.core.n_good + sim.core.n_bad
    candidates = [functools.partial(Sarathi, b) for b in (512, 128, 4096)]
    chosen = best_for_period(sim, candidates, 2.0, 8.0)
    assert (sim.core.now, sim.core.n_good + sim.core.n_bad) == (now, served), "sim itself is not advanced"
    scores = []
    for make in candidates:
        twin = sim.fork(keep_log=False)
        if twin.run_until(make(), until_s=now + 2.0):
            twin.run_until(candidates[0](), until_s=now + 8.0)
        scores.append(twin.core.n_good - twin.core.n_bad)
    assert scores[chosen] == max(scores) and chosen == scores.index(max(scores)), (chosen, scores)
    assert len(set(scores)) > 1, "the window must make the candidates differ for the test to bite"
