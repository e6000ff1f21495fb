"""Calibration of chunkgym's iteration cost model against real GPU timings.

Fits the coefficients of :class:`envs.serving.cost_model.CostParams` from Vidur-format
per-op tables (``vidur/profiling``) and whole-request runs (``splitwise/perf_model.csv``),
derives the configurations no table covers, and writes one coefficient file per
hardware x model x tensor-parallel degree into ``conf/cost/``.  Run ``python -m calibration``.
"""

__chunkgym__ = True
