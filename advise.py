"""The operator's advisor: your traffic and SLO in, the serving engine's flags to set out, with the evidence.

    python advise.py engine=vllm workload=azure_conv slo.itl_ms_p99=100 slo.ttft_ms_p99=2000
    python advise.py engine=vllm trace=my_trace.jsonl hardware=h100_80gb model=llama3_8b slo.tpot_ms_p99=50
    python advise.py engine=vllm "metrics=[scrape_a.txt,scrape_b.txt]" interval_s=60 slo.stall_ms_p99=500
    python advise.py engine=vllm workload=azure_code slo.preset=strict slo.attainment=0.9

It simulates vLLM V1's own scheduler under every candidate setting of its knobs
(``max_num_batched_tokens``, ``max_num_seqs``, ``long_prefill_token_threshold`` and its adaptive
floor, chunked prefill on or off; the current settings always among them) and chunkgym's
policies served through the scheduler plug-in, on the calibrated cost model of ``model`` on
``hardware``; searches each one's capacity (the highest multiple of today's arrival rate at which
every SLO target holds); and diagnoses the current settings' token gaps (head-of-line blocking or
not). With ``fleet.replicas`` > 1 each candidate runs on that many servers behind ``fleet.router``
and its capacity is the fleet's (docs/advise.md, "Fleets"); ``topology=auto`` also searches every
split of those servers into prefill and decode pools and says which serves more (docs/advise.md,
"Topology"). Writes ``advice.md``, ``advice.json`` and the plots under ``output_dir``; the last stdout
line is a JSON summary. Options: :class:`AdviseConfig`; the worked example: docs/advise.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from advisor.diagnosis import diagnose, gap_target_ms, verdict
from advisor.engines import ENGINES, Candidate, VllmKnobs, candidates, vllm_defaults
from advisor.report import Advice, markdown, pick
from advisor.search import Criterion, Found, at_rate, search
from advisor.targets import parse_targets
from advisor.topology import TOPOLOGIES, Topology, best, splits, tried
from advisor.traffic import Traffic, traffic_from
from chunkgym import REPO_ROOT
from chunkgym.backends import BACKENDS, executor, session
from chunkgym.cli import fail, one_line_errors, precheck
from chunkgym.config import POSITIVE, SEED, TP, Rule, prefixed, schema, to_object
from chunkgym.io import atomic_write_text, folder_lock, refuse_links
from chunkgym.parallel import default_jobs, parallel_map
from envs.serving.core import ServingConfig
from envs.serving.fleet import FleetSpec
from envs.serving.loop import SimResult
from envs.serving.metrics import load_slo, slo_names
from envs.serving.setup import SERVING_RULES, ServingSetup
from envs.serving.specs import HardwareSpec, ModelSpec
from envs.serving.workloads.spec import WorkloadSpec
from policies.config import simulated_fleet

log = logging.getLogger("advise")

OUTPUTS = ("advice.json", "advice.md", "capacity_by_knob.png", "bucket_tails.png", "worst_stalls.png")
"""What advise.py writes into ``output_dir``: none of them may be a link planted there."""


# ---- configuration ---------------------------------------------------------------------------
@dataclass
class SloConfig:
    """The SLO in operators' terms (``vllm bench serve``'s names, milliseconds), every key optional;
    or a chunkgym preset of conf/slo with the share of requests that must meet it."""

    ttft_ms_p50: float | None = None
    ttft_ms_p90: float | None = None
    ttft_ms_p95: float | None = None
    ttft_ms_p99: float | None = None
    itl_ms_p50: float | None = None
    itl_ms_p90: float | None = None
    itl_ms_p95: float | None = None
    itl_ms_p99: float | None = None
    tpot_ms_p50: float | None = None
    tpot_ms_p90: float | None = None
    tpot_ms_p95: float | None = None
    tpot_ms_p99: float | None = None
    stall_ms_p50: float | None = None  # each request's largest token gap, over requests
    stall_ms_p90: float | None = None
    stall_ms_p95: float | None = None
    stall_ms_p99: float | None = None
    preset: str | None = None  # a conf/slo name: its bounds per request, with `attainment`
    attainment: float = 0.9  # with `preset`: the share of requests that must meet it


@dataclass
class CurrentConfig:
    """The engine settings in use now; null: the engine's own default for that GPU."""

    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_num_active_seqs: int | None = None
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    enable_chunked_prefill: bool = True


@dataclass
class AdviseConfig:
    """``python advise.py KEY=VALUE ...``; defaults in ``conf/advise.yaml``."""

    engine: str = MISSING  # the serving engine whose knobs to search: vllm
    trace: str | None = None  # a trace file (any format chunkgym reads), or
    workload: WorkloadSpec | None = None  # config group conf/workload (workload=NAME), or
    metrics: list[str] | None = None  # a vLLM /metrics scrape (two scrapes give the rate)
    rate: float | None = None  # today's arrival rate (req/s); null: the traffic's own
    interval_s: float | None = None  # seconds between two metrics= scrapes
    arrival_cv: float = 1.0  # metrics=: the interarrival CV (1: Poisson; above 1: bursty, Gamma)
    duration_s: float = 600.0  # metrics=: seconds of traffic to generate
    model: ModelSpec = MISSING  # config group conf/model
    hardware: HardwareSpec = MISSING  # config group conf/hardware
    tp: int = 1  # tensor-parallel degree
    cost_model: str = "calibrated"  # calibrated (conf/cost), roofline, or a coefficient file path
    serving: ServingConfig = field(default_factory=ServingConfig)  # block size, KV blocks, ...
    current: CurrentConfig = field(default_factory=CurrentConfig)
    fleet: FleetSpec = field(default_factory=FleetSpec)  # servers behind a router (docs/fleet.md)
    topology: str = "colocated"  # auto: also every xPyD split of fleet.replicas servers over fleet.link
    slo: SloConfig = field(default_factory=SloConfig)
    rel_tol: float = 0.02  # the capacity search's relative bracket width
    fast: bool = True  # false: the reference search (same answers, slower)
    seed: int = 0  # generated arrivals (metrics=, length-only traces)
    n_jobs: int = 0  # worker processes; 0: every core (backend=ray: tasks in flight)
    backend: str = "local"  # local processes, or ray: the cluster at $RAY_ADDRESS
    plots: bool = True
    progress: bool = True
    output_dir: str = "outputs/advise/${now:%Y-%m-%d_%H-%M-%S}"


RULES: dict[str, Rule] = {
    **prefixed("serving", SERVING_RULES),
    "engine": Rule(
        lambda v: v in ENGINES, f"one of {', '.join(ENGINES)} (SGLang's scheduler is not modelled)"
    ),
    "tp": TP,
    "seed": SEED,
    "rel_tol": Rule(lambda v: 1e-4 <= v < 1, "a relative tolerance in [1e-4, 1)"),
    "arrival_cv": POSITIVE,
    "duration_s": Rule(lambda v: 0 < v <= 86400, "seconds in (0, 86400]"),
    "slo.attainment": Rule(lambda v: 0 < v <= 1, "a share in (0, 1]"),
    "backend": Rule(lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}"),
    "topology": Rule(lambda v: v in TOPOLOGIES, f"one of {', '.join(TOPOLOGIES)}"),
}
"""Ranges checked before anything runs; names, files and knob combinations by :func:`plan_of`."""

ConfigStore.instance().store(name="advise_schema", node=schema(AdviseConfig))


# ---- the plan: everything checked before any simulation --------------------------------------
@dataclass(frozen=True)
class Plan:
    traffic: Traffic
    criterion: Criterion
    preset: str
    candidates: list[Candidate]
    setups: list[ServingSetup]
    fleet: FleetSpec  # each candidate's servers: the capacities are this fleet's
    splits: tuple[FleetSpec, ...] = ()  # topology=auto: the xPyD splits of those servers


def plan_of(conf: AdviseConfig) -> Plan:
    """Resolve and check every input; raises ValueError naming the key, file or value."""
    slo_values = {f.name: getattr(conf.slo, f.name) for f in dataclasses.fields(SloConfig)}
    preset = slo_values.pop("preset")
    attainment = slo_values.pop("attainment")
    targets = parse_targets(slo_values)
    if preset is not None and preset not in slo_names():
        raise ValueError(f"slo.preset={preset!r}: unknown; valid: {', '.join(slo_names())}")
    if targets and preset is not None:
        raise ValueError("set either percentile targets (slo.ttft_ms_p99=...) or slo.preset, not both")
    if not targets and preset is None:
        raise ValueError("no SLO: set at least one target such as slo.itl_ms_p99=100, or slo.preset=strict")
    if conf.fleet.disaggregated:
        raise ValueError(
            f"fleet.prefill={conf.fleet.prefill} fleet.decode={conf.fleet.decode}: advise.py tries every "
            "prefill-decode split itself; set fleet.replicas to the servers to split and topology=auto"
        )
    fleet = simulated_fleet(conf.fleet)
    split_fleets = splits(conf.topology, conf.fleet)
    setup = ServingSetup.from_specs(
        conf.model, conf.hardware, conf.tp, load_slo(preset or "strict"), conf.cost_model, conf.serving
    )
    max_len = conf.serving.max_model_len or conf.model.max_context
    current = _current_knobs(conf, max_len)
    found = candidates(current, max_len)
    setups = [dataclasses.replace(setup, config=_serving(setup.config, c)) for c in found]
    traffic = traffic_from(
        conf.trace,
        conf.workload.name if conf.workload else None,
        conf.metrics,
        conf.rate,
        conf.interval_s,
        conf.arrival_cv,
        conf.duration_s,
        conf.seed,
    )
    return Plan(
        traffic, Criterion(targets, attainment), preset or "strict", found, setups, fleet, split_fleets
    )


def _serving(config: ServingConfig, c: Candidate) -> ServingConfig:
    """The engine settings a candidate runs under: its batch slots, and for vLLM's own scheduler a
    queue it may admit from as deep as those slots (vLLM looks at every waiting request)."""
    lookahead = config.lookahead if c.policy is not None else max(config.lookahead, c.knobs.max_num_seqs)
    return dataclasses.replace(config, max_num_seqs=c.knobs.max_num_seqs, lookahead=lookahead)


def _current_knobs(conf: AdviseConfig, max_model_len: int) -> VllmKnobs:
    default = vllm_defaults(conf.hardware, conf.tp)
    c = conf.current
    knobs = VllmKnobs(
        max_num_batched_tokens=default.max_num_batched_tokens
        if c.max_num_batched_tokens is None
        else c.max_num_batched_tokens,
        max_num_seqs=default.max_num_seqs if c.max_num_seqs is None else c.max_num_seqs,
        max_num_active_seqs=c.max_num_active_seqs,
        long_prefill_token_threshold=c.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=c.long_prefill_token_threshold_adaptive,
        enable_chunked_prefill=c.enable_chunked_prefill,
    )
    return knobs.check(max_model_len, "current")


# ---- the advice ------------------------------------------------------------------------------
def advise(conf: AdviseConfig, plan: Plan, out: Path) -> dict:
    """Search, diagnose, write every file under ``out``; returns advice.json's object."""
    start = time.perf_counter()
    jobs = conf.n_jobs or default_jobs()
    if conf.fast:  # each search's probe at scale 1 is its candidate's run at today's rate
        with executor(conf.backend, jobs) as pool:
            found = search(plan.setups, plan.candidates, plan.traffic, plan.criterion, conf.rel_tol,
                           n_jobs=jobs, executor=pool, fleet=plan.fleet, today=True)  # fmt: skip
            runs = [cast(SimResult, f.today) for f in found]
            log.info(
                "%d candidates at today's rate and searched in %.1f s", len(runs), time.perf_counter() - start
            )
            topology = _topology(conf, plan, found, jobs, pool)
    else:
        jobs_at_rate = [(s, c, plan.traffic, plan.fleet, i == 0)
                        for i, (s, c) in enumerate(zip(plan.setups, plan.candidates, strict=True))]  # fmt: skip
        runs = parallel_map(
            _at_rate, jobs_at_rate, conf.n_jobs, "at today's rate", conf.progress, conf.backend
        )
        log.info("%d candidates at today's rate in %.1f s; searching", len(runs), time.perf_counter() - start)
        found = search(plan.setups, plan.candidates, plan.traffic, plan.criterion, conf.rel_tol, fast=False,
                       fleet=plan.fleet)  # fmt: skip
        topology = _topology(conf, plan, found, 1, None)
    runs = _recommended_recorded(plan, found, runs)
    advice, page, summary = _advice(conf, plan, found, runs, out, topology)
    log.info("advised in %.1f s", time.perf_counter() - start)
    print(page, flush=True)
    print(json.dumps(summary, allow_nan=False), flush=True)  # the last stdout line
    return advice


def _at_rate(job: tuple[ServingSetup, Candidate, Traffic, FleetSpec, bool]) -> SimResult:
    """One candidate at today's rate: recorded for the current settings (the diagnosis and the
    worst-stalls plot read its iterations), outcomes only for the others (:func:`~advisor.search.serve`)."""
    setup, candidate, traffic, fleet, recorded = job
    return at_rate(setup, candidate, traffic, fleet, recorded=recorded)


def _recommended_recorded(plan: Plan, found: list[Found], runs: list[SimResult]) -> list[SimResult]:
    """``runs`` with the recommendation's run at today's rate recorded, for its diagnosis: served
    again if it was run for its outcomes only (the same run, so the same outcomes)."""
    rec = pick(found)
    if rec is None:
        return runs
    k = found.index(rec)
    if runs[k].iterations:  # recorded already: the current settings, or a fleet's run
        return runs
    return [*runs[:k], at_rate(plan.setups[k], plan.candidates[k], plan.traffic, plan.fleet), *runs[k + 1 :]]


def _topology(
    conf: AdviseConfig, plan: Plan, found: list[Found], jobs: int, pool: Executor | None
) -> Topology | None:
    """With ``topology=auto``: every split of the plan's servers searched as the colocated
    candidates were (the same criterion, tolerance and search), against the recommendation."""
    if not plan.splits:
        return None
    start = time.perf_counter()
    rec = pick(found)
    pairs = tried(plan.splits, found, rec)
    setups = [plan.setups[i] for _, i in pairs]
    chosen = [plan.candidates[i] for _, i in pairs]
    fleets = [f for f, _ in pairs]
    if pool is not None:
        split_found = search(setups, chosen, plan.traffic, plan.criterion, conf.rel_tol, n_jobs=jobs,
                             executor=pool, fleet=fleets)  # fmt: skip
    else:
        split_found = search(
            setups, chosen, plan.traffic, plan.criterion, conf.rel_tol, fast=False, fleet=fleets
        )
    k = best(split_found)
    scale = split_found[k].scale or 1.0  # the transfer's share at the split's capacity, or today's rate
    run = at_rate(setups[k], chosen[k], plan.traffic, fleets[k], scale)
    log.info("%d split searches in %.1f s", len(pairs), time.perf_counter() - start)
    return Topology(plan.fleet, conf.tp, rec, pairs, split_found, run)


def _advice(
    conf: AdviseConfig,
    plan: Plan,
    found: list[Found],
    runs: list[SimResult],
    out: Path,
    topology: Topology | None = None,
) -> tuple[dict, str, dict]:
    from advisor import plots  # matplotlib: only for runs that got this far

    target = gap_target_ms(plan.criterion.targets, plan.setups[0].slo.tpot_s)
    current = diagnose(runs[0], target)
    rec = pick(found)
    rec_diag = diagnose(runs[found.index(rec)], target) if rec is not None else None
    setting = _setting(rec.candidate) if rec is not None else None
    report = Advice(
        plan.traffic, plan.criterion.targets, plan.preset, plan.criterion.attainment, conf.model.hf_name or conf.model.name,
        _cost_name(conf), found, runs, current, rec_diag, verdict(current, rec_diag, setting), str(out.resolve()),
        plan.fleet, topology,
    )  # fmt: skip
    advice = report.to_json()
    images: list[str] = []
    if conf.plots:
        tables = [c["at_current_rate"] for c in advice["candidates"]]  # computed once, for the JSON
        targets_ms = {t.key: t.ms for t in plan.criterion.targets}
        images = [
            plots.capacity_by_knob(found, rec, out / "capacity_by_knob.png").name,
            plots.bucket_tails(found, tables, targets_ms, out / "bucket_tails.png").name,
            plots.worst_stalls(runs[0], current.worst_window_s, target, out / "worst_stalls.png").name,
        ]
    page = markdown(advice, images)
    atomic_write_text(out / "advice.json", json.dumps(advice, indent=1, allow_nan=False) + "\n")
    atomic_write_text(out / "advice.md", page)
    return advice, page, report.summary(advice)


def _setting(c: Candidate) -> str:
    """The recommendation as the diagnosis names it."""
    if c.policy is not None:
        return f"chunkgym's {c.policy} through the scheduler plug-in"
    k = c.knobs
    if not k.enable_chunked_prefill:
        return "turning chunked prefill off"
    threshold = (
        f" and long-prefill threshold {k.long_prefill_token_threshold}"
        if k.long_prefill_token_threshold
        else ""
    )
    return f"chunked prefill with budget {k.max_num_batched_tokens}{threshold}"


def _cost_name(conf: AdviseConfig) -> str:
    """The plug-in's ``cost`` key: the conf/cost file of this model on this GPU (or the path given)."""
    if conf.cost_model not in ("calibrated", "roofline"):
        return conf.cost_model
    return f"{conf.hardware.profile_name or conf.hardware.name}__{conf.model.name}__tp{conf.tp}"


# ---- entry point ---------------------------------------------------------------------------
@hydra.main(version_base="1.3", config_path="conf", config_name="advise")
@one_line_errors(tool="advise.py")  # every known input error: one line, exit code 2
def main(cfg: DictConfig) -> None:
    try:
        conf = to_object(cfg, AdviseConfig, "", RULES)
        plan = plan_of(conf)
    except (ValueError, FileNotFoundError) as exc:
        raise fail(exc, "advise.py") from None
    out = Path(HydraConfig.get().runtime.output_dir)
    refuse_links(out, OUTPUTS)
    # one advise.py per output folder: taken before Hydra wrote into it (precheck), held again here
    with folder_lock(out, "advise.py"), session(conf.backend, conf.n_jobs):
        advise(conf, plan, out)


if __name__ == "__main__":
    precheck(
        str(REPO_ROOT / "conf"), "advise", AdviseConfig, RULES, plan_of
    )  # bad input: one line, exit code 2, nothing written
    main()
