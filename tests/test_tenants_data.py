"""Tenants and SLO classes on the data side: labelled trace files, SLO classes, mix workloads."""

from __future__ import annotations

import collections
import hashlib
import json
import math
import pickle

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkgym.config import ConfigError, from_mapping
from envs.serving.metrics import load_slo
from envs.serving.slo_classes import load_slo_class, slo_class_names
from envs.serving.workload import WORKLOAD_DIR, TenantSpec, Workload, WorkloadSpec, load_workload
from envs.serving.workloads import files
from envs.serving.workloads.trace import DEFAULT_TENANT, Trace, TraceError

MIXES = sorted(p.stem for p in WORKLOAD_DIR.glob("mix_*.yaml"))


def _mooncake(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _record(ts, n_in=10, **labels):
    return {
        "timestamp": ts,
        "input_length": n_in,
        "output_length": 3,
        "hash_ids": [ts] * math.ceil(n_in / 512),
        **labels,
    }


def _lengths(path, prompt, n, tenant=None):
    header = "num_prefill_tokens,num_decode_tokens" + (",Tenant" if tenant else "")
    row = f"{prompt},5" + (f",{tenant}" if tenant else "")
    path.write_text(header + "\n" + "\n".join([row] * n) + "\n")
    return path


# ---- readers ---------------------------------------------------------------------------
def test_mooncake_labels_follow_the_time_sort(tmp_path):
    rows = [_record(2000, tenant="b", slo_class="batch"), _record(1000, tenant="a", slo_class="interactive")]
    got = files.read_rows(_mooncake(tmp_path / "t.jsonl", rows), "mooncake")
    assert got.times.tolist() == [1.0, 2.0]
    assert got.tenant == ("a", "b") and got.slo_class == ("interactive", "batch")


def test_csv_labels_in_azure_and_length_files(tmp_path):
    azure = tmp_path / "a.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens,Tenant,SloClass\n"
        "2023-11-16 18:00:02,5,6, acme ,standard\n2023-11-16 18:00:01,7,8,zeta,batch\n"
    )
    got = files.read_rows(azure, "azure")
    assert (
        got.prompt.tolist() == [7, 5]
        and got.tenant == ("zeta", "acme")
        and got.slo_class == ("batch", "standard")
    )
    lengths = files.read_rows(_lengths(tmp_path / "l.csv", 9, 3, tenant="t1"), "lengths")
    assert lengths.tenant == ("t1",) * 3 and lengths.slo_class is None


def test_labels_change_no_array(tmp_path):
    plain = [_record(1000 * i, 600 + i) for i in range(5)]
    labelled = [dict(r, tenant=f"t{i % 2}") for i, r in enumerate(plain)]
    a = files.read_rows(_mooncake(tmp_path / "a.jsonl", plain), "mooncake")
    b = files.read_rows(_mooncake(tmp_path / "b.jsonl", labelled), "mooncake")
    assert a.tenant is None and a.slo_class is None and b.slo_class is None
    for x, y in ((a.times, b.times), (a.prompt, b.prompt), (a.output, b.output)):
        assert x.tobytes() == y.tobytes()
    assert all(np.array_equal(x, y) for x, y in zip(a.hash_ids, b.hash_ids, strict=True))


@pytest.mark.parametrize(
    ("labels", "field", "needle"),
    [
        ({"tenant": ""}, "tenant", "empty label"),
        ({"tenant": 7}, "tenant", "expected text, got int"),
        ({"tenant": "x" * 65}, "tenant", "over the limit of 64"),
        ({"tenant": "a\nb"}, "tenant", "not printable"),
        ({"tenant": " a"}, "tenant", "whitespace"),
        ({"slo_class": "gold"}, "slo_class", "unknown slo_class 'gold'"),
        ({"slo_class": "x" * 10_000}, "slo_class", "over the limit"),
    ],
)
def test_bad_json_labels_are_one_line_errors(tmp_path, labels, field, needle):
    path = _mooncake(
        tmp_path / "t.jsonl",
        [
            _record(0, tenant="a", slo_class="batch"),
            _record(1000, **{"tenant": "a", "slo_class": "batch", **labels}),
        ],
    )
    with pytest.raises(TraceError) as err:
        files.read_rows(path, "mooncake")
    message = str(err.value)
    assert "\n" not in message and f"{path}:2: field {field!r}" in message and needle in message
    assert len(message) < 400


def test_a_label_on_some_records_only_is_refused(tmp_path):
    for rows, line in (
        ([_record(0, tenant="a"), _record(1000)], 2),
        ([_record(0), _record(1000, tenant="a")], 2),
    ):
        path = _mooncake(tmp_path / "t.jsonl", rows)
        with pytest.raises(TraceError, match=rf":{line}: field 'tenant': .*every record has it or none does"):
            files.read_rows(path, "mooncake")


@pytest.mark.parametrize(
    ("cell", "needle"), [("", "missing value"), ("gold", "unknown slo_class"), ("x" * 70, "over the limit")]
)
def test_bad_csv_labels_name_file_line_and_column(tmp_path, cell, needle):
    path = tmp_path / "l.csv"
    path.write_text(f"num_prefill_tokens,num_decode_tokens,SloClass\n1,1,batch\n2,2,{cell}\n")
    with pytest.raises(TraceError) as err:
        files.read_rows(path, "lengths")
    assert str(err.value).startswith(f"{path}:3: field 'SloClass': ") and needle in str(err.value)
    assert "\n" not in str(err.value)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_any_tenant_text_is_read_or_refused_in_one_line(tmp_path_factory, text):
    path = _mooncake(
        tmp_path_factory.mktemp("f") / "t.jsonl", [_record(0, tenant=text), _record(1000, tenant="ok")]
    )
    try:
        rows = files.read_rows(path, "mooncake")
    except TraceError as exc:
        assert "\n" not in str(exc) and ":1: field 'tenant'" in str(exc)
    else:
        assert rows.tenant == (text, "ok") and 0 < len(text) <= 64 and text.isprintable()


# ---- Trace ------------------------------------------------------------------------------
def _trace(n=4, tenant=("a", "b", "a", "c"), slo_class=("batch", "interactive", "batch", "standard")):
    return Trace(
        "t",
        "mem",
        np.arange(n, dtype=float),
        np.full(n, 600),
        np.full(n, 2),
        None,
        0,
        float(n),
        tenant=tenant,
        slo_class=slo_class,
    )


def test_trace_transforms_carry_labels():
    t = _trace()
    part = t.slice(1, 3)
    assert part.tenant == ("b", "a") and part.slo_class == ("interactive", "batch")
    short = t.scale_lengths(3.0)
    assert short.tenant == t.tenant and short.slo_class == t.slo_class
    back = pickle.loads(pickle.dumps(t))
    assert back.tenant == t.tenant and back.slo_class == t.slo_class
    assert (
        Trace("u", "mem", np.zeros(2), np.ones(2), np.ones(2), None, 0, 1.0).tenants()
        == (DEFAULT_TENANT,) * 2
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"tenant": ("a",)}, "1 tenant labels for 4 requests"),
        ({"slo_class": ("gold",) * 4}, "unknown slo_class 'gold'"),
        ({"tenant": ("",) * 4}, "empty label"),
    ],
)
def test_trace_refuses_bad_labels(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        _trace(**kwargs)


def test_file_workload_windows_keep_labels_aligned(tmp_path):
    rows = [_record(1000 * i, 100 + i, tenant=f"t{i % 3}", slo_class="batch") for i in range(200)]
    w = load_workload(f"file:{_mooncake(tmp_path / 't.jsonl', rows)}")
    for trace in (w.window("test", 3, 2.0, 20.0), w.split("train", 0, 0.5)):
        assert len(trace.tenant) == len(trace) and set(trace.slo_class) == {"batch"}
        rows_of = trace.prompt_len - 100  # each request's file row
        assert trace.tenant == tuple(f"t{i % 3}" for i in rows_of.tolist())


# ---- SLO classes -------------------------------------------------------------------------
def test_slo_classes_bracket_the_run_level_slos():
    assert slo_class_names() == ["batch", "interactive", "standard"]
    c = {n: load_slo_class(n) for n in slo_class_names()}
    strict, relaxed = load_slo("strict"), load_slo("relaxed")
    assert (c["interactive"].weight, c["standard"].weight, c["batch"].weight) == (3.0, 2.0, 1.0)
    for key in ("tpot_multiplier", "ttft_base_s", "ttft_factor"):
        assert getattr(c["interactive"], key) < getattr(strict, key)
        assert getattr(c["standard"], key) == getattr(strict, key)
        assert getattr(c["batch"], key) > getattr(relaxed, key)
    assert (
        c["batch"].slo_spec().name == "batch"
        and c["batch"].slo_spec().tpot_multiplier == c["batch"].tpot_multiplier
    )
    with pytest.raises(
        ValueError, match="unknown slo_class 'gold'; valid names: batch, interactive, standard"
    ):
        load_slo_class("gold")


# ---- mixes -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two length-only files: 50,000 short prompts and 50,000 long ones (10,000 in each test split)."""
    folder = tmp_path_factory.mktemp("sources")
    return _lengths(folder / "short.csv", 10, 50_000), _lengths(folder / "long.csv", 5000, 50_000)


def _mix(sources, shares=(3.0, 1.0), base_rate=8.0, window_s=200.0, extra=()):
    short, long = sources
    tenants = [
        TenantSpec("chat", f"file:{short}", shares[0], "interactive"),
        TenantSpec("docs", f"file:{long}", shares[1], "batch"),
        *extra,
    ]
    return Workload(WorkloadSpec("m", "mix", base_rate=base_rate, window_s=window_s, tenants=tenants))


def test_mix_merges_by_time_with_labels_aligned(sources):
    t = _mix(sources).window("test", 5)
    assert np.all(np.diff(t.arrival_s) >= 0) and t.span_s == pytest.approx(200.0)
    pairs = set(zip(t.tenant, t.prompt_len.tolist(), strict=True))
    assert pairs == {("chat", 10), ("docs", 5000)}  # every request keeps its tenant's label
    assert all(
        (p == 10) == (c == "interactive") for p, c in zip(t.prompt_len.tolist(), t.slo_class, strict=True)
    )
    assert t.hash_ids is None and t.first_row == -1 and t.source.startswith("mix:file:")


@settings(max_examples=15, deadline=None)
@given(st.floats(0.1, 10.0), st.floats(0.1, 10.0), st.integers(0, 2**32 - 1))
def test_request_counts_follow_shares(sources, a, b, seed):
    t = _mix(sources, (a, b), base_rate=20.0, window_s=400.0).window("test", seed)
    counts = collections.Counter(t.tenant)
    for name, share in (("chat", a), ("docs", b)):
        expected = 20.0 * 400.0 * share / (a + b)
        assert abs(counts[name] - expected) <= 5 * math.sqrt(expected) + 3  # Poisson arrivals


def test_mix_is_deterministic_per_seed_and_load_scales_every_tenant(sources):
    w = _mix(sources)
    a, b, c = w.window("val", 1), w.window("val", 1), w.window("val", 2)
    assert a.arrival_s.tobytes() == b.arrival_s.tobytes() and a.tenant == b.tenant
    assert a.arrival_s.tobytes() != c.arrival_s.tobytes()
    fast = w.window("val", 1, load_scale=4.0)
    assert fast.tenant == a.tenant and fast.prompt_len.tobytes() == a.prompt_len.tobytes()
    assert np.allclose(fast.arrival_s * 4.0, a.arrival_s) and fast.span_s == pytest.approx(a.span_s / 4.0)


def test_mix_split_is_cut_at_the_shortest_tenant(sources):
    t = _mix(sources, base_rate=8.0).split("test", 0)
    counts = collections.Counter(t.tenant)
    assert counts["chat"] == 10_000  # chat (6 req/s) runs out first: all of its split's rows
    assert abs(counts["docs"] - 10_000 / 3) < 5 * math.sqrt(10_000 / 3) and t.arrival_s[-1] <= t.span_s


def test_mix_hash_spaces_stay_apart(sources, tmp_path):
    rows = [_record(1000 * i, 1200) for i in range(300)]  # ids [i, i, i]: one file's blocks
    first = _mooncake(tmp_path / "a.jsonl", rows)
    second = _mooncake(tmp_path / "b.jsonl", rows)
    extra = (
        TenantSpec("agent_a", f"file:{first}", 1.0, "standard"),
        TenantSpec("agent_b", f"file:{second}", 1.0, "standard"),
    )
    t = _mix(sources, extra=extra).window("test", 0)
    assert t.hash_block_tokens == files.MOONCAKE_BLOCK_TOKENS
    owners: dict[int, set[str]] = collections.defaultdict(set)
    for who, ids, prompt in zip(t.tenant, t.hash_ids, t.prompt_len.tolist(), strict=True):
        assert len(ids) == math.ceil(prompt / 512)
        for h in ids.tolist():
            owners[h].add(who)
    assert all(len(who) == 1 for who in owners.values())  # no id shared across files or hashless tenants
    agent = [ids for who, ids in zip(t.tenant, t.hash_ids, strict=True) if who == "agent_a"]
    assert all(len(set(ids.tolist())) == 1 for ids in agent)  # a file's equal ids stay equal


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"slo_class": "gold"}, "tenants[0].slo_class: unknown slo_class 'gold'"),
        ({"share": 0.0}, "tenants[0].share: must be a finite number > 0"),
        ({"name": "docs"}, "tenants[1].name: name 'docs' repeats"),
        ({"name": "a\tb"}, "not printable"),
    ],
)
def test_bad_mix_specs_are_one_line_errors(tmp_path, change, needle):
    data = yaml.safe_load((WORKLOAD_DIR / "mix_chat_batch.yaml").read_text())
    data["tenants"][0].update(change)
    data["tenants"][1]["name"] = "docs"
    with pytest.raises(ConfigError) as err:
        from_mapping(WorkloadSpec, data, "mix.yaml")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_mixes_do_not_nest_and_tenants_need_a_mix():
    with pytest.raises(ValueError, match="is a mix; mixes do not nest"):
        Workload(
            WorkloadSpec("m", "mix", base_rate=1.0, tenants=[TenantSpec("x", "mix_flood", 1.0, "batch")])
        )
    with pytest.raises(ValueError, match="tenants are for format 'mix' only"):
        WorkloadSpec("w", "azure", path="x.csv", tenants=[TenantSpec("x", "azure_conv", 1.0, "batch")])


@pytest.mark.parametrize("name", MIXES)
def test_shipped_mixes_parse(name):
    spec = from_mapping(WorkloadSpec, yaml.safe_load((WORKLOAD_DIR / f"{name}.yaml").read_text()), name)
    assert spec.format == "mix" and spec.name == name and len(spec.tenants) >= 2
    assert {"mix_agent", "mix_chat_batch", "mix_flood"} <= set(MIXES)


@pytest.mark.needs_data("azure_llm_2023", "mooncake", "arxiv_lengths")
@pytest.mark.parametrize("name", MIXES)
def test_shipped_mixes_follow_their_shares(name):
    w = load_workload(name)
    t = w.split("test", 0)
    counts = collections.Counter(t.tenant)
    total = sum(x.share for x in w.spec.tenants)
    for tenant in w.spec.tenants:
        expected = len(t) * tenant.share / total
        assert abs(counts[tenant.name] - expected) <= 0.05 * expected + 5 * math.sqrt(expected)
    win = w.window("test", 1)
    assert win.span_s == pytest.approx(w.spec.window_s / w.spec.rate_scale) and set(win.tenant) == set(counts)


# ---- existing traces ---------------------------------------------------------------------
SYNTHETIC_BEFORE = {
    ("test", 0): "f9fb7aefb9ce833b",
    ("train", 1): "ee642738cda43ae0",
    ("val", 2): "2aef4f3a32f02a50",
}
"""Digests of synthetic_azure_conv windows at load 2 taken before tenants existed."""


@pytest.mark.parametrize(("split", "seed"), list(SYNTHETIC_BEFORE))
def test_unlabelled_workloads_are_bit_identical(split, seed):
    t = load_workload("synthetic_azure_conv").window(split, seed, 2.0)
    h = hashlib.sha256()
    for a in (t.arrival_s, t.prompt_len, t.output_len):
        h.update(a.tobytes())
    h.update(repr((t.span_s, t.offset_s, t.first_row, t.name, t.source, t.hash_block_tokens)).encode())
    assert h.hexdigest()[:16] == SYNTHETIC_BEFORE[(split, seed)]
    assert t.tenant is None and t.slo_class is None
