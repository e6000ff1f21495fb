"""Bad inputs: trace files (file, line and field named), specs, names, splits, seeds, missing data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from chunkgym.config import from_mapping
from envs.serving.workload import (
    TraceError,
    Workload,
    WorkloadSpec,
    load_workload,
    workload_names,
)

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:15:46.6805900,374,44\n"
LENGTH_HEADER = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def open_file(path, fmt, **fields):
    fields.setdefault("base_rate", 4.0 if fmt == "lengths" else 0.0)
    return Workload(WorkloadSpec(name="t", format=fmt, path=str(path), **fields))


def assert_names(err, path, line, field):
    message = str(err.value)
    assert str(path) in message and f":{line}:" in message, message
    if field is not None:
        assert repr(field) in message, message
    assert (err.value.path, err.value.line, err.value.field) == (str(path), line, field)


@pytest.mark.parametrize(
    ("body", "line", "field"),
    [
        (AZURE_ROW + "2023-11-16 18:15:47.1,abc,12\n", 3, "ContextTokens"),
        (AZURE_ROW + AZURE_ROW + "2023-11-16 18:15:48.0,0,12\n", 4, "ContextTokens"),
        (AZURE_ROW + "2023-11-16 18:15:48.0,-5,12\n", 3, "ContextTokens"),
        (AZURE_ROW + "2023-11-16 18:15:48.0,12,0\n", 3, "GeneratedTokens"),
        (AZURE_ROW + "2023-11-16 18:15:48.0,12,2.5\n", 3, "GeneratedTokens"),
        (AZURE_ROW + "2023-11-16 18:15:48.0,12,\n", 3, "GeneratedTokens"),
        (AZURE_ROW + "yesterday,12,4\n", 3, "TIMESTAMP"),
        (AZURE_ROW + "\n" + "2023-11-16 18:15:48.0,x,4\n", 4, "ContextTokens"),  # blank lines keep numbering
    ],
)
def test_azure_bad_cells(tmp_path, body, line, field):
    path = write(tmp_path, "azure.csv", AZURE_HEADER + body)
    with pytest.raises(TraceError) as err:
        open_file(path, "azure")
    assert_names(err, path, line, field)


def test_azure_missing_column(tmp_path):
    path = write(tmp_path, "azure.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,374\n")
    with pytest.raises(TraceError) as err:
        open_file(path, "azure")
    assert_names(err, path, 1, "GeneratedTokens")


def test_azure_blank_lines_are_not_requests_and_rows_sort_by_time(tmp_path):
    body = "2023-11-16 18:15:50.0,300,30\n\n2023-11-16 18:15:46.0,100,10\n2023-11-16 18:15:48.5,200,20\n"
    w = open_file(write(tmp_path, "azure.csv", AZURE_HEADER + body), "azure")
    whole = w.split("all")
    assert whole.prompt_len.tolist() == [100, 200, 300]
    assert whole.arrival_s.tolist() == [0.0, 2.5, 4.0]


@pytest.mark.parametrize(
    ("body", "line", "field"),
    [
        ("10,5,15,2.0\n7,zero,7,1\n", 3, "num_decode_tokens"),
        ("10,5,15,2.0\n0,5,5,0\n", 3, "num_prefill_tokens"),
        ("10,5,15,2.0\n3.5,5,8.5,0.7\n", 3, "num_prefill_tokens"),
        ("10,0,10,inf\n", 2, "num_decode_tokens"),
    ],
)
def test_lengths_bad_cells(tmp_path, body, line, field):
    path = write(tmp_path, "lengths.csv", LENGTH_HEADER + body)
    with pytest.raises(TraceError) as err:
        open_file(path, "lengths")
    assert_names(err, path, line, field)


def test_lengths_missing_column(tmp_path):
    path = write(tmp_path, "lengths.csv", "num_prefill_tokens,pd_ratio\n10,2.0\n")
    with pytest.raises(TraceError) as err:
        open_file(path, "lengths")
    assert_names(err, path, 1, "num_decode_tokens")


def mooncake_line(**overrides):
    rec = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
    rec.update(overrides)
    return json.dumps({k: v for k, v in rec.items() if v is not None}) + "\n"


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ('{"timestamp": 0, "input_length": 600,\n', None),
        ("[1, 2, 3]\n", None),
        (mooncake_line(hash_ids=None), "hash_ids"),
        (mooncake_line(input_length=0, hash_ids=[]), "input_length"),
        (mooncake_line(output_length=0), "output_length"),
        (mooncake_line(output_length="7"), "output_length"),
        (mooncake_line(hash_ids=[1]), "hash_ids"),
        (mooncake_line(hash_ids=[1, "b"]), "hash_ids"),
        (mooncake_line(timestamp=-3), "timestamp"),
        (mooncake_line(timestamp=True), "timestamp"),
    ],
)
def test_mooncake_bad_lines(tmp_path, bad, field):
    path = write(tmp_path, "trace.jsonl", mooncake_line() + "\n" + bad)
    with pytest.raises(TraceError) as err:
        open_file(path, "mooncake")
    assert_names(err, path, 3, field)
    if field is None:
        assert "JSON" in str(err.value)


def test_mooncake_small_file_keeps_order_and_hashes(tmp_path):
    lines = [
        mooncake_line(timestamp=0, input_length=1024, hash_ids=[7, 8]),
        mooncake_line(timestamp=0, input_length=513, hash_ids=[7, 9]),
        mooncake_line(timestamp=3000, input_length=100, hash_ids=[4]),
    ]
    w = open_file(write(tmp_path, "trace.jsonl", "".join(lines)), "mooncake")
    whole = w.split("all", seed=0)
    assert whole.prompt_len.tolist() == [1024, 513, 100]
    assert [h.tolist() for h in whole.hash_ids] == [[7, 8], [7, 9], [4]]
    assert whole.hash_block_tokens == 512 and whole.arrival_s.tolist() == [0.0, 0.0, 3.0]


@pytest.mark.parametrize("fmt", ["azure", "lengths", "mooncake", "servegen"])
def test_missing_and_unreadable_files(tmp_path, fmt):
    missing = tmp_path / "nope.csv"
    with pytest.raises(TraceError) as err:
        open_file(missing, fmt)
    message = str(err.value)
    assert str(missing) in message and "CHUNKGYM_DATA" in message and "allow_synthetic" in message
    folder = tmp_path / "a_folder"
    folder.mkdir()
    with pytest.raises(TraceError, match="a_folder"):
        open_file(folder, fmt)


def test_empty_file_is_an_error(tmp_path):
    path = write(tmp_path, "azure.csv", AZURE_HEADER)
    with pytest.raises(TraceError, match="no requests"):
        open_file(path, "azure")


def test_missing_data_falls_back_to_synthetic_only_when_allowed(tmp_path):
    # a file neither the data root nor the repository's shipped data/ holds
    spec = dict(
        name="azure_other", format="azure", path="traces/azure_llm_2023/AzureLLMInferenceTrace_other.csv"
    )
    with pytest.raises(TraceError, match="allow_synthetic"):
        Workload(WorkloadSpec(**spec), data_root=tmp_path)
    w = Workload(WorkloadSpec(**spec, allow_synthetic=True), data_root=tmp_path)
    assert w.source == "synthetic:azure_conv_fit"
    tr = w.window("test", 0)
    assert tr.source == "synthetic:azure_conv_fit" and len(tr) > 500


def test_real_file_wins_over_synthetic(tmp_path):
    path = write(tmp_path, "azure.csv", AZURE_HEADER + AZURE_ROW)
    w = open_file(path, "azure", allow_synthetic=True)
    assert w.source == f"file:{path}" and len(w.split("all")) == 1


def test_unknown_workload_lists_valid_names():
    with pytest.raises(ValueError) as err:
        load_workload("azure_chat")
    assert "azure_chat" in str(err.value)
    assert all(name in str(err.value) for name in workload_names())
    assert {"azure_conv", "azure_code", "mooncake_conv", "mooncake_synth", "sharegpt_poisson",
            "arxiv_poisson", "servegen_r1"} <= set(workload_names())  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"format": "parquet"}, "unknown format 'parquet'"),
        ({"rate_scale": -1.0}, "rate_scale"),
        ({"rate_scale": float("nan")}, "rate_scale"),
        ({"window_s": 0.0}, "window_s"),
        ({"base_rate": -2.0}, "base_rate"),
        ({"burstiness_cv": 0.0}, "burstiness_cv"),
        ({"slot_jitter_s": -1.0}, "slot_jitter_s"),
        ({"arrival_process": "hawkes"}, "arrival_process"),
        ({"format": "lengths", "base_rate": 0.0}, "base_rate > 0"),
        ({"path": ""}, "needs a path"),
    ],
)
def test_bad_spec_values(fields, needle):
    base = dict(name="x", format="azure", path="a.csv")
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        WorkloadSpec(**{**base, **fields})


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"name": "x", "format": "azure", "path": "a", "window_s": "long"}, "window_s: Value 'long'"),
        (
            {"name": "x", "format": "azure", "path": "a", "allow_synthetic": "maybe"},
            "allow_synthetic: Value 'maybe' is not a valid bool",
        ),
        ({"name": "x", "format": "azure", "path": "a", "windows": 3}, "windows: Key 'windows' not in"),
        ({"name": "x"}, "missing mandatory value: format"),
        ({"name": "x", "format": "azure", "path": "a", "rate_scale": -1}, "rate_scale"),
        (["x"], "expected a mapping"),
    ],
)
def test_spec_from_mapping_names_source_and_field(data, needle):
    with pytest.raises(ValueError, match=needle) as err:
        from_mapping(WorkloadSpec, data, "conf/workload/x.yaml")
    assert "conf/workload/x.yaml" in str(err.value)


def test_bad_split_seed_load_and_window():
    w = load_workload("synthetic_azure_conv")
    with pytest.raises(ValueError, match="valid splits: train, val, test, all"):
        w.window("holdout", 0)
    for seed in (-1, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            w.window("train", seed)
    for load in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="load_scale"):
            w.window("train", 0, load_scale=load)
    with pytest.raises(ValueError, match="window_s"):
        w.window("train", 0, window_s=0)


def test_from_path_infers_format_or_says_why_not(tmp_path):
    azure = write(tmp_path, "a.csv", AZURE_HEADER + AZURE_ROW)
    lengths = write(tmp_path, "l.csv", LENGTH_HEADER + "10,5,15,2\n")
    mooncake = write(tmp_path, "m.jsonl", mooncake_line())
    assert load_workload(f"file:{azure}").spec.format == "azure"
    assert load_workload(f"file:{lengths}").spec.format == "lengths"
    assert load_workload(f"file:{mooncake}").spec.format == "mooncake"
    assert load_workload(f"file:{azure}").spec.name == f"file:{azure}"
    odd = write(tmp_path, "o.csv", "when,what\n1,2\n")
    with pytest.raises(TraceError) as err:
        load_workload(f"file:{odd}")
    assert_names(err, odd, 1, None)
    with pytest.raises(TraceError, match="not found"):
        load_workload(f"file:{tmp_path / 'absent.csv'}")


def test_traces_are_read_only(tmp_path):
    tr = open_file(write(tmp_path, "a.csv", AZURE_HEADER + AZURE_ROW), "azure").split("all")
    with pytest.raises(ValueError):
        tr.prompt_len[0] = 5
    assert isinstance(tr.arrival_s, np.ndarray) and tr.arrival_s.dtype == np.float64
    assert tr.prompt_len.dtype == np.int64 and tr.output_len.dtype == np.int64
