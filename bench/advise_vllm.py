"""The advisor checked against vLLM: advise on the vLLM CPU set-up of ``bench/sim_to_real_vllm.py``, then
serve the recommendation and other candidates on vLLM with the same traffic and see whether vLLM
orders them as the advisor predicted.

    python bench/advise_vllm.py                                         # conf/replay/vllm/cpu_advise_vllm.yaml
    python bench/advise_vllm.py out=DIR report=reports/engine/advise_vllm   # also DIR's summary and page there
    python bench/advise_vllm.py served=2 window_s=30 grid_stride=4 repeats=1 warmup=0   # a plumbing run (~2 min)

1. **Profile** vLLM (its own scheduler) once over :func:`engine.vllm_backend.profile.grid` and fit the
   cost model, as ``bench/sim_to_real_vllm.py`` does; the load is scaled by this machine's speed
   (``reference_step_s``), so the offered rate sits in the regime it was chosen for.
2. **Traffic**: the replay's slice (the ``seed`` test window of ``workload`` at that load, lengths
   divided by ``length_scale``), written as an Azure-format trace file (``traffic.csv``) and read back
   through :func:`advisor.traffic.traffic_from` as ``advise.py trace=PATH`` reads it; load scale 1 of
   that traffic is the offered rate, and vLLM serves exactly its trace.
3. **Advise** in-process as ``advise.py`` does: :func:`advisor.engines.candidates` around vLLM's CPU
   defaults (``max_num_batched_tokens`` 2048, ``max_num_seqs`` 128), each run in the simulator with
   the fitted profile at the offered rate (:func:`advisor.search.at_rate`), then each one's capacity
   (:func:`advisor.search.search`) and the recommendation (:func:`advisor.report.pick`).
4. **The SLO, fixed before vLLM serves anything**: P99 TTFT and P99 ITL targets, each the median over
   all candidates of that simulated percentile at the offered rate (three significant digits).  So
   about half the candidates meet each target at today's rate and the two targets pull in opposite
   directions (small budgets cut ITL and raise TTFT), which makes the candidates' scores differ.
   It is a rule of the simulated runs alone: no vLLM result exists when it is applied.
5. **Candidates served**: a candidate's predicted score is its worst ratio of a simulated P99 to its
   target at the offered rate (:func:`advisor.report.worst_ratio`).  The recommendation, then
   ``served - 1`` others, each the candidate nearest (in log score) to one of ``served`` points spread
   evenly over the log scores' range (the point nearest the recommendation's left out), among those
   whose score differs by at least ``apart`` (max / min >= 1 + apart) from every one chosen; ties to
   the earlier candidate.  Also fixed before vLLM runs.
6. **vLLM serves** each chosen candidate on the same trace in real time (:mod:`engine.vllm_backend.replay`):
   a knob candidate with vLLM's OWN scheduler, its knobs as engine arguments (``max_num_batched_tokens``,
   ``max_num_seqs``, ``max_num_active_seqs``, ``long_prefill_token_threshold`` and its adaptive floor,
   ``enable_chunked_prefill``; checked on the started scheduler); a plug-in candidate through
   :class:`engine.vllm_backend.scheduler.ChunkgymScheduler` with the fitted cost file.
7. **Compare**: ``advise_vllm_tau``, Kendall's tau-b between the predicted and the measured worst ratios
   (target >= 0.8), and ``advise_vllm_err_max``, the larger of ``|predicted / measured - 1|`` of the
   recommendation's P99 TTFT and P99 ITL (target <= 0.15).

Writes under ``out``: the cost file, ``profile.csv``, ``traffic.csv``, ``advice.json`` (every
candidate's capacity and simulated latencies), ``iterations.csv`` (every vLLM step), ``summary.json``
and ``advise_vllm.md``; with ``report=STEM`` also ``STEM.json`` and ``STEM.md``.  The last stdout line
is the summary as JSON: ``advise_vllm_tau``, ``advise_vllm_err_max``, ``slo``, ``recommended``,
``served`` (per candidate: flags, capacity, predicted and measured P99s and worst ratios),
``load_avg``, ``vllm_version``, ``wall_s`` and the profile's fit.  Needs the ``[vllm]`` extra
(docs/vllm.md); about 12 minutes on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from vllm import LLMEngine

from advisor.engines import Candidate, VllmKnobs, candidates, vllm_defaults
from advisor.report import latency_table, pick, worst_ratio
from advisor.search import Criterion, Found, at_rate, search
from advisor.targets import Target, percentile_ms, samples
from advisor.traffic import Traffic, traffic_from
from chunkgym import REPO_ROOT, resolve_path
from chunkgym.cli import hydra_cli
from chunkgym.config import AT_LEAST_ONE, POSITIVE, Rule
from chunkgym.io import atomic_write_text
from engine.replay import check, iteration_frame, run_spec
from engine.sim_to_real import _rounded
from engine.vllm_backend import llm
from engine.vllm_backend.compare import kendall_tau_b
from engine.vllm_backend.profile import calibrate, grid
from engine.vllm_backend.replay import VllmReplayConfig, VllmServer, settings
from engine.vllm_backend.speed import machine_load
from envs.serving.cost_model import RooflineCostModel
from envs.serving.loop import SimResult
from envs.serving.setup import ServingSetup
from envs.serving.specs import load_hardware
from envs.serving.workloads.trace import Trace

DEFAULT_CONFIG = REPO_ROOT / "conf" / "replay" / "vllm" / "cpu_advise_vllm.yaml"
CONFIG_NAME = "advise_vllm"
TAU_TARGET = 0.8
ERR_TARGET = 0.15
SLO_METRICS = ("ttft", "itl")
"""The SLO's targets, each at P99: ``vllm bench serve``'s TTFT and ITL."""
SLO_PRESET = "strict"
"""The plug-in's SLO preset (``conf.slo`` of the replay presets; advise.py's default with percentile targets)."""
EPOCH = pd.Timestamp("2024-01-01")
"""Time zero of the written trace file (only differences between arrivals matter)."""


@dataclass
class AdviseVllmConfig(VllmReplayConfig):
    """The slice (``seed``'s window), the profiling, and how many candidates vLLM serves."""

    repeats: int = 5  # profiling repeats per composition (median)
    warmup: int = 1  # untimed repeats before them
    grid_stride: int = 1  # profile every k-th composition of the grid (plumbing runs)
    # seconds of speed.SPEED_PROBE on the machine load_scale was chosen on (see sim_to_real_vllm)
    reference_step_s: float | None = None
    served: int = 5  # candidates vLLM serves: the recommendation and served - 1 others
    apart: float = 0.15  # the predicted scores of any two served differ by at least this (relative)
    rel_tol: float = 0.02  # the capacity search's relative bracket width
    out: str = "outputs/advise_vllm"
    report: str | None = None  # STEM: also write STEM.json and STEM.md (e.g. reports/engine/advise_vllm)


RULES: dict[str, Rule] = {
    "repeats": AT_LEAST_ONE,
    "warmup": Rule(lambda v: v >= 0, "an integer >= 0"),
    "grid_stride": AT_LEAST_ONE,
    "reference_step_s": Rule(lambda v: v is None or POSITIVE.test(v), "null or seconds > 0"),
    "served": Rule(lambda v: v >= 2, "an integer >= 2 (a rank needs two)"),
    "apart": Rule(lambda v: 0 <= v < 10, "a relative gap in [0, 10)"),
    "rel_tol": Rule(lambda v: 1e-4 <= v < 1, "a relative tolerance in [1e-4, 1)"),
}


# ---- the traffic ---------------------------------------------------------------------------
def write_traffic(trace: Trace, path: Path) -> Traffic:
    """``trace`` as an Azure-format file at ``path``, read back as ``advise.py trace=PATH`` reads it."""
    stamps = EPOCH + pd.to_timedelta(np.round(trace.arrival_s * 1e9).astype(np.int64), unit="ns")
    frame = pd.DataFrame(
        {
            "TIMESTAMP": [str(s) for s in stamps],
            "ContextTokens": trace.prompt_len,
            "GeneratedTokens": trace.output_len,
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, frame.to_csv(index=False))
    return traffic_from(str(path), None, None, None, None, 1.0, 600.0, 0)


# ---- the advice ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Advised:
    """The search's results: every candidate with its setup, run at the offered rate and capacity."""

    traffic: Traffic
    candidates: list[Candidate]
    setups: list[ServingSetup]
    runs: list[SimResult]
    targets: tuple[Target, ...]
    found: list[Found]
    seconds: float

    @property
    def recommended(self) -> int:
        """The recommendation's index: :func:`advisor.report.pick`; with none (no candidate meets the
        SLO at any probed rate) the candidate of the least predicted score."""
        rec = pick(self.found)
        if rec is not None:
            return self.found.index(rec)
        return int(np.nanargmin(self.scores()))

    def scores(self) -> list[float]:
        return [worst_ratio(r.outcomes, self.targets) for r in self.runs]


def p99_ms(run: SimResult, metric: str) -> float:
    return percentile_ms(samples(run.outcomes, metric), 99)


def slo_of(runs: Sequence[SimResult]) -> tuple[Target, ...]:
    """The bench's SLO (module docstring, step 4): per metric the median of the candidates' finite P99s."""
    targets = []
    for metric in SLO_METRICS:
        values = [v for v in (p99_ms(r, metric) for r in runs) if math.isfinite(v)]
        if not values:
            raise ValueError(f"no candidate has a finite simulated P99 {metric} at the offered rate")
        targets.append(Target(metric, 99, float(f"{statistics.median(values):.3g}")))
    return tuple(targets)


def advise(conf: AdviseVllmConfig, traffic: Traffic, log: Callable[[str], None]) -> Advised:
    """Step 3-4: every candidate at the offered rate, the SLO from those runs, then the capacities.

    In this process, one probe at a time: vLLM ran here already (the profile), and a forked
    worker would inherit its threads' state."""
    start = time.perf_counter()
    setup = run_spec(conf, conf.policies[0]).setup.build()
    current = vllm_defaults(load_hardware(conf.hardware), 1)
    found = candidates(current, setup.config.max_model_len or setup.model.max_context)
    setups = [
        dataclasses.replace(
            setup, config=dataclasses.replace(setup.config, max_num_seqs=c.knobs.max_num_seqs)
        )
        for c in found
    ]
    runs = [at_rate(s, c, traffic) for s, c in zip(setups, found, strict=True)]
    targets = slo_of(runs)
    log(
        f"{len(found)} candidates at {traffic.rate_at(1.0):.3g} req/s in {time.perf_counter() - start:.0f} s; "
        f"SLO {', '.join(f'{t.key} {t.ms:g}' for t in targets)}; searching capacities"
    )
    criterion = Criterion(targets)
    with ThreadPoolExecutor(1) as pool:
        capacities = search(
            setups,
            found,
            traffic,
            criterion,
            conf.rel_tol,
            n_jobs=1,
            executor=pool,
            at_scale_one=[criterion.holds(r.outcomes) for r in runs],
        )
    return Advised(traffic, found, setups, runs, targets, capacities, time.perf_counter() - start)


def choose(scores: Sequence[float], first: int, n: int, apart: float) -> list[int]:
    """Step 5: ``first`` and up to ``n - 1`` others spread over the log scores, pairwise ``apart``."""
    finite = [i for i, s in enumerate(scores) if math.isfinite(s) and s > 0]
    if first not in finite:
        raise ValueError(f"the recommendation's predicted score is {scores[first]}, not a positive number")
    logs = {i: math.log(scores[i]) for i in finite}
    lo, hi = min(logs.values()), max(logs.values())
    points = [lo + (hi - lo) * k / (n - 1) for k in range(n)]
    points.remove(min(points, key=lambda p: abs(p - logs[first])))
    chosen = [first]

    def far(i: int) -> bool:
        return all(max(scores[i], scores[j]) >= (1 + apart) * min(scores[i], scores[j]) for j in chosen)

    for p in points:
        eligible = [i for i in finite if i not in chosen and far(i)]
        if eligible:
            chosen.append(min(eligible, key=lambda i: (abs(logs[i] - p), i)))
    return chosen


# ---- vLLM's own scheduler under a candidate's knobs -----------------------------------------
@dataclass(frozen=True)
class OwnStep:
    """A step of vLLM's own scheduler: it ran its own plan."""

    agrees: bool = True


class NoPolicy:
    """vLLM's own scheduler keeps no chunkgym policy; a fresh window resets nothing."""

    def reset(self, view: object) -> None:
        pass


class OwnScheduler:
    """vLLM's own scheduler as :meth:`VllmServer.serve` reads the plug-in: its ``requests``, a policy
    to reset, and a record per step while ``steps`` is a list (filled by :meth:`record`, which
    :class:`~engine.vllm_backend.llm.StepRecorder` calls after each ``schedule()``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chunkgym_policy = NoPolicy()
        self.view = None
        self.steps: list[OwnStep] | None = None

    @property
    def requests(self) -> Any:
        return self.inner.requests

    def record(self, sched: Any, step: llm.Step) -> None:
        if self.steps is not None:
            self.steps.append(OwnStep())


def knob_args(knobs: VllmKnobs) -> dict[str, Any]:
    """The knobs :func:`engine.vllm_backend.llm.engine_args` does not set, as vLLM's engine arguments."""
    return {
        "enable_chunked_prefill": knobs.enable_chunked_prefill,
        "long_prefill_token_threshold": knobs.long_prefill_token_threshold,
        "long_prefill_token_threshold_adaptive": knobs.long_prefill_token_threshold_adaptive,
        "max_num_active_seqs": knobs.max_num_active_seqs,
    }


def start_own(conf: VllmReplayConfig, knobs: VllmKnobs) -> LLMEngine:
    """vLLM with its own scheduler under ``knobs`` (``conf`` carries the budget and ``max_num_seqs``):
    the knobs :func:`engine.vllm_backend.llm.start`'s settings do not carry go in as extra engine
    arguments; raises if the started scheduler does not run them."""
    engine = llm.start(settings(conf), resolve_path(conf.checkpoints), **knob_args(knobs))
    sched = llm.scheduler(engine)
    config = sched.scheduler_config
    ran = {
        "max_num_batched_tokens": sched.max_num_scheduled_tokens,
        "max_num_seqs": sched.max_num_running_reqs,
        "max_num_active_seqs": sched.max_num_active_reqs,
        **{k: getattr(config, k) for k in knob_args(knobs) if k != "max_num_active_seqs"},
    }
    wanted = {
        **dataclasses.asdict(knobs),
        "max_num_active_seqs": knobs.max_num_active_seqs or knobs.max_num_seqs,
    }
    if ran != wanted:
        engine.engine_core.shutdown()
        raise RuntimeError(f"vLLM started with {ran}, not the knobs asked for: {wanted}")
    return engine


class KnobServer(VllmServer):
    """:class:`VllmServer` on vLLM's own scheduler under a candidate's knobs (no plug-in)."""

    def __init__(self, conf: VllmReplayConfig, name: str, knobs: VllmKnobs) -> None:
        self.conf = conf
        self.policy = name
        self.engine = start_own(conf, knobs)
        own = llm.scheduler(self.engine)
        self.sched = OwnScheduler(own)
        self.recorder = llm.StepRecorder(own, on_step=self.sched.record)
        self.vocab = self.engine.model_config.get_vocab_size()
        self.warm_up()


def engine_conf(conf: AdviseVllmConfig, candidate: Candidate) -> AdviseVllmConfig:
    """``conf`` with the candidate's budget and batch slots (vLLM's buffers and ``max_num_seqs``)."""
    k = candidate.knobs
    serving = dataclasses.replace(conf.serving, max_num_seqs=k.max_num_seqs)
    return dataclasses.replace(conf, max_num_batched_tokens=k.max_num_batched_tokens, serving=serving)


def serve(
    conf: AdviseVllmConfig,
    candidate: Candidate,
    setup: ServingSetup,
    trace: Trace,
    log: Callable[[str], None],
) -> SimResult:
    """``candidate`` on vLLM over ``trace`` in real time: a plug-in policy through the plug-in, knobs on vLLM's own scheduler."""
    one = engine_conf(conf, candidate)
    server: VllmServer
    if candidate.policy is not None:
        server = VllmServer(one, candidate.policy)
    else:
        server = KnobServer(one, candidate.name, candidate.knobs)
    try:
        log(f"{candidate.name} [vllm]: serving {len(trace)} requests over {trace.span_s:.0f} s of trace")
        return server.serve(trace, setup, log)
    finally:
        server.close()
        del server
        gc.collect()


# ---- the comparison ------------------------------------------------------------------------
def rel_err(predicted: float, measured: float) -> float:
    return abs(predicted / measured - 1.0) if measured > 0 else math.inf


def served_row(advised: Advised, i: int, measured: SimResult, cost: str) -> dict[str, Any]:
    """One served candidate: flags, capacity, and its P99s and worst ratio predicted and measured."""
    c, found, run = advised.candidates[i], advised.found[i], advised.runs[i]
    row: dict[str, Any] = {
        "name": c.name,
        "family": c.family,
        "flags": c.flags(SLO_PRESET, cost),
        "capacity_rps": found.rps,
        "capacity_scale": found.scale,
    }
    for metric in SLO_METRICS:
        row[f"{metric}_ms_p99_predicted"] = p99_ms(run, metric)
        row[f"{metric}_ms_p99_measured"] = p99_ms(measured, metric)
    row["worst_ratio_predicted"] = worst_ratio(run.outcomes, advised.targets)
    row["worst_ratio_measured"] = worst_ratio(measured.outcomes, advised.targets)
    row["finished_measured"] = int(measured.outcomes.finished.sum())
    return row


def markdown(summary: dict[str, Any]) -> str:
    """The page: verdicts, the SLO and how it was set, then the served candidates predicted against measured."""
    tau, err = summary["advise_vllm_tau"], summary["advise_vllm_err_max"]
    lines = [
        "# The advisor against vLLM",
        "",
        f"`python bench/advise_vllm.py` on {summary['machine']}; "
        f"mean 1-min load average {summary['load_avg']:.2f}, {summary['wall_s']:.0f} s in all.",
        "",
        f"* `advise_vllm_tau` (Kendall tau-b, predicted vs measured worst ratio): **{tau:.3f}** "
        f"(target >= {TAU_TARGET}: {'met' if tau >= TAU_TARGET else 'missed'})",
        f"* `advise_vllm_err_max` (recommendation's P99 TTFT and ITL): **{err:.3f}** "
        f"(target <= {ERR_TARGET}: {'met' if err <= ERR_TARGET else 'missed'})",
        f"* traffic: {summary['traffic']['source']}, {summary['traffic']['requests']} requests at "
        f"{summary['offered_rate_rps']:.3g} req/s (load {summary['load_scale']:g})",
        f"* SLO (the median over all {summary['candidates']} candidates of each simulated P99 at that rate, "
        f"set before vLLM served): {', '.join(f'{k} = {v:g}' for k, v in summary['slo'].items())}",
        f"* recommended: {summary['recommended']} (`{summary['recommended_command']}`)",
        "",
        "| candidate | capacity (req/s) | TTFT P99 pred / vLLM (ms) | ITL P99 pred / vLLM (ms) | worst ratio pred / vLLM |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in summary["served"]:
        lines.append(
            f"| {r['name']} | {r['capacity_rps']:.3g} | {r['ttft_ms_p99_predicted']:.0f} / {r['ttft_ms_p99_measured']:.0f} | "
            f"{r['itl_ms_p99_predicted']:.1f} / {r['itl_ms_p99_measured']:.1f} | "
            f"{r['worst_ratio_predicted']:.2f} / {r['worst_ratio_measured']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def run(conf: AdviseVllmConfig, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole check (module docstring); the JSON-ready summary."""
    check(conf)  # bad names and an empty window fail before minutes of profiling
    start = time.perf_counter()
    loads = [os.getloadavg()[0]]
    compositions = grid()[:: conf.grid_stride]
    log(f"profiling vLLM {llm.VERSION} ({conf.model}) over {len(compositions)} compositions...")
    cal = calibrate(conf, out, conf.repeats, conf.warmup, compositions, log, out / "profile.csv")
    log(f"fitted in {cal.seconds:.0f} s: held-out MAPE {cal.fit.heldout_mape:.3f} -> {cal.path}")
    load, speed = machine_load(conf.load_scale, conf.reference_step_s, RooflineCostModel(cal.fit.params))
    fitted = dataclasses.replace(conf, cost_model=str(cal.path), load_scale=load)
    traffic = write_traffic(check(fitted), out / "traffic.csv")
    trace = traffic.trace_at(1.0)
    loads.append(os.getloadavg()[0])
    advised = advise(fitted, traffic, log)
    scores = advised.scores()
    rec = advised.recommended
    chosen = choose(scores, rec, conf.served, conf.apart)
    log(
        f"advised in {advised.seconds:.0f} s; recommended {advised.candidates[rec].name}; vLLM serves "
        + ", ".join(f"{advised.candidates[i].name} ({scores[i]:.2f})" for i in chosen)
    )
    measured: dict[int, SimResult] = {}
    frames = []
    for i in sorted(chosen):
        loads.append(os.getloadavg()[0])
        c = advised.candidates[i]
        measured[i] = result = serve(fitted, c, advised.setups[i], trace, log)
        frames.append(iteration_frame(c.name, "vllm", result.iterations))
        m = result.outcomes
        log(
            f"{c.name} [vllm]: {int(m.finished.sum())}/{len(trace)} finished; P99 TTFT {p99_ms(result, 'ttft'):.0f} ms "
            f"(predicted {p99_ms(advised.runs[i], 'ttft'):.0f}), P99 ITL {p99_ms(result, 'itl'):.1f} ms "
            f"(predicted {p99_ms(advised.runs[i], 'itl'):.1f})"
        )
    loads.append(os.getloadavg()[0])
    pd.concat(frames, ignore_index=True).to_csv(out / "iterations.csv", index=False)
    cost_name = str(cal.path)
    rows = [served_row(advised, i, measured[i], cost_name) for i in chosen]
    tau = kendall_tau_b([r["worst_ratio_predicted"] for r in rows], [r["worst_ratio_measured"] for r in rows])
    rec_row = rows[0]
    err = max(rel_err(rec_row[f"{m}_ms_p99_predicted"], rec_row[f"{m}_ms_p99_measured"]) for m in SLO_METRICS)
    advice = {
        "slo": {t.key: t.ms for t in advised.targets},
        "candidates": [
            {
                "name": c.name,
                "family": c.family,
                "flags": c.flags(SLO_PRESET, cost_name),
                "capacity_rps": f.rps,
                "capacity_scale": f.scale,
                "worst_ratio_at_offered_rate": s,
                "at_offered_rate": latency_table(r.outcomes),
            }
            for c, f, r, s in zip(advised.candidates, advised.found, advised.runs, scores, strict=True)
        ],
    }
    atomic_write_text(out / "advice.json", json.dumps(_rounded(advice), indent=1) + "\n")
    return {
        "advise_vllm_tau": tau,
        "advise_vllm_err_max": err,
        "tau_target": TAU_TARGET,
        "err_target": ERR_TARGET,
        "recommended": advised.candidates[rec].name,
        "recommended_by": "capacity"
        if pick(advised.found) is not None
        else "least predicted score (none meets the SLO)",
        "recommended_flags": advised.candidates[rec].flags(SLO_PRESET, cost_name),
        "recommended_command": advised.candidates[rec].command(str(conf.model), SLO_PRESET, cost_name),
        "recommended_err": {
            m: rel_err(rec_row[f"{m}_ms_p99_predicted"], rec_row[f"{m}_ms_p99_measured"]) for m in SLO_METRICS
        },
        "slo": {t.key: t.ms for t in advised.targets},
        "slo_rule": "per metric, the median over all candidates of the simulated P99 at the offered rate",
        "candidates": len(advised.candidates),
        "candidates_served": [r["name"] for r in rows],
        "served": rows,
        "offered_rate_rps": traffic.rate_at(1.0),
        "load_scale": load,
        "load_scale_nominal": conf.load_scale,
        "machine_speed": speed,
        "traffic": {
            "source": f"{conf.workload} test window {conf.seed}, lengths / {conf.length_scale:g}",
            "file": str(out / "traffic.csv"),
            "requests": len(trace),
            "span_s": trace.span_s,
        },
        "advise_s": advised.seconds,
        "vllm_version": llm.VERSION,
        "machine": cal.where,
        "load_avg": float(np.mean(loads)),
        "loadavg_samples": loads,
        "profile": {
            "compositions": cal.fit.points,
            "in_sample_mape": cal.fit.in_sample_mape,
            "heldout_mape": cal.fit.heldout_mape,
            "seconds": cal.seconds,
            "file": cost_name,
        },
        "wall_s": time.perf_counter() - start,
        "output_dir": str(out),
    }


@hydra_cli(AdviseVllmConfig, CONFIG_NAME, RULES, DEFAULT_CONFIG)
def main(opts: AdviseVllmConfig) -> dict[str, Any]:
    """:func:`run`; ``out/summary.json`` and the page (and under ``report``), then the summary as the last stdout line."""
    out = resolve_path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        summary = run(opts, out, log=lambda s: print(s, flush=True))
    except ValueError as exc:
        raise SystemExit(f"python bench/advise_vllm.py: error: {exc}") from exc
    text, page = json.dumps(_rounded(summary), indent=1) + "\n", markdown(summary)
    atomic_write_text(out / "summary.json", text)
    atomic_write_text(out / "advise_vllm.md", page)
    if opts.report:
        stem = resolve_path(opts.report)
        stem.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(stem.with_suffix(".json"), text)
        atomic_write_text(stem.with_suffix(".md"), page)
    print(page, flush=True)
    print(json.dumps(_rounded(summary)), flush=True)
    return summary


if __name__ == "__main__":
    main()
