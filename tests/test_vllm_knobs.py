"""vLLM's own scheduler under each scheduling knob schedules, step by step, the chunks that
``baselines.VllmV1`` plans with the same knobs, in the simulator and inside vLLM through the
plug-in (``pip install -e '.[dev,vllm]'``; skipped without it).

Each knob setting starts vLLM (a 2-layer Llama with seeded random weights built here, never
downloaded, in-process on the CPU backend, synchronous scheduling) with those engine arguments and
its default scheduler, serves one fixed set of prompts queued at once, and records the tokens it
scheduled per request per step.  The same prompts are served by ``VllmV1`` with the same knobs in
chunkgym's simulator, planned every iteration, and by ``VllmV1`` through the plug-in on an engine
whose own knobs are neutral; all three step sequences must be the same.  The KV cache holds every
prompt at once, so vLLM never preempts (where the two models differ, see ``VllmV1``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed: pip install -e '.[dev,vllm]', then uninstall torchvision torchaudio torchcodec",
)

from baselines import VllmV1  # noqa: E402
from envs.serving.scheduling import Plan, Policy, ServingView  # noqa: E402
from envs.serving.shortcuts import NO_SHORTCUTS  # noqa: E402
from tests.models import tiny_llama  # noqa: E402
from tests.simtools import make_sim, make_trace  # noqa: E402

SCHEDULER = "engine.vllm_backend.scheduler.ChunkgymScheduler"
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 8
NUM_BLOCKS = 64  # of 128 tokens on the CPU backend: every prompt below fits at once
PROMPTS = [1000, 90, 300, 40, 500, 20, 150, 60]
OUTPUTS = [3, 6, 2, 8, 2, 5, 3, 4]
KNOBS: list[tuple[dict[str, Any], dict[int, int]]] = [  # each setting and vLLM's first step under it
    ({"max_num_batched_tokens": 256}, {0: 256}),
    (
        {"max_num_batched_tokens": 256, "long_prefill_token_threshold": 64},
        {0: 64, 1: 64, 2: 64, 3: 40, 4: 24},
    ),
    (  # the fair share, 256 // 8, is the threshold: the floor shows as requests leave
        {
            "max_num_batched_tokens": 256,
            "long_prefill_token_threshold": 32,
            "long_prefill_token_threshold_adaptive": True,
        },
        {0: 32, 1: 32, 2: 32, 3: 32, 4: 32, 5: 20, 6: 32, 7: 32},
    ),
    # 90 does not fit the 24 tokens left: admission ends, though 20 would fit
    ({"max_num_batched_tokens": 1024, "enable_chunked_prefill": False}, {0: 1000}),
    (  # capped first, then checked against the tokens left
        {
            "max_num_batched_tokens": 1024,
            "enable_chunked_prefill": False,
            "long_prefill_token_threshold": 200,
        },
        {0: 200, 1: 90, 2: 200, 3: 40, 4: 200, 5: 20, 6: 150, 7: 60},
    ),
    ({"max_num_batched_tokens": 256, "max_num_active_seqs": 2}, {0: 256}),  # the cap shows later
]
Steps = list[dict[int, int]]  # per step: request index -> tokens scheduled


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny_llama"), MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def engine_env():
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENGINE_ENV.items():
            mp.setenv(key, value)
        yield


def _llm(model_dir, **engine_args):
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        num_gpu_blocks_override=NUM_BLOCKS,
        enable_prefix_caching=False,
        **engine_args,
    )


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _serve(llm) -> Steps:
    """Serve :data:`PROMPTS` (fresh random tokens, all queued before the first step) for
    :data:`OUTPUTS` tokens each; the tokens scheduled per request index, step by step."""
    from vllm import SamplingParams, TokensPrompt

    sched = _scheduler(llm)
    inner = sched.schedule
    steps: Steps = []
    index: dict[str, int] = {}

    def schedule(*args: Any, **kwargs: Any) -> Any:
        if not index:  # the first step: every request waits, in the order it was added
            index.update((r.request_id, i) for i, r in enumerate([*sched.running, *sched.waiting]))
        out = inner(*args, **kwargs)
        steps.append({index[r]: n for r, n in out.num_scheduled_tokens.items()})
        return out

    tokens = random.Random(0)
    sched.schedule = schedule
    try:
        llm.generate(
            [TokensPrompt(prompt_token_ids=[tokens.randrange(1, 500) for _ in range(p)]) for p in PROMPTS],
            [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False) for n in OUTPUTS],
            use_tqdm=False,
        )
    finally:
        sched.schedule = inner
    assert len(index) == len(PROMPTS)
    return steps


class Recorded(Policy):
    """A policy that records each plan as tokens per request id (the simulator's rids are indices)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.steps: Steps = []

    def reset(self, view: ServingView) -> None:
        self.inner.reset(view)

    def plan(self, view: ServingView) -> Plan:
        plan = self.inner.plan(view)
        step = dict.fromkeys(view.decode.members, 1) if plan.decode else {}  # type: ignore[attr-defined]
        step.update((r.rid, n) for r, n in plan.chunks)
        self.steps.append(step)
        return plan


def _simulated(knobs: dict[str, Any], block_size: int, num_blocks: int) -> Steps:
    trace = make_trace([0.0] * len(PROMPTS), PROMPTS, OUTPUTS)
    sim = make_sim(
        trace,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
    )
    sim.core.shortcuts = NO_SHORTCUTS  # every iteration planned, decode-only ones too
    recorded = Recorded(VllmV1(**knobs))
    result = sim.run(recorded)
    assert result.metrics["finished"] == len(PROMPTS)
    return recorded.steps


@pytest.fixture(scope="module")
def vllm_runs(model_dir, engine_env) -> dict[str, tuple[Steps, int, int]]:
    """Per knob setting (by policy name): vLLM's own steps, its block size and usable blocks.  One
    engine at a time: engines in one process share vLLM's parallel state, which a shutdown ends."""
    runs = {}
    for knobs, _ in KNOBS:
        llm = _llm(model_dir, **knobs)
        try:
            sched = _scheduler(llm)
            config = sched.scheduler_config
            assert config.long_prefill_token_threshold == knobs.get("long_prefill_token_threshold", 0)
            assert config.long_prefill_token_threshold_adaptive == knobs.get(
                "long_prefill_token_threshold_adaptive", False
            )
            assert config.enable_chunked_prefill == knobs.get("enable_chunked_prefill", True)
            assert sched.max_num_active_reqs == knobs.get("max_num_active_seqs", MAX_NUM_SEQS)
            assert sched.max_num_scheduled_tokens == knobs["max_num_batched_tokens"]
            pool = sched.kv_cache_manager.block_pool
            assert pool.num_gpu_blocks == NUM_BLOCKS
            runs[VllmV1(**knobs).name] = (
                _serve(llm),
                sched.block_size,
                pool.num_gpu_blocks - 1,
            )  # less the null block
        finally:
            llm.llm_engine.engine_core.shutdown()
    return runs


@pytest.fixture(scope="module")
def plugin(model_dir, engine_env, vllm_runs):
    """vLLM with the plug-in and neutral knobs of its own: the policy's plans are all that shape a
    step.  Started after ``vllm_runs``'s engines have stopped."""
    llm = _llm(
        model_dir,
        max_num_batched_tokens=max(k["max_num_batched_tokens"] for k, _ in KNOBS),
        scheduler_cls=SCHEDULER,
        additional_config={"chunkgym": {"policy": "sarathi_256"}},
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _through_plugin(llm, knobs: dict[str, Any]) -> Steps:
    sched = _scheduler(llm)
    policy = VllmV1(**knobs)
    policy.reset(sched.view)
    sched.chunkgym_policy, sched.steps = policy, []
    try:
        steps = _serve(llm)
        assert all(s.agrees for s in sched.steps), "vLLM cut a plan of the policy"
    finally:
        sched.steps = None
    return steps


@pytest.mark.parametrize(("knobs", "first"), KNOBS, ids=[VllmV1(**k).name for k, _ in KNOBS])
def test_vllm_schedules_the_chunks_the_simulator_plans(vllm_runs, plugin, knobs, first):
    own, block_size, num_blocks = vllm_runs[VllmV1(**knobs).name]
    assert own[0] == first
    assert own == _simulated(knobs, block_size, num_blocks)
    assert _through_plugin(plugin, knobs) == own
    served = [sum(s.get(i, 0) for s in own) for i in range(len(PROMPTS))]
    assert served == [p + o - 1 for p, o in zip(PROMPTS, OUTPUTS, strict=True)]  # every token, once
