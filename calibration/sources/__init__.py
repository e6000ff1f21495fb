"""Where calibration's measurements come from, one module per source.

Published profiles, read: :mod:`~calibration.sources.vidur` (per-op and collective tables) and
:mod:`~calibration.sources.splitwise` (whole-request runs).  Profilers, run on this machine:
:mod:`~calibration.sources.torch_ops` (one layer's ops in plain PyTorch, into a Vidur-format table)
and :mod:`~calibration.sources.vllm_host` (vLLM's host time per step).  Live engines time their own
iterations (:mod:`engine.profile`, :mod:`engine.vllm_backend.profile`).
"""
