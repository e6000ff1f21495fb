"""Physics bounds on every shipped GPU cost file: no iteration beats the hardware's datasheet, and a
small model's batch-1 decode with the default engine stays near it.

A decode-only iteration must read the weights it multiplies (every layer and the LM head, split
over TP) and the KV cache it attends to at no more than the GPU's HBM bandwidth; a prefill must do
its linear layers' FLOPs (2 per weight per token) at no more than the GPU's peak dense FLOP/s.
Whatever a fit does to its coefficients, a file that predicts less is physically wrong.  Upward,
with the default engine overhead profile, a batch-1 decode of a 7-8B model at TP 1 takes at most
1.5x that bandwidth bound plus the profile's own batch-1 overhead (host and device terms added).
"""

from __future__ import annotations

import pytest

from envs.serving.cost_model import (
    COST_DIR,
    RooflineCostModel,
    load_cost_model,
    read_cost_file,
    roofline_params,
)
from envs.serving.engine_overhead import DEFAULT_ENGINE_OVERHEAD, OverheadTerms, load_engine_overhead
from envs.serving.specs import load_hardware, load_model

GPU_FILES = sorted(p for p in COST_DIR.glob("*.yaml") if not p.name.startswith("cpu__"))
DECODE_BATCHES = [(1, 1024), (8, 4096), (64, 2048), (256, 4096)]  # (sequences, context each)
SMALL_MODELS = ("llama2_7b", "llama3_8b", "mistral_7b")
SMALL_TP1_FILES = [p for p in GPU_FILES if p.stem.split("__")[1] in SMALL_MODELS and p.stem.endswith("__tp1")]
UPPER_FACTOR = 1.5
PREFILL_CHUNKS = [512, 2048, 8192, 16384]


def decode_bound(model, hardware, tp: int, seqs: int, context: int) -> float:
    weights = (
        model.num_layers * model.layer_params + model.vocab_size * model.hidden_size
    ) * model.dtype_bytes
    return (weights + model.kv_bytes_per_token * seqs * context) / tp / hardware.hbm_bandwidth


def prefill_bound(model, hardware, tp: int, tokens: int) -> float:
    return 2 * model.num_layers * model.layer_params * tokens / tp / hardware.peak_flops


def _setup(path):
    data = read_cost_file(path)
    model, hardware, tp = load_model(data["model"]), load_hardware(data["hardware"]), data["tp"]
    return model, hardware, tp, load_cost_model(model, hardware, tp)


def test_every_gpu_cost_file_is_checked():
    assert len(GPU_FILES) >= 60


@pytest.mark.parametrize("path", GPU_FILES, ids=lambda p: p.stem)
def test_decode_is_never_faster_than_reading_weights_and_kv_at_hbm_bandwidth(path):
    model, hardware, tp, cost = _setup(path)
    weights = (
        model.num_layers * model.layer_params + model.vocab_size * model.hidden_size
    ) * model.dtype_bytes
    for seqs, context in DECODE_BATCHES:
        kv = model.kv_bytes_per_token * seqs * context
        bound = (weights + kv) / tp / hardware.hbm_bandwidth
        got = cost.iteration_time(seqs, seqs * context, [], [])
        assert got >= bound, f"{path.name}: {seqs} x {context}: {got * 1e3:.3f} ms < {bound * 1e3:.3f} ms"


@pytest.mark.parametrize("path", GPU_FILES, ids=lambda p: p.stem)
def test_prefill_is_never_faster_than_its_linear_flops_at_peak(path):
    model, hardware, tp, cost = _setup(path)
    for tokens in PREFILL_CHUNKS:
        bound = prefill_bound(model, hardware, tp, tokens)
        got = cost.iteration_time(0, 0, [tokens], [0])
        assert got >= bound, f"{path.name}: prefill {tokens}: {got * 1e3:.3f} ms < {bound * 1e3:.3f} ms"


def test_a_model_faster_than_the_hardware_fails_both_bounds():
    """The bounds bite: a roofline run at twice the datasheet's bandwidth and FLOP/s breaks both."""
    model, hardware = load_model("llama2_7b"), load_hardware("h100_80gb")
    too_fast = RooflineCostModel(roofline_params(model, hardware, 1, 2.0, 2.0, 0.0), "twice the datasheet")
    assert too_fast.iteration_time(64, 64 * 2048, [], []) < decode_bound(model, hardware, 1, 64, 2048)
    assert too_fast.iteration_time(0, 0, [8192], [0]) < prefill_bound(model, hardware, 1, 8192)


def batch1_overhead(terms: OverheadTerms, num_layers: int) -> float:
    """The profile's own seconds for a one-sequence, one-token decode: host and device terms together."""
    host = (
        terms.host_fixed_s
        + terms.host_s_per_layer * num_layers
        + terms.host_s_per_seq
        + terms.host_s_per_token
    )
    return host + terms.device_fixed_s + terms.device_s_per_seq


def test_every_small_tp1_file_is_checked_upward():
    assert len(SMALL_TP1_FILES) == 12  # 3 models x A100, H100, H200, A40


@pytest.mark.parametrize("path", SMALL_TP1_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("context", [1, 1024, 4096])
def test_batch1_decode_of_a_small_model_stays_near_the_bandwidth_bound(path, context):
    model, hardware, tp, cost = _setup(path)
    terms = load_engine_overhead(DEFAULT_ENGINE_OVERHEAD).terms(hardware.name)
    limit = UPPER_FACTOR * (
        decode_bound(model, hardware, tp, 1, context) + batch1_overhead(terms, model.num_layers)
    )
    got = cost.iteration_time(1, context, [], [])
    assert got <= limit, f"{path.name}: 1 x {context}: {got * 1e3:.3f} ms > {limit * 1e3:.3f} ms"


def test_the_upper_bound_bites_on_the_2023_engine():
    """The 2023 eager engine's profile, moved to a 7B model at TP 1, breaks it (13.7 ms on H100)."""
    model, hardware = load_model("llama2_7b"), load_hardware("h100_80gb")
    default = load_engine_overhead(DEFAULT_ENGINE_OVERHEAD).terms(hardware.name)
    limit = UPPER_FACTOR * (
        decode_bound(model, hardware, 1, 1, 1024) + batch1_overhead(default, model.num_layers)
    )
    old = load_cost_model(model, hardware, 1, engine_overhead="splitwise_2023_eager")
    assert old.iteration_time(1, 1024, [], []) > limit
