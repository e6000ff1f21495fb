"""Whole-iteration profiles of a live engine: the batch compositions timed, and the cost model fitted to them.

A :class:`Composition` states one iteration's batch in the terms of
``envs/serving/cost_model.py`` (decoding sequences with their cached tokens; prefill chunks with
their query tokens and cached context), so any engine that can time it (ours:
:mod:`engine.profile`) yields :class:`Measurement` rows that fit that cost model
directly.  :func:`fit` fits the one cost-model form every backend shares
(:class:`envs.serving.cost_model.CostParams`) to those times with :func:`calibration.fit.fit_knee_grid`.
With ``L`` layers, ``T`` batched tokens, ``n`` decodes holding ``C`` KV tokens (the new token
included, as the core counts) and chunks of ``q`` queries over ``c`` cached tokens::

    iter_fixed + L * ( lin_elementwise * T + lin_per_token * max(T - knee, 0) + step * [T > 1]
                       + pair * sum q (c + (q + 1) / 2) + chunk * chunks + dec_tok * C + dec_seq * n
                       [+ lin_large * max(T - large_knee, 0)] )

The bracketed hinge is optional (``fit(..., large_knees=...)``, off by default): a second, steeper
per-token regime for steps of many thousand tokens, which vLLM on a CPU shows (the cost model's
``lin_large_*``).

A host-side floor and the LM head's separate terms are left at zero: on a CPU the host is the
device, and the head is folded into the per-token and per-sequence terms and the one step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from calibration.fit import KneeFit, fit_knee_grid, holdout_mask, mape
from envs.serving.cost_model import CostParams, RooflineCostModel

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


@dataclass(frozen=True)
class Composition:
    """One iteration's batch: decodes with their cached tokens, prefill chunks with theirs."""

    label: str
    decode_contexts: tuple[int, ...] = ()
    prefill_tokens: tuple[int, ...] = ()
    prefill_context: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.prefill_tokens) != len(self.prefill_context):
            raise ValueError(
                f"Composition {self.label!r}: prefill_tokens and prefill_context differ in length"
            )
        if not (self.decode_contexts or self.prefill_tokens):
            raise ValueError(f"Composition {self.label!r} is empty")
        if any(q < 1 for q in self.prefill_tokens) or min((*self.decode_contexts, *self.prefill_context)) < 0:
            raise ValueError(f"Composition {self.label!r}: chunks need >= 1 token and contexts >= 0")

    def cost_args(self) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        """The cost model's ``iteration_time`` arguments; the decode context counts the new tokens, as the core does."""
        n = len(self.decode_contexts)
        return n, sum(self.decode_contexts) + n, self.prefill_tokens, self.prefill_context


@dataclass(frozen=True)
class Measurement:
    """A composition's timed repeats, in seconds."""

    composition: Composition
    seconds: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    def row(self) -> dict[str, Any]:
        """The cost model's ``iteration_time`` arguments and the measured time."""
        c = self.composition
        return {
            "label": c.label,
            "num_decode": len(c.decode_contexts),
            "decode_context": sum(c.decode_contexts),
            "prefill_tokens": " ".join(map(str, c.prefill_tokens)),
            "prefill_context": " ".join(map(str, c.prefill_context)),
            "median_s": self.median_s,
            "min_s": min(self.seconds),
            "repeats": len(self.seconds),
        }


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
        return cls(*m.composition.cost_args(), m.median_s)

    def predict(self, cost: RooflineCostModel) -> float:
        return cost.iteration_time(
            self.num_decode, self.decode_context, self.prefill_tokens, self.prefill_context
        )


def columns(samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
    """(batched tokens, the attention and per-sequence columns of :data:`TERMS`) per sample."""
    tokens, extra = [], []
    for s in samples:
        pairs = sum(q * (c + 0.5 * (q + 1)) for q, c in zip(s.prefill_tokens, s.prefill_context, strict=True))
        tokens.append(s.num_decode + sum(s.prefill_tokens))
        extra.append([pairs, len(s.prefill_tokens), s.decode_context, s.num_decode])
    return np.array(tokens, dtype=np.float64), np.array(extra, dtype=np.float64).reshape(-1, 4)


@dataclass(frozen=True)
class Fit:
    """Fitted coefficients and how well they predict; MAPEs are fractions."""

    params: CostParams
    in_sample_mape: float
    heldout_mape: float
    points: int
    heldout_points: int


def fit_terms(samples: Sequence[Sample], large_knees: Sequence[float] = ()) -> KneeFit:
    """The coefficients of :data:`TERMS` with the least relative squared error over :data:`KNEES`
    (and, with ``large_knees``, the second hinge at the best of those inside the samples' range)."""
    y = np.array([s.seconds for s in samples])
    need = len(TERMS) + bool(large_knees)
    if len(samples) < need or not np.all(y > 0):
        raise ValueError(f"need at least {need} samples with positive times, got {len(samples)}")
    tokens, extra = columns(samples)
    return fit_knee_grid(tokens, y, KNEES, extra, STEPS, max_steps=len(STEPS), large_knees=large_knees)


def params_of(terms: KneeFit, num_layers: int) -> CostParams:
    """The fitted terms as :class:`CostParams` (per-layer terms divided by ``num_layers``)."""
    const, tokens, above, pairs, chunks, decode_kv, decodes = (float(x) for x in terms.coef[:7])
    per_layer = 1.0 / num_layers
    large = float(terms.coef[7]) if terms.large_knee is not None else 0.0
    return CostParams(
        num_layers=num_layers,
        lin_fixed_s=0.0,
        lin_mem_s=0.0,
        lin_s_per_token=above * per_layer,
        lin_knee_tokens=terms.knee,
        lin_elementwise_s_per_token=tokens * per_layer,
        lin_steps=tuple(
            (int(t), float(h) * per_layer)
            for t, h in zip(terms.thresholds, terms.heights, strict=True)
            if h > 0
        ),
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
        lin_large_s_per_token=large * per_layer,
        lin_large_knee_tokens=terms.large_knee if large > 0 and terms.large_knee is not None else 0.0,
    )


def fit(samples: Sequence[Sample], num_layers: int, seed: int = 0, large_knees: Sequence[float] = ()) -> Fit:
    """Fit on all samples; the held-out error comes from a refit on a seeded 80% of them.

    ``large_knees``: candidate starts of the optional second hinge (none: the form without it)."""
    params = params_of(fit_terms(samples, large_knees), num_layers)
    y = np.array([s.seconds for s in samples])
    cost = RooflineCostModel(params)
    in_sample = mape([s.predict(cost) for s in samples], y)
    held = holdout_mask(len(samples), 0.2, seed)
    kept = [s for s, h in zip(samples, held, strict=True) if not h]
    test = [s for s, h in zip(samples, held, strict=True) if h]
    part = RooflineCostModel(params_of(fit_terms(kept, large_knees), num_layers))
    heldout = mape([s.predict(part) for s in test], [s.seconds for s in test])
    return Fit(params, in_sample, heldout, len(samples), len(test))
