"""bench/engine_gpu.py's device profile, run on the CPU with the smoke shape: a device-only cost file comes out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from calibration.sources.torch_ops import vidur_columns
from chunkgym import REPO_ROOT
from envs.serving.cost_model import ENGINE_FIELDS, read_cost_file

ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}  # the script imports this checkout, not another install
SMOKE = ["smoke=true", "replay.device=cpu", "replay.dtype=float32", "replay.hardware=cpu"]
# what a machine with PyTorch alone holds: torch and what it needs, and the scientific stack
PYTORCH_IMAGE = (
    "torch torchgen functorch typing_extensions sympy mpmath networkx jinja2 markupsafe filelock fsspec "
    "numpy pandas dateutil pytz tzdata six scipy yaml tqdm packaging"
).split()
# the pure-Python packages bench/engine_gpu.py's docstring says to carry there (import name: pip name)
CARRIED = {
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "antlr4": "antlr4-python3-runtime",
    "gymnasium": "gymnasium",
    "farama_notifications": "farama-notifications",
}
PROJECT = ["baselines", "calibration", "chunkgym", "engine", "envs", "leaderboard", "policies"]
# runs a script with every other non-standard-library module hidden, as if not installed
HIDING_RUNNER = """
import importlib.abc, runpy, sys
allowed = set(sys.argv[1].split(","))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in allowed or top in sys.stdlib_module_names or top.startswith("_"):
            return None
        raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
sys.meta_path.insert(0, Hide())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_script_writes_a_device_only_cost_file_on_cpu(tmp_path: Path) -> None:
    allowed = ",".join([*PYTORCH_IMAGE, *CARRIED, *PROJECT])
    cmd = [sys.executable, "-c", HIDING_RUNNER, allowed, "bench/engine_gpu.py", *SMOKE, f"out={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    path = Path(report["cost_file"])
    assert path == tmp_path / "cpu__smoke__tp1.yaml"
    data = read_cost_file(path)
    assert data["device_only"] and data["tp"] == 1 and "plain PyTorch" in data["source"]
    params = data["params"]
    assert all(getattr(params, name) == 0 for name in ENGINE_FIELDS)
    # measured attention: a fit of positive times predicts positive times (single terms may fit to 0 on a noisy CPU)
    assert params.attn_prefill_fixed_s + params.attn_prefill_s_per_pair * 64 * 65 / 2 > 0
    assert params.attn_decode_fixed_s * 8 + params.attn_decode_s_per_token * 8 * 64 > 0
    assert params.lin_fixed_s + params.lin_mem_s > 0
    table = pd.read_csv(tmp_path / "cpu__smoke__tp1.mlp.csv")
    assert list(table.columns) == vidur_columns()
    assert {"per_layer_heldout_mape", "attention_prefill_mape", "attention_decode_mape"} <= set(report)
    # the file loads as a cost model with the default engine profile, as the GPU run reports it
    assert 0 < report["decode_1x1024_ms"] and 0 < report["prefill_512_ms"]


def test_gpu_script_says_what_to_carry_and_fails_without_it(tmp_path: Path) -> None:
    doc = (REPO_ROOT / "bench" / "engine_gpu.py").read_text()
    assert all(name in doc for name in CARRIED.values())
    allowed = ",".join([*PYTORCH_IMAGE, *PROJECT])  # a PyTorch machine without the carried wheels
    cmd = [sys.executable, "-c", HIDING_RUNNER, allowed, "bench/engine_gpu.py", *SMOKE, f"out={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode != 0 and "(hidden)" in proc.stderr and not list(tmp_path.iterdir())


def test_gpu_script_without_a_gpu_says_so(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "bench/engine_gpu.py", f"out={tmp_path}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    if proc.returncode == 0:  # a GPU is here: the profile ran
        return
    assert "no CUDA device here" in proc.stderr and not list(tmp_path.iterdir())
