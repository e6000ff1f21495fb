"""The tools' front door: overrides and options files call no resolver that reads, numbers have
ranges, output folders are checked and locked before Hydra writes, and every bad input is one line
on stderr with exit code 2."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from chunkgym import REPO_ROOT
from chunkgym.cli import InputExit, hydra_cli, load_options, one_line_errors, refuse_resolvers, resolvers_in
from chunkgym.config import ConfigError
from chunkgym.io import folder_lock
from chunkgym.received import ReceivedFileError
from policies.config import register_configs, to_train_config


@dataclass
class Options:
    name: str = "x"
    path: str = "out/${name}"
    steps: int = 1


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for parent, _, files in os.walk(root):
        for name in files:
            path = Path(parent) / name
            out[str(path)] = "link" if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def run(tool: str, *args: str, timeout: int = 120) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, tool, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )
    return done, time.perf_counter() - started


def assert_one_line(done: subprocess.CompletedProcess, prefix: str) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    return lines[0]


# ---- resolvers ---------------------------------------------------------------------------------
def test_resolver_calls_are_found_however_they_are_nested():
    assert resolvers_in("a${oc.env:HOME}b") == ["oc.env"]
    assert sorted(resolvers_in("${oc.decode:${oc.env:X}}")) == ["oc.decode", "oc.env"]
    assert resolvers_in("[a,'${oc.env:X}']") == ["oc.env"]
    assert resolvers_in("${${name}:x}") == ["${name}"]  # a resolver named by an interpolation
    assert resolvers_in("out/${now:%Y}/${a.b}") == ["now"]
    assert resolvers_in("\\${oc.env:X}") == []  # escaped: a plain string
    with pytest.raises(ConfigError, match="not a valid interpolation"):
        resolvers_in("${oc.env:")


def test_an_options_file_with_a_resolver_is_refused_and_plain_references_work(tmp_path, monkeypatch):
    monkeypatch.setenv("S1_SECRET", "hunter2")
    for text in ["name: ${oc.env:S1_SECRET}\n", "name: \"${oc.decode:'1'}\"\n", "name: ${${path}:x}\n"]:
        path = tmp_path / "opts.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_options(Options, [f"config={path}"], name="s1_cli_options")
        assert (
            str(path) in str(info.value) and "hunter2" not in str(info.value) and "\n" not in str(info.value)
        )
    (tmp_path / "opts.yaml").write_text("name: y\n")
    assert load_options(Options, [f"config={tmp_path / 'opts.yaml'}"], name="s1_cli_options").path == "out/y"
    (tmp_path / "opts.yaml").write_text("a: &x 1\nname: *x\n")
    with pytest.raises(ReceivedFileError, match="anchor or alias"):
        load_options(Options, [f"config={tmp_path / 'opts.yaml'}"], name="s1_cli_options")


def test_a_small_tool_refuses_a_resolver_override_in_one_line(capsys):
    ran = []
    main = hydra_cli(Options, "s1_cli_tool")(ran.append)
    with pytest.raises(InputExit) as info:
        main(["name=${oc.env:HOME}"])
    assert info.value.code == 2 and not ran
    assert capsys.readouterr().err.strip().splitlines() == [str(info.value)]
    assert "override name" in str(info.value) and os.environ.get("HOME", "~") not in str(info.value)
    main(["name=${now:%Y}"])  # the repo's own resolver stays
    assert ran[0].name.isdigit()


def test_nested_values_are_checked_too():
    refuse_resolvers({"a": ["b", {"c": "${now:%H}"}]}, "f")
    with pytest.raises(ConfigError, match=r"^f: '\$\{oc.env:X\}' calls the resolver\(s\) oc.env"):
        refuse_resolvers({"a": ["b", {"c": "${oc.env:X}"}]}, "f")


def test_one_line_errors_turns_input_errors_into_exit_2_and_keeps_bugs(capsys):
    def bad_file() -> None:
        raise ReceivedFileError("x.json: nested deeper than 64 levels")

    with pytest.raises(InputExit) as info:
        one_line_errors(tool="t.py")(bad_file)()
    assert (
        info.value.code == 2
        and capsys.readouterr().err == "t.py: error: x.json: nested deeper than 64 levels\n"
    )

    def bug() -> None:
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        one_line_errors(tool="t.py")(bug)()


# ---- numeric ranges --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("env.tp=65", "env.tp=65"),
        ("env.tp=0", "env.tp=0"),
        ("env.load_scale=[1e-300,1.0]", "env.load_scale="),
        ("env.load_scale=[1.0,1e20]", "env.load_scale="),
        ("eval.load_scale=1e20", "eval.load_scale=1e+20"),
        ("env.window_s=1e-300", "env.window_s=1e-300"),
        ("eval.window_s=1e20", "eval.window_s=1e+20"),
        ("seed=4294967296", "seed=4294967296"),
        ("eval.seeds=[-1]", "eval.seeds=[-1]"),
        ("+env.workload_loads.azure_code=[0.0,1.0]", "env.workload_loads="),
    ],
)
def test_train_numbers_out_of_range_are_one_line_naming_the_key(override, key):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["logger.mode=disabled", override])
    with pytest.raises(ConfigError) as info:
        to_train_config(cfg)
    assert str(info.value).startswith(key) and "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("tp=65", "tp=65: must be an integer in [1, 64]"),
        ("load_scales=[1e20]", "load_scales must be positive numbers in [0.001, 1000], got [1e+20]"),
        ("window_s=1e-300", "window_s must be null or seconds in [1, 2592000] (30 days), got 1e-300"),
        ("seeds=[4294967296]", "seeds must be an integer in [0, 4294967295], got [4294967296]"),
        ("slo.name=${oc.env:HOME}", "override slo.name: '${oc.env:HOME}' calls the resolver(s) oc.env"),
    ],
)
def test_evaluate_refuses_bad_numbers_and_resolvers_before_writing(tmp_path, override, message):
    out = tmp_path / "out"
    done, seconds = run("evaluate.py", override, f"output_dir={out}", "progress=false")
    assert assert_one_line(done, "evaluate.py: error: ").startswith(f"evaluate.py: error: {message}")
    assert not out.exists() and seconds < 60


# ---- output folders -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("folder", ["/", "/etc", "conf/policy", str(Path.home())])
def test_evaluate_and_advise_refuse_system_and_source_output_folders(folder):
    before = snapshot(REPO_ROOT / "conf")
    for tool in ("evaluate.py", "advise.py"):
        extra = ["engine=vllm", "workload=azure_conv", "slo.itl_ms_p99=100"] if tool == "advise.py" else []
        done, seconds = run(tool, *extra, f"output_dir={folder}")
        assert f"output_dir={folder}: resolves to" in assert_one_line(done, f"{tool}: error: ")
        assert seconds < 60
    assert snapshot(REPO_ROOT / "conf") == before


@pytest.mark.slow
def test_a_used_output_folder_is_refused_before_hydra_rewrites_it(tmp_path):
    out = tmp_path / "out"
    (out / ".hydra").mkdir(parents=True)
    (out / ".hydra" / "config.yaml").write_text("the first run's\n")
    with folder_lock(out, "evaluate.py"):
        before = snapshot(out)
        done, seconds = run("evaluate.py", "policies=[fcfs]", "seeds=[0]", f"output_dir={out}")
        assert "is in use by another evaluate.py run" in assert_one_line(done, "evaluate.py: error: ")
    assert snapshot(out) == before and seconds < 60


@pytest.mark.slow
def test_a_planted_hydra_link_is_refused_before_hydra_writes_through_it(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "config.yaml").write_text("someone else's\n")
    (out / ".hydra").symlink_to(elsewhere)
    before = snapshot(elsewhere)
    done, _ = run("evaluate.py", "results=/no/such.csv", f"output_dir={out}")
    assert ".hydra" in assert_one_line(done, "evaluate.py: error: ")
    assert snapshot(elsewhere) == before


@pytest.mark.slow
def test_a_planted_output_file_link_is_refused_before_anything_is_written(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "notes.md").write_text("mine\n")
    (out / "leaderboard.md").symlink_to(elsewhere / "notes.md")
    before = snapshot(elsewhere)
    done, seconds = run("evaluate.py", "results=/no/such.csv", f"output_dir={out}")
    line = assert_one_line(done, "evaluate.py: error: ")
    assert (
        line
        == f"evaluate.py: error: {out / 'leaderboard.md'}: is a symbolic link; files in {out} must be regular files inside it"
    )
    assert snapshot(elsewhere) == before and seconds < 60
