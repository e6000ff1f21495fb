"""Every env version's trajectories pinned bit for bit: observations, rewards, terminations,
truncations, action masks and infos of a few thousand steps each, on the calibrated cost model,
the shipped Azure traces, with and without KV pressure, across episode resets.

The env's speedups (one pass over the queue for features and masks, the decision-step loop) must
change none of it.  A recording is hashed in blocks of :data:`BLOCK` steps, so a failure names the
case, the field and the first block that differs.  Re-record (only for a new version or case) with
``python tests/test_env_golden.py``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import envs

GOLDEN = Path(__file__).parent / "fixtures" / "env_golden.json"
"""Recorded by :func:`record` at 304cb29, before the env's decision-step speedups, which must change none of it."""
STEPS = 2400
BLOCK = 200
FIELDS = ("obs", "reward", "terminated", "truncated", "mask", "info")
PLAIN = dict(workloads=["azure_conv", "azure_code"], window_scale=0.04, load_scale=(1.0, 3.0))
KV_PRESSURE = dict(
    workloads=["azure_conv"], window_scale=0.1, load_scale=(2.0, 3.0), serving={"num_blocks": 1500}
)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    f"v{v}{suffix}": (env_id, kw)
    for v, env_id in enumerate((envs.ENV_ID_V0, envs.ENV_ID_V1, envs.ENV_ID_V2, envs.ENV_ID_V3))
    for suffix, kw in (("", PLAIN), ("_kv", KV_PRESSURE))
}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value.item() if isinstance(value, np.generic) else value


def _rows(env_id: str, kw: dict[str, Any], seed: int = 3) -> dict[str, list[bytes]]:
    """Each step's fields as bytes (row 0: the reset): valid actions mostly, any action a fifth of the
    time (those go through ``canonical``), resetting at every truncation."""
    env = gym.make(env_id, **kw)
    nvec = env.action_space.nvec
    rng = np.random.default_rng(seed)
    rows: dict[str, list[bytes]] = {f: [] for f in FIELDS}
    obs, info = env.reset(seed=seed)
    reward, term, trunc = np.nan, False, False
    for _ in range(STEPS + 1):
        mask = info.pop("action_mask")
        assert mask is env.unwrapped.action_masks()  # type: ignore[attr-defined]
        for field, value in zip(
            FIELDS,
            (
                np.asarray(obs, np.float32).tobytes() + str(obs.dtype).encode(),
                np.float64(reward).tobytes(),
                bytes([term]),
                bytes([trunc]),
                mask.tobytes(),
                json.dumps(_jsonable(info), sort_keys=True).encode(),
            ),
            strict=True,
        ):
            rows[field].append(value)
        if trunc:
            obs, info = env.reset()
            reward, term, trunc = np.nan, False, False
            continue
        if rng.random() < 0.2:
            action = rng.integers(nvec)
        else:
            split = nvec[0]
            action = np.array(
                [rng.choice(np.flatnonzero(mask[:split])), rng.choice(np.flatnonzero(mask[split:]))]
            )
        obs, reward, term, trunc, info = env.step(action)
    return rows


def _digests(rows: dict[str, list[bytes]]) -> dict[str, list[str]]:
    """Per field, one SHA-256 prefix per block of :data:`BLOCK` rows."""
    out = {}
    for field, values in rows.items():
        out[field] = [
            hashlib.sha256(b"\0".join(values[i : i + BLOCK])).hexdigest()[:16]
            for i in range(0, len(values), BLOCK)
        ]
    return out


@pytest.mark.parametrize("case", CASES)
def test_trajectories_are_the_recorded_ones_bit_for_bit(case):
    env_id, kw = CASES[case]
    rows = _rows(env_id, kw)
    assert sum(r == b"\x01" for r in rows["truncated"]) >= 2, f"{case}: the rollout should cross resets"
    want = json.loads(GOLDEN.read_text())[case]
    got = _digests(rows)
    for field in FIELDS:
        for block, (g, w) in enumerate(zip(got[field], want[field], strict=True)):
            assert g == w, f"{case}: {field} first differs in rows {block * BLOCK}-{(block + 1) * BLOCK - 1}"


def record() -> None:
    """Write :data:`GOLDEN` from the current code."""
    GOLDEN.write_text(json.dumps({case: _digests(_rows(*CASES[case])) for case in CASES}, indent=1) + "\n")
    print(f"recorded {len(CASES)} cases to {GOLDEN}", file=sys.stderr)


if __name__ == "__main__":
    record()
