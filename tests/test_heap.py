"""The vLLM engine's pinned heap (engine/vllm_backend/heap.py): large blocks stop being mapped afresh."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from chunkgym import REPO_ROOT

PROBE = """
import ctypes, sys
from engine.vllm_backend import heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

info = ctypes.CDLL("libc.so.6").mallinfo2
info.restype = MallInfo2
assert not heap.pinned
if sys.argv[1] == "pinned":
    assert heap.pin_heap() and heap.pinned
before = info().hblks
block = bytearray(64 << 20)
print(info().hblks - before)
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


def _new_mappings(mode: str) -> int:
    """Blocks glibc mapped for one 64 MiB allocation in a fresh process (``mode``: pinned or default)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return int(done.stdout.strip())


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_a_pinned_heap_serves_a_large_block_without_mapping_it():
    assert _new_mappings("default") == 1  # glibc's default maps it: what the pin is for
    assert _new_mappings("pinned") == 0
