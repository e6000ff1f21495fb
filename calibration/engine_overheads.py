"""The engine overhead profiles ``python -m calibration`` writes to ``conf/engine_overhead/``.

* ``splitwise_2023_eager``: the engine terms and attention factors fitted on Splitwise's
  Llama-2-70B runs (TP 2/4/8, A100 and H100; :mod:`calibration.whole_request`), i.e. the eager
  vLLM of 2023 at TP >= 2.  A40 takes A100's fit and H200 H100's (their source GPUs, as in
  :mod:`calibration.from_published`).
* ``vllm_v1``: vLLM V1 with CUDA graphs and async scheduling (``combine: max``: the scheduler
  plans step N+1 while step N runs on the device).  Host terms are fitted to the step parts
  measured on the CPU wheel (:mod:`calibration.sources.vllm_host`, ``calibration/data``);
  the device-side terms come from published figures, below.  Kernel launches need no term of
  their own: the per-op tables time each op with its launch, and CUDA graphs only shorten that.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from calibration import whole_request
from calibration.fit import mape
from envs.serving.engine_overhead import DEFAULT_HARDWARE_KEY, EngineOverhead, OverheadTerms
from envs.serving.specs import load_hardware, load_model

VLLM_HOST_CSV = Path(__file__).parent / "data" / "vllm_v1_host.csv"
SAMPLING_URL = "https://github.com/pegainfer-project/pegainfer/issues/483"
SAMPLING_FIXED_S = 31e-6
"""Greedy sampling's step tail on an H100 at batch 1 (argmax, D2H readback and sync included): 31 us."""
SAMPLING_S_PER_SEQ = (104e-6 - 31e-6) / 255
"""... and at batch 256, 104 us: the slope per sequence between the two."""
SAMPLING_SOURCE = (
    f"sampling {SAMPLING_URL} (H100 80GB, argmax step tail incl. readback: 31 us at batch 1, 104 us at 256; "
    "FlashInfer top-k/top-p sampling costs more there: 205-1105 us)"
)
FALLBACK_HARDWARE = {"a40": "a100_80gb", "h200": "h100_80gb"}
"""GPUs without Splitwise runs borrow the fit of this one (the same mapping as the cost files)."""


@dataclass(frozen=True)
class HostFit:
    """The vLLM host terms and how well they fit the measured steps."""

    terms: OverheadTerms
    mape: float
    rows: int
    header: str


def read_host_csv(path: Path) -> tuple[str, list[dict[str, str]]]:
    """The CSV's first (comment) line and its rows."""
    lines = path.read_text().splitlines()
    if not lines or not lines[0].startswith("#"):
        raise ValueError(f"{path}: expected a '# ...' provenance line first")
    return lines[0].lstrip("# ").strip(), list(csv.DictReader(lines[1:]))


def fit_vllm_host(path: Path = VLLM_HOST_CSV) -> HostFit:
    """NNLS on relative error: host = fixed + per_seq * S + per_token * T, counted as the cost model
    counts them (a decode step of ``S`` requests: ``S`` sequences and ``S`` tokens; a prefill step
    of ``Q`` tokens: one sequence and ``Q`` tokens)."""
    header, rows = read_host_csv(path)
    try:
        decodes = np.array([int(r["decode_seqs"]) for r in rows], dtype=np.float64)
        prefill = np.array([int(r["prefill_tokens"]) for r in rows], dtype=np.float64)
        host = np.array([float(r["host_s"]) for r in rows], dtype=np.float64)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: bad row ({exc})") from None
    seqs = decodes + (prefill > 0)
    tokens = decodes + prefill
    if len(rows) < 3:
        raise ValueError(f"{path}: need at least 3 measured shapes, got {len(rows)}")
    a = np.stack([np.ones_like(seqs), seqs, tokens], axis=1) / host[:, None]
    coef, _ = nnls(a, np.ones(len(rows)))
    predicted = coef[0] + coef[1] * seqs + coef[2] * tokens
    terms = OverheadTerms(
        host_fixed_s=float(coef[0]),
        host_s_per_seq=float(coef[1]),
        host_s_per_token=float(coef[2]),
        device_fixed_s=SAMPLING_FIXED_S,
        device_s_per_seq=SAMPLING_S_PER_SEQ,
    )
    return HostFit(terms, mape(predicted, host), len(rows), header)


def vllm_v1(path: Path = VLLM_HOST_CSV) -> EngineOverhead:
    fit = fit_vllm_host(path)
    source = (
        f"host: {path.name} ({fit.header}; {fit.rows} step shapes, fit MAPE {fit.mape:.1%}); "
        f"device: {SAMPLING_SOURCE}"
    )
    notes = [
        "combine max: vLLM 0.32 turns async scheduling on by default (config/vllm.py), so the host plans step "
        "N+1 while the device runs step N; the slower of the two sets the pace.",
        "host: Scheduler.schedule + update_from_output, and the model runner's _update_states, _prepare_inputs, "
        "_build_attention_metadata and _bookkeeping_sync, timed per step on the CPU wheel (the CPU attention "
        "backend's metadata builder stands in for FlashAttention's).",
        "no launch term: the per-op device tables time each op with its launch; CUDA graphs only remove gaps.",
        "the same terms serve every GPU ('default'); the sampling figure is measured on an H100.",
    ]
    return EngineOverhead("vllm_v1", source, "max", {DEFAULT_HARDWARE_KEY: fit.terms}, tuple(notes))


def splitwise_2023_eager(
    engines: dict[str, whole_request.EngineFit], sources: dict[str, str]
) -> EngineOverhead:
    """The Splitwise fits per GPU (``engines``: hardware name -> fit), with GPUs that borrow one."""
    fitted_model = load_model("llama2_70b")
    hardware = {
        name: whole_request.engine_terms(fit, fitted_model, load_hardware(name))
        for name, fit in engines.items()
    }
    for name, donor in FALLBACK_HARDWARE.items():
        if donor in hardware:
            hardware[name] = hardware[donor]
    source = "; ".join(f"{name}: {src}" for name, src in sources.items())
    notes = [
        "a 2023 eager engine at TP >= 2 (the vLLM of Splitwise's runs): fitted jointly with its attention kernels, "
        "which were slower than today's; apply it to other models and TP degrees with care.",
        "combine max: an eager engine queues kernels asynchronously; its host sets the pace only when launching "
        "takes longer than the kernels run.",
        "host terms are per layer (launches scale with layer count); per-token device work is bytes per token, "
        "hidden unit and layer, at the GPU's bandwidth.",
        f"{', '.join(f'{k} uses {v}' for k, v in FALLBACK_HARDWARE.items())}'s fit (no Splitwise runs of its own).",
    ]
    return EngineOverhead("splitwise_2023_eager", source, "max", hardware, tuple(notes))
