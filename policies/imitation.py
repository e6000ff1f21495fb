"""Behaviour cloning warm start: imitate a teacher before PPO takes over.

PPO from scratch on ``ChunkedPrefill-v1`` settles on FCFS allocation with large budgets:
the allocation rule only changes the plan when the budget does not cover the queue, so
under the budgets it drifts to first, the rule's advantage is near zero and shortest-
remaining-first is never found (see the README's learning notes).  Starting from a
teacher fixes the exploration problem, and PPO then learns when to deviate from it.

Two teachers, both constant env actions ``(budget level, rule)`` within an episode:

* ``constant``: one fixed action everywhere (a fixed-budget Sarathi variant);
* ``window_best``: for each training episode, the constant action that serves that
  episode's window best, found in hindsight by simulating every candidate on it (a
  cheap oracle).  The network must then tell regimes apart from what it observes
  (bursty long prompts want a small budget and shortest-first, steady chat wants big
  budgets), which is what lets one policy beat every fixed budget across workloads.

For each state the label is the *valid* action with the same plan (budget clamped to
the covering level, rule to FCFS where rules are masked: see :mod:`envs.actions`), read
off the action mask, so the labels follow the env's masks exactly.  The policy is fitted
by masked cross-entropy and the value head by discounted returns of the teacher's own
rollouts (so PPO's first advantages are not noise).
"""

from __future__ import annotations

import numpy as np
import torch
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from envs.actions import BUDGET_LEVELS, NUM_LEVELS


def teacher_labels(masks: np.ndarray, level: int, rule: int) -> np.ndarray:
    """The canonical form of the constant action ``(level, rule)`` under each row of ``masks``."""
    levels = masks[:, :NUM_LEVELS]
    top = NUM_LEVELS - 1 - np.argmax(levels[:, ::-1], axis=1)  # highest valid budget level
    rules_ok = masks[:, NUM_LEVELS + rule]
    return np.stack([np.minimum(level, top), np.where(rules_ok, rule, 0)], axis=1).astype(np.int64)


def best_constant(env, candidates: list[tuple[int, int]]) -> tuple[int, int]:
    """The candidate action that serves ``env``'s current episode window best, by simulation."""
    from baselines import Sarathi

    trace, setup, rules = env.sim.trace, env.setup, env.actions.rule_names
    scores = []
    for level, rule in candidates:
        metrics = setup.simulator(trace).run(Sarathi(BUDGET_LEVELS[level], rules[rule])).metrics
        scores.append(metrics["slo_attainment"])
    return candidates[int(np.argmax(scores))]  # ties: the first, i.e. the smallest budget


def collect(
    venv: VecNormalize, teacher: str, level: int, rule: int, steps: int, gamma: float
) -> dict[str, np.ndarray]:
    """Roll the teacher out for ``steps`` env steps; normalised observations, masks, labels, returns.

    ``teacher``: ``constant`` (the action ``(level, rule)``) or ``window_best`` (per episode,
    the best constant action among budgets ``>= level`` x all rules; needs a DummyVecEnv).
    """
    if teacher not in ("constant", "window_best"):
        raise ValueError(f"unknown behaviour-cloning teacher {teacher!r}; valid: constant, window_best")
    n = venv.num_envs
    obs = venv.reset()
    actions_now = np.tile([level, rule], (n, 1))
    if teacher == "window_best":
        if not isinstance(venv.venv, DummyVecEnv):
            raise ValueError("the window_best teacher reads each env's window: use algo.vec_env=dummy")
        envs = [e.unwrapped for e in venv.venv.envs]
        candidates = [(lv, r) for lv in range(level, NUM_LEVELS) for r in range(len(envs[0].actions.rules))]
        actions_now = np.array([best_constant(e, candidates) for e in envs])
    rows: dict[str, list[np.ndarray]] = {"obs": [], "masks": [], "actions": [], "rewards": [], "dones": []}
    for _ in range(-(-steps // n)):
        masks = np.stack(venv.env_method("action_masks"))
        actions = np.stack([teacher_labels(masks[i : i + 1], *actions_now[i])[0] for i in range(n)])
        rows["obs"].append(obs)
        rows["masks"].append(masks)
        rows["actions"].append(actions)
        obs, rewards, dones, _ = venv.step(actions)
        rows["rewards"].append(rewards)
        rows["dones"].append(dones)
        if teacher == "window_best":
            for i in np.flatnonzero(dones):  # a new episode (window) began: find its best action
                actions_now[i] = best_constant(envs[i], candidates)
    data = {k: np.stack(v) for k, v in rows.items()}  # [T, n_envs, ...]
    returns = np.zeros_like(data["rewards"], dtype=np.float64)
    running = np.zeros(n)
    for t in range(len(returns) - 1, -1, -1):  # episode ends cut the sum (no bootstrap)
        running = data["rewards"][t] + gamma * running * (1.0 - data["dones"][t])
        returns[t] = running
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in data.items() if k not in ("rewards", "dones")}
    flat["returns"] = returns.reshape(-1)
    return flat


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
    for _ in range(epochs):
        for idx in torch.randperm(n, generator=gen).split(batch_size):
            kw = {"action_masks": masks[idx.numpy()]} if masked else {}
            values, log_prob, _ = policy.evaluate_actions(obs[idx], actions[idx], **kw)
            loss = -log_prob.mean() + 0.5 * torch.nn.functional.mse_loss(values.flatten(), returns[idx])
            policy.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), model.max_grad_norm)
            policy.optimizer.step()
    policy.set_training_mode(False)
    with torch.no_grad():
        kw = {"action_masks": masks} if masked else {}
        dist = policy.get_distribution(obs, **kw)
        agree = (dist.get_actions(deterministic=True) == actions).all(dim=1).float().mean().item()
    return {"samples": n, "agreement": agree}
