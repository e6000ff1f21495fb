"""policies/divergence.py: how a policy's decisions differ from adaptive_srpf's, and which modes it takes."""

from __future__ import annotations

import numpy as np
import torch

import envs
from envs.chunked_prefill import version_of
from policies.divergence import KINDS, Compared
from policies.export import in_memory_policy
from policies.exported import PolicyNet
from tests.simtools import make_sim, make_trace


def _trace():
    rng = np.random.default_rng(1)
    n = 80
    return make_trace(np.cumsum(rng.exponential(0.03, n)), rng.integers(100, 4000, n), rng.integers(2, 60, n))


def test_a_v4_policy_is_run_unchanged_and_each_of_its_decisions_counted_once_by_mode():
    torch.manual_seed(0)
    version = version_of(envs.ENV_ID_V4)
    policy = in_memory_policy(
        PolicyNet([len(version.feature_names), 16], version.actions.nvec), envs.ENV_ID_V4
    )
    compared = Compared(policy)
    counted = make_sim(_trace(), num_blocks=800).run(compared)
    alone = make_sim(_trace(), num_blocks=800).run(in_memory_policy(policy.net, envs.ENV_ID_V4))
    wall = {"sim_wall_s"}
    assert {k: v for k, v in counted.metrics.items() if k not in wall} == {
        k: v for k, v in alone.metrics.items() if k not in wall
    }  # counting changes no plan
    decisions = sum(compared.counts.values())
    assert decisions > 20 and set(compared.counts) <= set(KINDS)
    assert sum(compared.modes.values()) == decisions
    assert set(compared.modes) <= set(version.actions.mode_names)
