"""Behaviour cloning warm start: imitate a teacher action before PPO takes over.

PPO from scratch on ``ChunkedPrefill-v1`` settles on FCFS allocation with large budgets:
the allocation rule only changes the plan when the budget does not cover the queue, so
under the budgets it drifts to first, the rule's advantage is near zero and shortest-
remaining-first is never found (see the README's learning notes).  Starting from a
teacher fixes the exploration problem, and PPO then learns when to deviate from it.

The teacher is a constant env action ``(budget level, rule)``: a fixed-budget Sarathi
variant.  For each state its label is the *valid* action with the same plan (budget
clamped to the covering level, rule to FCFS where rules are masked: see
:mod:`envs.actions`), read off the action mask, so the labels follow the env's masks
exactly.  The policy is fitted by masked cross-entropy and the value head by discounted
returns of the teacher's own rollouts (so PPO's first advantages are not noise).
"""

from __future__ import annotations

import numpy as np
import torch
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.vec_env import VecNormalize

from envs.actions import NUM_LEVELS


def teacher_labels(masks: np.ndarray, level: int, rule: int) -> np.ndarray:
    """The canonical form of the constant action ``(level, rule)`` under each row of ``masks``."""
    levels = masks[:, :NUM_LEVELS]
    top = NUM_LEVELS - 1 - np.argmax(levels[:, ::-1], axis=1)  # highest valid budget level
    rules_ok = masks[:, NUM_LEVELS + rule]
    return np.stack([np.minimum(level, top), np.where(rules_ok, rule, 0)], axis=1).astype(np.int64)


def collect(venv: VecNormalize, level: int, rule: int, steps: int, gamma: float) -> dict[str, np.ndarray]:
    """Roll the teacher out for ``steps`` env steps; normalised observations, masks, labels, returns."""
    n = venv.num_envs
    obs = venv.reset()
    rows: dict[str, list[np.ndarray]] = {"obs": [], "masks": [], "actions": [], "rewards": [], "dones": []}
    for _ in range(-(-steps // n)):
        masks = np.stack(venv.env_method("action_masks"))
        actions = teacher_labels(masks, level, rule)
        rows["obs"].append(obs)
        rows["masks"].append(masks)
        rows["actions"].append(actions)
        obs, rewards, dones, _ = venv.step(actions)
        rows["rewards"].append(rewards)
        rows["dones"].append(dones)
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
