"""Behaviour cloning warm start: imitate a teacher before PPO takes over.

PPO from scratch on ``ChunkedPrefill-v1`` settles on FCFS allocation with large budgets:
the allocation rule only changes the plan when the budget does not cover the queue, so
under the budgets it drifts to first, the rule's advantage is near zero and shortest-
remaining-first is never found (docs/training.md, behaviour-cloning warm start).  Starting from a
teacher fixes the exploration problem, and PPO then learns when to deviate from it.

The teachers:

* ``constant``: one fixed action ``(budget level, rule)`` everywhere (a fixed-budget
  Sarathi variant);
* ``window_best``: for each training episode, the candidate that serves that episode's
  window best, found in hindsight by simulating every candidate on it (a cheap oracle).
  Candidates are constant actions and, optionally, named heuristics (``adaptive_srpf``)
  whose per-iteration plans the action space expresses.  The network must then tell
  regimes apart from what it observes (bursty long prompts want a small budget and
  shortest-first, steady chat wants big budgets), which is what lets one policy beat
  every fixed budget across workloads.
* ``period_best`` (v3): the same candidates, chosen anew every ``period_s`` seconds of the
  episode from the state the rollout has reached, by the hindsight oracle's rollout
  (:func:`policies.oracle.best_for_period`: each candidate for one period, then the first
  one until ``horizon_s``), so labels follow the state within a window, where window_best's
  are one per window.  Costlier: every period simulates each candidate over the horizon.
* ``workload_best`` (v3 and later): one label per (workload, SLO) the envs train on, the candidate
  with the highest attain90 capacity on the workload's train split (:func:`workload_best`: mean over a
  few windows' capacity searches), the first unless another's is higher by more than ``margin`` of the
  first's.  Capacity is the leaderboard's measure, so the label is chosen by what the policy is judged
  on; and one label per workload is a function the network can learn from the traffic features of
  ``ChunkedPrefill-v4`` (recent prompt and output lengths), where window_best's labels, one per
  120-s window at a random load, flip between near-tied candidates from window to window.

For each state the label is the *valid* action with the teacher's plan (for a constant
action: budget clamped to the covering level, rule to FCFS where rules are masked, read
off the action mask; for a heuristic: :meth:`envs.actions.ActionSpec.action_for`), so the
labels follow the env's masks exactly.  The policy is fitted
by masked cross-entropy and the value head by discounted returns of the teacher's own
rollouts (so PPO's first advantages are not noise).

From ``ChunkedPrefill-v3`` on, every candidate is a constant action: a named heuristic is the
action :func:`policies.constant.constant_action` gives it, listed before the budget
levels, so on a tie the heuristic (``adaptive_srpf`` first in the shipped recipe) is the label,
and with a ``margin`` it stays the label unless another candidate serves the window clearly better.
Labels are then state-independent within a window, and ``student`` rollouts (DAgger: the
states the policy itself reaches, labelled with the window's teacher) cost no more than the
teacher's own.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from sb3_contrib import MaskablePPO
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from baselines import Adaptive, Sarathi
from chunkgym.parallel import default_jobs
from chunkgym.progress import Progress
from envs.actions import NUM_LEVELS, TargetActionSpec
from envs.serving.capacity import CapacityQuery, measure_capacities
from envs.serving.levels import BUDGET_LEVELS
from envs.serving.scheduling import Policy
from policies.config import TEACHERS
from policies.constant import Action, ConstantAction, action_named, constant_action, is_action_name
from policies.oracle import best_for_period
from policies.registry import check_policy_name, make_policy

log = logging.getLogger(__name__)


def teacher_labels(masks: np.ndarray, level: int, rule: int) -> np.ndarray:
    """The canonical form of the constant action ``(level, rule)`` under each row of ``masks``."""
    levels = masks[:, :NUM_LEVELS]
    top = NUM_LEVELS - 1 - np.argmax(levels[:, ::-1], axis=1)  # highest valid budget level
    rules_ok = masks[:, NUM_LEVELS + rule]
    return np.stack([np.minimum(level, top), np.where(rules_ok, rule, 0)], axis=1).astype(np.int64)


Teacher = tuple[int, int] | str
"""A constant action ``(budget level, rule)``, or the name of a policy (``policies.registry``)."""


def teacher_policy(env, teacher: Teacher) -> Policy:
    """A fresh policy acting as ``teacher`` in ``env``'s action space (its planners admit new
    prompts as the env's version does, so their plans are the env's actions)."""
    admission = env.actions.admission
    if isinstance(env.actions, TargetActionSpec):  # v3: every candidate is a constant action
        assert not isinstance(teacher, str), "collect() turns v3's named teachers into actions"
        return ConstantAction(env.actions, teacher)
    if isinstance(teacher, str):
        policy = make_policy(teacher)
        if isinstance(policy, Sarathi | Adaptive):
            policy.admission = admission
        return policy
    level, rule = teacher
    return Sarathi(BUDGET_LEVELS[level], env.actions.rule_names[rule], admission.value)


def best_teacher(env, candidates: list[Teacher], margin: float = 0.0) -> Teacher:
    """The candidate that serves ``env``'s current episode window best (SLO attainment), by simulation;
    the first listed (the incumbent) unless another beats it by more than ``margin``."""
    trace, setup = env.sim.trace, env.setup
    scores = [
        setup.simulator(trace).run(teacher_policy(env, c)).metrics["slo_attainment"] for c in candidates
    ]
    best = int(np.argmax(scores))  # ties: the first listed
    return candidates[best] if scores[best] > scores[0] + margin else candidates[0]


class _Acting:
    """One env's current teacher, giving the label for the env's current state (chosen until the
    env's clock reaches ``until``, for period_best)."""

    def __init__(self, env, teacher: Teacher, until: float = math.inf) -> None:
        self.env, self.teacher, self.until = env, teacher, until
        self.policy = None
        if isinstance(teacher, str):
            self.policy = teacher_policy(env, teacher)
            self.policy.reset(env.sim.view)

    def label(self, mask: np.ndarray) -> np.ndarray:
        if self.policy is None:
            if isinstance(self.env.actions, TargetActionSpec):  # modes beyond the levels: the env's own map
                return np.array(self.env.actions.canonical(self.env.sim.view, *self.teacher), dtype=np.int64)
            return teacher_labels(mask[None], *self.teacher)[0]
        view = self.env.sim.view
        return np.array(self.env.actions.action_for(view, self.policy.plan(view)), dtype=np.int64)


def _period_best(env, candidates: list[Teacher], period_s: float, horizon_s: float, margin: float) -> _Acting:
    """The v3 candidate the hindsight oracle's rollout picks from ``env``'s current state, for one period."""
    make = [functools.partial(ConstantAction, env.actions, cast(tuple[int, int], c)) for c in candidates]
    best = candidates[best_for_period(env.sim, make, period_s, horizon_s, margin)]
    return _Acting(env, best, until=env.sim.core.now + period_s)


def collect(
    venv: VecNormalize,
    teacher: str,
    level: int,
    rule: int,
    steps: int,
    gamma: float,
    policies: Sequence[str] = (),
    student: OnPolicyAlgorithm | None = None,
    margin: float = 0.0,
    period_s: float = 10.0,
    horizon_s: float = 30.0,
    labels: Mapping[tuple[str, str], Teacher] | None = None,
) -> dict[str, np.ndarray]:
    """Roll the teacher out for ``steps`` env steps; normalised observations, masks, labels, returns.

    ``teacher``: ``constant`` (the action ``(level, rule)``) or ``window_best`` (per episode,
    the best of the constant actions with budget levels ``>= level`` x all rules, and the
    named ``policies``; needs a DummyVecEnv).  With ``student``, the student's deterministic
    actions drive the envs and the teacher only labels the states (DAgger).  ``margin``: see
    :func:`best_teacher` (the first candidate is the first named policy in v3, else budget ``level``).
    ``period_best`` (v3 only): window_best's candidates, re-chosen every ``period_s`` seconds by
    :func:`policies.oracle.best_for_period` with ``horizon_s`` and ``margin`` (there: a fraction of the
    requests the first candidate's rollout decides).  ``workload_best``: ``labels`` (from
    :func:`workload_best`) give each episode's teacher by its workload and SLO.
    """
    if teacher not in TEACHERS:
        raise ValueError(f"unknown behaviour-cloning teacher {teacher!r}; valid: {', '.join(TEACHERS)}")
    # Names from a config file: registered policies or v3 actions, checked before any work.
    for name in policies:
        if not is_action_name(name):
            check_policy_name(name)
    if teacher == "constant" and not 0 <= level < NUM_LEVELS:
        raise ValueError(f"the constant teacher needs a budget level 0..{NUM_LEVELS - 1}, got {level}")
    if policies and teacher == "constant":
        raise ValueError(f"teacher policies {list(policies)} are candidates of window_best or period_best")
    dummy = isinstance(venv.venv, DummyVecEnv)
    if teacher != "constant" and not dummy:
        raise ValueError(f"the {teacher} teacher reads each env's window: use algo.vec_env=dummy")
    v3 = isinstance(venv.get_attr("actions")[0], TargetActionSpec)
    if teacher in ("period_best", "workload_best") and not v3:
        raise ValueError(f"the {teacher} teacher's candidates are v3 constant actions: use a v3 or later env")
    if teacher == "workload_best" and labels is None:
        raise ValueError("the workload_best teacher needs its labels: call workload_best() first")
    if teacher == "period_best" and not 0 < period_s <= horizon_s:
        raise ValueError(f"period_best needs 0 < period_s <= horizon_s, got {period_s} and {horizon_s}")
    if not v3 and any(is_action_name(name) for name in policies):
        raise ValueError(f"constant action names in teacher policies {list(policies)} need a v3 env")
    if (v3 or student is not None) and not dummy:
        raise ValueError("v3 teachers and DAgger read each env's state: use algo.vec_env=dummy")
    n = venv.num_envs
    obs: Any = venv.reset()  # VecEnvObs; a Box observation space makes it an array
    # The ChunkedPrefillEnvs, or placeholders where they live in subprocesses (constant teachers only).
    envs: list[Any] = (
        [e.unwrapped for e in venv.venv.envs] if isinstance(venv.venv, DummyVecEnv) else [None] * n
    )
    if teacher != "constant":
        candidates = _candidates(envs[0], level, policies)

    def choose(env) -> _Acting:
        """The teacher of ``env``'s state: at an episode's start, and (period_best) each period."""
        if teacher == "workload_best":
            assert labels is not None
            return _Acting(env, labels[env.workload.spec.name, env.setup.slo.name])
        if teacher == "window_best":
            return _Acting(env, best_teacher(env, candidates, margin))
        if teacher == "period_best":
            return _period_best(env, candidates, period_s, horizon_s, margin)
        return _Acting(env, (level, rule))

    acting = [choose(e) for e in envs]
    rows: dict[str, list[np.ndarray]] = {"obs": [], "masks": [], "actions": [], "rewards": [], "dones": []}
    rounds = -(-steps // n)
    progress = Progress(f"behaviour cloning ({teacher}): teacher rollout", rounds * n, say=log.info)
    for t in range(rounds):
        progress.update(t * n, "env steps")
        masks = np.stack(venv.env_method("action_masks"))
        if teacher == "period_best":  # a period ended: choose again from the state reached
            acting = [
                choose(e) if e.sim.core.now >= a.until else a for e, a in zip(envs, acting, strict=True)
            ]
        actions = np.stack([acting[i].label(masks[i]) for i in range(n)])
        rows["obs"].append(obs)
        rows["masks"].append(masks)
        rows["actions"].append(actions)
        obs, rewards, dones, _ = venv.step(actions if student is None else _act(student, obs, masks))
        rows["rewards"].append(rewards)
        rows["dones"].append(dones)
        if teacher != "constant":
            for i in np.flatnonzero(dones):  # a new episode (window) began: find its best teacher
                acting[i] = choose(envs[i])
    progress.finish(rounds * n, "env steps")
    data = {k: np.stack(v) for k, v in rows.items()}  # [T, n_envs, ...]
    returns = np.zeros_like(data["rewards"], dtype=np.float64)
    running = np.zeros(n)
    for t in range(len(returns) - 1, -1, -1):  # episode ends cut the sum (no bootstrap)
        running = data["rewards"][t] + gamma * running * (1.0 - data["dones"][t])
        returns[t] = running
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in data.items() if k not in ("rewards", "dones")}
    flat["returns"] = returns.reshape(-1)
    return flat


def _candidates(env, level: int, policies: Sequence[str]) -> list[Teacher]:
    """window_best's candidates in ``env``: the budget levels >= ``level`` x every rule and the named
    ``policies``; in v3 and later all constant actions, the named ones first (ties keep them)."""
    n_rules = len(env.actions.rules)
    candidates: list[Teacher] = [(lv, r) for lv in range(level, NUM_LEVELS) for r in range(n_rules)]
    if isinstance(env.actions, TargetActionSpec):
        named = [_named_action(env.actions, name) for name in policies]
        return list(dict.fromkeys([*named, *candidates]))
    return candidates + list(policies)


def workload_best(
    venv: VecNormalize, level: int, policies: Sequence[str], seeds: Sequence[int], margin: float
) -> dict[tuple[str, str], dict[str, Any]]:
    """The ``workload_best`` teacher's labels: for each (workload name, SLO name) the envs of ``venv``
    train on, the candidate (as :func:`collect`'s, v3 and later) with the highest mean attain90 capacity
    over the train split's windows ``seeds`` (the envs' window length); the first candidate unless
    another's is higher by more than ``margin`` x the first's.  Values: ``action`` (the label),
    ``name`` and every candidate's ``capacity``, for the run's record."""
    if not isinstance(venv.venv, DummyVecEnv):
        raise ValueError("the workload_best teacher reads each env's workloads: use algo.vec_env=dummy")
    envs: list[Any] = [e.unwrapped for e in venv.venv.envs]  # the ChunkedPrefillEnvs
    if not isinstance(envs[0].actions, TargetActionSpec):
        raise ValueError(
            "the workload_best teacher's candidates are v3 constant actions: use a v3 or later env"
        )
    candidates = cast(list[Action], _candidates(envs[0], level, policies))
    pairs = {(w.spec.name, e.setup.slo.name): (w, e) for e in envs for w in e.workloads}
    queries = [
        CapacityQuery(
            env.setup,
            w,
            functools.partial(ConstantAction, env.actions, c),
            "attain90",
            "train",
            seed,
            window_s=env.window_s,
        )
        for w, env in pairs.values()
        for c in candidates
        for seed in seeds
    ]
    log.info("workload_best: %d capacity searches (%d workload x SLO pairs)", len(queries), len(pairs))
    found = iter(measure_capacities(queries, early_stop=True, parallel=default_jobs()))
    labels: dict[tuple[str, str], dict[str, Any]] = {}
    for key, (_, env) in pairs.items():
        names = [ConstantAction(env.actions, c).name for c in candidates]
        capacity = [sum(next(found).scale for _ in seeds) / len(seeds) for _ in candidates]
        best = int(np.argmax(capacity))  # ties: the first listed
        pick = best if capacity[best] > capacity[0] * (1 + margin) else 0
        labels[key] = {
            "action": candidates[pick],
            "name": names[pick],
            "capacity": dict(zip(names, capacity, strict=True)),
        }
        log.info(
            "workload_best: %s at %s -> %s (%.3f; %s: %.3f)",
            *key,
            names[pick],
            capacity[pick],
            names[0],
            capacity[0],
        )
    return labels


def _named_action(actions: TargetActionSpec, name: str) -> tuple[int, int]:
    """A v3 candidate named in ``bc_policies``: a constant action's name, or a heuristic's (its constant action)."""
    if is_action_name(name):
        return action_named(actions, name)
    return constant_action(actions, make_policy(name))


def _act(student: OnPolicyAlgorithm, obs: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """The student's deterministic actions (within the masks when it is a MaskablePPO)."""
    if isinstance(student, MaskablePPO):
        actions, _ = student.predict(obs, deterministic=True, action_masks=masks)
    else:
        actions, _ = student.predict(obs, deterministic=True)
    return np.asarray(actions)


def merge(*datasets: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The union of collected datasets (DAgger's aggregation)."""
    return {k: np.concatenate([d[k] for d in datasets]) for k in datasets[0]}


def clone(
    model: OnPolicyAlgorithm, data: dict[str, np.ndarray], epochs: int, batch_size: int, masked: bool
) -> dict:
    """Fit the policy to the labels (masked cross-entropy) and the value head to the returns."""
    policy = model.policy
    policy.set_training_mode(True)
    obs = torch.as_tensor(data["obs"], dtype=torch.float32)
    actions = torch.as_tensor(data["actions"])
    masks = data["masks"]
    returns = torch.as_tensor(data["returns"], dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    n = len(obs)
    progress = Progress("behaviour cloning: fit", epochs, say=log.info)
    for epoch in range(epochs):
        progress.update(epoch, f"epochs on {n} samples")
        for idx in torch.randperm(n, generator=gen).split(batch_size):
            kw = {"action_masks": masks[idx.numpy()]} if masked else {}
            values, log_prob, _ = policy.evaluate_actions(obs[idx], actions[idx], **kw)
            loss = -log_prob.mean() + 0.5 * torch.nn.functional.mse_loss(values.flatten(), returns[idx])
            policy.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), model.max_grad_norm)
            policy.optimizer.step()
    progress.finish(epochs, f"epochs on {n} samples")
    policy.set_training_mode(False)
    return {"samples": n, "agreement": agreement(model, data, masked)}


def agreement(model: OnPolicyAlgorithm, data: dict[str, np.ndarray], masked: bool) -> float:
    """The fraction of ``data``'s states where the policy's deterministic action is the label."""
    obs = torch.as_tensor(data["obs"], dtype=torch.float32)
    with torch.no_grad():
        kw = {"action_masks": data["masks"]} if masked else {}
        dist = model.policy.get_distribution(obs, **kw)
        actions = dist.get_actions(deterministic=True)
    return float((actions == torch.as_tensor(data["actions"])).all(dim=1).float().mean())
