"""The bench load that follows the machine's speed (engine/vllm_backend/speed.py; no vLLM needed)."""

from __future__ import annotations

import pytest
import yaml

from calibration.iterations import default_grid
from chunkgym import REPO_ROOT
from engine.vllm_backend.speed import SPEED_PROBE, machine_load, probe_seconds
from envs.serving.cost_model import COST_DIR, RooflineCostModel, read_cost_file


class FixedStep:
    """A cost model whose every step takes ``seconds``; records what it was asked."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.asked: list[tuple] = []

    def iteration_time(self, num_decode, decode_kv, chunks, contexts) -> float:
        self.asked.append((num_decode, decode_kv, tuple(chunks), tuple(contexts)))
        return self.seconds


def test_a_machine_twice_as_slow_serves_at_half_the_load():
    slow = FixedStep(0.1)
    assert machine_load(120.0, 0.05, slow) == (60.0, 0.5)
    assert machine_load(120.0, 0.05, FixedStep(0.025)) == (240.0, 2.0)
    assert slow.asked == [(16, 16 * 257, (448,), (0,))]  # the probe: 16 decodes at 256 + their new tokens


def test_without_a_reference_the_load_is_as_given():
    never = FixedStep(1.0)
    assert machine_load(120.0, None, never) == (120.0, 1.0)
    assert never.asked == []


def test_the_bench_reference_is_the_committed_profiles_probe_time():
    """cpu_vllm_bench.yaml's load was chosen on the machine of the committed profile: on it the load is unchanged."""
    bench = yaml.safe_load((REPO_ROOT / "conf/replay/vllm/cpu_vllm_bench.yaml").read_text())
    committed = RooflineCostModel(read_cost_file(COST_DIR / "cpu__vllm_small__tp1.yaml")["params"])
    assert bench["reference_step_s"] == pytest.approx(probe_seconds(committed), rel=1e-3)
    load, speed = machine_load(bench["load_scale"], bench["reference_step_s"], committed)
    assert speed == pytest.approx(1.0, rel=1e-3) and load == pytest.approx(bench["load_scale"], rel=1e-3)
    assert SPEED_PROBE in default_grid()  # a profiled composition, not an extrapolation
