"""A measured device-only cost file for this GPU from plain PyTorch: per-op layer times and attention.

    python -m calibration.from_torch hardware=h200 model=llama3_8b out=DIR
    python -m calibration.from_torch smoke=true hardware=cpu out=DIR      # tiny shape, seconds on a CPU

Times one decoder layer's ops over Vidur's token grid (:mod:`calibration.sources.torch_ops`) and
attention's prefill and decode grids (:mod:`calibration.sources.torch_attention`) at TP 1, fits the
per-layer curve exactly as for Vidur's tables (:func:`calibration.table_fits.fit_layer`), and writes
``<hardware>__<model>__tp1.yaml`` with ``device_only: true``: the engine overhead is a profile in
``conf/engine_overhead``, as for every GPU file.  ``bench/engine_gpu.py`` runs it first.  The
timing table is written beside the file (``<stem>.mlp.csv``, Vidur's format).
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from calibration import table_fits
from calibration.cost_files import CostFile, write_cost_files
from calibration.kernels import Kernels, kernel_params, layer_weight_seconds
from calibration.sources import torch_attention, torch_ops, vidur
from chunkgym import resolve_path
from chunkgym.cli import hydra_cli
from envs.serving.cost_model import cost_file_name
from envs.serving.specs import ModelSpec, load_hardware, load_model

HEADER = (
    "# Device-only cost-model coefficients measured in plain PyTorch on the device named in `source`.\n"
    "# Written by `python -m calibration.from_torch` (or bench/engine_gpu.py); do not edit. Times in seconds.\n"
)
SMOKE_CHUNKS = (8, 16, 32, 64)
SMOKE_DECODE = ((1, 16), (4, 16), (4, 64), (8, 64))


@dataclass
class Options:
    """``python -m calibration.from_torch``'s options."""

    hardware: str = "h200"  # conf/hardware name of this device (the file's name and its datasheet)
    model: str = "llama3_8b"  # conf/model name
    out: str = "outputs/gpu_profile"  # the cost file (and its timing table) go here
    max_tokens: int = 4096  # the per-op grid's largest token count
    warmup: int = 3
    repeats: int = 10
    device: str = "cuda"
    dtype: str = "bfloat16"  # bfloat16, float16 or float32
    smoke: bool = False  # a tiny model on a few points: checks the pipeline on a CPU in seconds


def profiled_model(opts: Options) -> ModelSpec:
    """The model whose layer is timed: ``opts.model``, or the tiny smoke shape."""
    return torch_ops.SMOKE_MODEL if opts.smoke else load_model(opts.model)


def measure(opts: Options) -> tuple[CostFile, Path | None]:
    """Profile and fit; returns the cost file's content (not yet written) and the timing table written."""
    if opts.dtype not in torch_ops.DTYPES:
        raise SystemExit(f"dtype: {opts.dtype!r} is not one of {', '.join(torch_ops.DTYPES)}")
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("calibration.from_torch: no CUDA device here (device=cpu, or smoke=true, to try it)")
    dtype = getattr(torch, opts.dtype)
    hardware = load_hardware(opts.hardware)
    model = profiled_model(opts)
    tokens: Sequence[int]
    chunks: Sequence[int]
    decode: Sequence[tuple[int, int]]
    if opts.smoke:
        tokens, chunks, decode = torch_ops.SMOKE_TOKENS, SMOKE_CHUNKS, SMOKE_DECODE
        warmup, repeats = 1, 3
    else:
        tokens = torch_ops.default_tokens(opts.max_tokens)
        chunks, decode = torch_attention.PREFILL_CHUNKS, torch_attention.DECODE_GRID
        warmup, repeats = opts.warmup, opts.repeats
    # CUDA events record on the current device's stream: make the profiled one current (cuda:1, say)
    current = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with current:
        table = torch_ops.profile(model, [1], tokens, device, dtype, warmup, repeats)
        attention = torch_attention.profile(model, 1, device, dtype, chunks, decode, warmup, repeats)
    where = _device_name(device)
    layer_fit = table_fits.fit_layer(vidur.op_times(table, 1, f"torch ops on {where}"))
    layer = layer_fit.layer.split(layer_weight_seconds(model, hardware, 1))
    kernels = Kernels(layer, None, layer_fit.source, "none (tp 1)")
    params = dataclasses.replace(
        kernel_params(model, hardware, 1, kernels),
        attn_prefill_fixed_s=attention.prefill_fixed_s,
        attn_prefill_s_per_pair=attention.prefill_s_per_pair,
        attn_decode_fixed_s=attention.decode_fixed_s,
        attn_decode_s_per_token=attention.decode_s_per_token,
    )
    source = (
        f"measured in plain PyTorch {torch.__version__} on {where}, {opts.dtype}: per-layer ops at "
        f"{len(tokens)} token points (median of {repeats}), attention by scaled_dot_product_attention at "
        f"{attention.points} shapes; engine overhead: none here (device_only), see conf/engine_overhead"
    )
    fit = {
        "per_layer_heldout_mape": layer_fit.heldout_mape,
        "per_op_heldout_mape": dict(layer_fit.op_heldout_mape),
        "attention_prefill_mape": attention.prefill_mape,
        "attention_decode_mape": attention.decode_mape,
        "table_max_tokens": int(layer_fit.max_tokens),
    }
    f = CostFile(hardware.name, model.name, 1, False, source, params, fit, device_only=True)
    out = resolve_path(opts.out)
    table_path = out / f"{Path(cost_file_name(hardware.name, model.name, 1)).stem}.mlp.csv"
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(table_path, index=False)
    return f, table_path


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU"


def run(opts: Options) -> Path:
    """Measure and write the cost file; returns its path."""
    f, table = measure(opts)
    path = write_cost_files([f], resolve_path(opts.out), HEADER)[0]
    p = f.params
    print(
        f"wrote {path} (and {table}): per-layer held-out MAPE {f.fit['per_layer_heldout_mape']:.1%}; attention "
        f"{p.attn_prefill_s_per_pair:.3g} s/pair, {p.attn_decode_s_per_token:.3g} s/KV token per layer"
    )
    return path


main = hydra_cli(Options, name="calibration_from_torch")(run)

if __name__ == "__main__":
    main()
