"""The lookahead scan the env shares between the features and the masks: its sums are the lookahead's,
and the features and valid actions computed from it are those computed without it."""

import numpy as np
import pytest

from envs.actions import ACTIONS_V0, ACTIONS_V1, ACTIONS_V2, ACTIONS_V3
from envs.chunked_prefill import ChunkedPrefillEnv
from envs.features import features_v0, features_v1, features_v3, features_v4
from envs.lookahead import Lookahead, scan_lookahead
from envs.serving.scheduling import blocks_needed

KW = dict(workloads=["azure_conv"], cost_model="calibrated", window_scale=0.05)
STATES = {
    "moderate": dict(load_scale=4.0),
    "kv_pressure": dict(load_scale=3.0, serving={"num_blocks": 1500, "lookahead": 8}),
}


def _states(kw: dict, steps: int = 1000):
    """The states a v0 agent sees (every iteration's, empty queues too) under random actions."""
    env = ChunkedPrefillEnv(version=0, **KW, **kw)
    env.reset(seed=1)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        yield env.sim.view
        if env.step(rng.integers(env.action_space.nvec))[3]:
            env.reset()


def _expected(view) -> Lookahead:
    look, now, bs = view.lookahead, view.now, view.block_size
    left = [r.target - r.computed for r in look]
    alive = [n for r, n in zip(look, left, strict=True) if not r.violated and now - r.arrival <= r.ttft_bound]
    slack = [
        (r.deadline - now - view.prefill_s_per_token * n) / r.ttft_bound
        for r, n in zip(look, left, strict=True)
    ]
    return Lookahead(
        size=len(look),
        pending=sum(left),
        shortest=min(left, default=0),
        min_slack=min([1.0, *slack]),
        oldest=min([now, *(r.arrival for r in look)]),
        doomed=sum(r.violated for r in look),
        alive=len(alive),
        alive_pending=sum(alive),
        alive_shortest=min(alive, default=0),
        new=sum(not r.running for r in look),
        blocks=sum(blocks_needed(bs, r, n) for r, n in zip(look, left, strict=True)),
    )


@pytest.mark.parametrize("case", STATES)
def test_the_scan_sums_the_lookahead_and_gives_what_features_and_masks_compute_alone(case):
    seen = {"queued": 0, "empty": 0, "truncated_lookahead": 0, "doomed": 0, "running": 0, "blocking": 0}
    for view in _states(STATES[case]):
        look = scan_lookahead(view)
        assert look == _expected(view)
        for spec in (ACTIONS_V0, ACTIONS_V1, ACTIONS_V2, ACTIONS_V3):
            assert spec.valid(view, look) == spec.valid(view)
        for features in (features_v0, features_v1, features_v3, features_v4):
            assert features(view, look).tobytes() == features(view).tobytes()
        seen["queued" if view.queue else "empty"] += 1
        seen["truncated_lookahead"] += len(view.queue) > len(view.lookahead)
        seen["doomed"] += look.doomed > 0
        seen["running"] += look.new < look.size
        seen["blocking"] += look.new > view.free_slots or look.blocks > view.free_blocks
    assert seen["queued"] and seen["empty"] and seen["doomed"] and seen["running"], seen
    assert case != "kv_pressure" or (seen["truncated_lookahead"] and seen["blocking"]), seen
