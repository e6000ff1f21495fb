"""Sim-to-real on this machine's CPU: profile the engine, fit the cost model, replay one slice in both.

    python bench/sim_to_real.py                      # sarathi_512 and fcfs on conf/replay/cpu_replay.yaml
    python bench/sim_to_real.py out=DIR seed=1 "policies=[sarathi_512,learned:PATH]" repeats=5

Profiles the small engine model on the CPU (median of ``repeats`` round-robin repeats, fixed torch
threads), fits the cost model, then replays the same trace slice per policy on the engine in real
time and in the simulator with that fitted profile (``engine/sim_to_real.py`` has the method).
Takes a few minutes on two CPU cores (current figures: docs/benchmarks.md); other processes make
the timings noisy, so the JSON records the load average.  Writes the fitted profile,
results.csv/json, iterations.csv and summary.json under ``out``.  Last stdout line, one JSON
object: ``iteration_mape`` (per-iteration latency, sim vs engine, all policies' iterations),
``ttft_p50_rel_err``, ``ttft_p99_rel_err`` and ``tbt_p99_rel_err`` (|sim / engine - 1|, worst
policy), all fractions, then per-policy numbers.
"""

from engine.sim_to_real import main

if __name__ == "__main__":
    main()
