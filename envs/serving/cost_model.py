"""Iteration latency as a function of the batch's composition.

One functional form serves every backend.  An iteration of ``T`` batched tokens over
``S`` sequences combines the host's and the device's work::

    T_iter = max(cpu, gpu)        (or cpu + gpu for an engine whose host work is serial)
    cpu    = cpu_fixed + cpu_prefill * [any prefill chunk] + cpu_per_seq * S + cpu_per_token * T
    gpu    = iter_fixed + head_fixed + (head_per_seq + iter_per_seq) * S + iter_per_token * T
             + L * ( linear(T) + n_allreduce * allreduce(T)
                     + sum_i prefill_attention(q_i, c_i) + decode_attention(n_decode, context_sum) )

The device terms (``linear``, attention, all-reduces, LM head) come from a GPU cost file in
``conf/cost/``; the engine terms (``cpu_*``, ``iter_*``, and how the two combine) from a named
engine overhead profile in ``conf/engine_overhead/`` (:mod:`envs.serving.engine_overhead`),
added by :func:`with_engine_overhead`.  A file profiled on a live engine (ours, on ``cpu``)
holds both at once.

* ``cpu`` is the host's work per step: scheduling and input preparation, and for an eager
  engine the launch of every kernel.  When the device work is shorter, the host sets the pace.
* ``linear(T)`` is the time of one layer's non-attention ops (norms, QKV/O projections,
  RoPE, SwiGLU MLP, residual add) on ``T`` tokens, roofline-shaped::

      lin_fixed + lin_elementwise * T + lin_mem + lin_per_token * max(T - lin_knee, 0)
      + sum of lin_steps heights whose threshold < T
      + lin_large_s_per_token * max(T - lin_large_knee_tokens, 0)

  a launch term, element-wise ops, the GEMMs' weight reads (memory-bound below the knee)
  and their compute above it, plus non-negative steps where a GEMM needs one more row
  tile or wave.  Every coefficient is >= 0, so it never falls as ``T`` grows; beyond the
  profiled range it continues as a straight line.  With ``lin_knee = lin_mem /
  lin_per_token`` this is ``lin_fixed + max(lin_mem, lin_per_token * T)``, the textbook
  roofline; a fitted knee lies further out because GEMMs near the knee run below peak.
  The last term (optional, zero unless a profile fits it) is a steeper regime of very
  large steps: vLLM's CPU backend costs ~25-40% more per token in steps of 8-16k tokens
  than in steps of 1-4k (memory effects of activations of tens of MB; not pinned down).
* ``prefill_attention(q, c)`` for a chunk of ``q`` query tokens over ``c`` tokens already
  cached: causal FLOPs, i.e. ``q * (c + (q + 1) / 2)`` query-key pairs, times a cost per
  pair, plus a per-chunk cost.
* ``decode_attention(n, C)`` for ``n`` decoding sequences holding ``C`` cached tokens in
  all: bytes of KV read, i.e. a cost per cached token, plus a per-sequence cost.
* ``allreduce(T) = fixed + per_token * T + per_token_above * max(T - knee, 0)``: two per
  layer under tensor parallelism, zero at ``tp = 1``; the last term is a slower regime
  for large messages that whole-request runs show and collective benchmarks do not.
* ``iter_per_token`` / ``iter_per_seq`` are the engine's device work outside the layers
  (e.g. sampling).

:class:`RooflineCostModel` evaluates it from :class:`CostParams`, which come either
from datasheet numbers (:func:`roofline_params`, the uncalibrated v0) or from a fitted
coefficient file in ``conf/cost/`` (:func:`load_cost_model`; written by ``python -m
calibration``).  Any other :class:`CostModel` can be swapped in.
"""

from __future__ import annotations

import bisect
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chunkgym.received import ReceivedFileError, load_yaml
from envs.serving.engine_overhead import (
    DEFAULT_ENGINE_OVERHEAD,
    EngineOverhead,
    OverheadTerms,
    check_non_negative,
    decode_token_seconds,
    load_engine_overhead,
    per_token_seconds,
    prefill_pair_seconds,
)
from envs.serving.specs import CONF_DIR, HardwareSpec, ModelSpec

COST_DIR = CONF_DIR / "cost"


class CostModel(ABC):
    """Predicts the wall time of one engine iteration from what the batch holds."""

    description: str  # where its numbers come from (results name it)
    monotone: bool = False
    """True when no latency falls as a batch gains tokens or chunks (IEEE rounding is monotone, so
    nonnegative terms keep it so in floating point): a planner may then take "fits within a target"
    over growing batches as true up to one point and false beyond it."""

    @abstractmethod
    def iteration_time(
        self,
        num_decode: int,
        decode_context: int,
        prefill_tokens: Sequence[int],
        prefill_context: Sequence[int],
    ) -> float:
        """Seconds for one iteration.

        Args:
            num_decode: decoding sequences in the batch (one query token each).
            decode_context: their cached tokens summed (what decode attention reads).
            prefill_tokens: query tokens of each prefill chunk.
            prefill_context: tokens already cached for each chunk's sequence
                (prefix-cache hits plus earlier chunks), same order.
        """

    @abstractmethod
    def decode_times(self, num_decode: int, decode_context: np.ndarray) -> np.ndarray:
        """Seconds of decode-only iterations, vectorised over ``decode_context``."""

    def decode_iteration_times(self, num_decode: int, decode_context: np.ndarray) -> np.ndarray:
        """:meth:`iteration_time` of decode-only iterations, bit for bit, over an int64 array of
        ``decode_context`` s: how the simulator prices a decode-only stretch in one call.
        (:meth:`decode_times` groups its terms differently, so it may differ in the last bit.)"""
        return np.array([self.iteration_time(num_decode, c, (), ()) for c in decode_context.tolist()])

    def decode_step_time(self, num_decode: int) -> Callable[[int], float]:
        """:meth:`iteration_time` of a decode-only iteration of ``num_decode`` sequences, as a function
        of their cached tokens, bit for bit: how the simulator prices a short decode stretch one
        iteration at a time, with whatever does not change along it computed once."""
        return lambda decode_context: self.iteration_time(num_decode, decode_context, (), ())

    def chunk_iteration_times(
        self, num_decode: int, decode_context: int, tokens: int, computed: int, count: int
    ) -> list[float]:
        """:meth:`iteration_time` of ``count`` iterations of ``num_decode`` decodes plus one chunk of
        ``tokens``, bit for bit: the ``i``-th with ``decode_context + i * num_decode`` cached decode
        tokens and ``computed + i * tokens`` cached chunk tokens (a chunk stretch's iterations, which
        the simulator prices in one call)."""
        return [
            self.iteration_time(
                num_decode, decode_context + i * num_decode, (tokens,), (computed + i * tokens,)
            )
            for i in range(count)
        ]

    def prefill_time_alone(self, prompt_tokens: int) -> float:
        """Seconds to prefill one prompt in a single iteration on an idle engine."""
        return self.iteration_time(0, 0, (prompt_tokens,), (0,))


Steps = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class CostParams:
    """Coefficients of the shared functional form; every time is in seconds.

    ``lin_*`` and ``attn_*`` and ``allreduce_*`` are per layer; the rest per iteration.
    ``lin_steps`` holds ``(tokens, seconds)`` pairs, thresholds strictly increasing: the
    layer takes ``seconds`` longer once it has more than ``tokens`` tokens.
    """

    num_layers: int
    lin_fixed_s: float
    lin_mem_s: float
    lin_s_per_token: float
    lin_knee_tokens: float
    attn_prefill_s_per_pair: float
    attn_prefill_fixed_s: float
    attn_decode_s_per_token: float
    attn_decode_fixed_s: float
    allreduce_count: int
    allreduce_fixed_s: float
    allreduce_s_per_token: float
    iter_fixed_s: float
    head_fixed_s: float
    head_s_per_seq: float
    lin_elementwise_s_per_token: float = 0.0
    lin_steps: Steps = ()
    iter_s_per_token: float = 0.0
    allreduce_s_per_token_above: float = 0.0
    allreduce_knee_tokens: int = 0
    cpu_fixed_s: float = 0.0
    cpu_prefill_s: float = 0.0
    cpu_s_per_seq: float = 0.0
    cpu_s_per_token: float = 0.0
    iter_s_per_seq: float = 0.0
    lin_large_s_per_token: float = 0.0
    lin_large_knee_tokens: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "lin_steps":
                check_non_negative(
                    f"cost parameter {f.name!r}", getattr(self, f.name), integer=f.type == "int"
                )
        if self.num_layers < 1:
            raise ValueError(f"cost parameter 'num_layers' must be >= 1, got {self.num_layers}")
        steps = tuple(tuple(step) for step in self.lin_steps)
        for i, step in enumerate(steps):
            if len(step) != 2:
                raise ValueError(
                    f"cost parameter 'lin_steps'[{i}] must be a (tokens, seconds) pair, got {step!r}"
                )
            check_non_negative(f"cost parameter 'lin_steps[{i}] tokens'", step[0], integer=True)
            check_non_negative(f"cost parameter 'lin_steps[{i}] seconds'", step[1])
        thresholds = [t for t, _ in steps]
        if any(b <= a for a, b in zip(thresholds, thresholds[1:], strict=False)):
            raise ValueError(
                f"cost parameter 'lin_steps' thresholds must increase strictly, got {thresholds}"
            )
        object.__setattr__(self, "lin_steps", steps)

    @classmethod
    def from_mapping(cls, data: Any, source: str) -> CostParams:
        """Build from a YAML mapping, naming ``source`` and the field on any bad value.

        Stricter than :func:`envs.serving.specs.from_mapping`: no type coercion (a quoted
        number is an error), and ``lin_steps`` is a list of ``[tokens, seconds]`` pairs.
        """
        if not isinstance(data, dict):
            raise ValueError(f"{source}: 'params' must be a mapping, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{source}: unknown cost parameter(s) {unknown}; valid: {sorted(fields)}")
        missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{source}: missing cost parameter(s) {missing}")
        steps = data.get("lin_steps", ())
        if not isinstance(steps, list | tuple):
            raise ValueError(
                f"{source}: cost parameter 'lin_steps' must be a list of [tokens, seconds] pairs"
            )
        try:
            return cls(**{**data, "lin_steps": tuple(tuple(s) if isinstance(s, list) else s for s in steps)})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from exc


ENGINE_FIELDS = (
    "iter_fixed_s",
    "iter_s_per_token",
    "iter_s_per_seq",
    "cpu_fixed_s",
    "cpu_prefill_s",
    "cpu_s_per_seq",
    "cpu_s_per_token",
)
""":class:`CostParams`' engine terms: zero in a device-only cost file, set by :func:`with_engine_overhead`."""
OPTIONAL_FIELDS = ("lin_large_s_per_token", "lin_large_knee_tokens")
""":class:`CostParams`' fields a coefficient file holds only when set (non-zero): files fitted without them stay as
they were."""


def with_engine_overhead(
    device: CostParams, terms: OverheadTerms, model: ModelSpec, hardware: HardwareSpec, tp: int
) -> CostParams:
    """``device`` (a device-only cost file's terms) with one GPU's engine terms of a profile added.

    Host launches scale with the layer count; the per-token device work with hidden x layers
    over this GPU's bandwidth; an engine with its own attention kernels replaces the file's.
    """
    layers = model.num_layers
    out = dataclasses.replace(
        device,
        cpu_fixed_s=terms.host_fixed_s + terms.host_s_per_layer * layers,
        cpu_prefill_s=terms.host_prefill_s_per_layer * layers,
        cpu_s_per_seq=terms.host_s_per_seq,
        cpu_s_per_token=terms.host_s_per_token,
        iter_fixed_s=terms.device_fixed_s,
        iter_s_per_seq=terms.device_s_per_seq,
        iter_s_per_token=per_token_seconds(terms, model, hardware),
    )
    if not terms.has_attention:
        return out
    assert terms.attention_prefill_factor is not None and terms.attention_decode_factor is not None
    assert terms.attention_prefill_chunk_s is not None and terms.attention_decode_seq_s is not None
    return dataclasses.replace(
        out,
        attn_prefill_s_per_pair=terms.attention_prefill_factor * prefill_pair_seconds(model, hardware, tp),
        attn_prefill_fixed_s=terms.attention_prefill_chunk_s,
        attn_decode_s_per_token=terms.attention_decode_factor * decode_token_seconds(model, hardware, tp),
        attn_decode_fixed_s=terms.attention_decode_seq_s,
    )


class RooflineCostModel(CostModel):
    """Evaluates the shared form for one (hardware, model, tp) from :class:`CostParams`.

    Plain Python floats throughout: the simulator calls :meth:`iteration_time` about
    100k times per run, so no numpy on scalars.  :attr:`~CostModel.monotone`: every coefficient
    is nonnegative (:class:`CostParams` checks it), so every term grows with the batch.
    """

    monotone = True

    def __init__(self, params: CostParams, description: str = "", serial_host: bool = False) -> None:
        self.params = params
        self.description = description
        self.serial_host = serial_host
        """Host and device time add up (``cpu + gpu``) instead of overlapping (``max``)."""
        p = params
        self._layers = p.num_layers
        self._gpu_const = p.iter_fixed_s + p.head_fixed_s
        self._per_seq = p.head_s_per_seq + p.iter_s_per_seq
        self._tok = p.iter_s_per_token
        self._ar_above = p.allreduce_count * p.allreduce_s_per_token_above
        self._ar_knee = p.allreduce_knee_tokens
        self._lin_fixed = p.lin_fixed_s + p.lin_mem_s + p.allreduce_count * p.allreduce_fixed_s
        self._lin_tok = p.lin_elementwise_s_per_token + p.allreduce_count * p.allreduce_s_per_token
        self._slope = p.lin_s_per_token
        self._knee_lin = p.lin_knee_tokens
        self._large_slope = p.lin_large_s_per_token
        self._large_knee = p.lin_large_knee_tokens
        self._step_at = [t for t, _ in p.lin_steps]
        self._step_sum = [0.0]
        for _, height in p.lin_steps:
            self._step_sum.append(self._step_sum[-1] + height)
        self._pair = p.attn_prefill_s_per_pair
        self._chunk = p.attn_prefill_fixed_s
        self._dec_seq = p.attn_decode_fixed_s
        self._dec_tok = p.attn_decode_s_per_token
        self._cpu = p.cpu_fixed_s
        self._cpu_prefill = p.cpu_prefill_s
        self._cpu_seq = p.cpu_s_per_seq
        self._cpu_tok = p.cpu_s_per_token
        self._linear_memo: dict[int, float] = {}  # linear_time by batch size: a few hundred sizes recur

    def __reduce__(self) -> tuple[type[RooflineCostModel], tuple[CostParams, str, bool]]:
        # Pickled (to a pool worker) as its constructor's arguments: CPython 3.11 reads the
        # attributes of an object restored through its ``__dict__`` (pickle's default) more slowly
        # than a constructed one's, and ``iteration_time`` reads a dozen per call.
        return type(self), (self.params, self.description, self.serial_host)

    def linear_time(self, num_tokens: int) -> float:
        """One layer's non-attention ops plus its all-reduces, for ``num_tokens`` tokens."""
        if num_tokens <= 0:
            return 0.0
        t = self._lin_fixed + self._lin_tok * num_tokens
        if num_tokens > self._knee_lin:
            t += self._slope * (num_tokens - self._knee_lin)
        if num_tokens > self._ar_knee:
            t += self._ar_above * (num_tokens - self._ar_knee)
        if self._large_slope and num_tokens > self._large_knee:
            t += self._large_slope * (num_tokens - self._large_knee)
        if self._step_at:
            t += self._step_sum[bisect.bisect_left(self._step_at, num_tokens)]
        return t

    def _engine_time(self, tokens: int, seqs: int) -> float:
        return self._gpu_const + self._per_seq * seqs + self._tok * tokens

    def iteration_time(
        self,
        num_decode: int,
        decode_context: int,
        prefill_tokens: Sequence[int],
        prefill_context: Sequence[int],
    ) -> float:
        tokens = num_decode
        attn = 0.0
        if num_decode:
            attn = self._dec_seq * num_decode + self._dec_tok * decode_context
        chunks = len(prefill_tokens)
        if chunks:
            pair, chunk = self._pair, self._chunk
            if chunks == 1:  # the common shape, without the zip: the same operations
                (q,), (c,) = prefill_tokens, prefill_context
                tokens += q
                attn += chunk + pair * q * (c + 0.5 * (q + 1))
            else:
                for q, c in zip(prefill_tokens, prefill_context, strict=True):
                    tokens += q
                    attn += chunk + pair * q * (c + 0.5 * (q + 1))
        if tokens <= 0:
            return 0.0
        seqs = num_decode + chunks
        linear = self._linear_memo.get(tokens)
        if linear is None:
            linear = self._linear_memo[tokens] = self.linear_time(tokens)
        gpu = self._engine_time(tokens, seqs) + self._layers * (linear + attn)
        cpu = (
            self._cpu + self._cpu_seq * seqs + self._cpu_tok * tokens + (self._cpu_prefill if chunks else 0.0)
        )
        if self.serial_host:
            return gpu + cpu
        return gpu if gpu > cpu else cpu

    def chunk_iteration_times(
        self, num_decode: int, decode_context: int, tokens: int, computed: int, count: int
    ) -> list[float]:
        # iteration_time's one-chunk path, operation for operation, with the terms that do not change
        # along the stretch (everything but the two contexts) computed once.
        if tokens <= 0:
            return super().chunk_iteration_times(num_decode, decode_context, tokens, computed, count)
        total, seqs, layers = num_decode + tokens, num_decode + 1, self._layers
        base, linear = self._engine_time(total, seqs), self.linear_time(total)
        cpu = self._cpu + self._cpu_seq * seqs + self._cpu_tok * total + self._cpu_prefill
        pair, chunk, half = self._pair * tokens, self._chunk, 0.5 * (tokens + 1)
        dec_fixed, dec_tok, serial = self._dec_seq * num_decode, self._dec_tok, self.serial_host
        times = []
        for i in range(count):
            attn = chunk + pair * (computed + i * tokens + half)
            if num_decode:
                attn = dec_fixed + dec_tok * (decode_context + i * num_decode) + attn
            gpu = base + layers * (linear + attn)
            times.append(gpu + cpu if serial else gpu if gpu > cpu else cpu)
        return times

    def decode_step_time(self, num_decode: int) -> Callable[[int], float]:
        # iteration_time's decode-only path, operation for operation, with every term but the
        # context's computed once.
        if num_decode <= 0:
            return lambda decode_context: 0.0
        seq_term, dec_tok, layers, serial = (
            self._dec_seq * num_decode,
            self._dec_tok,
            self._layers,
            self.serial_host,
        )
        base = self._engine_time(num_decode, num_decode)
        linear = self._linear_memo.get(num_decode)
        if linear is None:
            linear = self._linear_memo[num_decode] = self.linear_time(num_decode)
        cpu = self._cpu + self._cpu_seq * num_decode + self._cpu_tok * num_decode + 0.0

        def step_time(decode_context: int) -> float:
            gpu = base + layers * (linear + (seq_term + dec_tok * decode_context))
            if serial:
                return gpu + cpu
            return gpu if gpu > cpu else cpu

        return step_time

    def decode_iteration_times(self, num_decode: int, decode_context: np.ndarray) -> np.ndarray:
        # iteration_time's decode-only path, operation for operation: numpy's float64 ops round
        # exactly as Python's, so every element equals the scalar call's result.
        # In place, each term added the other way round (IEEE addition and multiplication commute).
        if num_decode <= 0:
            return np.zeros(len(decode_context))
        gpu = decode_context * self._dec_tok  # float64, as Python's int * float
        gpu += self._dec_seq * num_decode  # attention
        gpu += self.linear_time(num_decode)
        gpu *= self._layers
        gpu += self._engine_time(num_decode, num_decode)
        cpu = self._cpu + self._cpu_seq * num_decode + self._cpu_tok * num_decode + 0.0
        if self.serial_host:
            gpu += cpu
            return gpu
        return np.maximum(gpu, cpu, out=gpu)  # no NaN: the larger, as ``gpu if gpu > cpu else cpu``

    def decode_times(self, num_decode: int, decode_context: np.ndarray) -> np.ndarray:
        context = np.asarray(decode_context, dtype=np.float64)
        if num_decode <= 0:
            return np.zeros_like(context)
        base = self._engine_time(num_decode, num_decode)
        base += self._layers * (self.linear_time(num_decode) + self._dec_seq * num_decode)
        gpu = base + (self._layers * self._dec_tok) * context
        cpu = self._cpu + (self._cpu_seq + self._cpu_tok) * num_decode
        return gpu + cpu if self.serial_host else np.maximum(gpu, cpu)


def roofline_params(
    model: ModelSpec,
    hardware: HardwareSpec,
    tp: int = 1,
    compute_efficiency: float = 0.6,
    bandwidth_efficiency: float = 0.8,
    iteration_overhead_s: float = 2e-3,
) -> CostParams:
    """Uncalibrated v0 coefficients from datasheet peaks and nominal efficiencies.

    The defaults are round numbers (60% of peak FLOP/s, 80% of peak bandwidth, 2 ms of
    scheduling and launch overhead), not fits: use a calibrated file where one exists.
    """
    flops = hardware.peak_flops * compute_efficiency
    bw = hardware.hbm_bandwidth * bandwidth_efficiency
    layer_bytes = model.layer_params * model.dtype_bytes / tp
    heads = model.num_heads / tp
    kv_layer_bytes = 2 * model.num_kv_heads * model.head_dim * model.dtype_bytes / tp
    hidden_bytes = model.hidden_size * model.dtype_bytes
    allreduce = tp > 1
    # A ring all-reduce moves 2 (tp - 1) / tp of the message over the interconnect.
    ar_bytes_per_token = 2 * (tp - 1) / tp * hidden_bytes if allreduce else 0.0
    lin_mem_s = layer_bytes / bw
    lin_s_per_token = 2 * model.layer_params / tp / flops
    return CostParams(
        num_layers=model.num_layers,
        lin_fixed_s=20e-6,
        lin_mem_s=lin_mem_s,
        lin_s_per_token=lin_s_per_token,
        lin_knee_tokens=lin_mem_s / lin_s_per_token,
        attn_prefill_s_per_pair=4 * heads * model.head_dim / flops,
        attn_prefill_fixed_s=5e-6,
        attn_decode_s_per_token=kv_layer_bytes / bw,
        attn_decode_fixed_s=1e-7,
        allreduce_count=2 if allreduce else 0,
        allreduce_fixed_s=10e-6 if allreduce else 0.0,
        allreduce_s_per_token=ar_bytes_per_token / hardware.interconnect_bandwidth,
        iter_fixed_s=iteration_overhead_s,
        head_fixed_s=model.vocab_size * model.hidden_size * model.dtype_bytes / tp / bw,
        head_s_per_seq=2 * model.vocab_size * model.hidden_size / tp / flops,
    )


# ---- coefficient files ---------------------------------------------------------------------

COST_FILE_FIELDS: dict[str, type] = {
    "hardware": str,
    "model": str,
    "tp": int,
    "derived": bool,
    "source": str,
    "params": dict,
    "fit": dict,
}
"""Top-level fields every coefficient file must have, with their YAML types."""
DEVICE_ONLY = "device_only"
"""Optional top-level field: ``true`` when the file holds device terms only (its engine terms are
zero and an engine overhead profile supplies them); absent or ``false`` for a file profiled on a
live engine, which holds its engine's terms itself."""


def cost_file_name(hardware: str, model: str, tp: int) -> str:
    return f"{hardware}__{model}__tp{tp}.yaml"


def read_cost_file(path: str | Path) -> dict[str, Any]:
    """Parse and validate a coefficient file; ``params`` becomes a :class:`CostParams`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"cost coefficient file not found: {path}")
    try:  # a received file: a regular file within the document budget, no aliases, bounded nesting
        data = load_yaml(path)
    except ReceivedFileError as exc:
        reason = exc.detail.removeprefix(f"{path}: ")
        raise ValueError(f"{path}: not a readable YAML coefficient file ({reason})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    missing = [name for name in COST_FILE_FIELDS if name not in data]
    if missing:
        raise ValueError(f"{path}: missing field(s) {missing}")
    for name, kind in COST_FILE_FIELDS.items():
        value = data[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{path}: field {name!r} must be {kind.__name__}, got {value!r}")
    device_only = data.get(DEVICE_ONLY, False)
    if not isinstance(device_only, bool):
        raise ValueError(f"{path}: field {DEVICE_ONLY!r} must be bool, got {device_only!r}")
    params = CostParams.from_mapping(data["params"], source=f"{path}: params")
    engine = [name for name in ENGINE_FIELDS if getattr(params, name) != 0]
    if device_only and engine:
        raise ValueError(
            f"{path}: a {DEVICE_ONLY} file must leave the engine terms to a profile, but sets {engine}"
        )
    return {**data, DEVICE_ONLY: device_only, "params": params}


def load_cost_model(
    model: ModelSpec,
    hardware: HardwareSpec,
    tp: int = 1,
    kind: str = "calibrated",
    path: str | Path | None = None,
    engine_overhead: str | EngineOverhead = DEFAULT_ENGINE_OVERHEAD,
) -> CostModel:
    """The cost model for ``model`` on ``tp`` x ``hardware``.

    ``kind="calibrated"`` loads ``conf/cost/<hardware>__<model>__tp<tp>.yaml``;
    ``kind="roofline"`` returns the uncalibrated v0; ``path`` loads any coefficient file
    (e.g. an engine profiled on ``cpu``) and overrides ``kind``.  The file's hardware,
    model, tp and layer count must match the arguments.  A device-only file gets the engine
    terms of the profile ``engine_overhead`` (a name in ``conf/engine_overhead``); a file
    profiled on a live engine already holds its own, and the profile is not applied.
    """
    if path is None:
        if kind == "roofline":
            return RooflineCostModel(roofline_params(model, hardware, tp), f"roofline v0 {hardware.name}")
        if kind != "calibrated":
            raise ValueError(f"unknown cost model kind {kind!r}; valid: 'calibrated', 'roofline'")
        path = COST_DIR / cost_file_name(hardware.name, model.name, tp)
        if not path.is_file():
            available = sorted(p.name for p in COST_DIR.glob("*.yaml"))
            raise FileNotFoundError(
                f"no calibrated cost model for {model.name} on {tp} x {hardware.name}: {path} is absent; "
                f"available in {COST_DIR}: {', '.join(available) or 'none'}"
            )
    profile = (
        engine_overhead
        if isinstance(engine_overhead, EngineOverhead)
        else load_engine_overhead(engine_overhead)
    )
    data = read_cost_file(path)
    expected = {"hardware": hardware.name, "model": model.name, "tp": tp}
    for name, value in expected.items():
        if data[name] != value:
            raise ValueError(f"{path}: field {name!r} is {data[name]!r}, but {value!r} was asked for")
    params: CostParams = data["params"]
    if params.num_layers != model.num_layers:
        raise ValueError(
            f"{path}: params.num_layers is {params.num_layers}, but {model.name} has {model.num_layers} layers"
        )
    origin = "derived" if data["derived"] else "calibrated"
    description = f"{origin} {hardware.name} {model.name} tp{tp}: {data['source']}"
    if not data[DEVICE_ONLY]:
        return RooflineCostModel(params, description)
    terms = profile.terms(hardware.name)
    return RooflineCostModel(
        with_engine_overhead(params, terms, model, hardware, tp),
        f"{description}; engine overhead {profile.name} (combine {profile.combine}): {profile.source}",
        serial_host=profile.serial,
    )
