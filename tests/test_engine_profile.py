"""Our engine as a profiling source: compositions become runnable batches and rows in the cost model's terms."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch

from calibration.iterations import Composition
from chunkgym import REPO_ROOT
from engine.profile import ProbeOptions, batch_items, default_compositions, measure, probe


def test_batch_items_use_disjoint_blocks_and_the_stated_contexts():
    comp = Composition("mix", decode_contexts=(5, 9), prefill_tokens=(12,), prefill_context=(3,))
    items, num_blocks = batch_items(comp, block_size=4, vocab_size=50)
    assert [(i.start, len(i.token_ids)) for i in items] == [(3, 12), (5, 1), (9, 1)]
    tables = [list(i.block_table) for i in items]
    assert [len(t) for t in tables] == [4, 2, 3]
    assert sorted(b for t in tables for b in t) == list(range(num_blocks))
    assert all(0 <= t < 50 for i in items for t in i.token_ids)


def test_measure_reports_cost_model_arguments():
    comps = [
        Composition("decodes", decode_contexts=(40, 60)),
        Composition("mixed", decode_contexts=(30,), prefill_tokens=(20, 8), prefill_context=(0, 16)),
    ]
    rows = [m.row() for m in measure("tiny", comps, dtype=torch.float32, repeats=3, warmup=1)]
    assert (rows[0]["num_decode"], rows[0]["decode_context"], rows[0]["prefill_tokens"]) == (2, 100, "")
    assert (rows[1]["prefill_tokens"], rows[1]["prefill_context"]) == ("20 8", "0 16")
    assert all(0 < r["min_s"] <= r["median_s"] and r["repeats"] == 3 for r in rows)


@pytest.mark.slow
def test_cli_writes_one_row_per_default_composition(tmp_path):
    out = tmp_path / "tiny.csv"
    args = ["preset=tiny", "threads=1", "repeats=1", "warmup=0", f"csv={out}"]
    cmd = [sys.executable, "-m", "engine.profile", *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with out.open() as f:
        labels = [row["label"] for row in csv.DictReader(f)]
    assert labels == [c.label for c in default_compositions()]
    assert "prefill 2048" in proc.stdout


@pytest.mark.parametrize(("field", "value"), [("preset", "huge"), ("dtype", "int8")])
def test_a_bad_choice_is_named_before_building_a_model(field, value):
    with pytest.raises(SystemExit, match=f"{field}: '{value}'"):
        probe(ProbeOptions(**{field: value}))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "is empty"),
        ({"prefill_tokens": (4,)}, "differ in length"),
        ({"prefill_tokens": (0,), "prefill_context": (0,)}, ">= 1 token"),
    ],
)
def test_bad_composition_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Composition("bad", **kwargs)


@pytest.mark.parametrize(
    ("override", "named"), [("replay.model=nope", "unknown model 'nope'"), ("repeats=x", "repeats")]
)
@pytest.mark.slow
def test_engine_calibration_names_bad_input_before_profiling(tmp_path, override, named):
    cmd = [sys.executable, "-m", "engine.calibrate", override, f"out={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and named in proc.stderr
    assert not list(tmp_path.iterdir())
