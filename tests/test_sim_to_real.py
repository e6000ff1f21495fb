"""The sim-to-real pieces: the engine profile's fit, the comparison, and the scripts' command lines."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from calibration.iterations import KNEES, Sample, default_grid, fit
from chunkgym import REPO_ROOT
from engine.calibrate import cost_file, write
from engine.model import build_model
from engine.replay import head, load_config, replay_trace, scheduler_overhead
from engine.sim_to_real import compare, iteration_mape
from envs.serving.cost_model import CostParams, RooflineCostModel, load_cost_model
from envs.serving.loop import SimResult
from envs.serving.setup import ServingSetup
from envs.serving.specs import load_hardware, load_model

TRUTH = CostParams(
    num_layers=6,
    lin_fixed_s=0.0,
    lin_mem_s=0.0,
    lin_s_per_token=2e-5,
    lin_knee_tokens=32.0,
    lin_elementwise_s_per_token=1e-6,
    lin_steps=((1, 1e-4),),
    attn_prefill_s_per_pair=3e-9,
    attn_prefill_fixed_s=2e-5,
    attn_decode_s_per_token=4e-8,
    attn_decode_fixed_s=1e-5,
    allreduce_count=0,
    allreduce_fixed_s=0.0,
    allreduce_s_per_token=0.0,
    iter_fixed_s=6e-3,
    head_fixed_s=0.0,
    head_s_per_seq=0.0,
)


def samples(noise: float = 0.0, seed: int = 0) -> list[Sample]:
    """The default grid timed by a known cost model, optionally with multiplicative noise."""
    truth = RooflineCostModel(TRUTH)
    rng = np.random.default_rng(seed)
    out = []
    for comp in default_grid():
        s = Sample(
            len(comp.decode_contexts),
            sum(comp.decode_contexts) + len(comp.decode_contexts),
            comp.prefill_tokens,
            comp.prefill_context,
            1.0,
        )
        seconds = s.predict(truth) * (1.0 + noise * rng.standard_normal())
        out.append(dataclasses.replace(s, seconds=seconds))
    return out


def test_the_fit_recovers_a_cost_model_of_its_own_form():
    assert TRUTH.lin_knee_tokens in KNEES
    result = fit(samples(), num_layers=6)
    assert result.in_sample_mape < 1e-6 and result.heldout_mape < 1e-6
    got = RooflineCostModel(result.params)
    for s in samples():
        assert s.predict(got) == pytest.approx(s.seconds, rel=1e-6)


def test_the_fit_finds_a_steeper_regime_of_large_steps_when_asked():
    """vLLM's CPU profile: steps past a large knee cost more per token; the default fit has no such term."""
    truth = dataclasses.replace(TRUTH, lin_large_s_per_token=1e-5, lin_large_knee_tokens=4096.0)
    timed = []
    for s in samples() + [
        Sample(0, 0, (q,) * k, (0,) * k, 1.0) for k, q in ((1, 4096), (8, 1024), (16, 1024), (64, 256))
    ]:
        timed.append(dataclasses.replace(s, seconds=s.predict(RooflineCostModel(truth))))
    result = fit(timed, num_layers=6, large_knees=(2048, 4096, 8192))
    assert result.in_sample_mape < 1e-6
    assert (result.params.lin_large_knee_tokens, result.params.lin_large_s_per_token) == pytest.approx(
        (4096, 1e-5)
    )
    plain = fit(timed, num_layers=6)
    assert plain.params.lin_large_s_per_token == 0.0 and plain.in_sample_mape > 0.01


def test_noise_shows_in_the_heldout_error_not_in_the_coefficients_sign():
    result = fit(samples(noise=0.05, seed=1), num_layers=6)
    assert 0.01 < result.heldout_mape < 0.12
    assert all(v >= 0 for v in dataclasses.asdict(result.params).values() if isinstance(v, float))


def test_fitted_file_loads_as_the_hardware_profile(tmp_path):
    result = fit(samples(), num_layers=6)
    path = write(cost_file("cpu", "engine_small", result, "a test machine"), tmp_path)
    assert path.name == "cpu__engine_small__tp1.yaml"
    cost = load_cost_model(load_model("engine_small"), load_hardware("cpu"), 1, path=path)
    assert cost.iteration_time(4, 400, [128], [0]) == pytest.approx(
        RooflineCostModel(TRUTH).iteration_time(4, 400, [128], [0])
    )
    assert "a test machine" in cost.description
    setup = ServingSetup.from_names("engine_small", "cpu", 1, "strict", str(path), {"num_blocks": 64})
    assert setup.slo.tpot_s == pytest.approx(5 * float(cost.decode_times(32, np.array([32 * 4096]))[0]))


def test_scheduler_overhead_is_added_to_every_iteration(tmp_path):
    result = fit(samples(), num_layers=6)
    plain = RooflineCostModel(result.params)
    path = write(cost_file("cpu", "engine_small", result, "here", overhead_s=2e-4), tmp_path)
    cost = load_cost_model(load_model("engine_small"), load_hardware("cpu"), 1, path=path)
    for args in ((1, 17, (), ()), (0, 0, (128,), (0,)), (8, 800, (64,), (256,))):
        assert cost.iteration_time(*args) == pytest.approx(plain.iteration_time(*args) + 2e-4)
    assert "0.200 ms per iteration of scheduler work" in cost.description


def test_scheduler_overhead_is_measured_on_another_window_in_real_time(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "200,40\n" * 20)
    conf = load_config([f"workload=file:{trace}", "length_scale=4", "load_scale=4", "idle=sleep"])
    assert len(head(replay_trace(conf), 1.0)) < len(replay_trace(conf))
    overhead = scheduler_overhead(conf, build_model("engine_small"), span_s=1.0)
    assert 1e-6 < overhead < 5e-3


def test_the_committed_cpu_profile_resolves_an_slo():
    setup = ServingSetup.from_names("engine_small", "cpu", 1, "strict")
    decode = setup.cost_model.iteration_time(8, 8 * 200, (), ())
    assert 1e-3 < decode < 0.1  # a CPU decode step: milliseconds
    assert setup.slo.tpot_s > decode and setup.slo.stall_s == pytest.approx(5 * setup.slo.tpot_s)


def _result(latency, predicted, **metrics) -> SimResult:
    iterations = {"latency": np.array(latency), "predicted": np.array(predicted)}
    return SimResult(None, iterations, metrics, {})


def test_compare_reports_mape_and_worst_policy_relative_errors():
    engine_a = _result([0.01, 0.02], [0.011, 0.018], ttft_p50_s=0.1, ttft_p99_s=1.0, tbt_p99_s=0.05)
    sim_a = _result([], [], ttft_p50_s=0.11, ttft_p99_s=0.9, tbt_p99_s=0.05)
    engine_b = _result([0.04], [0.04], ttft_p50_s=0.2, ttft_p99_s=2.0, tbt_p99_s=0.1)
    sim_b = _result([], [], ttft_p50_s=0.2, ttft_p99_s=2.5, tbt_p99_s=0.08)
    runs = {("a", "engine"): engine_a, ("a", "sim"): sim_a, ("b", "engine"): engine_b, ("b", "sim"): sim_b}
    out = compare(runs, ["a", "b"])
    assert iteration_mape(engine_a.iterations) == pytest.approx(0.1)
    assert out["iteration_mape"] == pytest.approx(0.2 / 3)
    assert out["ttft_p50_rel_err"] == pytest.approx(0.1)
    assert out["ttft_p99_rel_err"] == pytest.approx(0.25)
    assert out["tbt_p99_rel_err"] == pytest.approx(0.2)
    assert out["policies"]["a"]["ttft_p99_rel_err"] == pytest.approx(0.1)
    assert out["policies"]["b"]["iterations"] == 1


def test_gpu_script_parses_its_config_without_a_gpu():
    proc = subprocess.run(
        [sys.executable, "bench/engine_gpu.py", "dry_run=true", "replay.seed=3", "replay.hardware=h100_80gb"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    conf = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (conf["device"], conf["dtype"], conf["model"]) == ("cuda", "bfloat16", "llama3_2_1b")
    assert (conf["seed"], conf["hardware"]) == (3, "h100_80gb")
    assert conf["policies"] == ["sarathi_512", "fcfs"]
    spec = load_model(conf["model"])
    assert 1e9 < spec.num_params < 9e9
