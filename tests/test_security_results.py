"""A received results file names data, never files: every cell is checked before any work.

Each test plants a row (a path to a secret in a cell, a traversal in a name, a repeated run, a BOM,
Markdown in a cell) and asserts the one-line answer, that no worker started, that the secret's
content never reaches the message, and that no file outside the test's folder changed.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import leaderboard.validate as validate_module
from chunkgym import REPO_ROOT
from envs.serving.metrics import load_slo
from leaderboard.cells import AllowedPaths, check_cost_model, check_workload
from leaderboard.runs import RunSpec, SetupKey, run_row
from leaderboard.tables import markdown, ranking, read_results, read_rows
from leaderboard.validate import validate

SECRET = "SECRET_TOKEN_4F2A"
SETUP = SetupKey.create("llama3_8b", "a100_80gb", 1, load_slo("strict"), "roofline")


@pytest.fixture(scope="module")
def base_rows() -> list[dict[str, str]]:
    """Two real rows, as results.csv holds them (cells as text)."""
    rows = [
        run_row(RunSpec(p, "synthetic_azure_conv", 1.0, 0, SETUP, window_s=10.0)).row
        for p in ("fcfs", "sarathi_512")
    ]
    return [{k: "" if v != v else str(v) for k, v in row.items()} for row in rows]  # NaN -> ""


@pytest.fixture
def secret(tmp_path) -> Path:
    """A folder with files a row must never open: YAML whose parse error would quote the secret."""
    folder = tmp_path / "secret"
    folder.mkdir()
    for name in ("cost.yaml", "model.yaml", "trace.jsonl"):
        (folder / name).write_text(f"hardware: a100_80gb\n{SECRET}: [unclosed\n")
    return folder


@pytest.fixture
def no_workers(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker started before every row was checked")

    monkeypatch.setattr(validate_module, "parallel_map", refuse)


def write(rows: list[dict[str, str]], path: Path, bom: bool = False) -> Path:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + buf.getvalue().encode())
    return path


def checksums(folder: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and SECRET not in message and len(message) < 2000, message
    return message


def planted(secret: Path) -> list[tuple[str, str]]:
    rel = os.path.relpath(secret, Path.cwd())
    return [
        ("cost_model", str(secret / "cost.yaml")),
        ("cost_model", f"{rel}/cost.yaml"),
        ("cost_model", f"calibrated:{rel}/cost.yaml"),
        ("cost_model", f"{secret / 'cost.yaml'}:vllm"),
        ("workload", f"file:{secret / 'trace.jsonl'}"),
        ("workload", os.path.relpath(secret / "cost", REPO_ROOT / "conf" / "workload")),
        ("model", os.path.relpath(secret / "model", REPO_ROOT / "conf" / "model")),
        ("hardware", os.path.relpath(secret / "model", REPO_ROOT / "conf" / "hardware")),
    ]


@pytest.mark.parametrize("case", range(8))
def test_a_cell_naming_a_file_is_refused_before_anything_opens_it(
    base_rows, secret, tmp_path, no_workers, case
):
    column, value = planted(secret)[case]
    before = checksums(secret)
    path = write([{**base_rows[0], column: value}], tmp_path / "results.csv")
    with pytest.raises(ValueError) as exc:
        validate(path, n_jobs=1, progress=False)
    assert re.match(rf"{re.escape(str(path))}: row 1: column {column}: ", one_line(exc))
    assert checksums(secret) == before


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        (
            "workload",
            "no_such_workload",
            "unknown workload 'no_such_workload'",
        ),  # a JobError traceback before
        ("model", "no_such_model", "unknown model"),
        ("tp", "1000000", "column tp: '1000000' is not an integer in"),
        ("load_scale", "nan", "column load_scale: 'nan' is not a finite load scale"),
        ("seed", "-1", "column seed: '-1' is not an integer in"),
        ("window_s", "1e-300", "column window_s"),
        ("slo_spec", '{"name": "${oc.env:HOME}"}', "holds an interpolation"),
        ("serving", "[" * 100 + "]" * 100, "nested deeper than 64 levels"),
        ("policy", "fcfs\nevil" + "x" * 100_000, r"unknown policy 'fcfs\\nevilxxx"),
    ],
)
def test_a_bad_row_is_one_line_before_any_worker_starts(
    base_rows, tmp_path, no_workers, column, value, message
):
    path = write([{**base_rows[0], column: value}], tmp_path / "results.csv")
    with pytest.raises(ValueError) as exc:
        validate(path, n_jobs=1, progress=False)
    assert message in one_line(exc).replace("\\\\", "\\") or re.search(message, str(exc.value))
    assert os.environ.get("HOME", "/nonexistent") not in str(exc.value).split(": row 1")[1]


def test_allowed_paths_allow_what_the_user_named_and_nothing_else(tmp_path, secret, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "t.jsonl").write_text("{}\n")
    (tmp_path / "traces" / "out").symlink_to(secret / "trace.jsonl")
    allowed = AllowedPaths.of(["file:traces", None, "calibrated", f"{secret / 'cost.yaml'}:vllm"])
    assert check_workload("file:traces/t.jsonl", allowed) == "file:traces/t.jsonl"
    assert check_workload(f"file:{tmp_path / 'traces' / 't.jsonl'}", allowed)
    assert check_cost_model(f"{secret / 'cost.yaml'}", allowed)  # the command line's cost_model=PATH:profile
    assert check_cost_model("calibrated:vllm", AllowedPaths())
    assert check_cost_model(str(REPO_ROOT / "conf" / "cost" / "cpu__engine_small__tp1.yaml"), AllowedPaths())
    for cell in ("file:traces/out", "file:traces/../../secret/trace.jsonl", f"file:{secret / 'trace.jsonl'}"):
        with pytest.raises(ValueError, match="names a trace file that was not allowed"):
            check_workload(cell, allowed)
    with pytest.raises(ValueError, match="is neither calibrated nor roofline"):
        check_cost_model(str(secret / "model.yaml"), allowed)


def test_a_repeated_run_is_refused_naming_its_rows(base_rows, tmp_path, no_workers):
    rows = [base_rows[0], base_rows[1], {**base_rows[0], "load_scale": "1", "goodput_rps": "9.0"}]
    path = write(rows, tmp_path / "results.csv")
    with pytest.raises(ValueError) as exc:
        validate(path, n_jobs=1, progress=False)
    assert "row 1, row 3 repeat one run (backend='sim', policy='fcfs'" in one_line(exc)
    with pytest.raises(ValueError, match=r"results.csv row 1, .*results.csv row 3 repeat one run"):
        read_results([str(path)])
    # across files too: one replay per seed pooled with a glob must not hold a run twice
    other = write(base_rows[:1], tmp_path / "other.csv")
    with pytest.raises(ValueError, match=r"results.csv row 1, .*other.csv row 1 repeat one run"):
        read_results([str(write(base_rows, tmp_path / "results.csv")), str(other)])


def test_a_results_file_with_a_byte_order_mark_validates_and_renders(base_rows, tmp_path):
    plain = write(base_rows, tmp_path / "plain.csv")
    bom = write(base_rows, tmp_path / "bom.csv", bom=True)
    assert read_rows(bom) == read_rows(plain)
    n, problems = validate(bom, n_jobs=1, progress=False)
    assert (n, problems) == (2, [])
    board = read_results([str(bom)])
    assert markdown(board, ranking(board)) == markdown(read_results([str(plain)]), ranking(board))


@pytest.mark.parametrize("kind", ["fifo", "link", "sparse"])
def test_the_results_file_itself_is_read_as_a_received_file(tmp_path, secret, kind):
    path = tmp_path / "results.csv"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        path.symlink_to(secret / "cost.yaml")
    else:
        with open(path, "wb") as f:
            f.truncate(8 << 30)
    for read in (read_rows, lambda p: read_results([str(p)])):
        with pytest.raises(ValueError) as exc:
            read(path)
        assert str(path) in one_line(exc)


def test_markdown_cells_stay_text_in_their_cells(base_rows, tmp_path):
    nasty = {
        "workload": "file:/x|y\n| 1 | z |",
        "model": "<script>alert(1)</script>",
        "cost_model": "a`b`` | <b>x</b>",
        "env_version": "[link](javascript:alert(1)) & \\| tail",
    }
    board_rows = read_results([str(write([{**base_rows[0], **nasty}], tmp_path / "r.csv"))])
    board = markdown(board_rows, ranking(board_rows))
    tables = [line for line in board.splitlines() if line.startswith("|")]
    assert len({len(re.findall(r"(?<!\\)\|", line)) for line in tables}) == 1, tables
    outside_code = re.sub(r"(`+) .*? \1|(`+)[^`]+\2", "", board)
    assert "<script" not in outside_code and "<b>" not in outside_code and "](" not in outside_code
    assert "## file:/x\\|y \\| 1 \\| z \\| (test split)" in board
    assert "cost model ```a`b`` | <b>x</b>```" in board  # a code span longer than any run inside


def test_evaluate_validate_answers_a_bad_row_with_one_line(base_rows, secret, tmp_path):
    path = write([{**base_rows[0], "cost_model": str(secret / "cost.yaml")}], tmp_path / "results.csv")
    proc = subprocess.run(
        [
            sys.executable,
            "evaluate.py",
            f"validate={path}",
            "progress=false",
            f"hydra.run.dir={tmp_path / 'o'}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "row 1: column cost_model" in lines[0] and SECRET not in proc.stderr + proc.stdout
