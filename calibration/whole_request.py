"""Attention efficiencies and engine overheads, fitted on whole-request runs.

Vidur's tables time the linear ops and all-reduces but not attention, the LM head's
sampling, or the serving engine around the kernels.  Splitwise's whole-request runs
(Llama-2-70B at TP 2/4/8 on DGX A100 and H100) contain all of it, so the remaining terms
of :class:`~envs.serving.cost_model.CostParams` are fitted there, with the kernel terms
held at their Vidur fits:

* prefill attention = ``prefill_attention_factor`` x its FLOPs at datasheet peak, plus
  ``prefill_chunk_s`` per chunk and layer;
* decode attention = ``decode_attention_factor`` x its KV bytes at datasheet bandwidth,
  plus ``decode_seq_s`` per sequence and layer;
* all-reduces of messages above :data:`LARGE_MESSAGE_BYTES` cost ``large_allreduce_s_per_byte``
  more per byte beyond it, times the ring traffic ``2 (tp - 1) / tp``;
* the engine: a per-iteration and a per-token device cost, and the host floor
  ``max(cpu, gpu)`` of an eager engine that launches kernels one by one (a fixed part, a
  part for iterations with a prefill, and a part per sequence).  ``max``, not a sum: an eager
  engine queues its kernels asynchronously, so the host runs ahead while the device is the
  bottleneck, and sets the pace when launching takes longer than the kernels run.

The engine terms and the attention factors are a 2023 eager engine at TP >= 2 (vLLM of that
year under Splitwise's runs); :func:`engine_terms` writes them as the profile
``conf/engine_overhead/splitwise_2023_eager.yaml``.

Every parameter is shared across tensor-parallel degrees; how each one scales with tp
is fixed by physics (attention is sharded by heads, the engine is not), which is what
leave-one-TP-out validation tests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from calibration.fit import mape
from envs.serving.cost_model import CostParams, RooflineCostModel, with_engine_overhead
from envs.serving.engine_overhead import OverheadTerms, decode_token_seconds, prefill_pair_seconds
from envs.serving.specs import HardwareSpec, ModelSpec

LARGE_MESSAGE_BYTES = 2048 * 8192 * 2
"""Splitwise's per-token prefill cost rises between 2048 and 4096 tokens per iteration (no
runs lie between), more at higher tp, as all-reduce traffic does; Vidur's kernels show no
such rise up to 32768 tokens and its all-reduce benchmark stops at 64 MiB.  So it is read as
a slower all-reduce regime above the message of 2048 Llama-2-70B tokens (32 MiB), the
largest measured point below the rise."""

BLOOM_176B = ModelSpec(
    name="bloom_176b",
    num_layers=70,
    hidden_size=14336,
    num_heads=112,
    num_kv_heads=112,
    ffn_size=38229,  # GeLU MLP of 2 x 4h^2 weights = SwiGLU's 3 x h x ffn with ffn = 8h/3
    vocab_size=250880,
    max_context=2048,
    hf_name="bigscience/bloom",
)
"""BLOOM-176B (bigscience/bloom config.json), only to check the fit on a model it never saw."""

_LOSS_SCALE = 0.05
_FIELDS = (
    "cpu_fixed_s",
    "cpu_prefill_s",
    "cpu_s_per_seq",
    "iter_fixed_s",
    "prefill_attention_factor",
    "prefill_chunk_s",
    "decode_attention_factor",
    "decode_seq_s",
    "s_per_token",
    "large_allreduce_s_per_byte",
)
_TYPICAL = np.array([0.03, 0.02, 3e-4, 5e-3, 3.0, 1e-4, 3.0, 5e-6, 3e-5, 1e-11])


@dataclass(frozen=True)
class EngineFit:
    """Fitted terms for one model on one hardware (see the module docstring for meanings)."""

    cpu_fixed_s: float
    cpu_prefill_s: float
    cpu_s_per_seq: float
    iter_fixed_s: float
    prefill_attention_factor: float
    prefill_chunk_s: float
    decode_attention_factor: float
    decode_seq_s: float
    s_per_token: float
    large_allreduce_s_per_byte: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def apply_engine(
    kernels: CostParams,
    engine: EngineFit,
    model: ModelSpec,
    hardware: HardwareSpec,
    tp: int,
    fitted_model: ModelSpec,
    fitted_hardware: HardwareSpec,
    link_ratio: float = 1.0,
) -> CostParams:
    """``kernels`` with the attention and engine terms of ``engine``, moved to this configuration:
    the large-message all-reduce regime (:func:`with_large_allreduce`, a device term) and the
    fit as a 2023 engine profile (:func:`engine_terms`) applied by
    :func:`~envs.serving.cost_model.with_engine_overhead`.

    Attention: the fitted factors times this model's FLOPs per pair (heads / tp) over this
    device's peak, and KV bytes per token (KV heads / tp) over its bandwidth.  Engine:
    host launches scale with layer count; per-token device work with hidden x layers over
    bandwidth (like unfused element-wise traffic, replicated across ranks); the rest stays.
    """
    device = with_large_allreduce(kernels, engine, model, tp, link_ratio)
    return with_engine_overhead(
        device, engine_terms(engine, fitted_model, fitted_hardware), model, hardware, tp
    )


def with_large_allreduce(
    kernels: CostParams, engine: EngineFit, model: ModelSpec, tp: int, link_ratio: float = 1.0
) -> CostParams:
    """The slower all-reduce regime above :data:`LARGE_MESSAGE_BYTES`, scaled by message bytes and
    ``link_ratio`` (how much slower this device's link is than the fitted one's)."""
    return dataclasses.replace(
        kernels,
        allreduce_s_per_token_above=(
            engine.large_allreduce_s_per_byte * ring_traffic(tp) * message_bytes(model) * link_ratio
            if tp > 1
            else 0.0
        ),
        allreduce_knee_tokens=large_message_tokens(model) if tp > 1 else 0,
    )


def engine_terms(engine: EngineFit, fitted_model: ModelSpec, fitted_hardware: HardwareSpec) -> OverheadTerms:
    """The fit as one GPU's entry of an engine overhead profile: host launches per layer, per-token
    device work per byte (hidden x layers at the fitted GPU's bandwidth), its attention kernels."""
    layers = fitted_model.num_layers
    return OverheadTerms(
        host_s_per_layer=engine.cpu_fixed_s / layers,
        host_prefill_s_per_layer=engine.cpu_prefill_s / layers,
        host_s_per_seq=engine.cpu_s_per_seq,
        device_fixed_s=engine.iter_fixed_s,
        device_bytes_per_token_hidden_layer=(
            engine.s_per_token * fitted_hardware.hbm_bandwidth / (fitted_model.hidden_size * layers)
        ),
        attention_prefill_factor=engine.prefill_attention_factor,
        attention_prefill_chunk_s=engine.prefill_chunk_s,
        attention_decode_factor=engine.decode_attention_factor,
        attention_decode_seq_s=engine.decode_seq_s,
    )


def ring_traffic(tp: int) -> float:
    """Bytes each rank sends in a ring all-reduce, per byte of message."""
    return 2 * (tp - 1) / tp


def message_bytes(model: ModelSpec) -> int:
    """All-reduce message per token: one hidden vector."""
    return model.hidden_size * model.dtype_bytes


def large_message_tokens(model: ModelSpec) -> int:
    return LARGE_MESSAGE_BYTES // message_bytes(model)


# ---- the fit ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Components:
    """Per measurement, what each fitted parameter multiplies (arrays of equal length)."""

    kernel_s: np.ndarray
    pairs_s: np.ndarray
    chunks: np.ndarray
    kv_s: np.ndarray
    decodes: np.ndarray
    tokens: np.ndarray
    seqs: np.ndarray
    prefill: np.ndarray
    large_bytes: np.ndarray


def measurement_rows(prompt: pd.DataFrame, token: pd.DataFrame) -> pd.DataFrame:
    """One table of prompt and token measurements: kind, tp, prompt, batch, tokens, seconds.

    A token row is the mean decode iteration of ``batch`` sequences whose context grows
    from ``prompt`` to ``prompt + tokens``, i.e. ``prompt + tokens / 2`` on average.
    """
    p = prompt.assign(kind="prompt", tokens=0)[["kind", "tp", "prompt", "batch", "tokens", "seconds"]]
    t = token.assign(kind="token")[["kind", "tp", "prompt", "batch", "tokens", "seconds"]]
    return pd.concat([p, t], ignore_index=True)


def components(rows: pd.DataFrame, model: ModelSpec, hardware: HardwareSpec, kernels: dict[int, CostParams]):
    """Evaluate the kernel terms and the fitted parameters' multipliers for each row."""
    out: dict[str, list[float]] = {f.name: [] for f in dataclasses.fields(Components)}
    layers = model.num_layers
    for kind, tp, prompt, batch, tokens in rows[["kind", "tp", "prompt", "batch", "tokens"]].itertuples(
        index=False
    ):
        cost = RooflineCostModel(kernels[tp])
        if kind == "prompt":
            out["kernel_s"].append(cost.iteration_time(0, 0, [prompt] * batch, [0] * batch))
            out["pairs_s"].append(
                layers * batch * prompt * (prompt + 1) / 2 * prefill_pair_seconds(model, hardware, tp)
            )
            out["chunks"].append(layers * batch)
            out["kv_s"].append(0.0)
            out["decodes"].append(0.0)
            out["tokens"].append(batch * prompt)
        else:
            context = batch * (prompt + tokens / 2)
            out["kernel_s"].append(cost.iteration_time(batch, int(round(context)), (), ()))
            out["pairs_s"].append(0.0)
            out["chunks"].append(0.0)
            out["kv_s"].append(layers * context * decode_token_seconds(model, hardware, tp))
            out["decodes"].append(layers * batch)
            out["tokens"].append(batch)
        out["seqs"].append(batch)
        out["prefill"].append(1.0 if kind == "prompt" else 0.0)
        beyond = max(out["tokens"][-1] - large_message_tokens(model), 0)
        out["large_bytes"].append(2 * layers * ring_traffic(tp) * beyond * message_bytes(model))
    return Components(**{k: np.asarray(v, dtype=np.float64) for k, v in out.items()})


def predict(theta: np.ndarray, c: Components) -> np.ndarray:
    """The cost model's iteration time for each row, vectorised over rows."""
    cpu_fixed, cpu_prefill, cpu_seq, fixed, f_prefill, chunk, f_decode, dec_seq, tok, large = theta
    gpu = (
        c.kernel_s
        + fixed
        + f_prefill * c.pairs_s
        + chunk * c.chunks
        + f_decode * c.kv_s
        + dec_seq * c.decodes
        + tok * c.tokens
        + large * c.large_bytes
    )
    cpu = cpu_fixed + cpu_prefill * c.prefill + cpu_seq * c.seqs
    return np.maximum(gpu, cpu)


def fit_engine(c: Components, seconds: np.ndarray) -> EngineFit:
    """Robust (soft-L1) least squares on relative errors: deterministic, from fixed starts.

    The attention factors are bounded below by 1 (nothing beats the datasheet peak).  The
    max() makes the loss non-convex, so several starts are tried, including ones that put
    the host floor just under the fastest decode iteration.
    """
    lower = np.zeros(len(_FIELDS))
    lower[[_FIELDS.index("prefill_attention_factor"), _FIELDS.index("decode_attention_factor")]] = 1.0
    lower = lower / _TYPICAL
    decode = c.prefill == 0
    floor = 0.9 * float(seconds[decode].min()) if decode.any() else _TYPICAL[0]
    best = None
    for scale in (1.0, 0.3, 3.0):
        for cpu in (_TYPICAL[0], floor):
            z0 = np.maximum(np.full(len(_FIELDS), scale), lower)
            z0[0] = cpu / _TYPICAL[0]

            def residual(z: np.ndarray) -> np.ndarray:
                return predict(z * _TYPICAL, c) / seconds - 1.0

            result = least_squares(residual, z0, bounds=(lower, np.inf), loss="soft_l1", f_scale=_LOSS_SCALE)
            if best is None or result.cost < best.cost - 1e-12:
                best = result
    assert best is not None, "the loops above ran at least once"
    theta = best.x * _TYPICAL
    theta[theta < 1e-6 * _TYPICAL] = 0.0  # optimiser dust, not a measurement
    return EngineFit(**{name: float(v) for name, v in zip(_FIELDS, theta, strict=True)})


def engine_vector(engine: EngineFit) -> np.ndarray:
    return np.array([getattr(engine, name) for name in _FIELDS])


@dataclass(frozen=True)
class Validation:
    """Leave-one-TP-out errors: fit on the other degrees, predict ``tp``."""

    tp: int
    prompt_mape: float
    token_mape: float
    prompt_rows: int
    token_rows: int
    kind: np.ndarray
    measured: np.ndarray
    predicted: np.ndarray


def leave_one_tp_out(rows: pd.DataFrame, c: Components) -> list[Validation]:
    out = []
    kind = rows["kind"].to_numpy()
    seconds = rows["seconds"].to_numpy()
    for tp in sorted(rows["tp"].unique()):
        test = (rows["tp"] == tp).to_numpy()
        engine = fit_engine(_subset(c, ~test), seconds[~test])
        pred = predict(engine_vector(engine), _subset(c, test))
        is_prompt = kind[test] == "prompt"
        out.append(
            Validation(
                int(tp),
                mape(pred[is_prompt], seconds[test][is_prompt]),
                mape(pred[~is_prompt], seconds[test][~is_prompt]),
                int(is_prompt.sum()),
                int((~is_prompt).sum()),
                kind[test],
                seconds[test],
                pred,
            )
        )
    return out


def cost_model_predictions(rows: pd.DataFrame, params: dict[int, CostParams]) -> np.ndarray:
    """Each row through :class:`RooflineCostModel` itself (not the vectorised fit form)."""
    out = []
    for kind, tp, prompt, batch, tokens in rows[["kind", "tp", "prompt", "batch", "tokens"]].itertuples(
        index=False
    ):
        cost = RooflineCostModel(params[tp])
        if kind == "prompt":
            out.append(cost.iteration_time(0, 0, [prompt] * batch, [0] * batch))
        else:
            out.append(cost.iteration_time(batch, int(round(batch * (prompt + tokens / 2))), (), ()))
    return np.asarray(out)


def errors(rows: pd.DataFrame, c: Components, engine: EngineFit) -> dict[str, float]:
    """In-sample or out-of-sample MAPE of ``engine`` on ``rows``, per kind present."""
    pred = predict(engine_vector(engine), c)
    seconds = rows["seconds"].to_numpy()
    kind = rows["kind"].to_numpy()
    return {k: mape(pred[kind == k], seconds[kind == k]) for k in ("prompt", "token") if (kind == k).any()}


def _subset(c: Components, mask: np.ndarray) -> Components:
    return Components(**{f.name: getattr(c, f.name)[mask] for f in dataclasses.fields(Components)})
