"""How much of the TTFT tail gap to Vidur does the admission rule explain?

    python bench/admission_ablation.py [load=2.0] [budget=512] [cost_models=[roofline,calibrated]] [num_blocks=0]

Vidur's configuration (Llama-2-7B on one H100, TP1, batch cap 256, 7,609 KV blocks of 16
tokens; :func:`sim_speed.vidur_setup`) serves all of the Azure conv trace at ``load`` x its
recorded rate with Sarathi at ``budget``, once per admission rule: ``skip`` (a waiting
prompt that does not fit in KV is passed over, later ones of the 64-prompt lookahead start)
and ``stop`` (it ends admission for the iteration, as vLLM V1 and Sarathi-Serve, and Vidur's
Sarathi scheduler, do).  At 2x, Vidur reports a TTFT P90 of 7.2 s; the share of the gap
between ``skip``'s P90 and Vidur's that ``stop`` closes is what the rule explains:
``(P90_stop - P90_skip) / (7.2 s - P90_skip)``.  ``num_blocks`` shrinks the KV cache, to see how
the tail depends on capacity rather than on the rule.  The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from sim_speed import native_trace, vidur_setup

import chunkgym
from baselines import Sarathi
from chunkgym.cli import hydra_cli
from chunkgym.config import AT_LEAST_ONE, POSITIVE, Rule
from envs.serving.metrics import pct
from envs.serving.scheduling import Admission
from envs.serving.setup import ServingSetup
from envs.serving.workloads.trace import Trace

VIDUR_TTFT_P90_S = 7.2  # Vidur itself, Sarathi-512, the same trace at 2x (docs/baselines.md)
PERCENTILES = (50, 90, 99)
NON_NEGATIVE_INT = Rule(lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0: from memory)")
COST_MODELS = Rule(
    lambda v: len(v) > 0 and all(c in ("calibrated", "roofline") or Path(c).is_file() for c in v),
    "a non-empty list of calibrated, roofline or cost files",
)


@dataclass
class Options:
    """``python bench/admission_ablation.py KEY=VALUE ...``."""

    load: float = 2.0  # x the trace's recorded arrival rate (Vidur's 7.2 s P90 is at 2x)
    budget: int = 512  # Sarathi's token budget per iteration
    cost_models: list[str] = field(default_factory=lambda: ["roofline", "calibrated"])
    num_blocks: int = 0  # KV blocks of 16 tokens; 0 = from memory (7,609, as Vidur)


def ttft_stats(setup: ServingSetup, trace: Trace, budget: int, admission: Admission) -> dict[str, float]:
    """TTFT percentiles (s), preemptions and iterations of Sarathi at ``budget`` with ``admission``."""
    start = time.perf_counter()
    result = setup.simulator(trace).run(Sarathi(budget, admission=admission.value))
    out = result.outcomes
    ttft = out.ttft[out.finished]
    stats = {f"ttft_p{q}_s": pct(ttft, q) for q in PERCENTILES}
    stats |= {k: result.metrics[k] for k in ("finished", "preemptions", "iterations")}
    print(
        f"{setup.cost_model_kind:10s} {admission.value:4s}: TTFT P50/P90/P99 "
        + " / ".join(f"{stats[f'ttft_p{q}_s']:8.3f}" for q in PERCENTILES)
        + f" s; {stats['finished']:.0f} finished, {stats['preemptions']:.0f} preemptions, "
        f"{stats['iterations']:.0f} iterations ({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    return stats


def gap_explained(skip_p90: float, stop_p90: float, vidur_p90: float = VIDUR_TTFT_P90_S) -> float | None:
    """The share of the P90 gap from ``skip`` up to Vidur that ``stop`` closes (1: all of it);
    None when ``skip`` is not below Vidur (no such gap: the cost model alone overshoots)."""
    return (stop_p90 - skip_p90) / (vidur_p90 - skip_p90) if skip_p90 < vidur_p90 else None


RULES = {"load": POSITIVE, "budget": AT_LEAST_ONE, "cost_models": COST_MODELS, "num_blocks": NON_NEGATIVE_INT}


@hydra_cli(Options, "admission_ablation", RULES)
def main(args: Options) -> None:
    chunkgym.require_own_packages()
    print(
        f"Sarathi-{args.budget}, Azure conv at {args.load}x; Vidur's TTFT P90 {VIDUR_TTFT_P90_S} s",
        file=sys.stderr,
    )
    trace = native_trace(args.load)
    setups = {name: vidur_setup(name) for name in args.cost_models}
    if args.num_blocks:
        setups = {
            k: replace(s, config=replace(s.config, num_blocks=args.num_blocks)) for k, s in setups.items()
        }
    runs: dict[str, dict[str, dict[str, float]]] = {}
    explained: dict[str, float | None] = {}
    for cost_model, setup in setups.items():
        runs[cost_model] = {a.value: ttft_stats(setup, trace, args.budget, a) for a in Admission}
        skip, stop = (runs[cost_model][a.value]["ttft_p90_s"] for a in (Admission.SKIP, Admission.STOP))
        explained[cost_model] = gap_explained(skip, stop)
        share = explained[cost_model]
        print(
            f"{cost_model:10s}: stop closes {share:+.1%} of the TTFT P90 gap to Vidur"
            if share is not None
            else f"{cost_model:10s}: skip's TTFT P90 is already above Vidur's: no gap for the rule to explain"
        )
    print(
        json.dumps(
            {
                "load": args.load,
                "budget": args.budget,
                "num_blocks": args.num_blocks,
                "vidur_ttft_p90_s": VIDUR_TTFT_P90_S,
                "runs": runs,
                "p90_gap_explained": explained,
            }
        )
    )


if __name__ == "__main__":
    main()
