"""The KV transfer (link) model of prefill-decode disaggregation (envs/serving/kv_transfer.py).

Unit tests, hypothesis properties of the fair-sharing event model, the link files' loader, and the
validation against published transfer measurements (calibration/kv_transfer_validation.csv), whose
ratios are printed (``pytest -s``) and checked against the band the module docstring states.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgym import REPO_ROOT
from chunkgym.config import ConfigError
from envs.serving.fleet import LINKS
from envs.serving.kv_transfer import (
    Link,
    LinkSpec,
    completion_times,
    exposed_transfer_time,
    kv_heads_per_gpu,
    kv_transfer_bytes,
    link_names,
    load_link,
    transfer_time,
)
from envs.serving.specs import load_model

VALIDATION = REPO_ROOT / "calibration" / "kv_transfer_validation.csv"
BAND = 3.0  # predicted/measured within [1/BAND, BAND] on the rows marked in_band (module docstring)

bandwidths = st.floats(1e6, 1e12)
latencies = st.just(0.0) | st.floats(1e-9, 1e-3)  # no subnormal floats: their rounding is not the model's
sizes = st.just(0.0) | st.floats(1.0, 1e10)
batches = st.lists(st.tuples(st.floats(0.0, 10.0), sizes), min_size=1, max_size=12)


def spec(bw: float = 1e9, base: float = 0.0) -> LinkSpec:
    return LinkSpec("test", bw, base)


def close(a: float, b: float, scale: float = 1.0) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9 * scale)


# --- the link files -------------------------------------------------------------------------------


def test_every_fleet_link_kind_has_a_file_with_its_source():
    assert link_names() == sorted(LINKS)
    for name in LINKS:
        link = load_link(name)
        assert link.name == name and link.bandwidth_bytes_s > 0 and link.base_latency_s > 0 and link.source


def test_the_nvlink_file_matches_the_default_hardware():
    from envs.serving.specs import load_hardware

    assert load_link("nvlink").bandwidth_bytes_s == load_hardware("a100_80gb").interconnect_bandwidth / 2


def test_links_order_by_speed():
    bw = [load_link(n).bandwidth_bytes_s for n in ("eth_25g", "ib_200g", "ib_400g", "nvlink")]
    assert bw == sorted(bw) and load_link("eth_25g").base_latency_s > load_link("ib_400g").base_latency_s


def test_an_unknown_link_names_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown link 'tcp'; valid names: eth_25g, ib_200g, ib_400g, nvlink"
    ):
        load_link("tcp")


GOOD = "name: {name}\nbandwidth_bytes_s: 1.0e9\nbase_latency_s: 1.0e-6\nsource: a test\n"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (GOOD.replace("1.0e9", "-1.0e9"), "bandwidth_bytes_s"),
        (GOOD.replace("1.0e9", "0"), "bandwidth_bytes_s"),
        (GOOD.replace("1.0e9", ".inf"), "bandwidth_bytes_s"),
        (GOOD.replace("1.0e9", ".nan"), "bandwidth_bytes_s"),
        (GOOD.replace("1.0e-6", "0"), "base_latency_s"),
        (GOOD.replace("1.0e-6", "-1.0e-6"), "base_latency_s"),
        (GOOD.replace("1.0e-6", "fast"), "base_latency_s"),
        (GOOD + "extra: 1\n", "extra"),
        (GOOD.replace("name: {name}", "name: other"), "name"),
    ],
)
def test_the_loader_refuses_bad_values_naming_file_and_field(tmp_path: Path, text: str, field: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text.format(name="bad"))
    with pytest.raises(ValueError) as err:
        load_link("bad", tmp_path)
    message = str(err.value)
    assert str(path) in message and field in message and "\n" not in message, message


def test_the_loader_reads_a_good_file(tmp_path: Path):
    (tmp_path / "ok.yaml").write_text(GOOD.format(name="ok"))
    assert load_link("ok", tmp_path) == LinkSpec("ok", 1e9, 1e-6, "a test")


def test_a_bad_file_is_a_config_error(tmp_path: Path):
    (tmp_path / "bad.yaml").write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_link("bad", tmp_path)


def test_a_spec_in_code_is_checked():
    with pytest.raises(ValueError, match="bandwidth_bytes_s"):
        LinkSpec("x", 0.0, 0.0)
    with pytest.raises(ValueError, match="base_latency_s"):
        LinkSpec("x", 1.0, -1.0)
    assert LinkSpec("x", 1.0, 0.0).base_latency_s == 0.0  # an ideal link, for what-ifs


# --- bytes ----------------------------------------------------------------------------------------


def test_bytes_of_a_known_model():
    m = load_model("llama2_70b")  # 80 layers, 8 KV heads of 128, bf16: 320 KiB per token
    assert kv_transfer_bytes(m, 1, 1) == m.kv_bytes_per_token == 327680
    assert kv_transfer_bytes(m, 1000, 8) == 1000 * 327680 // 8
    assert kv_transfer_bytes(m, 0, 4) == 0


@pytest.mark.parametrize("name", ["llama2_7b", "llama3_8b", "llama2_70b", "llama3_2_1b", "engine_small"])
@given(tokens=st.integers(0, 200_000), k=st.integers(1, 5))
@settings(max_examples=25, deadline=None)
def test_bytes_are_linear_in_tokens_and_divide_by_tp(name: str, tokens: int, k: int):
    m = load_model(name)
    assert kv_transfer_bytes(m, k * tokens, 1) == k * kv_transfer_bytes(m, tokens, 1)
    for tp in (1, 2, 4, 8):
        if tp <= m.num_kv_heads and m.num_kv_heads % tp == 0:
            assert kv_transfer_bytes(m, tokens, tp) * tp == m.kv_bytes_per_token * tokens
            assert kv_heads_per_gpu(m, tp) == m.num_kv_heads // tp


def test_more_gpus_than_kv_heads_replicate_one_head_each():
    m = load_model("engine_small")  # 1 KV head
    assert kv_heads_per_gpu(m, 4) == 1
    assert kv_transfer_bytes(m, 10, 4) == kv_transfer_bytes(m, 10, 1) == 10 * m.kv_bytes_per_token
    m8 = load_model("llama3_8b")  # 8 KV heads: tp 16 replicates each on 2 GPUs
    assert kv_transfer_bytes(m8, 10, 16) == kv_transfer_bytes(m8, 10, 8)


def test_bad_tp_or_tokens_are_refused():
    m = load_model("llama3_8b")
    for tp in (0, 3, 12, True):
        with pytest.raises(ValueError, match="tp"):
            kv_transfer_bytes(m, 10, tp)  # type: ignore[arg-type]
    for tokens in (-1, 1.5):
        with pytest.raises(ValueError, match="tokens"):
            kv_transfer_bytes(m, tokens, 1)  # type: ignore[arg-type]


# --- alone, and twice as fast --------------------------------------------------------------------


def test_transfer_time_alone():
    link = spec(1e9, 5e-6)
    assert transfer_time(link, 2e9) == pytest.approx(2.0 + 5e-6)
    assert transfer_time(link, 0) == 5e-6
    with pytest.raises(ValueError, match="nbytes"):
        transfer_time(link, -1)


@given(bw=bandwidths, base=latencies, nbytes=sizes)
def test_twice_as_fast_halves_the_time_above_the_base_latency(bw: float, base: float, nbytes: float):
    slow, fast = spec(bw, base), spec(2 * bw, base)
    assert close(
        transfer_time(fast, nbytes) - base, (transfer_time(slow, nbytes) - base) / 2, base + nbytes / bw
    )


@given(bw=bandwidths, base=latencies, start=st.floats(0, 10), batch=st.lists(sizes, min_size=1, max_size=10))
def test_twice_as_fast_halves_shared_times_of_a_common_start(bw, base, start, batch):
    starts = [start] * len(batch)
    slow = completion_times(spec(bw, base), starts, batch) - start - base
    fast = completion_times(spec(2 * bw, base), starts, batch) - start - base
    np.testing.assert_allclose(fast, slow / 2, rtol=1e-9, atol=1e-9 * (start + base + sum(batch) / bw))


@given(bw=bandwidths, base=latencies, batch=batches)
def test_twice_as_fast_with_twice_as_early_readiness_halves_every_completion(bw, base, batch):
    """Time-scale invariance of fair sharing: bandwidth x2 and every ready time (start + base) /2
    gives every completion /2, whatever the overlaps."""
    starts = np.array([s for s, _ in batch])
    nbytes = [b for _, b in batch]
    slow = completion_times(spec(bw, base), starts, nbytes)
    fast = completion_times(spec(2 * bw, base), (starts + base) / 2 - base, nbytes)
    np.testing.assert_allclose(fast, slow / 2, rtol=1e-9, atol=1e-9 * (max(nbytes) / bw + 10))


# --- fair sharing ---------------------------------------------------------------------------------


@given(bw=bandwidths, base=latencies, start=st.floats(0, 10), size=sizes, k=st.integers(1, 20))
def test_k_equal_transfers_started_together_finish_at_base_plus_k_sizes(bw, base, start, size, k):
    done = completion_times(spec(bw, base), [start] * k, [size] * k)
    np.testing.assert_allclose(done, start + base + k * size / bw, rtol=1e-9, atol=1e-12)


def busy_time(ready: np.ndarray, done: np.ndarray) -> float:
    """Measure of the union of [ready_i, done_i]: the time some transfer's bytes were flowing."""
    total, end = 0.0, -math.inf
    for r, d in sorted(zip(ready, done, strict=True)):
        if d > end:
            total += d - max(r, end)
            end = d
    return total


@given(bw=bandwidths, base=latencies, batch=batches)
@settings(max_examples=200)
def test_bytes_are_conserved_and_the_makespan_is_bounded(bw, base, batch):
    starts = np.array([s for s, _ in batch])
    nbytes = np.array([b for _, b in batch])
    done = completion_times(spec(bw, base), starts, nbytes)
    ready = starts + base
    scale = nbytes.sum() / bw + 10
    assert (done >= ready + nbytes / bw - 1e-9 * scale).all()  # nobody beats running alone
    # work conservation: while any transfer flows, the link serves bandwidth bytes/s, all to them
    tol = 1e-9 * nbytes.sum() + 1e-12 * done.max() * bw  # rounding of the times themselves
    assert math.isclose(busy_time(ready, done) * bw, nbytes.sum(), rel_tol=1e-9, abs_tol=tol)
    # the last completion is no earlier than the first start + base + all bytes at full bandwidth
    assert done.max() >= starts.min() + base + nbytes.sum() / bw - 1e-9 * scale


@given(bw=bandwidths, base=latencies, batch=batches)
def test_transfers_that_never_overlap_take_their_alone_time(bw, base, batch):
    link = spec(bw, base)
    nbytes = [b for _, b in batch]
    starts, t = [], 0.0
    for gap, b in batch:  # each starts after the previous one has finished
        t += gap
        starts.append(t)
        t += transfer_time(link, b) * (1 + 1e-9) + 1e-12
    done = completion_times(link, starts, nbytes)
    alone = np.array(starts) + [transfer_time(link, b) for b in nbytes]
    np.testing.assert_allclose(done, alone, rtol=1e-9, atol=1e-12)


@given(bw=bandwidths, base=latencies, batch=batches)
@settings(max_examples=100)
def test_a_contiguous_busy_period_ends_at_first_ready_plus_all_bytes(bw, base, batch):
    """All transfers ready before any finishes: the link is busy from the first ready time on."""
    starts = np.array([s * 1e-9 for s, _ in batch])  # all start within 10 ns
    nbytes = np.array([b for _, b in batch]) + bw * 2e-8  # and each takes longer than that alone
    done = completion_times(spec(bw, base), starts, nbytes)
    assert close(done.max(), starts.min() + base + nbytes.sum() / bw, nbytes.sum() / bw)


def reference_completions(link: LinkSpec, starts: list[float], nbytes: list[float]) -> list[float]:
    """A second, independent implementation of the rule: step from event to event, keeping each
    flowing transfer's remaining bytes (no finish tags)."""
    ready = [s + link.base_latency_s for s in starts]
    left = list(nbytes)
    done = [math.nan] * len(starts)
    t = min(ready)
    while any(math.isnan(d) for d in done):
        flowing = [i for i in range(len(left)) if math.isnan(done[i]) and ready[i] <= t]
        upcoming = [r for i, r in enumerate(ready) if r > t]
        rate = link.bandwidth_bytes_s / len(flowing) if flowing else 0.0
        finish = t + min(left[i] for i in flowing) / rate if flowing else math.inf
        t_next = min(finish, min(upcoming, default=math.inf))
        for i in flowing:
            left[i] -= (t_next - t) * rate
            if t_next == finish and left[i] <= 1e-9 * nbytes[i] + 1e-6:
                done[i] = t_next
        t = t_next
    return done


@given(
    bw=st.floats(1e3, 1e6),
    base=latencies,
    batch=st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(1e3, 1e6)), min_size=1, max_size=8),
)
@settings(max_examples=200)
def test_the_event_model_agrees_with_a_remaining_bytes_simulation(bw, base, batch):
    starts = [s for s, _ in batch]
    nbytes = [b for _, b in batch]
    got = completion_times(spec(bw, base), starts, nbytes)
    np.testing.assert_allclose(
        got, reference_completions(spec(bw, base), starts, nbytes), rtol=1e-6, atol=1e-6
    )


def test_a_hand_worked_example():
    # bandwidth 1 byte/s, base 1 s.  A: 4 bytes at t=0 (flows from 1).  B: 2 bytes at t=1 (flows from 2).
    # 1..2: A alone, 1 byte (3 left).  From 2: both at 1/2: B's 2 bytes take 4 s -> B done at 6, A has
    # 1 left, alone -> done at 7.
    np.testing.assert_allclose(completion_times(spec(1.0, 1.0), [0, 1], [4, 2]), [7.0, 6.0])


def test_the_incremental_link_matches_the_batch_function():
    link = Link(spec(1.0, 1.0))
    link.start(0, 0.0, 4.0)
    assert link.next_completion() == (5.0, 0)  # alone it would finish at 5
    assert link.advance(1.0) == [] and link.active == 1
    link.start(1, 1.0, 2.0)
    assert link.next_completion() == (6.0, 1)  # the peek admits B at 2 without moving
    assert link.now == 1.0 and link.flowing == 1
    assert link.advance(6.0) == [(6.0, 1)]
    assert link.drain() == [(7.0, 0)]
    assert link.next_completion() is None and link.active == 0


def test_starting_past_an_uncollected_completion_is_refused():
    link = Link(spec(1.0, 0.0))
    link.start(0, 0.0, 1.0)
    with pytest.raises(ValueError, match="advance"):
        link.start(1, 5.0, 1.0)
    assert link.advance(5.0) == [(1.0, 0)]
    link.start(1, 5.0, 1.0)
    with pytest.raises(ValueError, match="already"):
        link.start(1, 5.0, 1.0)
    with pytest.raises(ValueError, match="before"):
        link.start(2, 4.0, 1.0)


@given(bw=bandwidths, base=latencies, batch=batches)
@settings(max_examples=100)
def test_peeking_predicts_each_completion(bw, base, batch):
    starts = sorted(s for s, _ in batch)
    link = Link(spec(bw, base))
    for i, (t, (_, b)) in enumerate(zip(starts, batch, strict=True)):
        link.advance(t) if link.active else None
        link.start(i, t, b)
    expected = completion_times(spec(bw, base), starts, [b for _, b in batch])
    while (nxt := link.next_completion()) is not None:
        when, tid = nxt
        got = link.advance(when)
        assert got and got[0][1] == tid
        for t, i in got:
            assert close(t, expected[i], 1 + max(b for _, b in batch) / bw)


def test_completion_times_refuses_mismatched_or_bad_input():
    with pytest.raises(ValueError, match="one size per start"):
        completion_times(spec(), [0, 1], [1])
    with pytest.raises(ValueError, match="finite"):
        completion_times(spec(), [0], [-1])
    assert completion_times(spec(), [], []).shape == (0,)


# --- layer-wise streaming -------------------------------------------------------------------------


@given(bw=bandwidths, base=latencies, nbytes=sizes, prefill=st.floats(0, 10), layers=st.integers(1, 128))
def test_exposure_lies_between_the_base_latency_and_the_alone_time(bw, base, nbytes, prefill, layers):
    link = spec(bw, base)
    exposed = exposed_transfer_time(link, nbytes, prefill, layers)
    assert base - 1e-15 <= exposed <= transfer_time(link, nbytes) * (1 + 1e-12) + 1e-15


def per_layer_simulation(link: LinkSpec, nbytes: float, prefill: float, layers: int) -> float:
    """The rule of the docstring, step by step: layers ready at prefill*(i+1)/L, served in order."""
    t = 0.0
    for i in range(layers):
        t = max(t, prefill * (i + 1) / layers) + nbytes / layers / link.bandwidth_bytes_s
    return link.base_latency_s + max(0.0, t - prefill)


@given(bw=bandwidths, base=latencies, nbytes=sizes, prefill=st.floats(0, 10), layers=st.integers(1, 96))
def test_exposure_equals_the_layer_by_layer_simulation(bw, base, nbytes, prefill, layers):
    link = spec(bw, base)
    assert close(
        exposed_transfer_time(link, nbytes, prefill, layers),
        per_layer_simulation(link, nbytes, prefill, layers),
        prefill + nbytes / bw,
    )


def test_a_link_much_faster_than_the_prefill_leaves_only_base_plus_one_layer():
    link = spec(1e12, 5e-6)
    nbytes, layers = 1e9, 80  # 1 ms of bandwidth time against a 300 ms prefill
    exposed = exposed_transfer_time(link, nbytes, 0.3, layers)
    assert exposed == pytest.approx(5e-6 + 1e-3 / 80)
    # the bandwidth-bound part vanishes as the link outpaces the prefill
    faster = exposed_transfer_time(spec(1e18, 5e-6), nbytes, 0.3, layers)
    assert faster - 5e-6 == pytest.approx(0.0, abs=1e-8)


def test_without_a_prefill_to_hide_behind_the_whole_transfer_is_exposed():
    link = spec(1e9, 5e-6)
    assert exposed_transfer_time(link, 1e9, 0.0, 32) == pytest.approx(transfer_time(link, 1e9))
    assert exposed_transfer_time(link, 1e9, 1.0, 1) == pytest.approx(transfer_time(link, 1e9))  # one layer
    with pytest.raises(ValueError, match="num_layers"):
        exposed_transfer_time(link, 1e9, 1.0, 0)
    with pytest.raises(ValueError, match="prefill_s"):
        exposed_transfer_time(link, 1e9, -1.0, 4)


# --- validation against published measurements ----------------------------------------------------


def validation_rows() -> list[dict[str, str]]:
    with VALIDATION.open(newline="") as f:
        return list(csv.DictReader(f))


def predicted_s(row: dict[str, str]) -> float:
    link = load_link(row["link"])
    if row["bandwidth_bytes_s"]:  # the measured system's own link speed where the conf file's differs
        link = dataclasses.replace(link, bandwidth_bytes_s=float(row["bandwidth_bytes_s"]))
    return transfer_time(link, int(row["bytes"]) / int(row["tp"]))


def test_the_validation_rows_are_well_formed():
    rows = validation_rows()
    assert len(rows) >= 3
    assert list(rows[0]) == [
        "source", "system", "link", "model", "tokens", "bytes", "tp", "bandwidth_bytes_s",
        "measured_s", "in_band", "notes",
    ]  # fmt: skip
    for row in rows:
        assert row["source"] and row["notes"] and row["link"] in LINKS and row["in_band"] in ("yes", "no")
        assert float(row["measured_s"]) > 0 and int(row["bytes"]) > 0 and int(row["tp"]) >= 1
        if row["model"]:  # bytes are the model's KV of that many tokens
            m = load_model(row["model"])
            assert int(row["bytes"]) == int(row["tokens"]) * m.kv_bytes_per_token
            assert int(row["bytes"]) // int(row["tp"]) == kv_transfer_bytes(
                m, int(row["tokens"]), int(row["tp"])
            )


def test_published_measurements_are_predicted_within_the_band():
    print(f"\nKV transfer validation (predicted / measured; band {BAND}x on in_band rows):")
    outside = []
    for row in validation_rows():
        pred, meas = predicted_s(row), float(row["measured_s"])
        ratio = pred / meas
        print(
            f"  {row['system']:<78} {row['link']:<8} pred {pred:.4g} s  meas {meas:.4g} s  ratio {ratio:.2f}"
        )
        if row["in_band"] == "yes" and not 1 / BAND <= ratio <= BAND:
            outside.append((row["system"], ratio))
        if row["in_band"] == "no":
            assert ratio < 1, (row["system"], ratio)  # left-out overheads only ever make it slower
    assert not outside, outside
