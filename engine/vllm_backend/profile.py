"""vLLM's cost profile: time its steps over the calibration grid, fit the cost model, write ``conf/cost``.

    python -m engine.vllm_backend.profile                      # conf/replay/vllm/cpu_vllm.yaml -> conf/cost/cpu__vllm_small__tp1.yaml
    python -m engine.vllm_backend.profile out=DIR repeats=3 config=conf/replay/my_vllm.yaml
    python -m engine.vllm_backend.profile refit=outputs/vllm/profile.csv   # fit saved samples again, running no vLLM step

Each composition of :func:`grid` (:func:`calibration.iterations.default_grid`: decodes x context,
prefill chunks x context, several prompts at once, a chunk beside decodes; and whole-prompt steps of
4-16k tokens) is made to happen on vLLM's own
scheduler by setting its per-step token budget (``max_num_scheduled_tokens``) before each step:
running requests of the composition's context decode first, a chunk over cached context is
prefilled in two steps (the context, then the chunk).  The timed quantity is one whole
``LLMEngine.step()`` (schedule, forward pass, sampling, output processing), the same span a replay's
iteration latency measures, so the fitted cost needs no separate scheduler term.  What vLLM
actually ran is read from its scheduler (:class:`~engine.vllm_backend.llm.StepRecorder`) and is what
is fitted; a step that differs from the composition asked for raises.  The fit is
:func:`calibration.iterations.fit`, the one every engine's profile goes through, with its optional
second per-token hinge (:data:`LARGE_KNEES`).  The measured steps are saved (``samples``, a CSV with
the fit's prediction per step and the machine), so a change to the fit can be tried on them with
``refit=PATH`` instead of profiling again.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from calibration.cost_files import CostFile, write_cost_files
from calibration.iterations import Composition, Fit, Sample, default_grid, fit
from chunkgym import resolve_path
from chunkgym.cli import hydra_cli, load_options
from chunkgym.config import AT_LEAST_ONE, Rule
from engine.serve import prompt_tokens
from engine.vllm_backend import llm
from engine.vllm_backend.replay import DEFAULT_CONFIG, VllmReplayConfig, settings
from envs.serving.cost_model import COST_DIR, RooflineCostModel
from envs.serving.specs import load_model

HEADER = (
    "# Cost-model coefficients of vLLM, measured on the machine named in `source`.\n"
    "# Written by `python -m engine.vllm_backend.profile` (or bench/sim_to_real_vllm.py); do not edit. Times in seconds.\n"
)
LARGE_STEPS = ((1, 4096), (8, 1024), (16, 1024), (32, 256), (64, 256))
"""(prompts, tokens each) of steps beyond the calibration grid: vLLM runs whole prompts (fcfs) and large
adaptive budgets in steps of 4-16k tokens, which a fit to <= 4k-token steps under-predicted by ~30%;
many short prompts (fcfs's 16k-token steps hold ~60) separate the per-token cost from attention's."""
LARGE_KNEES = (2048, 3072, 4096, 5120, 6144, 8192, 12288)
"""Where the fit may start the cost model's steeper per-token regime (``lin_large_*``): on vLLM's CPU
backend, steps of 8-16k tokens of ``vllm_small`` cost ~25-40% more per token than steps of 1-4k, which
one knee and a straight line cannot follow (16 x 1024 tokens: 2.1 s measured, 1.56 s fitted without it)."""
MIN_SPAN = 5.0
"""Slowest over fastest profiled step below which the fit degenerates into a constant (a warning)."""


def grid() -> list[Composition]:
    """:func:`calibration.iterations.default_grid` and :data:`LARGE_STEPS`."""
    return default_grid() + [
        Composition(f"{k} prompts x {q}", prefill_tokens=(q,) * k, prefill_context=(0,) * k)
        for k, q in LARGE_STEPS
    ]


class Profiler:
    """Drives one vLLM engine (its own scheduler) through compositions and times the steps."""

    def __init__(self, engine, vocab_size: int, seed: int = 0) -> None:
        self.engine = engine
        self.sched = llm.scheduler(engine)
        self.recorder = llm.StepRecorder(self.sched)
        self.ceiling = self.sched.max_num_scheduled_tokens
        self.vocab = vocab_size
        self.names = itertools.count()
        self.seed = seed

    def add(self, length: int, max_tokens: int) -> str:
        i = next(self.names)
        return llm.add(self.engine, f"p{i}", prompt_tokens(self.seed, i, length, self.vocab), max_tokens)

    def step(self, budget: int) -> tuple[float, llm.Step]:
        self.sched.max_num_scheduled_tokens = min(budget, self.ceiling)
        t0 = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - t0
        assert self.recorder.last is not None
        return seconds, self.recorder.last

    def drain(self) -> None:
        """Abort what is left and step until vLLM holds no request."""
        left = list(self.sched.requests)
        if left:
            self.engine.abort_request(left, internal=True)
        while self.engine.has_unfinished_requests():
            self.step(self.ceiling)

    def measure(self, comp: Composition, repeats: int, warmup: int) -> Sample:
        """The median of ``repeats`` timed steps of ``comp`` (after ``warmup`` untimed ones)."""
        chunks = list(zip(comp.prefill_tokens, comp.prefill_context, strict=True))
        if len(chunks) > 1 and any(c for _, c in chunks):
            raise ValueError(
                f"composition {comp.label!r}: several chunks over cached context cannot be staged"
            )
        n = len(comp.decode_contexts)
        if len(set(comp.decode_contexts)) > 1:
            raise ValueError(f"composition {comp.label!r}: decodes need one context")
        steps = warmup + repeats
        prefill_steps = -(-sum(comp.decode_contexts) // self.ceiling)  # the first decoders step meanwhile
        for c in comp.decode_contexts:  # decoders: prefilled first, then one token per step
            self.add(c, steps + prefill_steps + 2)
        while self.engine.has_unfinished_requests() and self._prefilling():
            self.step(self.ceiling)
        timed: list[tuple[float, llm.Step]] = []
        for _ in range(steps):
            for q, c in chunks:
                self.add(c + q, 1)
            context = sum(c for _, c in chunks)
            if context:
                self.step(n + context)
            timed.append(self.step(n + sum(q for q, _ in chunks)))
        self.drain()
        kept = timed[warmup:]
        seconds = [s for s, _ in kept]
        num_decode, decode_kv, tokens, contexts = kept[len(kept) // 2][1].composition()
        if num_decode != n or sorted(tokens) != sorted(comp.prefill_tokens):
            raise RuntimeError(
                f"vLLM ran {num_decode} decodes and chunks {tokens} for composition {comp.label!r}"
            )
        return Sample(num_decode, decode_kv, tokens, contexts, statistics.median(seconds))

    def _prefilling(self) -> bool:
        return any(r.num_computed_tokens < r.num_prompt_tokens for r in self.sched.requests.values())


def profile(
    engine,
    vocab_size: int,
    compositions: Sequence[Composition] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    log: Callable[[str], None] = print,
) -> list[Sample]:
    """Time every composition of ``compositions`` (default :func:`grid`) on ``engine``: the median
    of ``repeats`` rounds over the whole grid, so a burst of load from other processes on a shared
    machine slows one repeat of each composition rather than every repeat of one."""
    comps = list(compositions or grid())
    prof = Profiler(engine, vocab_size)
    prof.measure(Composition("warm-up", prefill_tokens=(256,), prefill_context=(0,)), 2, 1)
    rounds = []
    for r in range(repeats):
        rounds.append([prof.measure(comp, 1, warmup) for comp in comps])
        log(f"profiled round {r + 1} of {repeats} over {len(comps)} compositions")
    prof.sched.max_num_scheduled_tokens = prof.ceiling
    return [
        dataclasses.replace(first, seconds=statistics.median(r[i].seconds for r in rounds))
        for i, first in enumerate(rounds[0])
    ]


SAMPLE_COLUMNS = ("num_decode", "decode_context", "prefill_tokens", "prefill_context", "seconds")
"""What a saved profile holds per step (``predicted`` and ``machine`` beside them)."""


def sample_frame(samples: Sequence[Sample], cost: RooflineCostModel, where: str) -> pd.DataFrame:
    """The profiled steps in the cost model's terms, with the fitted prediction for each and where they ran."""
    return pd.DataFrame(
        {
            "num_decode": s.num_decode,
            "decode_context": s.decode_context,
            "prefill_tokens": " ".join(map(str, s.prefill_tokens)),
            "prefill_context": " ".join(map(str, s.prefill_context)),
            "seconds": s.seconds,
            "predicted": s.predict(cost),
            "machine": where,
        }
        for s in samples
    )


def read_samples(path: Path) -> tuple[list[Sample], str]:
    """The steps of a profile saved by :func:`sample_frame`, and where they ran (a plain CSV; nothing is executed)."""
    if not path.is_file():
        raise FileNotFoundError(f"refit: saved profile not found: {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        columns = reader.fieldnames or []
    missing = [c for c in SAMPLE_COLUMNS if c not in columns]
    if missing or not rows:
        raise ValueError(f"{path}: not a saved vLLM profile (missing columns {missing} or no rows)")
    samples = []
    for i, r in enumerate(rows, start=2):
        try:
            samples.append(
                Sample(
                    int(r["num_decode"]),
                    int(r["decode_context"]),
                    tuple(int(q) for q in r["prefill_tokens"].split()),
                    tuple(int(c) for c in r["prefill_context"].split()),
                    float(r["seconds"]),
                )
            )
        except ValueError as exc:
            raise ValueError(f"{path}: line {i}: {exc}") from None
    machines = {r["machine"] for r in rows} if "machine" in columns else {"a machine not recorded"}
    return samples, "; ".join(sorted(machines))


def latency_span(samples: Sequence[Sample]) -> float:
    """Slowest over fastest profiled step."""
    y = [s.seconds for s in samples]
    return max(y) / min(y)


def cost_file(conf: VllmReplayConfig, result: Fit, where: str, span: float) -> CostFile:
    source = (
        f"measured: {where}, model {conf.model} (random weights), {result.points} batch compositions "
        f"(median of round-robin repeats, whole LLMEngine.step), whole-iteration fit by calibration/iterations.py"
    )
    metrics = {
        "in_sample_mape": result.in_sample_mape,
        "heldout_mape": result.heldout_mape,
        "points": result.points,
        "heldout_points": result.heldout_points,
        "latency_span": span,
    }
    return CostFile(conf.hardware, conf.model, 1, False, source, result.params, metrics)


@dataclass(frozen=True)
class Calibrated:
    """What :func:`calibrate` (or :func:`refit`) measured or read, and wrote."""

    path: Path
    fit: Fit
    samples: list[Sample]
    span: float
    where: str
    seconds: float


def calibrate(
    conf: VllmReplayConfig,
    out_dir: str | Path = COST_DIR,
    repeats: int = 5,
    warmup: int = 1,
    compositions: Sequence[Composition] | None = None,
    log: Callable[[str], None] = print,
    samples_csv: Path | None = None,
) -> Calibrated:
    """Start vLLM with its own scheduler, profile, fit, write ``<out_dir>/<hardware>__<model>__tp1.yaml``
    (and the measured steps to ``samples_csv``)."""
    start = time.perf_counter()
    spec = load_model(conf.model)
    engine = llm.start(settings(conf), resolve_path(conf.checkpoints))  # vLLM's own scheduler
    try:
        samples = profile(engine, spec.vocab_size, compositions, repeats, warmup, log)
    finally:
        engine.engine_core.shutdown()
    return fitted(conf, samples, llm.machine(settings(conf)), Path(out_dir), start, log, samples_csv)


def refit(
    conf: VllmReplayConfig,
    samples_csv: Path,
    out_dir: str | Path = COST_DIR,
    log: Callable[[str], None] = print,
) -> Calibrated:
    """Fit a profile saved by :func:`calibrate` again (no vLLM) and write the coefficient file."""
    samples, where = read_samples(samples_csv)
    where = f"{where}; refitted from the saved {samples_csv.name}"
    return fitted(conf, samples, where, Path(out_dir), time.perf_counter(), log)


def fitted(
    conf: VllmReplayConfig,
    samples: list[Sample],
    where: str,
    out_dir: Path,
    start: float,
    log: Callable[[str], None],
    samples_csv: Path | None = None,
) -> Calibrated:
    """Fit ``samples``, write the coefficient file into ``out_dir`` (and the samples with the fit to ``samples_csv``)."""
    result = fit(samples, load_model(conf.model).num_layers, large_knees=LARGE_KNEES)
    span = latency_span(samples)
    if span < MIN_SPAN:
        log(
            f"warning: profiled step latencies span only {span:.1f}x (< {MIN_SPAN:g}x): compute does not dominate"
        )
    path = write_cost_files([cost_file(conf, result, where, span)], out_dir, HEADER)[0]
    if samples_csv is not None:
        samples_csv.parent.mkdir(parents=True, exist_ok=True)
        sample_frame(samples, RooflineCostModel(result.params), where).to_csv(samples_csv, index=False)
    return Calibrated(path, result, samples, span, where, time.perf_counter() - start)


@dataclass
class ProfileOptions(VllmReplayConfig):
    """The engine settings of a vLLM replay file (``config=PATH``) and the profiling."""

    out: str = "conf/cost"
    repeats: int = 5
    warmup: int = 1
    samples: str = "outputs/vllm/profile.csv"  # the measured steps, for refit=
    refit: str = ""  # a samples CSV written earlier: fit it again instead of profiling


RULES: dict[str, Rule] = {"repeats": AT_LEAST_ONE, "warmup": Rule(lambda v: v >= 0, "an integer >= 0")}
CONFIG_NAME = "vllm_profile"


def options(argv: Sequence[str]) -> ProfileOptions:
    return load_options(ProfileOptions, argv, DEFAULT_CONFIG, RULES, CONFIG_NAME)


@hydra_cli(ProfileOptions, CONFIG_NAME, RULES, DEFAULT_CONFIG)
def main(opts: ProfileOptions) -> Path:
    log = functools.partial(print, flush=True)
    out = resolve_path(opts.out)
    if opts.refit:
        done = refit(opts, resolve_path(opts.refit), out, log)
    else:
        done = calibrate(
            opts, out, opts.repeats, opts.warmup, log=log, samples_csv=resolve_path(opts.samples)
        )
    y = np.array([s.seconds for s in done.samples])
    print(
        f"{done.fit.points} compositions on {done.where}: steps {y.min() * 1e3:.1f}-{y.max() * 1e3:.1f} ms "
        f"({done.span:.1f}x), in-sample MAPE {done.fit.in_sample_mape:.3f}, held-out {done.fit.heldout_mape:.3f}; "
        f"wrote {done.path} in {done.seconds:.0f} s"
    )
    return done.path


if __name__ == "__main__":
    main()
