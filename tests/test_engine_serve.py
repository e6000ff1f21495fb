"""The engine's scheduler: the serving core driving the real model, deciding exactly like the simulator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import envs
from engine.model import build_model
from engine.serve import Engine, EngineResult, PacedRunner, VirtualClock, WallClock, prompt_tokens
from envs.serving.core import ServingConfig
from envs.serving.loop import ITERATION_COLUMNS
from envs.serving.setup import ServingSetup
from policies.registry import make_policy
from tests.simtools import make_trace

POLICIES = ("sarathi_512", "sarathi_128", "fcfs", "fixed_chunk_512", "adaptive")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def setup(num_blocks: int = 512) -> ServingSetup:
    """Llama-3-8B's roofline latencies; the core's limits fit the tiny model (4096 positions)."""
    config = ServingConfig(num_blocks=num_blocks, max_model_len=1024, lookahead=8)
    return ServingSetup.from_names("llama3_8b", "h100_80gb", 1, "strict", "roofline", config)


def trace(n: int = 24, seed: int = 0):
    """Bursts of short and long prompts: mixed batches, queueing, chunking."""
    rng = np.random.default_rng(seed)
    arrivals = np.sort(rng.uniform(0.0, 0.25, n))
    prompts = rng.choice([7, 40, 130, 300, 620], n)
    outputs = rng.integers(1, 40, n)
    return make_trace(arrivals, prompts, outputs)


def paced(tr, serving: ServingSetup, model, policy: str) -> tuple[Engine, EngineResult]:
    clock = VirtualClock()
    engine = Engine(tr, serving, model, seed=3, clock=clock)
    engine.runner = PacedRunner(engine.core, clock, engine.runner)
    return engine, engine.run(make_policy(policy))


@pytest.mark.parametrize("policy", POLICIES)
def test_engine_decides_like_the_simulator_given_the_same_latencies(model, policy):
    tr, serving = trace(), setup()
    _, got = paced(tr, serving, model, policy)
    want = serving.simulator(tr).run(make_policy(policy))
    for name in ITERATION_COLUMNS:
        if name == "latency":  # the engine logs end - start, the simulator the latency it added
            np.testing.assert_allclose(got.result.iterations[name], want.iterations[name], rtol=1e-9)
        else:
            np.testing.assert_array_equal(got.result.iterations[name], want.iterations[name], err_msg=name)
    assert got.result.token_times.keys() == want.token_times.keys()
    for rid, times in want.token_times.items():
        np.testing.assert_array_equal(got.result.token_times[rid], times)
    for key, value in want.metrics.items():
        if key != "sim_wall_s":
            assert got.result.metrics[key] == pytest.approx(value, nan_ok=True), key
    assert got.result.metrics["finished"] == len(tr)
    assert [len(o) for o in got.outputs] == list(tr.output_len)


def test_engine_predicts_each_batch_with_the_cost_model(model):
    _, got = paced(trace(), setup(), model, "sarathi_512")
    it = got.result.iterations
    np.testing.assert_allclose(it["predicted"], it["latency"], rtol=1e-9)
    assert len(it["execute"]) == len(it["start"]) and np.all(it["decode_context"] >= it["decode_tokens"])


def test_preemption_recomputes_and_emits_the_same_greedy_tokens(model):
    tr = trace(n=16, seed=1)
    roomy_engine, roomy = paced(tr, setup(num_blocks=512), model, "sarathi_128")
    tight_engine, tight = paced(tr, setup(num_blocks=56), model, "sarathi_128")
    assert roomy.result.metrics["preemptions"] == 0
    assert tight.result.metrics["preemptions"] > 0
    assert tight.outputs == roomy.outputs
    assert [len(o) for o in tight.outputs] == list(tr.output_len)
    for engine in (roomy_engine, tight_engine):
        engine.blocks.check_consistency()
        assert engine.blocks.num_used_blocks == engine.core.kv.used == 0


def test_outputs_are_the_models_greedy_continuation(model):
    tr = trace(n=6, seed=2)
    _, got = paced(tr, setup(num_blocks=64), model, "sarathi_128")
    for rid in range(len(tr)):
        prompt = prompt_tokens(3, rid, int(tr.prompt_len[rid]), model.config.vocab_size)
        out = got.outputs[rid]
        logits = model.reference_logits(torch.tensor(prompt + out[:-1]))
        assert logits[len(prompt) - 1 :].argmax(dim=-1).tolist() == out


def test_physical_blocks_follow_the_core_every_iteration(model):
    tr, serving = trace(n=16, seed=1), setup(num_blocks=56)
    clock = VirtualClock()
    engine = Engine(tr, serving, model, clock=clock)
    engine.runner = PacedRunner(engine.core, clock, engine.runner)
    policy = make_policy("sarathi_128")
    loop = engine.loop
    policy.reset(loop.view)
    steps = 0
    while loop.advance_to_work():
        loop.step(policy.plan(loop.view))
        assert engine.blocks.num_used_blocks == engine.core.kv.used
        engine.blocks.check_consistency()
        steps += 1
    assert steps > 10 and engine.core.preemptions > 0


def test_a_mismatch_between_physical_and_counted_blocks_stops_the_engine(model):
    clock = VirtualClock()
    engine = Engine(trace(n=4), setup(), model, clock=clock)
    engine.blocks.add("intruder", [1, 2, 3])
    engine.blocks.reserve("intruder", 3)
    with pytest.raises(RuntimeError, match="physical KV blocks in use"):
        engine.run(make_policy("sarathi_512"))


def test_an_exported_policy_runs_unchanged(model, tmp_path):
    from policies.export import write_export
    from policies.exported import PolicyNet, env_contract

    contract = env_contract(envs.ENV_ID_V0)
    torch.manual_seed(0)
    net = PolicyNet([len(contract["feature_names"]), 8], contract["nvec"]).eval()
    write_export(net, envs.ENV_ID_V0, tmp_path, {"algo": "untrained stub"})
    tr, serving = trace(), setup()
    _, got = paced(tr, serving, model, f"learned:{tmp_path}")
    want = serving.simulator(tr).run(make_policy(f"learned:{tmp_path}"))
    np.testing.assert_array_equal(got.result.iterations["prefill_tokens"], want.iterations["prefill_tokens"])
    assert [len(o) for o in got.outputs] == list(tr.output_len)


def test_refuses_what_it_cannot_serve(model):
    hashed = make_trace([0.0], [32], [4], hashes=[[1, 2]], unit=16)
    with pytest.raises(ValueError, match="prefix hash ids"):
        Engine(hashed, setup(), model)
    long = ServingSetup.from_names(
        "llama3_8b", "h100_80gb", 1, "strict", "roofline", ServingConfig(num_blocks=64)
    )
    with pytest.raises(ValueError, match="max_context"):
        Engine(trace(n=2), long, model)


def test_synthetic_prompts_are_deterministic_and_distinct():
    assert prompt_tokens(0, 5, 50, 512) == prompt_tokens(0, 5, 50, 512)
    assert prompt_tokens(0, 5, 50, 512) != prompt_tokens(1, 5, 50, 512)
    assert prompt_tokens(0, 5, 50, 512) != prompt_tokens(0, 6, 50, 512)
    assert all(0 <= t < 512 for t in prompt_tokens(0, 5, 500, 512))


@pytest.mark.parametrize("idle", ["sleep", "spin"])
def test_wall_clock_waits_until_the_time_asked(idle):
    clock = WallClock(idle)
    clock.start()
    clock.sleep_until(0.02)
    assert 0.02 <= clock.now() < 0.5
    with pytest.raises(ValueError, match="idle"):
        WallClock("nap")


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_greedy_is_the_argmax_of_the_logits(model, rows):
    hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    assert model.greedy(hidden) == model.logits(hidden).argmax(dim=-1).tolist()


def test_a_dry_run_schedules_like_the_simulator_without_forward_passes(model):
    tr, serving = trace(), setup()
    clock = VirtualClock()
    engine = Engine(tr, serving, model, clock=clock)
    engine.runner = PacedRunner(engine.core, clock)  # no model: every token is 0
    got = engine.run(make_policy("sarathi_128"))
    want = serving.simulator(tr).run(make_policy("sarathi_128"))
    np.testing.assert_array_equal(got.result.iterations["start"], want.iterations["start"])
    assert all(set(o) == {0} and len(o) == n for o, n in zip(got.outputs, tr.output_len, strict=True))
