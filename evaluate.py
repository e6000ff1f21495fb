"""chunkgym's leaderboard: policies x workloads x load scales x seeds, simulated on held-out traces.

    python evaluate.py                     # the default grid of conf/evaluate.yaml; prints the leaderboard
    python evaluate.py "policies=[fcfs,sarathi_512,learned:PATH]" "workloads=[azure_conv,file:/abs/t.jsonl]" \\
        "load_scales=[1.0,2.0]" "seeds=[0,1,2]" slo=strict capacity=false output_dir=DIR
    python evaluate.py validate=DIR/results.csv   # rerun every row; exits 1 naming each differing value
    python evaluate.py results=DIR/results.csv    # only render the leaderboard of existing rows (e.g. engine)

Named workloads run on their test split (``split=val`` to select models), one window per seed; a
``file:PATH`` trace is used whole
(split ``all``; the seed draws the arrivals of a length-only file). Writes under ``output_dir``:
``results.csv`` and ``results.json`` (one row per policy, workload, load scale and seed; floats
exact), ``leaderboard.md`` (also printed), ``buckets.csv`` (per prompt-length bucket),
``tenants.csv`` (per tenant, SLO class and class-bucket: docs/tenants.md),
``capacity.csv`` (with ``capacity=true``) and PNG plots. Options: :class:`EvaluateConfig`.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
import signal
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import pandas as pd
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf

from chunkgym import REPO_ROOT
from chunkgym.backends import BACKENDS, session
from chunkgym.cli import fail, one_line_errors, precheck
from chunkgym.config import LOAD_SCALE, SEED, TP, WINDOW_S, Rule, prefixed, schema, to_object
from chunkgym.io import atomic_path, atomic_write_text, folder_lock, refuse_links
from chunkgym.parallel import default_jobs, parallel_map
from chunkgym.tracking import LoggerConfig, upload
from envs.serving.capacity import CRITERIA
from envs.serving.core import ServingConfig
from envs.serving.fleet import FleetSpec
from envs.serving.metrics import MIN_REL_TOL, SLOSpec
from envs.serving.setup import SERVING_RULES, SLO_RULES
from envs.serving.specs import HardwareSpec, ModelSpec, load_hardware, load_model
from envs.serving.tenancy import trace_tenants
from envs.serving.workload import FILE_PREFIX
from envs.serving.workloads.renewal import check_seed
from leaderboard.cells import fleet_columns
from leaderboard.runs import (
    BACKEND,
    REPORT_SPLITS,
    TBT_PROBS,
    CapacityJob,
    RowResult,
    RunSpec,
    SetupKey,
    cached_workload,
    run_capacity,
    run_row,
    simulate,
)
from leaderboard.tables import markdown, ranking, read_capacity, read_results, write_csv, write_json
from leaderboard.validate import validate
from policies.config import simulated_fleet
from policies.registry import make_policy, policy_names

log = logging.getLogger("evaluate")

ALL_POLICIES = "all"
"""In ``policies``: every policy (``policy_names()``: the baselines and the artefacts in policies/artifacts)."""
MAX_REPORTED = 50
"""Differing values validation prints (it counts them all)."""
OUTPUTS = (
    "results.csv", "results.json", "buckets.csv", "tenants.csv", "capacity.csv", "leaderboard.md",
    "goodput_vs_load.png", "tbt_cdf.png", "timeline_fcfs_vs_sarathi.png", "batch_composition.png",
    "service_by_tenant.png", "wandb",
)  # fmt: skip
"""What evaluate.py writes into ``output_dir``: none of them may be a link planted there."""
SHOWCASE_POLICIES = ("fcfs", "sarathi_512")
TENANT_SHOWCASE_POLICIES = ("sarathi_512", "vtc")
"""The service-per-tenant plot's pair (a showcase window with several tenants): FCFS order and VTC."""
"""The stall picture's pair: the first is searched for a long prompt prefilled while another request streams."""


# ---- configuration ---------------------------------------------------------------------------
@dataclass
class ShowcaseConfig:
    """The window of the timeline and batch-composition plots; null: the grid's first workload, load, seed."""

    workload: str | None = None
    load_scale: float | None = None
    seed: int | None = None


@dataclass
class EvaluateConfig:
    """``python evaluate.py KEY=VALUE ...``; the grid's defaults live in ``conf/evaluate.yaml``."""

    policies: list[str] = MISSING  # conf/policy names, learned, learned:PATH, or all
    workloads: list[str] = MISSING  # conf/workload names or file:PATH
    load_scales: list[float] = MISSING  # arrival-rate multipliers
    seeds: list[int] = MISSING  # one test window (or arrival draw) per seed
    slo: SLOSpec = MISSING  # config group conf/slo
    model: ModelSpec = MISSING  # config group conf/model (named files only: rows record the name)
    hardware: HardwareSpec = MISSING  # config group conf/hardware (named files only)
    tp: int = 1  # tensor-parallel degree
    cost_model: str = "calibrated"  # calibrated (conf/cost), roofline, or a coefficient file path
    serving: ServingConfig = field(default_factory=ServingConfig)  # engine settings
    fleet: FleetSpec = field(default_factory=FleetSpec)  # servers behind a router (docs/fleet.md)
    window_s: float | None = None  # window length (trace s) for named workloads; null: each one's own
    split: str = "test"  # named workloads' split: test (report) or val (model selection)
    capacity: bool = False  # also search each policy's capacity (both criteria) -> capacity.csv
    capacity_rel_tol: float = 0.01  # the capacity search's relative bracket width
    capacity_early_stop: bool = True  # stop attain90 probes once decided (false: the reference search)
    capacity_criteria: list[str] = field(
        default_factory=lambda: list(CRITERIA)
    )  # searched; others left blank
    n_jobs: int = 0  # worker processes; 0: every core (backend=ray: tasks in flight; 0: all)
    backend: str = "local"  # local processes, or ray: the cluster at $RAY_ADDRESS (unset: a local one)
    progress: bool = True  # progress bar on stderr
    plots: bool = True  # write the PNG plots
    showcase: ShowcaseConfig = field(default_factory=ShowcaseConfig)
    logger: LoggerConfig = MISSING  # config group conf/logger
    output_dir: str = "outputs/evaluate/${now:%Y-%m-%d_%H-%M-%S}"
    validate: str | None = None  # a results.csv/json to rerun and check instead of evaluating
    results: str | None = None  # results.csv/json file(s) to render instead of evaluating (a glob pools them)
    allow_paths: list[str] = field(
        default_factory=list
    )  # validate=: files the rows may read (file: traces, cost files)


RULES: dict[str, Rule] = {
    **prefixed("slo", SLO_RULES),
    **prefixed("serving", SERVING_RULES),
    "tp": TP,
    "capacity_rel_tol": Rule(lambda v: MIN_REL_TOL <= v < 1, f"a relative tolerance in [{MIN_REL_TOL:g}, 1)"),
    "backend": Rule(lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}"),
}
"""Ranges checked before anything runs (types are Hydra's; lists by :func:`check_values`, names by :func:`grid_of`)."""

ConfigStore.instance().store(name="evaluate_schema", node=schema(EvaluateConfig))


# ---- the grid ------------------------------------------------------------------------------
@dataclass
class Grid:
    """The checked grid: its rows in (workload, load, policy, seed) order, and the showcase runs."""

    specs: list[RunSpec]
    showcase: list[RunSpec]


def check_values(conf: EvaluateConfig) -> None:
    """The grid's lists and values (no file or name looked up): before Hydra makes the output folder."""
    _unique("load_scales", conf.load_scales)
    _unique("seeds", conf.seeds)
    bad = [x for x in conf.load_scales if not LOAD_SCALE.test(x)]
    if bad:
        raise ValueError(f"load_scales must be positive numbers in [0.001, 1000], got {bad}")
    seeds = [*conf.seeds, *([] if conf.showcase.seed is None else [conf.showcase.seed])]
    bad = [s for s in seeds if not SEED.test(s)]
    if bad:
        raise ValueError(f"seeds must be {SEED.want}, got {bad}")
    unknown = sorted(set(conf.capacity_criteria) - set(CRITERIA))
    if unknown:
        raise ValueError(f"unknown capacity_criteria {unknown}; valid: {', '.join(CRITERIA)}")
    if conf.split not in REPORT_SPLITS:
        raise ValueError(f"split must be one of {', '.join(REPORT_SPLITS)}, got {conf.split!r}")
    if not WINDOW_S.test(conf.window_s):
        raise ValueError(f"window_s must be {WINDOW_S.want}, got {conf.window_s}")
    simulated_fleet(conf.fleet, roles=True)  # routers by name: a typo fails before the output folder
    check_named(conf)


def grid_of(conf: EvaluateConfig) -> Grid:
    """Resolve and check every name and value up front, so a typo fails before any simulation."""
    policies = _unique("policies", _resolve_policies(conf.policies))
    workloads = _unique("workloads", conf.workloads)
    check_values(conf)
    loads, seeds = list(conf.load_scales), [check_seed(s) for s in conf.seeds]
    # after the option names and values: a missing data folder must not hide a typo
    _check_workloads([*workloads, *([conf.showcase.workload] if conf.showcase.workload else [])])
    setup = SetupKey.create(
        conf.model.name, conf.hardware.name, conf.tp, conf.slo, conf.cost_model, conf.serving
    )
    setup.build()  # unknown model or hardware, or a missing cost model, fails here
    fleet = simulated_fleet(conf.fleet, roles=True)
    unseeded = {w for w in workloads if w.startswith(FILE_PREFIX) and not cached_workload(w).seeded_arrivals}
    for w in sorted(unseeded) if len(seeds) > 1 else []:
        log.warning("%s is used whole and its arrivals do not depend on the seed: seed %d only", w, seeds[0])
    specs = [
        RunSpec(p, w, x, s, setup, conf.window_s, conf.split, fleet)
        for w in workloads
        for x in loads
        for p in policies
        for s in (seeds[:1] if w in unseeded else seeds)
    ]
    show = conf.showcase
    window = (
        workloads[0] if show.workload is None else show.workload,
        loads[0] if show.load_scale is None else show.load_scale,
        seeds[0] if show.seed is None else check_seed(show.seed),
    )
    return Grid(specs, [RunSpec(p, *window, setup, conf.window_s, conf.split) for p in SHOWCASE_POLICIES])


def check_named(conf: EvaluateConfig) -> None:
    """Rows record the model and hardware by name, so a field overridden on the command line is refused."""
    _check_named(conf.model, load_model, "model")
    _check_named(conf.hardware, load_hardware, "hardware")


def _check_named(spec: ModelSpec | HardwareSpec, load: typing.Callable[[str], typing.Any], key: str) -> None:
    named = load(spec.name)
    changed = [f"{key}.{f.name}={getattr(spec, f.name)!r}" for f in dataclasses.fields(spec)
               if getattr(spec, f.name) != getattr(named, f.name)]  # fmt: skip
    if changed:
        raise ValueError(
            f"{', '.join(changed)}: evaluate.py runs the named files of conf/{key} only; "
            f"add a conf/{key}/NAME.yaml and select it with {key}=NAME"
        )


def _resolve_policies(names: list[str]) -> list[str]:
    expanded = [n for name in names for n in (policy_names() if name == ALL_POLICIES else [name])]
    errors = []
    for name in expanded:
        try:
            make_policy(name)
        except (ValueError, ImportError) as exc:
            errors.append(f"{exc} (or {ALL_POLICIES!r} for every shipped policy)")
    if errors:
        raise ValueError("; ".join(errors))
    return expanded


def _check_workloads(names: list[str]) -> None:
    errors = []
    for name in names:
        try:
            cached_workload(name)
        except ValueError as exc:
            hint = "" if name.startswith(FILE_PREFIX) else f" (or {FILE_PREFIX}PATH for any trace file)"
            errors.append(f"{exc}{hint}")
    if errors:
        raise ValueError("; ".join(errors))


def _unique(key: str, values: list) -> list:
    if not values:
        raise ValueError(f"{key} is empty")
    twice = sorted({str(v) for v in values if values.count(v) > 1})
    if twice:
        raise ValueError(f"{key} lists {', '.join(twice)} more than once")
    return list(values)


# ---- evaluation ----------------------------------------------------------------------------
def evaluate(conf: EvaluateConfig, grid: Grid, out: Path) -> None:
    """Run the grid, write every file under ``out``, print the leaderboard, upload if a logger is on."""
    start = time.perf_counter()
    log.info("%d rows on %s -> %s", len(grid.specs), _workers(conf), out)
    done: list[RowResult] = parallel_map(
        run_row, grid.specs, conf.n_jobs, "evaluate", conf.progress, conf.backend
    )
    with atomic_path(out / "results.csv") as tmp:
        results = write_csv([d.row for d in done], tmp)
    with atomic_path(out / "results.json") as tmp:
        write_json([d.row for d in done], tmp)
    with atomic_path(out / "buckets.csv") as tmp:
        write_csv([b for d in done for b in d.buckets], tmp)
    with atomic_path(out / "tenants.csv") as tmp:
        write_csv([t for d in done for t in d.tenants], tmp)
    capacity = measure_capacities(conf, grid.specs, out / "capacity.csv") if conf.capacity else None
    ranked = ranking(results)
    board = markdown(results, ranked, capacity)
    atomic_write_text(out / "leaderboard.md", board)
    images = draw(grid, results, done, ranked, out) if conf.plots else []
    print(board, flush=True)
    tables = {"leaderboard": ranked, **({"capacity": capacity} if capacity is not None else {})}
    config = typing.cast(  # of a structured config: a dict with str keys
        "dict[str, typing.Any]",
        OmegaConf.to_container(OmegaConf.structured(conf), resolve=True, enum_to_str=True),
    )
    upload(conf.logger, config, tables, images, out)
    log.info("evaluated %d rows in %.1f s; files in %s", len(grid.specs), time.perf_counter() - start, out)


def _workers(conf: EvaluateConfig) -> str:
    if conf.backend == "ray":
        return f"Ray ({conf.n_jobs or 'all'} tasks in flight)"
    return f"{conf.n_jobs or default_jobs()} processes"


def measure_capacities(conf: EvaluateConfig, specs: list[RunSpec], path: Path) -> pd.DataFrame:
    """capacity.csv: per (policy, workload, seed) the load scale and request rate at capacity, per criterion."""
    bases = list(dict.fromkeys(dataclasses.replace(s, load_scale=1.0) for s in specs))
    searched = [c for c in CRITERIA if c in conf.capacity_criteria]
    jobs = [
        CapacityJob(s, c, conf.capacity_rel_tol, conf.capacity_early_stop) for s in bases for c in searched
    ]
    found = iter(parallel_map(run_capacity, jobs, conf.n_jobs, "capacity", conf.progress, conf.backend))
    rows = []
    for s in bases:
        row = {"policy": s.policy, "workload": s.workload, "seed": s.seed, **fleet_columns(s.fleet)}
        for criterion in CRITERIA:
            row[f"capacity_{criterion}_scale"], row[f"capacity_{criterion}_rps"] = (
                next(found) if criterion in searched else (math.nan, math.nan)
            )
        setup = s.setup
        row.update(hardware=setup.hardware, model=setup.model, tp=setup.tp, slo=setup.slo.name)
        row.update(cost_model=setup.cost_model, split=s.split, window_s=s.effective_window_s())
        rows.append(row)
    with atomic_path(path) as tmp:
        return write_csv(rows, tmp)


def draw(
    grid: Grid, results: pd.DataFrame, done: list[RowResult], ranked: pd.DataFrame, out: Path
) -> list[Path]:
    """Every plot; the timeline and composition plots simulate the showcase pair on one window."""
    from leaderboard import plots  # matplotlib takes ~0.3 s to import: not for runs that fail early

    setup = plots.setup_label(results)
    images = [
        plots.goodput_vs_load(ranked, setup, out / "goodput_vs_load.png"),
        plots.tbt_cdfs(results, [d.tbt_quantiles for d in done], TBT_PROBS, out / "tbt_cdf.png"),
    ]
    traced = {s.policy: simulate(s) for s in grid.showcase}
    runs = {policy: result for policy, (_, result) in traced.items()}
    first = grid.showcase[0]
    title = f"{first.workload}, load {first.load_scale:g}x, seed {first.seed}; {plots.setup_label(results, False)}"
    stall = plots.find_stall(runs[first.policy])
    if stall is None:
        log.warning("%s: no prompt was prefilled while another request streamed; no timeline plot", title)
        span = (0.0, 30.0)
    else:
        slo = first.setup.build().slo
        images.append(plots.timeline(runs, stall, slo, title, out / "timeline_fcfs_vs_sarathi.png"))
        span = plots.stall_window(runs, stall)
    images.append(plots.batch_composition(runs, span, title, out / "batch_composition.png"))
    trace = next(iter(traced.values()))[0]
    tenants = trace_tenants(trace)
    if len(set(tenants)) > 1:  # VTC's figure: FCFS order against VTC, on the same window
        fair = {p: simulate(dataclasses.replace(first, policy=p))[1] for p in TENANT_SHOWCASE_POLICIES}
        images.append(
            plots.service_by_tenant(fair, tenants, trace.span_s, title, out / "service_by_tenant.png")
        )
    return images


def render(pattern: str, out: Path) -> str:
    """The leaderboard of existing results files (any backend), written to ``out/leaderboard.md``.

    ``pattern`` is one file or a glob (``DIR/seed*/results.csv``: one engine replay per seed, pooled);
    the ``capacity.csv`` files beside them are pooled into the capacity table.
    Rows of another backend than the simulator (``python -m engine.replay``) carry it in their
    policy label, so a policy's real and simulated runs rank side by side instead of pooling.
    """
    paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    if not paths:
        raise ValueError(f"no results file matches {pattern}")
    results = read_results(paths)  # every row checked as a board reads it, each run once
    other = results["backend"] != BACKEND
    results.loc[other, "policy"] = results["policy"][other] + " [" + results["backend"][other] + "]"
    board = markdown(results, ranking(results), read_capacity(paths))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "leaderboard.md", board)
    return board


# ---- entry point ---------------------------------------------------------------------------
def _exit_on_sigterm(signum: int, _frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C: the worker pool is shut down, the lock released, temp files removed."""
    raise SystemExit(f"evaluate.py: stopped by signal {signum}")


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
@one_line_errors(tool="evaluate.py")  # every known input error: one line, exit code 2
def main(cfg: DictConfig) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    conf = to_object(cfg, EvaluateConfig, "", RULES)
    if conf.validate:
        try:
            with session(conf.backend, conf.n_jobs):
                rows, problems = validate(
                    conf.validate, conf.n_jobs, conf.progress, conf.backend, conf.allow_paths
                )
        except ValueError as exc:
            raise fail(exc, "evaluate.py") from None
        for problem in problems[:MAX_REPORTED]:
            print(problem, file=sys.stderr)
        if problems:  # exit code 1: values that do not reproduce (2 is a bad input)
            more = f" (first {MAX_REPORTED} shown)" if len(problems) > MAX_REPORTED else ""
            hint = (
                "; config_hash differs, so the configuration changed"
                if "config_hash" in str(problems)
                else ""
            )
            raise SystemExit(
                f"evaluate.py: {len(problems)} value(s) of {conf.validate} do not reproduce{more}{hint}"
            )
        print(f"{conf.validate}: all {rows} rows reproduce")
        return
    out = Path(HydraConfig.get().runtime.output_dir)
    refuse_links(out, OUTPUTS)
    if conf.results:
        try:
            with folder_lock(out, "evaluate.py"):
                print(render(conf.results, out), end="")
        except (ValueError, KeyError, FileNotFoundError) as exc:
            named = str(exc) if conf.results in str(exc) else f"{conf.results}: {exc}"  # the file, once
            raise fail(named, "evaluate.py") from None
        return
    try:
        grid = grid_of(conf)
    except (ValueError, FileNotFoundError) as exc:  # a bad name, value or file: the message says which
        raise fail(exc, "evaluate.py") from None
    # one evaluate.py per output folder: taken before Hydra wrote into it (precheck), held again here
    with folder_lock(out, "evaluate.py"), session(conf.backend, conf.n_jobs):  # one Ray connection
        evaluate(conf, grid, out)


if __name__ == "__main__":
    precheck(
        str(REPO_ROOT / "conf"), "evaluate", EvaluateConfig, RULES, check_values
    )  # bad overrides: one line, exit code 2, before Hydra writes into output_dir
    main()
