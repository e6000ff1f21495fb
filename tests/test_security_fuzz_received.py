"""Fuzz the received files: a mutated results file or policy folder gets a correct answer or one line.

Hypothesis mutates a real results row (a cell, a byte-order mark, a repeated row, a cut) and a
real export (a manifest field, the weights' bytes, a cut).  Each example must end with a correct
result (validation reports a difference exactly when a compared cell changed; a loaded policy
acts as the original does) or a ValueError of one line; any other exception fails.  The whole
run happens in a subprocess under ``RLIMIT_AS`` (:data:`MEMORY_BUDGET`), so an input that makes
a reader allocate without bound fails the test instead of the machine.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkgym import REPO_ROOT

MEMORY_BUDGET = 3 << 30  # address space: the imports take about 0.7 GiB
EXAMPLES = 40
NASTY = [
    "", "nan", "inf", "-1", "0", "1e400", "1" * 5000, "${oc.env:HOME}", "[" * 200, "{}", "[]", "null",
    "file:/etc/passwd", "../../../etc/passwd", "/etc/passwd", "calibrated:../x", "roofline", "fcfs",
    "sarathi_512", "azure_conv", "all", "val", "sim", "engine", "a|b\n<b>`c`</b>", "\x00", "\u2028",
]  # fmt: skip
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BUDGET, MEMORY_BUDGET))


def test_mutated_received_files_get_a_correct_answer_or_one_line_within_the_memory_budget():
    proc = subprocess.run(
        [sys.executable, "-c", "import tests.test_security_fuzz_received as t; t.fuzz_all()"],
        cwd=REPO_ROOT,
        preexec_fn=limit_memory,  # noqa: PLW1509 - a single-threaded parent
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "fuzzed" in proc.stdout


def assert_one_line(exc: BaseException) -> None:
    if not isinstance(exc, ValueError):
        raise AssertionError(f"not a one-line refusal: {type(exc).__name__}: {exc}") from exc
    message = str(exc)
    assert message and "\n" not in message and len(message) < 2000, repr(message[:500])


# ---- results files ---------------------------------------------------------------------------
def fuzz_results(folder: Path) -> None:
    from envs.serving.metrics import load_slo
    from leaderboard.runs import RunSpec, SetupKey, run_row
    from leaderboard.validate import UNCOMPARED, same, validate

    setup = SetupKey.create("llama3_8b", "a100_80gb", 1, load_slo("strict"), "roofline")
    row = run_row(RunSpec("fcfs", "synthetic_azure_conv", 1.0, 0, setup, window_s=10.0)).row
    base = {k: "" if v != v else str(v) for k, v in row.items()}

    @SETTINGS
    @given(
        column=st.sampled_from(sorted(base)),
        value=st.one_of(st.sampled_from(NASTY), st.text(max_size=30)),
        shape=st.sampled_from(["cell", "bom", "repeat", "cut"]),
        cut=st.floats(0, 1),
    )
    def one(column: str, value: str, shape: str, cut: float) -> None:
        rows = [{**base, column: value}] if shape == "cell" else [base, base] if shape == "repeat" else [base]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(base))
        writer.writeheader()
        writer.writerows(rows)
        data = ("\ufeff" if shape == "bom" else "") + buf.getvalue()
        path = folder / "results.csv"
        path.write_text(
            data[: int(len(data) * cut)] if shape == "cut" else data, encoding="utf-8", errors="surrogatepass"
        )
        try:
            n, problems = validate(path, n_jobs=1, progress=False)
        except Exception as exc:  # noqa: BLE001 - any other kind is the failure looked for
            assert_one_line(exc)
            return
        changed = shape == "cell" and column not in UNCOMPARED and not same(base[column], value)
        assert n == 1 and bool(problems) == changed, (column, value, problems[:3])
        assert all("\n" not in p for p in problems)

    one()


# ---- policy folders --------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10,
)


def fuzz_policy_folder(folder: Path) -> None:
    import numpy as np
    import torch

    from envs import ENV_ID_V0
    from envs.actions import NVEC
    from envs.chunked_prefill import version_of
    from policies.export import write_export
    from policies.exported import PolicyNet, load_policy

    n_features = len(version_of(ENV_ID_V0).feature_names)
    torch.manual_seed(0)
    original = folder / "original"
    write_export(PolicyNet([n_features, 16], NVEC), ENV_ID_V0, original, {"note": "fuzz"})
    obs = np.random.default_rng(0).normal(size=(32, n_features)).astype(np.float32)
    mask = np.ones((32, sum(NVEC)), dtype=bool)
    expected = load_policy(original).act(obs, mask)
    spec = json.loads((original / "policy.json").read_text())
    fields = [k for k in spec if k != "files"] + [f"normalisation.{k}" for k in spec["normalisation"]]

    @SETTINGS
    @given(
        kind=st.sampled_from(["field", "flip", "cut", "flip-rehashed"]),
        field=st.sampled_from(fields),
        value=JSON_VALUES,
        where=st.floats(0, 1),
        name=st.sampled_from(["policy.json", "policy.safetensors"]),
    )
    def one(kind: str, field: str, value: Any, where: float, name: str) -> None:
        copy = folder / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(original, copy)
        manifest = json.loads((copy / "policy.json").read_text())
        if kind == "field":
            node, key = (
                (manifest["normalisation"], field.split(".")[1]) if "." in field else (manifest, field)
            )
            node[key] = value
        else:
            data = bytearray((copy / name).read_bytes())
            at = min(int(len(data) * where), len(data) - 1)
            if kind == "cut":
                del data[at:]
            else:
                data[at] ^= 0x5A
            (copy / name).write_bytes(bytes(data))
            if kind == "flip-rehashed" and name == "policy.safetensors":
                manifest["files"][name] = hashlib.sha256(bytes(data)).hexdigest()
        if kind == "field" or (kind == "flip-rehashed" and name == "policy.safetensors"):
            (copy / "policy.json").write_text(json.dumps(manifest))
        try:
            policy = load_policy(copy)
        except Exception as exc:  # noqa: BLE001 - any other kind is the failure looked for
            assert_one_line(exc)
            return
        assert (policy.act(obs, mask) == expected).all(), (kind, field, name)

    one()


def fuzz_all() -> None:
    """Both fuzzers, in this (memory-limited) process."""
    with tempfile.TemporaryDirectory() as tmp:
        fuzz_results(Path(tmp))
        fuzz_policy_folder(Path(tmp))
    print("fuzzed", 2 * EXAMPLES, "inputs")
