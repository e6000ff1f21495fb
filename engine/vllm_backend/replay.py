"""Replay a trace slice on vLLM in real time, a chunkgym policy scheduling it; and in the simulator.

    python -m engine.vllm_backend.replay                         # conf/replay/vllm/cpu_vllm.yaml as is
    python -m engine.vllm_backend.replay "policies=[sarathi_512,learned_vllm]" seed=1 "backends=[vllm,sim]"

The slice is :mod:`engine.replay`'s (the workload's test window for ``seed`` at ``load_scale``,
lengths divided by ``length_scale``), its options a :class:`VllmReplayConfig` (engine.replay's
plus vLLM's own), its rows ``evaluate.py``'s columns built by the same code, ``backend`` ``vllm``
or ``sim``.  Per policy, vLLM starts with :class:`engine.vllm_backend.scheduler.ChunkgymScheduler`
running that policy (named in ``additional_config``, with the SLO and the cost file its features
need), and serves the slice on the wall clock: each request is added when its arrival time has
passed (with that arrival time), ``LLMEngine.step()`` runs while work is left, and every token's
time is the end of the step that emitted it.  ``python evaluate.py results=DIR/results.csv`` ranks
the rows beside simulated and engine rows (vLLM rows labelled ``policy [vllm]``).

Per step ``iterations.csv`` also holds the cost model's ``predicted`` latency for the batch vLLM
ran, ``decode_context``, ``schedule_s`` (time inside ``schedule()``, the policy's included) and
``plan_agrees`` (vLLM scheduled exactly the tokens per request the policy planned on vLLM's state).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd

from chunkgym import REPO_ROOT, resolve_path
from chunkgym.cli import hydra_cli, load_options
from chunkgym.provenance import config_hash
from engine.replay import (
    Replay,
    ReplayConfig,
    check,
    iteration_frame,
    replay_and_write,
    row,
    run_sim,
    run_spec,
)
from engine.serve import WallClock, prompt_tokens
from engine.vllm_backend import llm
from engine.vllm_backend.compare import plan_agreement
from envs.serving.cost_model import CostModel
from envs.serving.loop import ITERATION_COLUMNS, SimResult, iteration_summary
from envs.serving.metrics import RequestOutcomes, request_summary
from envs.serving.setup import ServingSetup
from envs.serving.workloads.trace import Trace

DEFAULT_CONFIG = REPO_ROOT / "conf" / "replay" / "vllm" / "cpu_vllm.yaml"
CONFIG_NAME = "vllm_replay"
SCHEDULER = "engine.vllm_backend.scheduler.ChunkgymScheduler"
EXTRA_COLUMNS = {
    "predicted": np.float64,
    "decode_context": np.int64,
    "schedule_s": np.float64,
    "plan_agrees": bool,
}
"""Per-step records beside the simulator's ``ITERATION_COLUMNS``."""
WARMUP = ((256, 16),) * 4 + ((512, 4),) * 2 + ((64, 32),) * 8
"""(prompt, output) tokens of requests served before a replay: vLLM's first steps after start-up run
2-3x slower than later ones of the same batch.  They arrive (for the policy's rate estimate) long ago."""
WARMUP_AGE_S = 3600.0


@dataclass
class VllmReplayConfig(ReplayConfig):
    """engine.replay's slice and policies; vLLM instead of our engine (see ``conf/replay/vllm/cpu_vllm.yaml``)."""

    backends: list[str] = field(default_factory=lambda: ["vllm"])
    model: str = "vllm_small"
    max_num_batched_tokens: int = 16384  # vLLM's buffers; plans above it are cut (fcfs: whole prompts)
    checkpoints: str = "outputs/vllm/checkpoints"  # where the random-weight checkpoint is written once
    output_dir: str = "outputs/vllm/replay"
    gpu_memory_utilization: float = 0.9  # device cuda: GPU memory vLLM may take; serving.num_blocks must fit
    enforce_eager: bool = True  # device cuda: False captures CUDA graphs for decode batches
    pin_heap: bool = True  # device cpu: glibc's heap never maps or trims (engine/vllm_backend/heap.py)
    BACKENDS: ClassVar[tuple[str, ...]] = ("vllm", "sim")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device not in llm.DEVICES or self.dtype is not None:
            raise ValueError(
                f"device/dtype: vLLM runs on {' or '.join(llm.DEVICES)} at the model file's dtype (dtype null), "
                f"got {self.device}/{self.dtype}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


def load_config(argv: Sequence[str] = ()) -> VllmReplayConfig:
    """What ``python -m engine.vllm_backend.replay ARGV`` reads (bad keys raise naming them)."""
    return load_options(VllmReplayConfig, argv, DEFAULT_CONFIG, name=CONFIG_NAME)


def settings(conf: VllmReplayConfig, policy: str | None = None) -> llm.EngineSettings:
    """vLLM's settings for ``conf``: the chunkgym scheduler running ``policy`` (None: vLLM's own)."""
    plugin = None
    if policy is not None:
        cost = conf.cost_model if conf.cost_model not in ("calibrated", "roofline") else None
        cost = cost or f"{conf.hardware}__{conf.model}__tp1"
        plugin = {
            "chunkgym": {"policy": policy, "slo": conf.slo, "cost": cost, "lookahead": conf.serving.lookahead}
        }
    return llm.EngineSettings(
        conf.model,
        conf.weights_seed,
        conf.serving,
        conf.max_num_batched_tokens,
        conf.threads,
        SCHEDULER if policy is not None else None,
        plugin,
        conf.device,
        conf.gpu_memory_utilization,
        conf.enforce_eager,
        conf.pin_heap,
    )


class VllmServer:
    """One vLLM engine running one policy; serves trace slices in real time (:meth:`serve`)."""

    def __init__(self, conf: VllmReplayConfig, policy: str) -> None:
        if conf.cost_model == "roofline":
            raise ValueError(
                "cost_model: the vLLM plugin needs a coefficient file (calibrated or a path), got 'roofline'"
            )
        self.conf = conf
        self.policy = policy
        self.engine = llm.start(settings(conf, policy), resolve_path(conf.checkpoints))
        self.sched = llm.scheduler(self.engine)
        self.recorder = llm.StepRecorder(self.sched)
        self.vocab = self.engine.model_config.get_vocab_size()
        self.warm_up()

    def warm_up(self) -> list[tuple[float, llm.Step]]:
        """Serve :data:`WARMUP` to completion: each step's seconds and what vLLM ran in it."""
        past = time.time() - WARMUP_AGE_S
        for k, (prompt, output) in enumerate(WARMUP):
            tokens = prompt_tokens(self.conf.prompt_seed + 1, k, prompt, self.vocab)
            self.engine.add_request(
                f"warmup{k}",
                llm.TokensPrompt(prompt_token_ids=tokens),
                llm.sampling(output),
                arrival_time=past,
            )
        steps = []
        while self.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            self.engine.step()
            steps.append((time.perf_counter() - t0, self.recorder.last))
        return [(seconds, step) for seconds, step in steps if step is not None]

    def time_scale(self, cost: CostModel) -> float:
        """How much longer this engine's steps take now than ``cost`` predicts: the median over the
        steps of serving :data:`WARMUP` once more of measured / predicted seconds.  vLLM's CPU steps
        run up to ~20% faster or slower from one engine, or one window, to the next on a shared machine
        (``step_speed_per_window`` of ``bench/sim_to_real_vllm.py``), while a profile is one number."""
        return statistics.median(
            seconds / cost.iteration_time(*step.composition()) for seconds, step in self.warm_up()
        )

    def close(self) -> None:
        self.engine.engine_core.shutdown()

    def serve(self, trace: Trace, setup: ServingSetup, log: Callable[[str], None] = print) -> SimResult:
        """Serve ``trace`` in real time from now; the policy is reset first (a fresh window).

        What the process holds when the window starts (earlier windows' results, the simulator's
        runs) is collected and frozen out of the garbage collector, as vLLM's engine core freezes its
        start-up heap: a served step then pays for collecting only what serving allocates, as in
        vLLM's own server, whose engine core process holds no harness."""
        conf, engine, sched, rec = self.conf, self.engine, self.sched, self.recorder
        if engine.has_unfinished_requests():
            raise RuntimeError("vLLM still holds requests of an earlier replay")
        gc.collect()
        gc.freeze()
        sched.chunkgym_policy.reset(sched.view)
        sched.steps = []  # the plugin records plan and schedule of every step
        n = len(trace)
        limit = setup.config.max_model_len or setup.model.max_context
        lengths = trace.prompt_len + trace.output_len
        reject = [
            f"prompt+output {t} tokens exceeds max_model_len {limit}" if t > limit else "" for t in lengths
        ]
        times: list[list[float]] = [[] for _ in range(n)]
        first = np.full(n, -1.0)
        preempted = np.zeros(n, dtype=np.int64)
        index: dict[str, int] = {}
        cols: dict[str, list] = {k: [] for k in (*ITERATION_COLUMNS, *EXTRA_COLUMNS)}
        clock = WallClock(conf.idle)
        wall0 = time.time()
        clock.start()
        i, shown = 0, 0.0
        while True:
            now = clock.now()
            while i < n and trace.arrival_s[i] <= now:
                if not reject[i]:
                    tokens = prompt_tokens(conf.prompt_seed, i, int(trace.prompt_len[i]), self.vocab)
                    rid = engine.add_request(
                        str(i),
                        llm.TokensPrompt(prompt_token_ids=tokens),
                        llm.sampling(int(trace.output_len[i])),
                        arrival_time=wall0 + float(trace.arrival_s[i]),
                    )
                    index[rid] = index[str(i)] = i
                i += 1
            if not engine.has_unfinished_requests():
                if i >= n:
                    break
                clock.sleep_until(float(trace.arrival_s[i]))
                continue
            start = clock.now()
            outputs = engine.step()
            end = clock.now()
            step = rec.last
            assert step is not None
            for r in step.tokens:
                j = index[r]
                if first[j] < 0:
                    first[j] = start
                held = sched.requests.get(r)
                if held is not None:
                    preempted[j] = held.num_preemptions
            for out in outputs:
                j = index[out.request_id]
                new = len(out.outputs[0].token_ids) - len(times[j])
                times[j].extend([end] * new)
            num_decode, decode_kv, chunks, contexts = step.composition()
            record = sched.steps[-1]
            for name, value in (
                ("start", start),
                ("latency", end - start),
                ("decode_tokens", num_decode),
                ("prefill_tokens", sum(chunks)),
                ("prefill_seqs", len(chunks)),
                ("kv_used", llm.kv_used(engine)),
                ("predicted", setup.cost_model.iteration_time(num_decode, decode_kv, chunks, contexts)),
                ("decode_context", decode_kv),
                ("schedule_s", step.schedule_s),
                ("plan_agrees", record.agrees),
            ):
                cols[name].append(value)
            if end - shown >= 10.0:
                shown = end
                log(
                    f"{self.policy} [vllm]: {end:.0f} of {trace.span_s:.0f} s of the trace served in real time"
                )
        sched.steps = None
        it = {k: np.array(v, dtype=({**ITERATION_COLUMNS, **EXTRA_COLUMNS})[k]) for k, v in cols.items()}
        return result(trace, setup, times, first, preempted, reject, it, time.time() - wall0)


def result(
    trace: Trace,
    setup: ServingSetup,
    times: list[list[float]],
    first: np.ndarray,
    preempted: np.ndarray,
    reject: list[str],
    iterations: dict[str, np.ndarray],
    wall_s: float,
) -> SimResult:
    """The replay in the simulator's terms: the core's SLO bounds (the same cost model), outcomes, metrics."""
    cost, slo = setup.cost_model, setup.slo
    token_times = [np.array(t) if not why else None for t, why in zip(times, reject, strict=True)]
    outcomes = RequestOutcomes.from_token_times(
        arrival=trace.arrival_s.tolist(),
        prompt_len=trace.prompt_len.tolist(),
        output_len=trace.output_len.tolist(),
        token_times=token_times,
        first_scheduled=first.tolist(),
        ttft_bound=[slo.ttft_bound(cost.prefill_time_alone(int(p))) for p in trace.prompt_len],
        slo=slo,
        reject_reason=reject,
        preemptions=preempted.tolist(),
    )
    metrics = request_summary(outcomes, trace.span_s)
    metrics.update(iteration_summary(iterations, setup.config.num_blocks, outcomes))
    metrics["sim_wall_s"] = wall_s
    kept = {k: np.asarray(t) for k, t in enumerate(token_times) if t is not None}
    return SimResult(outcomes, iterations, metrics, kept)


def replay(
    conf: VllmReplayConfig,
    servers: dict[str, VllmServer] | None = None,
    log: Callable[[str], None] = print,
    time_scale: float = 1.0,
) -> Replay:
    """Every policy on every backend over the slice (vLLM in real time).  ``servers``: engines
    already started per policy (kept open for the caller); others are started and closed here.
    ``time_scale``: the simulator's (see :class:`~envs.serving.simulator.CostModelClock`)."""
    trace = check(conf)
    rows, frames, results = [], [], {}
    for policy in conf.policies:
        for backend in conf.backends:
            t0 = time.perf_counter()
            log(f"{policy} [{backend}]: serving {len(trace)} requests over {trace.span_s:.0f} s of trace")
            if backend == "vllm":
                server = (servers or {}).get(policy) or VllmServer(conf, policy)
                try:
                    result_ = server.serve(trace, run_spec(conf, policy).setup.build(), log)
                finally:
                    if server is not (servers or {}).get(policy):
                        server.close()
            else:
                result_ = run_sim(conf, policy, trace, time_scale)
            results[(policy, backend)] = result_
            out = row(conf, policy, trace, result_, backend)
            if backend == "vllm":  # the hash covers vLLM's own settings too
                vllm_settings = {
                    "version": llm.VERSION,
                    "max_num_batched_tokens": conf.max_num_batched_tokens,
                }
                out.row["config_hash"] = config_hash({"run": out.row["config_hash"], "vllm": vllm_settings})
            rows.append(out)
            frames.append(iteration_frame(policy, backend, result_.iterations))
            m = result_.metrics
            log(
                f"{policy} [{backend}] {m['finished']}/{m['requests']} finished in {time.perf_counter() - t0:.1f} s: "
                f"TTFT p50 {m['ttft_p50_s']:.3f} s, p99 {m['ttft_p99_s']:.3f} s, TBT p99 {m['tbt_p99_s']:.4f} s, "
                f"goodput {m['goodput_rps']:.3f} req/s"
                + (f", plan agreement {plan_agreement(result_.iterations):.3f}" if backend == "vllm" else "")
            )
    return Replay(rows, pd.concat(frames, ignore_index=True), results)


@hydra_cli(VllmReplayConfig, CONFIG_NAME, default_file=DEFAULT_CONFIG)
def main(conf: VllmReplayConfig) -> Path:
    directory = resolve_path(conf.output_dir)
    print(
        f"replaying {conf.workload} seed {conf.seed} at load {conf.load_scale:g} on vLLM {llm.VERSION} -> {directory}"
    )
    return replay_and_write(conf, replay, directory, "python -m engine.vllm_backend.replay")


if __name__ == "__main__":
    main()
