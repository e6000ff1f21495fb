"""Profile the real engine on this machine and fit the simulator's cost model to it.

    python -m engine.calibrate --model engine_small --hardware cpu --threads 1   # -> conf/cost/cpu__engine_small__tp1.yaml

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
device, and the head is folded into the per-token and per-sequence terms and the one step.  The scheduler's own per-iteration work (policy, core,
batch building: ~0.1 ms on the dev VM) is not in these timings.
"""

from __future__ import annotations

import argparse
import os
import platform
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
from engine.profile import Composition, Measurement, measure
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
    "# Written by `python -m engine.calibrate` (or bench/sim_to_real.py); do not edit by hand. Times in seconds.\n"
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
    repeats: int = 7,
    warmup: int = 2,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    block_size: int = 16,
    grid: Sequence[Composition] | None = None,
) -> list[Sample]:
    """Time the grid on ``model`` (a preset or ``conf/model`` name) with ``threads`` torch threads.

    ``dtype`` names a torch dtype; ``None`` is the engine's default (float32 on CPU, bfloat16 on CUDA).
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
    )
    return [Sample.of(m) for m in measured]


def machine(device: str, threads: int) -> str:
    """Where a profile was measured, for the coefficient file's ``source``."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    return f"{cpu} ({os.cpu_count()} CPUs, {threads} torch threads), torch {torch.__version__}"


def cost_file(hardware: str, model: str, result: Fit, where: str) -> CostFile:
    """The coefficient file's content for ``result`` measured ``where``."""
    source = (
        f"measured: engine/runner.py on {where}, {result.points} batch compositions (median of repeats), "
        "whole-iteration fit by engine/calibrate.py"
    )
    metrics = {
        "in_sample_mape": result.in_sample_mape,
        "heldout_mape": result.heldout_mape,
        "points": result.points,
        "heldout_points": result.heldout_points,
    }
    return CostFile(hardware, model, 1, False, source, result.params, metrics)


def write(file: CostFile, out_dir: str | Path = COST_DIR) -> Path:
    """Write ``file`` as ``<out_dir>/<hardware>__<model>__tp1.yaml`` in the format of ``conf/cost``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / cost_file_name(file.hardware, file.model, file.tp)
    body = yaml.safe_dump(cost_file_mapping(file), sort_keys=False, width=110, default_flow_style=None)
    path.write_text(HEADER + body)
    return path


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m engine.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="engine_small", help="conf/model name the engine runs")
    parser.add_argument("--hardware", default="cpu", help="conf/hardware name of this device")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared VM)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="torch dtype; default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--out-dir", default=str(COST_DIR))
    args = parser.parse_args(argv)
    spec = load_model(args.model)
    samples = profile(
        args.model, args.threads, args.repeats, args.warmup, device=args.device, dtype=args.dtype
    )
    result = fit(samples, spec.num_layers)
    where = machine(args.device, args.threads)
    path = write(cost_file(args.hardware, args.model, result, where), args.out_dir)
    print(
        f"{len(samples)} compositions on {where}: in-sample MAPE {result.in_sample_mape:.3f}, "
        f"held-out {result.heldout_mape:.3f}; wrote {path}"
    )
    return path


if __name__ == "__main__":
    main()
