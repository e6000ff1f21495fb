"""Received traces, archives, cost files and /metrics pages stay within their budgets: a hostile
input gets one line naming the file and the limit, in bounded memory and time, and a valid trace
parses as it always did."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chunkgym
from advisor.prometheus import MetricsError, read_metrics
from envs.serving import capacity
from envs.serving.capacity import Probe, sequential_search
from envs.serving.cost_model import read_cost_file
from envs.serving.workload import TraceError, Workload, WorkloadSpec, load_workload
from envs.serving.workloads import files
from envs.serving.workloads.files import split_lines

AZURE_HEADER = b"TIMESTAMP,ContextTokens,GeneratedTokens\n"
LIMIT = f"over the trace limit of {files.DEFAULT_MAX_TRACE_BYTES} bytes"


def azure_rows(n: int) -> bytes:
    return b"".join(
        f"2023-11-16 18:{i // 60 % 60:02d}:{i % 60:02d}.{i:07d},{100 + i},{10 + i}\n".encode()
        for i in range(n)
    )


def load(path: Path) -> int:
    return len(load_workload(f"file:{path}").split("all", 0, 1.0))


def gz_of(parts: list[tuple[bytes, int]]) -> bytes:
    """A gzip stream of each part repeated, compressed as it goes (never built whole)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [packer.compress(part) for part, times in parts for _ in range(times)]
    return b"".join([*out, packer.flush()])


def run_limited(code: str, limit_mib: int, timeout: float = 120.0) -> tuple[str, int]:
    """``code`` in a fresh interpreter under an address-space limit: its last output line, and
    how far its peak RSS rose (MiB) over the peak after importing the readers."""
    script = (
        "import resource, sys\n"
        "import envs.serving.workload, advisor.prometheus\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({limit_mib << 20}, {limit_mib << 20}))\n"
        f"{code}\n"
        "print('RSS', (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=chunkgym.REPO_ROOT,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) > 1 and lines[-1].startswith("RSS"), proc.stderr[-2000:]
    return lines[-2], int(lines[-1].split()[1])


LOAD_ONE_LINE = """
from envs.serving.workload import TraceError, load_workload
try:
    print('OK', len(load_workload('file:' + sys.argv[1] if len(sys.argv) > 1 else 'file:{path}').split('all', 0, 1.0)))
except TraceError as exc:
    print('ERR', str(exc))
"""


# ---- decompressed text: the 64 KB .csv.gz of blank lines ------------------------------
def test_a_small_gzip_of_blank_lines_is_refused_in_one_line_within_a_fixed_memory(tmp_path):
    path = tmp_path / "blank.csv.gz"
    path.write_bytes(gz_of([(AZURE_HEADER, 1), (b"\n" * (1 << 20), 66)]))
    assert path.stat().st_size < 70_000  # 66 MiB of text; the issue measured 3.8 GB to read it
    line, rss = run_limited(LOAD_ONE_LINE.format(path=path), 2048)
    assert (
        line
        == f"ERR {path}: holds more text (decompressed), {LIMIT} (set CHUNKGYM_MAX_TRACE_BYTES to raise it)"
    )
    assert rss < 200, rss


def test_blank_lines_within_the_budget_cost_no_memory_per_line(tmp_path):
    path = tmp_path / "blank.csv.gz"
    path.write_bytes(gz_of([(AZURE_HEADER, 1), (b"\n" * (1 << 20), 60), (azure_rows(30), 1)]))
    line, rss = run_limited(LOAD_ONE_LINE.format(path=path), 2048)
    assert line == "OK 30"
    assert rss < 200, rss  # 60 MiB of text: streamed, never held


@pytest.mark.parametrize("limit", [4 << 20, 1 << 20])
def test_the_budget_counts_text_and_the_variable_raises_it(tmp_path, monkeypatch, limit):
    path = tmp_path / "t.csv"
    path.write_bytes(AZURE_HEADER + azure_rows(30) + b"\n" * (2 << 20))  # 2 MiB, blank lines included
    monkeypatch.setenv("CHUNKGYM_MAX_TRACE_BYTES", str(limit))
    if limit > path.stat().st_size:
        assert load(path) == 30
    else:
        with pytest.raises(TraceError, match=rf"t.csv: is \d+ bytes, over the trace limit of {limit} bytes"):
            load(path)


def test_a_bad_budget_variable_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKGYM_MAX_TRACE_BYTES", "lots")
    with pytest.raises(
        ValueError, match=r"^CHUNKGYM_MAX_TRACE_BYTES='lots': expected a positive whole number"
    ):
        files.max_trace_bytes()


def test_a_gzip_bomb_stops_at_the_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKGYM_MAX_TRACE_BYTES", str(1 << 20))
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(gz_of([(b'{"timestamp": "', 1), (b"a" * (1 << 20), 1024)]))  # 1 GiB of text
    with pytest.raises(
        TraceError, match=r"bomb.jsonl.gz: holds more text \(decompressed\), over the trace limit of 1048576"
    ):
        load(path)


# ---- what is not a regular file, and sparse files ---------------------------------------------
def test_a_sparse_trace_is_refused_by_its_apparent_size_before_reading(tmp_path):
    path = tmp_path / "sparse.csv"
    path.write_bytes(AZURE_HEADER + azure_rows(3))
    os.truncate(path, 8 << 30)
    with pytest.raises(TraceError, match=rf"sparse.csv: is {8 << 30} bytes, {LIMIT}"):
        load(path)


def test_a_fifo_trace_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "trace.csv"
    os.mkfifo(fifo)
    outcome: list[BaseException | int] = []
    worker = threading.Thread(target=lambda: outcome.append(_attempt(fifo)), daemon=True)
    worker.start()
    worker.join(10)
    assert outcome, "reading a FIFO blocked"
    assert isinstance(outcome[0], TraceError)
    assert str(outcome[0]) == f"{fifo}: is a FIFO, device or socket; a regular file is expected"


def _attempt(path: Path) -> BaseException | int:
    try:
        return load(path)
    except Exception as exc:  # noqa: BLE001 - the test inspects what came back
        return exc


# ---- JSON lines: nesting, digits, and the BOM ---------------------------------------------------
def mooncake(ts: int) -> bytes:
    return (
        json.dumps({"timestamp": ts, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]}).encode()
        + b"\n"
    )


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (b"[" * 100_000, "maximum recursion depth exceeded"),
        (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "maximum recursion depth exceeded"),
        (b'{"timestamp": ' + b"9" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
    ],
)
def test_deep_or_long_json_records_name_file_and_line(tmp_path, record, reason):
    path = tmp_path / "t.jsonl"
    path.write_bytes(mooncake(0) + mooncake(1000) + record + b"\n")
    with pytest.raises(TraceError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}:3: not a readable JSON record (")
    assert reason in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("packed", [False, True])
def test_a_byte_order_mark_is_accepted(tmp_path, packed):
    body = AZURE_HEADER + azure_rows(20)
    data = b"\xef\xbb\xbf" + body
    plain, marked = tmp_path / "plain.csv", tmp_path / ("marked.csv.gz" if packed else "marked.csv")
    plain.write_bytes(body)
    marked.write_bytes(gzip.compress(data) if packed else data)
    a = load_workload(f"file:{plain}").split("all")
    b = load_workload(f"file:{marked}").split("all")
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    np.testing.assert_array_equal(a.prompt_len, b.prompt_len)


def test_a_huge_cell_is_quoted_short(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(AZURE_HEADER + b"x" * 100_000 + b",1,1\n")
    with pytest.raises(TraceError) as err:
        load(path)
    assert len(str(err.value)) < 400 and "xxx...'" in str(err.value)


# ---- streaming changes nothing ------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.sampled_from(list("ab, \n\r\x0b\x85\u2028")), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
)
def test_split_lines_is_splitlines_of_the_whole_text(text, cuts):
    edges = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    chunks = [text[a:b] for a, b in zip(edges, edges[1:], strict=False)]
    assert [line for lines in split_lines(chunks) for line in lines] == text.splitlines(keepends=True)


@pytest.mark.parametrize("name", ["t.csv", "t.jsonl", "t.lengths.csv"])
def test_parsing_in_many_small_chunks_gives_the_same_arrays(tmp_path, monkeypatch, name):
    rng = np.random.default_rng(0)
    if name == "t.csv":  # fractions of 0 to 7 digits, blank lines, CRLF and LF
        rows = [
            f"2023-11-16 18:{i // 60 % 60:02d}:{i % 60:02d}{'.' + '5' * (i % 8) if i % 8 else ''},{rng.integers(1, 9000)},"
            f"{rng.integers(1, 900)}{chr(13) if i % 3 == 0 else ''}\n" + ("\n" if i % 7 == 0 else "")
            for i in range(3000)
        ]
        text = AZURE_HEADER.decode() + "".join(rows)
    elif name == "t.jsonl":
        text = "".join(mooncake(int(t)).decode() for t in np.sort(rng.integers(0, 10**6, 3000)))
    else:
        text = "num_prefill_tokens,num_decode_tokens\n" + "".join(
            f"{a},{b}\n" for a, b in rng.integers(1, 5000, (3000, 2))
        )
    path = tmp_path / name
    path.write_text(text)
    fmt = {"t.csv": "azure", "t.jsonl": "mooncake", "t.lengths.csv": "lengths"}[name]
    whole = files._read_cached.__wrapped__(str(path), fmt, 0, 0)
    monkeypatch.setattr(files, "CHUNK_BYTES", 997)  # a prime: chunks end mid-line, mid-"\r\n"
    pieces = files._read_cached.__wrapped__(str(path), fmt, 0, 0)
    for field in ("times", "prompt", "output"):
        a, b = getattr(whole, field), getattr(pieces, field)
        assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b)), field
    if whole.hash_ids is not None:
        assert all(np.array_equal(x, y) for x, y in zip(whole.hash_ids, pieces.hash_ids, strict=True))


# ---- ServeGen archives ---------------------------------------------------------------------------
TRACE_CSV = b"".join(f"{600 * j},0.5,1.0,Gamma,1.0,2.0\n".encode() for j in range(4))
DATASET = json.dumps({"0": {"input_tokens": "{100: 0.5, 200: 0.5}", "output_tokens": "{10: 1.0}"}}).encode()


def archive(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def servegen(path: Path) -> int:
    return len(Workload(WorkloadSpec(name="sg", format="servegen", path=str(path))).split("all", 0, 1.0))


def test_a_small_servegen_archive_still_reads(tmp_path):
    path = tmp_path / "ok.tar.gz"
    path.write_bytes(archive([("d/chunk-0-trace.csv", TRACE_CSV), ("d/chunk-0-dataset.json", DATASET)]))
    assert servegen(path) == 1200


def member_bomb(name: str, mib: int) -> bytes:
    """A .tar.gz whose member ``name`` holds ``mib`` MiB of newlines, packed to a few KB a MiB."""
    info = tarfile.TarInfo(name)
    info.size = mib << 20
    return gz_of([(info.tobuf(), 1), (b"\n" * (1 << 20), mib), (b"\0" * 1024, 1)])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "d/chunk-0-trace.csv",
            "its members up to d/chunk-0-trace.csv hold 3145728000 bytes (stated sizes), over the trace limit",
        ),
        (
            "d/unrelated.bin",
            "the archive holds more than 67108864 bytes (decompressed), over the trace limit",
        ),
    ],
)
def test_servegen_members_and_skipped_data_are_capped(tmp_path, name, message):
    path = tmp_path / "bomb.tar.gz"
    path.write_bytes(member_bomb(name, 3000))
    line, rss = run_limited(
        f"from envs.serving.workload import Workload, WorkloadSpec, TraceError\n"
        f"try:\n    Workload(WorkloadSpec(name='sg', format='servegen', path='{path}'))\n"
        f"except TraceError as exc:\n    print('ERR', exc)",
        2048,
    )
    assert line.startswith(f"ERR {path}: {message}"), line
    assert rss < 200, rss


def test_a_servegen_rate_that_would_generate_too_many_requests_is_refused(tmp_path):
    path = tmp_path / "rate.tar.gz"
    path.write_bytes(
        archive(
            [
                ("d/chunk-0-trace.csv", b"0,1e12,1,Gamma,1,1\n600,1,1,Gamma,1,1\n"),
                ("d/chunk-0-dataset.json", DATASET),
            ]
        )
    )
    with pytest.raises(
        TraceError, match=r"rate.tar.gz: its rates make 6e\+14 requests a day, over the limit of 5000000"
    ):
        servegen(path)


@pytest.mark.parametrize(
    ("pmf", "message"),
    [
        (
            "{1: " + "(" * 600_000 + "1" + ")" * 600_000 + "}",
            "not a plain {tokens: probability} dict, and over",
        ),
        (
            "{1: " + "(" * 1000 + "1" + ")" * 1000 + "}",
            "not a Python dict literal: too many nested parentheses",
        ),
        (
            "{" + ", ".join(f"{i}: 1e-7" for i in range(1, (1 << 20) + 2)) + "}",
            "more than 1048576 token counts",
        ),
    ],
)
def test_servegen_pmfs_are_bounded(tmp_path, pmf, message):
    path = tmp_path / "pmf.tar.gz"
    dataset = json.dumps({"0": {"input_tokens": pmf, "output_tokens": "{10: 1.0}"}}).encode()
    path.write_bytes(archive([("d/chunk-0-trace.csv", TRACE_CSV), ("d/chunk-0-dataset.json", dataset)]))
    with pytest.raises(TraceError) as err:
        servegen(path)
    assert message in str(err.value) and "[0][input_tokens]" in str(err.value)


def test_deep_servegen_json_is_one_line(tmp_path):
    path = tmp_path / "deep.tar.gz"
    path.write_bytes(
        archive([("d/chunk-0-trace.csv", TRACE_CSV), ("d/chunk-0-dataset.json", b"[" * 100_000)])
    )
    with pytest.raises(
        TraceError, match=r"deep.tar.gz\[d/chunk-0-dataset.json\]: malformed JSON: maximum recursion"
    ):
        servegen(path)


# ---- generated workloads --------------------------------------------------------------------------
def test_a_generated_workload_has_a_bounded_request_count():
    spec = WorkloadSpec(name="s", format="synthetic", base_rate=1e7)
    with pytest.raises(
        ValueError,
        match=r"^1e\+07 arrivals/s over 3501.72 s would generate 3.50172e\+10 requests, over the limit of 5000000$",
    ):
        Workload(spec).split("all")


# ---- cost files and /metrics pages ------------------------------------------------------------------
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (LAUGHS, "uses a YAML anchor or alias (line 1)"),
        ("a: " + "[" * 10_000 + "\n", "nested deeper than 64 levels"),
        ("hardware: a100\nparams: [unclosed\n", "while parsing a flow sequence: expected ',' or ']'"),
    ],
)
def test_a_cost_file_is_read_as_received_yaml(tmp_path, text, reason):
    path = tmp_path / "a100__x__tp1.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        read_cost_file(path)
    assert str(err.value).startswith(f"{path}: not a readable YAML coefficient file (")
    assert reason in str(err.value) and "\n" not in str(err.value)


def test_a_cost_file_error_never_quotes_the_file(tmp_path):
    path = tmp_path / "a100__x__tp1.yaml"
    path.write_text("hardware: a100\nparams: [s3cr3t-value, {\n")
    with pytest.raises(ValueError) as err:
        read_cost_file(path)
    assert "s3cr3t" not in str(err.value)


@pytest.mark.parametrize("kind", ["fifo", "sparse"])
def test_cost_and_metrics_files_that_are_fifos_or_sparse_are_refused(tmp_path, kind):
    cost, page = tmp_path / "a100__x__tp1.yaml", tmp_path / "metrics.txt"
    for path in (cost, page):
        if kind == "fifo":
            os.mkfifo(path)
        else:
            path.write_bytes(b"x: 1\n")
            os.truncate(path, 8 << 30)
    reason = "is a FIFO, device or socket" if kind == "fifo" else f"{8 << 30} bytes, over the limit"
    with pytest.raises(ValueError, match=reason):
        read_cost_file(cost)
    with pytest.raises(MetricsError, match=reason):
        read_metrics([page], rate=1.0)


# ---- capacity searches ---------------------------------------------------------------------------------
class _Query:
    def __init__(self, rel_tol: float):
        self.rel_tol = rel_tol

    def trace_at(self, scale: float) -> None:
        return None


def _passes_below(boundary: float):
    return lambda scale, trace: Probe(scale, scale < boundary, False, 0, 0)


@pytest.mark.parametrize("rel_tol", [1e-300, 1e-7, 0.0, 1.0, float("nan")])
def test_a_capacity_tolerance_below_the_floor_is_refused(rel_tol):
    with pytest.raises(ValueError, match=r"capacity rel_tol must be in \[1e-06, 1\)"):
        sequential_search(_Query(rel_tol), _passes_below(1.2345))


def test_the_floor_converges_and_every_search_is_capped(monkeypatch):
    result, probes = sequential_search(_Query(1e-6), _passes_below(1.2345))
    assert len(probes) < capacity.MAX_PROBES and abs(result.scale - 1.2345) < 2e-6
    monkeypatch.setattr(capacity, "MAX_PROBES", 5)
    with pytest.raises(RuntimeError, match="capacity search: 5 probes without converging"):
        sequential_search(_Query(1e-6), _passes_below(1.2345))
