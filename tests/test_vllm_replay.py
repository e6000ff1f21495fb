"""vLLM as the real engine, inside the pinned vLLM (``pip install -e '.[dev,vllm]'``; skipped without it):
the profile runs the batches it is asked for, a replay yields evaluate.py's rows with every token
timed, and the sim-to-real bench's smoke run prints its JSON.

Engines run in-process on the CPU backend with the ``vllm_small`` shapes and seeded random weights
(a checkpoint written into a temporary folder; nothing is downloaded).
"""

from __future__ import annotations

import dataclasses
import gc
import json

import numpy as np
import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed: pip install -e '.[dev,vllm]', then uninstall torchvision torchaudio torchcodec",
)

from calibration.cost_files import write_cost_files  # noqa: E402
from calibration.iterations import Composition, Sample, fit  # noqa: E402
from chunkgym import REPO_ROOT  # noqa: E402
from engine.replay import run_spec  # noqa: E402
from engine.vllm_backend import llm  # noqa: E402
from engine.vllm_backend.profile import (  # noqa: E402
    HEADER,
    LARGE_KNEES,
    Profiler,
    cost_file,
    read_samples,
    refit,
    sample_frame,
)
from engine.vllm_backend.replay import WARMUP, VllmServer, load_config, replay, settings  # noqa: E402
from envs.serving.cost_model import COST_DIR, RooflineCostModel, read_cost_file  # noqa: E402
from evaluate import render  # noqa: E402

SLICE = ["workload=azure_code", "seed=1", "load_scale=120", "window_s=30", "policies=[sarathi_256]"]
"""15 requests over 3 s of the bursty code trace: a replay of a few seconds."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def conf(checkpoints):
    return load_config([*SLICE, f"checkpoints={checkpoints}", "backends=[vllm,sim]"])


def test_checkpoint_is_written_once_with_the_model_files_shapes(checkpoints):
    path = llm.checkpoint("vllm_small", 0, checkpoints)
    written = (path / "model.safetensors").stat().st_mtime_ns
    assert llm.checkpoint("vllm_small", 0, checkpoints) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == written
    shape = json.loads((path / "config.json").read_text())
    assert (shape["num_hidden_layers"], shape["hidden_size"], shape["num_key_value_heads"]) == (6, 256, 1)


def test_profiler_times_exactly_the_compositions_asked_for(conf, checkpoints):
    engine = llm.start(settings(conf), checkpoints)  # vLLM's own scheduler
    try:
        prof = Profiler(engine, 16384)
        asked = [
            Composition("decode 3 x ctx 64", decode_contexts=(64,) * 3),
            Composition("prefill 96 over ctx 64", prefill_tokens=(96,), prefill_context=(64,)),
            Composition("2 prompts x 32", prefill_tokens=(32, 32), prefill_context=(0, 0)),
            Composition(
                "prefill 40 + 2 decodes",
                decode_contexts=(128, 128),
                prefill_tokens=(40,),
                prefill_context=(0,),
            ),
        ]
        got = [prof.measure(c, repeats=3, warmup=1) for c in asked]
        assert not engine.has_unfinished_requests()  # each composition cleans up after itself
    finally:
        engine.engine_core.shutdown()
    decode, chunk, prompts, mixed = got
    assert (decode.num_decode, decode.prefill_tokens) == (3, ())
    # the middle timed step: warm-up 1 + 1 step in, 64 cached + 2 generated before, + 1 new token each
    assert decode.decode_context == 3 * (64 + 2 + 1)
    assert (chunk.num_decode, chunk.prefill_tokens, chunk.prefill_context) == (0, (96,), (64,))
    assert (prompts.prefill_tokens, prompts.prefill_context) == ((32, 32), (0, 0))
    assert (mixed.num_decode, mixed.prefill_tokens) == (2, (40,))
    assert all(s.seconds > 0 for s in got)


def test_a_saved_profile_refits_without_vllm_to_the_same_file(conf, tmp_path):
    truth = RooflineCostModel(read_cost_file(COST_DIR / "cpu__vllm_small__tp1.yaml")["params"])
    samples = [
        Sample(n, n * 65, q, (0,) * len(q), 1.0)
        for n, q in [(0, (q,)) for q in (8, 64, 256, 1024, 2048, 4096)]
        + [(n, ()) for n in (1, 2, 4, 8, 16, 32, 64)]
        + [(4, (256,)), (0, (1024,) * 8), (0, (1024,) * 16), (0, (256,) * 64)]
    ]
    samples = [dataclasses.replace(s, seconds=s.predict(truth)) for s in samples]
    frame = sample_frame(samples, truth, "a test machine")
    frame.to_csv(tmp_path / "profile.csv", index=False)
    assert read_samples(tmp_path / "profile.csv") == (samples, "a test machine")
    done = refit(conf, tmp_path / "profile.csv", tmp_path)
    written = read_cost_file(done.path)
    # samples of the form itself are recovered, the committed file's large regime included
    assert done.fit.in_sample_mape < 1e-4 and truth.params.lin_large_knee_tokens in LARGE_KNEES
    assert written["params"].lin_large_knee_tokens == truth.params.lin_large_knee_tokens
    direct = cost_file(conf, fit(samples, 6, large_knees=LARGE_KNEES), "x", 1.0)
    assert (
        written["params"]
        == read_cost_file(write_cost_files([direct], tmp_path / "direct", HEADER)[0])["params"]
    )
    assert "a test machine; refitted from the saved profile.csv" in written["source"]
    frame.drop(columns="seconds").to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(
        ValueError, match=r"bad.csv: not a saved vLLM profile \(missing columns \['seconds'\]"
    ):
        refit(conf, tmp_path / "bad.csv", tmp_path)


def test_replay_times_every_token_and_writes_evaluate_rows(conf, tmp_path):
    server = VllmServer(conf, "sarathi_256")
    held = [[]]  # alive before the window: tracked by the collector until the window starts
    assert any(o is held for o in gc.get_objects())
    tracked_in_first_step: list[bool] = []
    step = server.engine.step

    def watched_step():
        if not tracked_in_first_step:
            tracked_in_first_step.append(any(o is held for o in gc.get_objects()))
        return step()

    server.engine.step = watched_step
    try:
        out = replay(conf, {"sarathi_256": server}, log=lambda _: None)
        assert tracked_in_first_step == [False]  # frozen out of the collector while served
        server.engine.step = step
        assert not server.engine.has_unfinished_requests()
        steps = server.warm_up()  # timed steps of known batches, as time_scale measures them
        assert len(steps) >= max(output for _, output in WARMUP) and all(s > 0 for s, _ in steps)
        scale = server.time_scale(run_spec(conf, "sarathi_256").setup.build().cost_model)
        assert 0.1 < scale < 10 and not server.engine.has_unfinished_requests()
    finally:
        server.close()
    real, sim = out.results[("sarathi_256", "vllm")], out.results[("sarathi_256", "sim")]
    o = real.outcomes
    assert o.finished.all() and len(o.arrival) == 15
    assert sim.outcomes.finished.all() and np.array_equal(sim.outcomes.arrival, o.arrival)  # the same slice
    for rid, times in real.token_times.items():
        assert len(times) == o.output_len[rid]
        assert times[0] >= o.arrival[rid] and np.all(np.diff(times) >= 0)
    it = real.iterations
    assert np.all(it["plan_agrees"])  # Sarathi's plan is what vLLM ran, every step
    assert np.all(it["decode_tokens"] + it["prefill_tokens"] <= 256)
    assert np.all(it["predicted"] > 0) and np.all(it["latency"] > 0)
    assert it["prefill_tokens"].sum() == o.prompt_len.sum()  # no preemption: each prompt token once
    vllm_row, sim_row = (r.row for r in out.rows)
    assert vllm_row["backend"] == "vllm" and sim_row["backend"] == "sim"
    assert list(vllm_row) == list(sim_row)  # exactly evaluate.py's columns
    assert vllm_row["requests"] == sim_row["requests"] == 15
    assert vllm_row["config_hash"] != sim_row["config_hash"]
    from engine.replay import write

    write(out, tmp_path)
    board = render(str(tmp_path / "results.csv"), tmp_path / "board")
    assert "sarathi_256 [vllm]" in board and "sarathi_256" in board.replace("sarathi_256 [vllm]", "")


def test_bad_settings_fail_before_any_engine_starts(checkpoints):
    with pytest.raises(ValueError, match="backends"):
        load_config([*SLICE, "backends=[engine]"])
    with pytest.raises(ValueError, match="device"):
        load_config([*SLICE, "device=tpu"])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        load_config([*SLICE, "gpu_memory_utilization=1.5"])


@pytest.mark.slow
def test_bench_smoke_run_prints_its_json(tmp_path, capsys, checkpoints):
    from engine.vllm_backend.sim_to_real import main

    main(
        [
            f"config={REPO_ROOT / 'conf/replay/vllm/cpu_vllm_smoke.yaml'}",
            f"out={tmp_path}",
            f"checkpoints={checkpoints}",
            "calibrate_speed=true",
        ]
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    for key in (
        "iteration_mape",
        "ttft_p50_rel_err",
        "ttft_p99_rel_err",
        "tbt_p99_rel_err",
        "plan_agreement",
    ):
        assert isinstance(summary[key], float) and summary[key] >= 0
    assert summary["policies"] == ["sarathi_512"] and summary["windows"] == 1
    assert summary["vllm_version"] == llm.VERSION and isinstance(summary["load_avg"], float)
    assert summary["plan_agreement"] == 1.0
    assert isinstance(summary["iteration_mape_profile"], float) and summary["calibrate_speed"] is True
    ((before, after),) = summary["time_scale_before_after"].values()
    assert before > 0 and after > 0
    assert (tmp_path / "cpu__vllm_small__tp1.yaml").is_file() and (tmp_path / "results.csv").is_file()


@pytest.mark.parametrize(
    "module", ["engine.vllm_backend.replay", "engine.vllm_backend.profile", "engine.vllm_backend.sim_to_real"]
)
def test_commands_reject_an_unknown_key_in_one_line(module):
    import importlib

    with pytest.raises(SystemExit, match="no_such_key"):
        importlib.import_module(module).main(["no_such_key=1"])


def test_bench_rejects_a_bad_reference_step_in_one_line():
    from engine.vllm_backend.sim_to_real import main

    with pytest.raises(SystemExit, match="reference_step_s"):
        main(["reference_step_s=0"])
