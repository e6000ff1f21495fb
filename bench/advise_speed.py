"""Time ``python advise.py`` on the full one-hour Azure conv trace, the fast search against the reference.

    python bench/advise_speed.py [SLO overrides...]

Runs the advisor twice as an operator would, each a fresh process: once as shipped and once with
``fast=false`` (every probe served to the end, the core's shortcuts off, one candidate after
another), on Llama-3-8B on one A100 with vLLM's defaults as the current settings and the SLO
``slo.ttft_ms_p99=3000 slo.itl_ms_p99=200`` unless overrides are given. The last stdout line is
one JSON object: ``advise_wall_s`` and ``reference_wall_s`` (each run's wall time, start-up
included), ``speedup``, ``candidates`` (how many were searched), ``identical`` (the same
recommendation and every capacity, bracket and request rate bit-identical), and the load average
before and after. Target: ``advise_wall_s`` <= 120 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SLO = ("slo.ttft_ms_p99=3000", "slo.itl_ms_p99=200")


def run(out: Path, extra: list[str]) -> tuple[float, dict]:
    """One ``advise.py`` run into ``out``: its wall time and advice.json."""
    cmd = [sys.executable, str(ROOT / "advise.py"), "engine=vllm", "workload=azure_conv", *extra]
    cmd += [f"output_dir={out}", "progress=false"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    return wall, json.loads((out / "advice.json").read_text())


def same(a: dict, b: dict) -> bool:
    """Bit-identical advice: the recommendation and every candidate's capacity."""
    keys = ("name", "capacity_scale", "capacity_rps", "bracket")
    return a["recommended"] == b["recommended"] and [{k: c[k] for k in keys} for c in a["candidates"]] == [
        {k: c[k] for k in keys} for c in b["candidates"]
    ]


def main() -> None:
    slo = sys.argv[1:] or list(DEFAULT_SLO)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        fast_s, fast = run(Path(tmp) / "fast", slo)
        print(f"advise.py: {fast_s:.1f} s, {len(fast['candidates'])} candidates", flush=True)
        ref_s, ref = run(Path(tmp) / "reference", [*slo, "fast=false", "plots=false"])
        print(f"advise.py fast=false: {ref_s:.1f} s", flush=True)
    for c in sorted(fast["candidates"], key=lambda c: -c["capacity_rps"]):
        print(f"{c['name']:40s} {c['capacity_rps']:8.4f} req/s  scale {c['capacity_scale']:.6f}")
    print(
        json.dumps(
            {
                "advise_wall_s": round(fast_s, 2),
                "reference_wall_s": round(ref_s, 2),
                "speedup": round(ref_s / fast_s, 3),
                "candidates": len(fast["candidates"]),
                "identical": same(fast, ref),
                "recommended": fast["recommended_name"],
                "slo": slo,
                "load_avg_before": [round(x, 2) for x in load_before],
                "load_avg": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
