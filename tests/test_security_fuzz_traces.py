"""Fuzzed trace files: every mutation of a valid trace (truncation, byte flips, inserted blank
lines, huge numbers, deep JSON, a byte-order mark, gzip of the result or of garbage) parses to a
valid request stream or fails with one line naming the file, never another exception, and the
whole run stays under a fixed memory limit (a subprocess under ``RLIMIT_AS``)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chunkgym
from envs.serving.workload import TraceError, load_workload

MEMORY_LIMIT = 1 << 30
"""Address space for the fuzzing interpreter: its imports take about 170 MiB of it, and no trace
of these sizes may take the rest."""

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    f"2023-11-16 18:{i // 60:02d}:{i % 60:02d}.{i:07d},{100 + i},{10 + i}\n" for i in range(40)
)
LENGTHS = "num_prefill_tokens,num_decode_tokens\n" + "".join(f"{5 + i},{3 + i}\n" for i in range(40))
MOONCAKE = "".join(
    json.dumps({"timestamp": 1000 * i, "input_length": 600 + i, "output_length": 20, "hash_ids": [i, i + 1]})
    + "\n"
    for i in range(40)
)
BASES = [AZURE.encode(), LENGTHS.encode(), MOONCAKE.encode()]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["truncate", "flip", "blank", "huge", "deep", "bom", "garbage", "cell"]))
        if kind == "truncate":
            data = data[:at]
        elif kind == "flip" and data:
            i = min(at, len(data) - 1)
            data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
        elif kind == "blank":
            data = data[:at] + b"\n" * draw(st.integers(1, 5000)) + data[at:]
        elif kind == "huge":
            digits = draw(st.sampled_from([b"9" * 5000, b"1e999", b"-1", b"18446744073709551616", b"nan"]))
            data = data[:at] + digits + data[at:]
        elif kind == "deep":
            data = data[:at] + b"\n" + b"[" * draw(st.integers(1, 100_000)) + b"\n" + data[at:]
        elif kind == "bom":
            data = b"\xef\xbb\xbf" + data
        elif kind == "garbage":
            data = data[:at] + draw(st.binary(max_size=64)) + data[at:]
        else:
            data = data[:at] + draw(st.text(max_size=20)).encode() + data[at:]
    packing = draw(st.sampled_from(["plain", "gzip", "gzip-garbage"]))
    if packing == "gzip":
        return gzip.compress(data)
    if packing == "gzip-garbage":
        return b"\x1f\x8b" + draw(st.binary(max_size=200))
    return data


def check_one(data: bytes) -> None:
    """A valid stream, or one line of :class:`TraceError` naming the file; nothing else."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzzed.trace"
        path.write_bytes(data)
        try:
            trace = load_workload(f"file:{path}").split("all", 0, 1.0)
        except TraceError as exc:
            message = str(exc)
            assert "\n" not in message and message.startswith(str(path)), message
            return
        assert len(trace) > 0
        assert np.all(np.diff(trace.arrival_s) >= 0) and trace.arrival_s[0] >= 0
        assert trace.prompt_len.min() >= 1 and trace.output_len.min() >= 1


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(mutated())
def fuzz_traces(data: bytes) -> None:
    check_one(data)


def test_fuzzed_traces_parse_or_fail_in_one_line_within_a_memory_limit():
    script = (
        "import resource\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
        "from tests.test_security_fuzz_traces import fuzz_traces\n"
        "fuzz_traces()\n"
        "print('fuzzed')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=chunkgym.REPO_ROOT,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("fuzzed"), proc.stderr[-4000:]


def test_the_checker_lets_any_other_exception_through(monkeypatch):
    def recursing(name: str) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(sys.modules[__name__], "load_workload", recursing)
    with pytest.raises(RecursionError):
        check_one(b"anything")
