"""Calibration of chunkgym's iteration cost model: measured times in, ``conf/cost/*.yaml`` out.

Every coefficient file holds :class:`envs.serving.cost_model.CostParams` for one hardware x model x
tensor-parallel degree, fitted by the one routine :func:`calibration.fit.fit_knee_grid`:

* ``python -m calibration``: published profiles (:mod:`calibration.sources.vidur` per-op tables,
  :mod:`calibration.sources.splitwise` whole-request runs) -> every GPU file, derived where no table
  exists (:mod:`calibration.from_published`; per-layer fits :mod:`~calibration.table_fits`, kernel
  terms :mod:`~calibration.kernels`, attention and engine terms :mod:`~calibration.whole_request`,
  roofline scaling :mod:`~calibration.derive`, the fidelity report :mod:`~calibration.report`);
* live engines profile themselves over :mod:`calibration.iterations`'s batch compositions and fit
  its whole-iteration form -> ``<hardware>__<model>__tp1.yaml``: ours with ``python -m engine.calibrate``
  (:mod:`engine.profile` times it), vLLM with ``python -m engine.vllm_backend.profile``; calibration
  itself imports no engine;
* ``python -m calibration.sources.torch_ops``: one layer's ops timed in plain PyTorch on this
  device, written as a Vidur-format table the published-profile fit reads.

Files are written by :mod:`calibration.cost_files`.
"""

__chunkgym__ = True
