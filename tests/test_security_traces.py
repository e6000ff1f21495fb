"""Hostile or careless trace and cost files: clear errors naming file, line and field, never nonsense."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from envs.serving.cost_model import read_cost_file
from envs.serving.workload import TraceError, load_workload

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def azure_rows(n: int, start_s: int = 0) -> str:
    return "".join(
        f"2023-11-16 18:{(start_s + i) // 60 % 60:02d}:{(start_s + i) % 60:02d},{100 + i},{10 + i}\n"
        for i in range(n)
    )


def mooncake_line(ts, n_in=600, n_out=20, ids=None) -> str:
    return (
        json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids or [1, 2]})
        + "\n"
    )


def load(path):
    return load_workload(f"file:{path}").split("all", 0, 1.0)


def expect(path, line, field, message):
    with pytest.raises(TraceError) as err:
        load(path)
    assert (err.value.path, err.value.line, err.value.field) == (str(path), line, field), str(err.value)
    assert message in str(err.value)
    return str(err.value)


# ---- integers beyond int64 ------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1e19", "18446744073709551616", "2147483648"])
def test_csv_lengths_beyond_exact_integers_name_line_and_field(tmp_path, value):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + azure_rows(2) + f"2023-11-16 18:00:05,{value},5\n")
    expect(path, 4, "ContextTokens", f"got {value!r}; expected an integer in 1..2147483647")


@pytest.mark.parametrize(
    ("record", "field", "message"),
    [
        (
            mooncake_line(3000, n_in=10**19, ids=[1]),
            "input_length",
            "expected an integer in 1..2147483647",
        ),
        (mooncake_line(3000, n_out=2**64), "output_length", "expected an integer in 1..2147483647"),
        (
            mooncake_line(3000, ids=[1, 2**70]),
            "hash_ids",
            f"block id {2**70} does not fit in a 64-bit integer",
        ),
        (mooncake_line(10**400), "timestamp", "expected milliseconds in 0..9007199254740992"),
    ],
)
def test_jsonl_integers_beyond_int64_name_line_and_field(tmp_path, record, field, message):
    path = tmp_path / "t.jsonl"
    path.write_text(mooncake_line(0) + mooncake_line(1000) + record)
    expect(path, 3, field, message)


# ---- spans: zero, or made by one outlier -------------------------------------------------------
def test_a_trace_with_zero_span_is_refused_with_the_numbers(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + "".join(f"2023-11-16 18:00:00,{10 + i},5\n" for i in range(5)))
    expect(path, 2, "TIMESTAMP", "all 5 requests arrive at the same time, so the trace spans 0 s")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(mooncake_line(7) * 3)
    expect(jsonl, 1, "timestamp", "all 3 requests arrive at the same time")


def test_one_outlier_date_is_refused_with_the_numbers(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + azure_rows(10) + "2099-11-16 18:00:00,50,5\n" + azure_rows(10, 10))
    text = expect(
        path, 12, "TIMESTAMP", "1 request(s) arrive 2.39838e+09 s (2.776e+04 days) away from the other 20"
    )
    assert "one gap makes 100.00% of the trace's 2.39838e+09 s span" in text


def test_three_rows_with_a_2099_date_are_refused_too(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + azure_rows(2) + "2099-01-01 00:00:00,50,5\n")
    expect(path, 4, "TIMESTAMP", "an outlier timestamp?")


def test_a_real_gap_with_many_requests_on_both_sides_is_kept(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEADER + azure_rows(20) + azure_rows(20, 3000))  # a 50-min pause, half on each side
    assert len(load(path)) == 40


# ---- compression and encodings --------------------------------------------------------------
@pytest.mark.parametrize("name", ["t.csv", "t.jsonl"])
def test_gzip_compressed_csv_and_jsonl_read_as_the_plain_file(tmp_path, name):
    text = (
        AZURE_HEADER + azure_rows(30)
        if name.endswith(".csv")
        else "".join(mooncake_line(1000 * i) for i in range(30))
    )
    plain = tmp_path / name
    plain.write_text(text)
    packed = tmp_path / f"packed_{name}.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    a, b = load(plain), load(packed)
    assert len(a) == len(b) == 30
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    np.testing.assert_array_equal(a.prompt_len, b.prompt_len)


def test_a_corrupt_gzip_file_says_so(tmp_path):
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress((AZURE_HEADER + azure_rows(30)).encode())[:60])
    with pytest.raises(TraceError, match=r"t.csv.gz: cannot read trace file: Compressed file ended"):
        load(path)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be"])
def test_utf16_files_get_an_accurate_message(tmp_path, encoding):
    path = tmp_path / "t.csv"
    path.write_bytes((AZURE_HEADER + azure_rows(3)).encode(encoding))
    expect(path, 1, None, "the file is UTF-16 (or binary): traces must be UTF-8 text; convert it with `iconv")


def test_latin1_bytes_name_their_line(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes((AZURE_HEADER + azure_rows(3)).encode() + b"2023-11-16 18:00:09,12,5\xe9\n")
    expect(path, 5, None, "not UTF-8 text (byte 0xe9)")


def test_symlink_loops_and_dangling_links_get_accurate_messages(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(TraceError, match=r"/a: symbolic link loop"):
        load(tmp_path / "a")
    (tmp_path / "c").symlink_to(tmp_path / "gone.csv")
    with pytest.raises(TraceError, match=r"/c: symbolic link to '.*gone.csv', which does not exist"):
        load(tmp_path / "c")


def test_a_cost_model_yaml_that_does_not_parse_names_its_file(tmp_path):
    path = tmp_path / "a100__x__tp1.yaml"
    path.write_text("hardware: a100\nparams: [unclosed\n")
    with pytest.raises(
        ValueError, match=r"a100__x__tp1.yaml: not a readable YAML coefficient file \(while parsing"
    ):
        read_cost_file(path)
    path.write_bytes(b"\xff\xfe\x00h")
    with pytest.raises(ValueError, match=r"a100__x__tp1.yaml: not a readable YAML coefficient file"):
        read_cost_file(path)
