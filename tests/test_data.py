"""The data folder: its default (the user cache), shipped Azure traces, the pinned manifest, ``chunkgym.data``."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

import chunkgym
from chunkgym import data
from chunkgym.data import Archive, DataError, DataFile, Source
from envs.serving.workload import WORKLOAD_DIR, TraceError, Workload, load_workload
from policies.config import register_configs, to_train_config

SOURCES = data.load_sources()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _source(files: dict[str, bytes], members: dict[str, bytes] | None = None) -> Source:
    """A made-up upstream repository ``o/r`` with loose files and an optional archive."""
    loose = tuple(DataFile(f"up/{name}", f"traces/x/{name}", _sha(b)) for name, b in files.items())
    archive = None
    if members:
        archive = Archive("traces/x/pack.tar.gz", tuple(DataFile(n, n, _sha(b)) for n, b in members.items()))
    return Source("x", "o/r", "c" * 40, "MIT", loose, archive)


def _mirror(root: Path, files: dict[str, bytes]) -> Path:
    for name, b in files.items():
        (root / "o/r" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "o/r" / name).write_bytes(b)
    return root


def test_the_default_data_folder_is_the_per_user_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(chunkgym.DATA_ENV_VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert chunkgym.data_root() == tmp_path / "xdg/chunkgym/data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert chunkgym.data_root() == tmp_path / "home/.cache/chunkgym/data"
    for ignored in ("", "relative/cache"):  # the XDG spec: an empty or relative value is not a cache folder
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert chunkgym.data_root() == tmp_path / "home/.cache/chunkgym/data"
    monkeypatch.setenv(chunkgym.DATA_ENV_VAR, "")  # empty: unset
    assert chunkgym.data_root() == tmp_path / "home/.cache/chunkgym/data"


def test_chunkgym_data_beats_the_cache_and_an_explicit_data_root_beats_both(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(chunkgym.DATA_ENV_VAR, str(tmp_path / "mirror"))
    assert chunkgym.data_root() == tmp_path / "mirror"
    assert chunkgym.data_root(tmp_path / "given") == tmp_path / "given"
    monkeypatch.setenv(chunkgym.DATA_ENV_VAR, "mirror")  # relative: against the repository root
    assert chunkgym.data_root() == chunkgym.REPO_ROOT / "mirror"
    monkeypatch.delenv(chunkgym.DATA_ENV_VAR)
    assert chunkgym.data_root(str(tmp_path / "given")) == tmp_path / "given"


def test_fetch_writes_into_the_cache_when_no_folder_is_named(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.delenv(chunkgym.DATA_ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    source = _source({"a.csv": b"1\n"})
    monkeypatch.setattr(data, "load_sources", lambda: [source])
    mirror = _mirror(tmp_path / "mirror", {"up/a.csv": b"1\n"})
    assert data.main(["fetch", f"from={mirror}"]) == 0
    cache = tmp_path / "xdg/chunkgym/data"
    assert (cache / "traces/x/a.csv").read_bytes() == b"1\n"
    assert f"fetching into {cache}" in capsys.readouterr().out


def test_the_default_training_config_needs_only_the_shipped_traces(tmp_path) -> None:
    """``python train.py`` on a fresh clone: every workload it reads loads from ``data/`` with an empty data folder."""
    register_configs()
    with initialize_config_dir(config_dir=str(chunkgym.REPO_ROOT / "conf"), version_base="1.3"):
        cfg = to_train_config(compose("train"))
    workloads = [Workload(cfg.workload, tmp_path)]
    workloads += [Workload.from_name(n, tmp_path) for n in [*cfg.env.workloads, *cfg.eval.workloads]]
    for w in workloads:
        assert w.source.startswith(f"file:{chunkgym.SHIPPED_DATA}"), w.source
    assert not any(tmp_path.iterdir())  # nothing was written to the data folder either


def test_shipped_azure_traces_are_the_pinned_files_and_load_with_an_empty_data_root(tmp_path) -> None:
    azure = next(s for s in SOURCES if s.name == "azure_llm_2023")
    assert azure.shipped and list(data.problems(azure, chunkgym.SHIPPED_DATA)) == []
    assert {"LICENSE", "AzureLLMInferenceDataset2023.md"} <= {Path(p).name for p in azure.paths()}
    for name in ("azure_conv", "azure_code"):
        w = load_workload(name, data_root=tmp_path)
        assert w.source.startswith(f"file:{chunkgym.SHIPPED_DATA}")
        assert len(w.window("test", 0)) > 100
    assert data.verify(tmp_path, [azure]) == []  # the shipped copy counts for a shipped source


def test_a_copy_in_the_data_root_takes_precedence_over_the_shipped_one(tmp_path) -> None:
    rel = "traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv"
    assert chunkgym.data_file(rel, tmp_path) == chunkgym.SHIPPED_DATA / rel
    (tmp_path / rel).parent.mkdir(parents=True)
    (tmp_path / rel).write_bytes((chunkgym.SHIPPED_DATA / rel).read_bytes())
    assert chunkgym.data_file(rel, tmp_path) == tmp_path / rel
    assert chunkgym.data_file("traces/none.csv", tmp_path) == tmp_path / "traces/none.csv"


def test_every_workload_file_is_covered_by_a_pinned_source() -> None:
    covered = {p for s in SOURCES for p in s.paths()}
    for path in WORKLOAD_DIR.glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())
        if spec["format"] == "mix":  # tenants of shipped workloads, each covered as its own file
            assert all((WORKLOAD_DIR / f"{t['source']}.yaml").is_file() for t in spec["tenants"]), path
        elif spec["format"] != "synthetic":
            assert spec["path"] in covered, path
    for s in SOURCES:
        assert len(s.commit) == 40 and s.licence
        hashes = [f.sha256 for f in s.files] + [m.sha256 for m in (s.archive.members if s.archive else ())]
        assert all(len(h) == 64 for h in hashes)


def test_a_missing_data_file_names_the_fetch_command_in_one_line(tmp_path) -> None:
    with pytest.raises(TraceError) as info:
        load_workload("sharegpt_poisson", data_root=tmp_path)
    message = str(info.value)
    assert "\n" not in message and data.FETCH_COMMAND in message and str(tmp_path) in message


def test_train_py_reports_missing_data_in_one_line_without_a_traceback(tmp_path) -> None:
    env = {"CHUNKGYM_DATA": str(tmp_path), "WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "workload=sharegpt_poisson",
            "logger=disabled",
            f"hydra.run.dir={tmp_path}/r",
        ],
        cwd=chunkgym.REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:") and data.FETCH_COMMAND in lines[0]


@pytest.mark.parametrize(
    ("command", "tool"),
    [
        (["bench/sarathi_capacity.py"], "sarathi_capacity.py"),
        (["-m", "calibration", "out=OUT", "report=null"], "python -m calibration"),
    ],
)
def test_tools_report_missing_data_in_one_line_without_a_traceback(tmp_path, command, tool) -> None:
    env = {"CHUNKGYM_DATA": str(tmp_path), "PATH": "/usr/bin:/bin"}
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    proc = subprocess.run(
        [sys.executable, *args], cwd=chunkgym.REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: error:") and data.FETCH_COMMAND in lines[0]


def test_fetch_from_an_upstream_layout_mirror_writes_checked_files_and_packs_the_archive(tmp_path) -> None:
    loose = {"a.csv": b"x,y\n1,2\n", "LICENSE": b"MIT\n"}
    members = {"data/m/chunk-0-trace.csv": b"0,1\n", "data/m/chunk-0-dataset.json": b"{}"}
    source = _source(loose, members)
    mirror = _mirror(tmp_path / "mirror", {f"up/{n}": b for n, b in loose.items()} | members)
    dest = tmp_path / "data"
    lines: list[str] = []
    assert data.fetch(dest, [source], data.from_mirror(mirror), lines.append) == 3
    assert (dest / "traces/x/a.csv").read_bytes() == loose["a.csv"]
    with tarfile.open(dest / "traces/x/pack.tar.gz") as tar:
        assert {m.name: tar.extractfile(m).read() for m in tar} == members
    assert data.verify(dest, [source]) == []
    assert any("[2/2]" in line for line in lines)  # progress per file
    assert data.fetch(dest, [source], data.from_mirror(mirror), lines.append) == 0  # already there
    assert lines[-1].startswith("x: up to date")


def test_fetch_refuses_a_file_whose_hash_differs_and_writes_nothing(tmp_path) -> None:
    source = _source({"a.csv": b"good\n"})
    mirror = _mirror(tmp_path / "mirror", {"up/a.csv": b"tampered\n"})
    with pytest.raises(DataError, match=r"traces/x/a\.csv: SHA-256 .* is not the pinned .*nothing written"):
        data.fetch(tmp_path / "data", [source], data.from_mirror(mirror), print)
    assert not (tmp_path / "data/traces/x/a.csv").exists()


def test_a_data_folder_layout_mirror_serves_loose_files_and_archive_members(tmp_path) -> None:
    members = {"data/m/chunk-1-trace.csv": b"0,2\n"}
    source = _source({"a.csv": b"1\n"}, members)
    other = tmp_path / "other"  # someone's data folder: files at their data-folder paths
    (other / "traces/x").mkdir(parents=True)
    (other / "traces/x/a.csv").write_bytes(b"1\n")
    (other / "traces/x/pack.tar.gz").write_bytes(data.pack(list(members.items())))
    data.fetch(tmp_path / "data", [source], data.from_mirror(other), print)
    assert data.verify(tmp_path / "data", [source]) == []
    assert (tmp_path / "data/traces/x/pack.tar.gz").read_bytes() == data.pack(list(members.items()))


def test_pack_is_reproducible_and_verify_names_a_changed_member(tmp_path) -> None:
    members = [("b", b"2"), ("a", b"1")]
    assert data.pack(members) == data.pack(list(reversed(members)))
    source = _source({}, dict(members))
    (tmp_path / "traces/x").mkdir(parents=True)
    (tmp_path / "traces/x/pack.tar.gz").write_bytes(data.pack([("a", b"1"), ("b", b"changed")]))
    (bad,) = data.verify(tmp_path, [source])
    assert "pack.tar.gz[b]: SHA-256" in bad


def test_download_uses_the_pinned_commit_url(monkeypatch) -> None:
    source = _source({"a.csv": b"payload"})
    seen = []

    def fake_urlopen(url: str, timeout: float) -> io.BytesIO:
        seen.append(url)
        return io.BytesIO(b"payload")

    monkeypatch.setattr(data.urllib.request, "urlopen", fake_urlopen)
    assert data.checked(source, source.files[0], data.download) == b"payload"
    assert seen == [f"https://raw.githubusercontent.com/o/r/{'c' * 40}/up/a.csv"]


def test_cli_accepts_hydra_style_options_and_rejects_unknown_sources(tmp_path, capsys) -> None:
    assert data._hydra_style(["fetch", "from=/m", "only=[a,b]"]) == [
        "fetch",
        "--from",
        "/m",
        "--only",
        "a",
        "b",
    ]
    with pytest.raises(SystemExit):
        data.main(["verify", "--only", "nope"])
    assert "unknown source(s) ['nope']" in capsys.readouterr().err
    assert data.main(["verify", f"data={tmp_path}", "only=[azure_llm_2023]"]) == 0  # the shipped copy


@pytest.mark.needs_data(*(s.name for s in SOURCES))
def test_fetch_from_a_full_data_folder_verifies_every_pinned_file(tmp_path, capsys) -> None:
    assert data.main(["fetch", "--from", str(chunkgym.data_root()), "--data", str(tmp_path)]) == 0
    n = sum(len(s.files) + (len(s.archive.members) if s.archive else 0) for s in SOURCES)
    assert f"all {n} files of {len(SOURCES)} source(s) match" in capsys.readouterr().out
    assert load_workload("servegen_r1", data_root=tmp_path).window("test", 0).prompt_len.size > 0
