"""Profile the real engine on this machine and fit the simulator's cost model to it.

    python -m engine.calibrate         # conf/engine/cpu_replay.yaml -> conf/cost/cpu__engine_small__tp1.yaml
    python -m engine.calibrate config=conf/engine/gpu_replay.yaml hardware=h200 --out-dir DIR

Times :meth:`engine.runner.ModelRunner.execute` over a grid of batch compositions (decode-only at
several batch sizes and contexts, prefill chunks at several sizes and contexts, several prompts at
once, and mixed batches; median of round-robin repeats, :func:`engine.profile.measure`), then fits
the coefficients of the one cost-model form every backend shares
(:class:`envs.serving.cost_model.CostParams`) to the whole-iteration times, and writes a coefficient
file in the format of :mod:`calibration.files`, so ``ServingSetup.from_names(model, hardware)``
loads it like any GPU profile.

The fit: for a fixed knee the form is linear in its coefficients, so each knee on a grid is one
non-negative least-squares solve on relative residuals (the metric is MAPE), as
:mod:`calibration.fit` does for per-layer tables; the best knee wins.  The terms, with ``L`` layers,
``T`` batched tokens, ``n`` decodes holding ``C`` KV tokens (the new token included, as the core
counts) and chunks of ``q`` queries over ``c`` cached tokens::

    iter_fixed + L * ( lin_elementwise * T + lin_per_token * max(T - knee, 0) + step * [T > 1]
                       + pair * sum q (c + (q + 1) / 2) + chunk * chunks + dec_tok * C + dec_seq * n )

A host-side floor and the LM head's separate terms are left at zero: on a CPU the host is the
device, and the head is folded into the per-token and per-sequence terms and the one step.  The
scheduler's own per-iteration work (policy, core, batch building: ~0.1 ms on the dev VM), which the
profile's forward passes leave out, is measured in a 10-second real-time replay of another window
and added to ``iter_fixed`` (:func:`calibrate`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from scipy.optimize import nnls

from calibration.files import cost_file_mapping
from calibration.fit import holdout_mask, mape
from calibration.pipeline import CostFile
from engine.model import LlamaModel
from engine.profile import Composition, Measurement, measure
from engine.replay import ReplayConfig, build, check, load_config, scheduler_overhead
from envs.serving.cost_model import COST_DIR, CostParams, RooflineCostModel, cost_file_name
from envs.serving.specs import load_model

DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
DECODE_CONTEXTS = (16, 128, 512)
PREFILL_TOKENS = (8, 32, 64, 128, 256, 384, 512, 768, 1024, 2048)
CHUNK_OVER_CONTEXT = ((128, 512), (256, 256), (512, 512), (512, 1024), (256, 1536))
MANY_PROMPTS = ((4, 128), (8, 128), (4, 512), (16, 256))
MIXED = ((64, 4), (256, 8), (448, 16), (480, 32))
MIXED_CONTEXT = 256
KNEES = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
STEPS = (1,)
"""Token counts above which the fit may add a step: past one row the LM head turns from a matrix-vector
product into a GEMM (see ``engine/runner.py``), a jump a straight line cannot follow."""
TERMS = ("const", "tokens", "above_knee", "pairs", "chunks", "decode_kv", "decodes") + tuple(
    f"step_{t}" for t in STEPS
)
HEADER = (
    "# Cost-model coefficients of the real engine, measured on the machine named in `source`.\n"
    "# Written by `python -m engine.calibrate` (or bench/sim_to_real.py); do not edit. Times in seconds.\n"
)


def default_grid() -> list[Composition]:
    """The compositions profiled: every shape a replay's iterations take, at several sizes.

    Decode-only (batch x per-sequence context), single prompts from scratch, chunks over a cached
    prefix (Sarathi's later chunks), several whole prompts at once (FCFS), and a chunk beside
    decodes (Sarathi's mixed batches).
    """
    grid = [
        Composition(f"decode {n} x ctx {c}", decode_contexts=(c,) * n)
        for n in DECODE_BATCHES
        for c in DECODE_CONTEXTS
    ]
    grid += [Composition(f"prefill {q}", prefill_tokens=(q,), prefill_context=(0,)) for q in PREFILL_TOKENS]
    grid += [
        Composition(f"prefill {q} over ctx {c}", prefill_tokens=(q,), prefill_context=(c,))
        for q, c in CHUNK_OVER_CONTEXT
    ]
    grid += [
        Composition(f"{k} prompts x {q}", prefill_tokens=(q,) * k, prefill_context=(0,) * k)
        for k, q in MANY_PROMPTS
    ]
    grid += [
        Composition(
            f"prefill {q} + {n} decodes x ctx {MIXED_CONTEXT}",
            decode_contexts=(MIXED_CONTEXT,) * n,
            prefill_tokens=(q,),
            prefill_context=(0,),
        )
        for q, n in MIXED
    ]
    return grid


@dataclass(frozen=True)
class Sample:
    """One measured iteration in the cost model's arguments (decode context counts the new tokens)."""

    num_decode: int
    decode_context: int
    prefill_tokens: tuple[int, ...]
    prefill_context: tuple[int, ...]
    seconds: float

    @classmethod
    def of(cls, m: Measurement) -> Sample:
        c = m.composition
        decode_kv = sum(c.decode_contexts) + len(c.decode_contexts)
        return cls(len(c.decode_contexts), decode_kv, c.prefill_tokens, c.prefill_context, m.median_s)

    def predict(self, cost: RooflineCostModel) -> float:
        return cost.iteration_time(
            self.num_decode, self.decode_context, self.prefill_tokens, self.prefill_context
        )


def design(samples: Sequence[Sample], knee: float) -> np.ndarray:
    """Each sample's multiplier of every term in :data:`TERMS` (rows) at ``knee``."""
    rows = []
    for s in samples:
        tokens = s.num_decode + sum(s.prefill_tokens)
        pairs = sum(q * (c + 0.5 * (q + 1)) for q, c in zip(s.prefill_tokens, s.prefill_context, strict=True))
        rows.append(
            [
                1.0,
                tokens,
                max(tokens - knee, 0.0),
                pairs,
                len(s.prefill_tokens),
                s.decode_context,
                s.num_decode,
                *(float(tokens > t) for t in STEPS),
            ]
        )
    return np.array(rows, dtype=np.float64)


@dataclass(frozen=True)
class Fit:
    """Fitted coefficients and how well they predict; MAPEs are fractions."""

    params: CostParams
    in_sample_mape: float
    heldout_mape: float
    points: int
    heldout_points: int


def fit_terms(samples: Sequence[Sample]) -> tuple[np.ndarray, float]:
    """(coefficients of :data:`TERMS`, knee): the least relative squared error over the knee grid."""
    y = np.array([s.seconds for s in samples])
    if len(samples) < len(TERMS) or not np.all(y > 0):
        raise ValueError(f"need at least {len(TERMS)} samples with positive times, got {len(samples)}")
    best = None
    for knee in KNEES:
        a = design(samples, knee) / y[:, None]
        coef, _ = nnls(a, np.ones_like(y), maxiter=50 * a.shape[1])
        loss = float(np.sum((a @ coef - 1.0) ** 2))
        if best is None or loss < best[0] - 1e-12:
            best = (loss, coef, float(knee))
    return best[1], best[2]


def params_of(coef: np.ndarray, knee: float, num_layers: int) -> CostParams:
    """The fitted terms as :class:`CostParams` (per-layer terms divided by ``num_layers``)."""
    const, tokens, above, pairs, chunks, decode_kv, decodes, *steps = (float(x) for x in coef)
    per_layer = 1.0 / num_layers
    return CostParams(
        num_layers=num_layers,
        lin_fixed_s=0.0,
        lin_mem_s=0.0,
        lin_s_per_token=above * per_layer,
        lin_knee_tokens=knee,
        lin_elementwise_s_per_token=tokens * per_layer,
        lin_steps=tuple((t, h * per_layer) for t, h in zip(STEPS, steps, strict=True) if h > 0),
        attn_prefill_s_per_pair=pairs * per_layer,
        attn_prefill_fixed_s=chunks * per_layer,
        attn_decode_s_per_token=decode_kv * per_layer,
        attn_decode_fixed_s=decodes * per_layer,
        allreduce_count=0,
        allreduce_fixed_s=0.0,
        allreduce_s_per_token=0.0,
        iter_fixed_s=const,
        head_fixed_s=0.0,
        head_s_per_seq=0.0,
    )


def fit(samples: Sequence[Sample], num_layers: int, seed: int = 0) -> Fit:
    """Fit on all samples; the held-out error comes from a refit on a seeded 80% of them."""
    coef, knee = fit_terms(samples)
    params = params_of(coef, knee, num_layers)
    y = np.array([s.seconds for s in samples])
    cost = RooflineCostModel(params)
    in_sample = mape([s.predict(cost) for s in samples], y)
    held = holdout_mask(len(samples), 0.2, seed)
    kept = [s for s, h in zip(samples, held, strict=True) if not h]
    test = [s for s, h in zip(samples, held, strict=True) if h]
    part = RooflineCostModel(params_of(*fit_terms(kept), num_layers))
    heldout = mape([s.predict(part) for s in test], [s.seconds for s in test])
    return Fit(params, in_sample, heldout, len(samples), len(test))


def profile(
    model: str,
    threads: int,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    block_size: int = 16,
    grid: Sequence[Composition] | None = None,
    settle: int = 1,
) -> list[Sample]:
    """Time the grid on ``model`` (a preset or ``conf/model`` name) with ``threads`` torch threads.

    ``dtype`` names a torch dtype; ``None`` is the engine's default (float32 on CPU, bfloat16 on CUDA).
    Each timed run follows ``settle`` untimed runs of the same batch (:func:`engine.profile.measure`).
    """
    torch.set_num_threads(threads)
    measured = measure(
        model,
        grid or default_grid(),
        seed=seed,
        dtype=getattr(torch, dtype) if dtype else None,
        device=device,
        block_size=block_size,
        repeats=repeats,
        warmup=warmup,
        settle=settle,
    )
    return [Sample.of(m) for m in measured]


def machine(device: str, threads: int) -> str:
    """Where a profile was measured, for the coefficient file's ``source`` (CPU: with the load average)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    load = os.getloadavg()[0]
    return (
        f"{_cpu_name()} ({os.cpu_count()} CPUs, {threads} torch threads, 1-min load average {load:.1f}), "
        f"torch {torch.__version__}"
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def with_overhead(params: CostParams, seconds: float) -> CostParams:
    """``params`` with ``seconds`` of the engine's own scheduling work added to every iteration."""
    return dataclasses.replace(params, iter_fixed_s=params.iter_fixed_s + seconds)


def cost_file(hardware: str, model: str, result: Fit, where: str, overhead_s: float = 0.0) -> CostFile:
    """The coefficient file's content for ``result`` measured ``where``, plus ``overhead_s`` per iteration."""
    source = (
        f"measured: engine/runner.py on {where}, {result.points} batch compositions (median of repeats), "
        "whole-iteration fit by engine/calibrate.py"
        + (
            f", plus {overhead_s * 1e3:.3f} ms per iteration of scheduler work, timed in a replay"
            if overhead_s
            else ""
        )
    )
    metrics = {
        "in_sample_mape": result.in_sample_mape,
        "heldout_mape": result.heldout_mape,
        "points": result.points,
        "heldout_points": result.heldout_points,
        "scheduler_overhead_s": overhead_s,
    }
    return CostFile(hardware, model, 1, False, source, with_overhead(result.params, overhead_s), metrics)


def write(file: CostFile, out_dir: str | Path = COST_DIR) -> Path:
    """Write ``file`` as ``<out_dir>/<hardware>__<model>__tp1.yaml`` in the format of ``conf/cost``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / cost_file_name(file.hardware, file.model, file.tp)
    body = yaml.safe_dump(cost_file_mapping(file), sort_keys=False, width=110, default_flow_style=None)
    path.write_text(HEADER + body)
    return path


@dataclass(frozen=True)
class Calibrated:
    """What :func:`calibrate` measured and wrote."""

    path: Path
    fit: Fit
    overhead_s: float
    where: str
    seconds: float


def calibrate(
    conf: ReplayConfig,
    out_dir: str | Path = COST_DIR,
    repeats: int = 5,
    warmup: int = 1,
    model: LlamaModel | None = None,
) -> Calibrated:
    """Profile ``conf``'s model on its device and threads, fit, and write the coefficient file.

    The engine's own work per iteration (policy, core, batch building), which the profile's forward
    passes leave out, is measured in a short real-time replay of another window of ``conf``'s
    workload (:func:`engine.replay.scheduler_overhead`) and added to the fixed term.
    """
    start = time.perf_counter()
    samples = profile(
        conf.model,
        conf.threads,
        repeats,
        warmup,
        seed=conf.weights_seed,
        device=conf.device,
        dtype=conf.dtype,
    )
    result = fit(samples, load_model(conf.model).num_layers)
    where = machine(conf.device, conf.threads)
    with tempfile.TemporaryDirectory() as tmp:  # its own path: setups are cached by cost-model path
        fitted = write(cost_file(conf.hardware, conf.model, result, where), tmp)
        overhead = scheduler_overhead(dataclasses.replace(conf, cost_model=str(fitted)), model or build(conf))
    path = write(cost_file(conf.hardware, conf.model, result, where, overhead), out_dir)
    return Calibrated(path, result, overhead, where, time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m engine.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per composition (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out-dir", default=str(COST_DIR))
    parser.add_argument(
        "overrides",
        nargs="*",
        help="the replay config naming model, hardware, device, threads and the scheduler timing: "
        "config=PATH (default conf/engine/cpu_replay.yaml) and KEY=VALUE",
    )
    args = parser.parse_args(argv)
    try:
        conf = load_config(args.overrides)
        check(conf)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"python -m engine.calibrate: error: {exc}") from exc
    done = calibrate(conf, args.out_dir, args.repeats, args.warmup)
    print(
        f"{done.fit.points} compositions on {done.where}: in-sample MAPE {done.fit.in_sample_mape:.3f}, "
        f"held-out {done.fit.heldout_mape:.3f}; scheduler {done.overhead_s * 1e3:.3f} ms per iteration; "
        f"wrote {done.path} in {done.seconds:.0f} s"
    )
    return done.path


if __name__ == "__main__":
    main()
