"""Calibration against the real tables: the fidelity gates, the anomalies, the committed files.

Skipped unless the GPU profiles are in the data root (``python -m chunkgym.data fetch``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import chunkgym
from calibration.cost_files import write_cost_files, write_engine_overheads
from calibration.from_published import Calibration, calibrate
from calibration.report import summary
from calibration.sources import splitwise, vidur
from envs.serving.cost_model import COST_DIR, load_cost_model
from envs.serving.engine_overhead import ENGINE_OVERHEAD_DIR
from envs.serving.specs import load_hardware, load_model

DATA = chunkgym.data_root()
pytestmark = pytest.mark.needs_data("vidur_profiles", "splitwise_profiles")


@pytest.fixture(scope="module")
def cal() -> Calibration:
    return calibrate(DATA)


@pytest.mark.slow
def test_fidelity_gates(cal: Calibration) -> None:
    s = summary(cal)
    assert s["per_layer_mape_max"] <= 0.05
    assert s["whole_request_mape_max"] <= 0.10
    measured = {(r.hardware, r.model, r.fit.tp) for r in cal.layer_fits}
    assert len(measured) == 28  # A100: 3 models, H100 and A40: 2 models; 4 TP degrees each
    assert {e.hardware for e in cal.engines.values()} == {"a100_80gb", "h100_80gb"}
    assert all(len(e.leave_one_out) == 3 for e in cal.engines.values())


def test_known_anomalies_are_left_out() -> None:
    table = splitwise.read_perf_model(splitwise.perf_model_path(DATA))
    m = splitwise.clean(table)
    broken = [e for e in m.exclusions if e.what == "whole row"]
    assert {e.where for e in broken} >= {
        "llama2-70b a100-80gb TP2: p512 b64 t128",
        "llama2-70b h100-80gb TP2: p512 b64 t128",
    }
    tp2 = m.prompt[(m.prompt["model"] == "llama2-70b") & (m.prompt["tp"] == 2)]
    assert 64 not in tp2["batch"].tolist()
    assert not (m.token["hardware"] == "h100-80gb-pcap").any()
    assert (m.prompt["hardware"] == "h100-80gb-pcap").any()
    assert (m.token["seconds"] > 0).all()


def test_calibrated_model_reproduces_measured_rows() -> None:
    model, hw = load_model("llama2_7b"), load_hardware("a100_80gb")
    cost = load_cost_model(model, hw, 1)
    times = vidur.op_times(vidur.read_op_table(vidur.compute_table_path(DATA, "a100", model.hf_name)), 1)
    for tokens in (1, 64, 512, 2048, 4096):
        measured = times.layer[list(times.tokens).index(tokens)]
        assert cost.linear_time(tokens) == pytest.approx(measured, rel=0.08)
    m = splitwise.clean(splitwise.read_perf_model(splitwise.perf_model_path(DATA)))
    # Splitwise's runs are the 2023 engine: its profile is the one they check.
    big = load_cost_model(
        load_model("llama2_70b"), load_hardware("h100_80gb"), 4, engine_overhead="splitwise_2023_eager"
    )
    sel = (m.prompt["model"] == "llama2-70b") & (m.prompt["hardware"] == "h100-80gb") & (m.prompt["tp"] == 4)
    for prompt, batch, seconds in m.prompt[sel][["prompt", "batch", "seconds"]].itertuples(index=False):
        if batch == 1 and prompt in (512, 2048, 8192):
            assert big.iteration_time(0, 0, [prompt], [0]) == pytest.approx(seconds, rel=0.15)
    sel = (m.token["model"] == "llama2-70b") & (m.token["hardware"] == "h100-80gb") & (m.token["tp"] == 4)
    for prompt, batch, tokens, seconds in m.token[sel][["prompt", "batch", "tokens", "seconds"]].itertuples(
        index=False
    ):
        predicted = big.iteration_time(batch, int(batch * (prompt + tokens / 2)), (), ())
        assert predicted == pytest.approx(seconds, rel=0.15)


LOO_ABS_TOL = 0.005
"""The leave-one-TP-out MAPEs, refitted on two TP degrees only, land in slightly different optima of a
non-convex fit on different CPUs (tp2 held out, A100: token MAPE 0.0772 in the committed files, 0.0755
refitted on another CPU; H100: 0.0150 against 0.0124); everything else in a file must match to the digit."""


def _same_fit(committed: str, written: str) -> bool:
    """The same cost file, up to :data:`LOO_ABS_TOL` in its leave-one-TP-out errors."""
    a, b = yaml.safe_load(committed), yaml.safe_load(written)

    la, lb = _find_loo(a), _find_loo(b)
    if la.keys() != lb.keys() or a != b:
        return False
    return all(
        set(la[tp]) == set(lb[tp]) and all(abs(la[tp][k] - lb[tp][k]) <= LOO_ABS_TOL for k in la[tp])
        for tp in la
    )


def _find_loo(doc: object) -> dict:
    """Remove and return the ``leave_one_tp_out_mape`` mapping, wherever it is nested in ``doc``."""
    if isinstance(doc, dict):
        if "leave_one_tp_out_mape" in doc:
            return doc.pop("leave_one_tp_out_mape")
        for value in doc.values():
            found = _find_loo(value)
            if found:
                return found
    return {}


def test_committed_files_are_what_the_fit_writes(cal: Calibration, tmp_path: Path) -> None:
    written = write_cost_files(cal.files, tmp_path)
    # The GPU files; profiles of the local engine (hardware `cpu`) come from engine/calibrate.py.
    committed = sorted(p for p in COST_DIR.glob("*.yaml") if not p.name.startswith("cpu__"))
    assert sorted(p.name for p in written) == [p.name for p in committed]
    stale = [p.name for p in committed if not _same_fit(p.read_text(), (tmp_path / p.name).read_text())]
    assert not stale, f"conf/cost is out of date (rerun `python -m calibration`): {stale}"
    profiles = write_engine_overheads(cal.overheads, tmp_path / "overhead")
    assert sorted(p.name for p in profiles) == sorted(p.name for p in ENGINE_OVERHEAD_DIR.glob("*.yaml"))
    stale = [p.name for p in profiles if p.read_text() != (ENGINE_OVERHEAD_DIR / p.name).read_text()]
    assert not stale, f"conf/engine_overhead is out of date (rerun `python -m calibration`): {stale}"


def test_splitwise_profile_reproduces_the_model_its_fit_checks(cal: Calibration) -> None:
    """The 2023 engine profile on the device-only files is exactly the model fitted on Splitwise's runs."""
    from calibration import whole_request
    from calibration.fit import mape

    m = splitwise.clean(splitwise.read_perf_model(splitwise.perf_model_path(DATA)))

    def pick(df):
        return df[(df["model"] == "llama2-70b") & (df["hardware"] == "h100-80gb")]

    rows = whole_request.measurement_rows(pick(m.prompt), pick(m.token))
    params = {
        tp: cal.cost_model("h100_80gb", "llama2_70b", tp, "splitwise_2023_eager").params for tp in (2, 4, 8)
    }
    predicted = whole_request.cost_model_predictions(rows, params)
    for kind, error in cal.engines["h100_80gb"].in_sample.items():
        sel = (rows["kind"] == kind).to_numpy()
        assert mape(predicted[sel], rows["seconds"].to_numpy()[sel]) == pytest.approx(error, rel=1e-6)


def test_modern_engine_rows_are_predicted_with_the_default_profile(cal: Calibration) -> None:
    s = summary(cal)
    assert s["modern_engine_rows"] >= 12
    assert s["modern_engine_mape_max"] == max(abs(r.error) for r in cal.modern_engines)
    row = cal.modern_engines[0]
    direct = load_cost_model(load_model(row.row.model), load_hardware(row.row.hardware), row.row.tp)
    from calibration.validation import predict

    assert predict(row.row, direct) == pytest.approx(row.predicted, rel=1e-5)


@pytest.mark.slow
def test_cli_writes_files_and_report(tmp_path: Path) -> None:
    args = [f"data_root={DATA}", f"out={tmp_path / 'cost'}", f"report={tmp_path / 'report'}"]
    args.append(f"engine_overhead_out={tmp_path / 'overhead'}")
    cmd = [
        sys.executable,
        "-m",
        "calibration",
        *args,
        "hardware=[h100_80gb]",
        "models=[llama2_7b]",
        "tp=[1,2]",
    ]
    proc = subprocess.run(cmd, cwd=chunkgym.REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "cost").glob("*.yaml")) == [
        "h100_80gb__llama2_7b__tp1.yaml",
        "h100_80gb__llama2_7b__tp2.yaml",
    ]
    assert sorted(p.name for p in (tmp_path / "overhead").glob("*.yaml")) == [
        "splitwise_2023_eager.yaml",
        "vllm_v1.yaml",
    ]
    report = (tmp_path / "report" / "fidelity.md").read_text()
    assert "Modern engines" in report and "Engine overhead profiles" in report
    assert (
        "leave one TP degree out" in report
        and (tmp_path / "report" / "predicted_vs_measured.png").stat().st_size
    )
