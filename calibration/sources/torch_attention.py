"""Time attention on this device in plain PyTorch, and fit the cost model's attention terms to it.

``torch.nn.functional.scaled_dot_product_attention`` (bf16 on CUDA: PyTorch's FlashAttention-2
or memory-efficient kernel) on one tensor-parallel rank's heads:

* prefill: one chunk of ``q`` tokens, causal, over no cached context; the cost model's
  ``attn_prefill_fixed_s + attn_prefill_s_per_pair * q (q + 1) / 2``;
* decode: ``n`` sequences of one query token over ``c`` cached tokens each, with the model's KV
  heads (``enable_gqa``: each KV head is read once for its group of query heads);
  ``attn_decode_fixed_s * n + attn_decode_s_per_token * n c``.

Each fit is non-negative least squares on relative error over the grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import nnls

from calibration.fit import mape
from calibration.sources.torch_ops import time_op
from envs.serving.specs import ModelSpec

PREFILL_CHUNKS = (64, 128, 256, 512, 1024, 2048, 4096)
DECODE_GRID = tuple((n, c) for n in (1, 8, 32, 128) for c in (256, 1024, 4096))


@dataclass(frozen=True)
class AttentionFit:
    """Per-layer attention terms of :class:`~envs.serving.cost_model.CostParams`, and their in-sample MAPE."""

    prefill_fixed_s: float
    prefill_s_per_pair: float
    decode_fixed_s: float
    decode_s_per_token: float
    prefill_mape: float
    decode_mape: float
    points: int


def _heads(model: ModelSpec, tp: int) -> tuple[int, int]:
    if model.num_heads % tp or model.num_kv_heads % tp:
        raise ValueError(f"{model.name}: heads and KV heads must divide by tp={tp}")
    return model.num_heads // tp, model.num_kv_heads // tp


def time_prefill(
    model: ModelSpec, tp: int, q: int, device: torch.device, dtype: torch.dtype, warmup: int, repeats: int
) -> float:
    """Median seconds of one causal chunk of ``q`` tokens."""
    heads, _ = _heads(model, tp)
    x = torch.randn(1, heads, q, model.head_dim, device=device, dtype=dtype)
    ms = time_op(
        lambda: torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True),
        device,
        warmup,
        repeats,
    )
    return float(np.median(ms)) / 1e3


def time_decode(
    model: ModelSpec,
    tp: int,
    n: int,
    context: int,
    device: torch.device,
    dtype: torch.dtype,
    warmup: int,
    repeats: int,
) -> float:
    """Median seconds of ``n`` one-token queries over ``context`` cached tokens each."""
    heads, kv_heads = _heads(model, tp)
    q = torch.randn(n, heads, 1, model.head_dim, device=device, dtype=dtype)
    kv = torch.randn(n, kv_heads, context, model.head_dim, device=device, dtype=dtype)
    gqa = kv_heads != heads
    ms = time_op(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=gqa),
        device,
        warmup,
        repeats,
    )
    return float(np.median(ms)) / 1e3


def _fit(columns: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, float]:
    coef, _ = nnls(columns / seconds[:, None], np.ones(len(seconds)))
    return coef, mape(columns @ coef, seconds)


def profile(
    model: ModelSpec,
    tp: int,
    device: torch.device,
    dtype: torch.dtype,
    chunks: Sequence[int] = PREFILL_CHUNKS,
    decode: Sequence[tuple[int, int]] = DECODE_GRID,
    warmup: int = 3,
    repeats: int = 10,
) -> AttentionFit:
    """Time the grids and fit both terms; ``torch.inference_mode`` throughout."""
    with torch.inference_mode():
        pre = np.array([time_prefill(model, tp, q, device, dtype, warmup, repeats) for q in chunks])
        dec = np.array([time_decode(model, tp, n, c, device, dtype, warmup, repeats) for n, c in decode])
    q = np.asarray(chunks, dtype=np.float64)
    pre_coef, pre_err = _fit(np.stack([np.ones_like(q), q * (q + 1) / 2], axis=1), pre)
    n = np.array([n for n, _ in decode], dtype=np.float64)
    tokens = np.array([n * c for n, c in decode], dtype=np.float64)
    dec_coef, dec_err = _fit(np.stack([n, tokens], axis=1), dec)
    return AttentionFit(
        float(pre_coef[0]),
        float(pre_coef[1]),
        float(dec_coef[0]),
        float(dec_coef[1]),
        pre_err,
        dec_err,
        len(chunks) + len(decode),
    )
