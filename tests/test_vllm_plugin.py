"""The scheduler plugin inside the pinned vLLM (``pip install -e '.[dev,vllm]'``; skipped without it).

One engine serves the module (start-up takes seconds): a 2-layer Llama with seeded random
weights built here, never downloaded, run in-process on the CPU backend.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed: pip install -e '.[dev,vllm]', then uninstall torchvision torchaudio torchcodec",
)

from baselines import Sarathi, Vtc  # noqa: E402
from envs.serving.scheduling import Policy  # noqa: E402
from tests.models import tiny_llama  # noqa: E402

SCHEDULER = "engine.vllm_backend.scheduler.ChunkgymScheduler"
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
MAX_BATCHED = 2048  # vLLM's step limit; every plan below is smaller, so the plan sets the budget


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny_llama"), 4096)


def _llm(model_dir, policy: str, **settings):
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_BATCHED,
        scheduler_cls=SCHEDULER,
        additional_config={"chunkgym": {"policy": policy, **settings}},
    )


@pytest.fixture(scope="module")
def llm(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENGINE_ENV.items():
            mp.setenv(key, value)
        llm = _llm(model_dir, "sarathi_256")
        yield llm
        llm.llm_engine.engine_core.shutdown()


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


_TOKENS = random.Random(0)


def _fresh(n: int) -> list[int]:
    """A new random prompt of ``n`` tokens: no prefix-cache hit on earlier prompts."""
    return [_TOKENS.randrange(1, 500) for _ in range(n)]


def _serve(llm, policy: Policy, prompts: list[int] | list[list[int]], max_tokens: int = 3):
    """Serve the prompts (token lists, or lengths of fresh ones), all queued at once, under ``policy``;
    the step records."""
    from vllm import SamplingParams, TokensPrompt

    sched = _scheduler(llm)
    policy.reset(sched.view)
    sched.chunkgym_policy, sched.steps = policy, []
    token_lists = [_fresh(p) if isinstance(p, int) else p for p in prompts]
    llm.generate(
        [TokensPrompt(prompt_token_ids=t) for t in token_lists],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )
    steps, sched.steps = sched.steps, None
    return steps


def test_the_plugin_loads_by_name_with_the_named_policy(llm):
    from engine.vllm_backend.scheduler import ChunkgymScheduler

    sched = _scheduler(llm)
    assert isinstance(sched, ChunkgymScheduler)
    assert isinstance(sched.chunkgym_policy, Sarathi) and sched.chunkgym_policy.name == "sarathi_256"
    assert sched.budget_limit == MAX_BATCHED and sched.view.block_size == sched.block_size


def test_async_scheduling_builds_the_scheduler_over_async_scheduler():
    """vLLM's default on GPUs (the CPU platform turns async scheduling off, so it is built, not run, here)."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from engine.vllm_backend.scheduler import ChunkgymAsyncScheduler, ChunkgymScheduler

    def built(async_scheduling: bool) -> type:
        conf = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
        return type(ChunkgymScheduler.__new__(ChunkgymScheduler, vllm_config=conf))

    assert built(True) is ChunkgymAsyncScheduler and built(False) is ChunkgymScheduler
    assert issubclass(ChunkgymAsyncScheduler, AsyncScheduler) and issubclass(
        ChunkgymAsyncScheduler, ChunkgymScheduler
    )


def test_a_fixed_budget_is_carried_out_exactly(llm):
    steps = _serve(llm, Sarathi(256), [1000])
    assert all(s.agrees for s in steps)
    assert [c for s in steps for c in s.chunks] == [(256, 0), (256, 256), (256, 512), (232, 768)]
    assert [s.num_decode for s in steps] == [0, 0, 0, 0, 1, 1]  # then 2 decode steps of the 3 tokens
    assert [sum(s.emitted.values()) for s in steps] == [0, 0, 0, 1, 1, 1]
    assert all(s.start_s < s.end_s for s in steps)
    # two prompts and their decodes share each step's 256 tokens (decodes count against the budget)
    steps = _serve(llm, Sarathi(256), [600, 500], max_tokens=8)
    assert all(s.agrees for s in steps)
    prefill = [s for s in steps if s.chunks]
    assert [sum(s.scheduled.values()) for s in prefill[:-1]] == [256] * (len(prefill) - 1)
    assert sum(q for s in steps for q, _ in s.chunks) == 1100
    assert any(s.num_decode and s.chunks for s in steps)


def test_prefix_cache_hits_are_planned_as_vllm_finds_them(llm):
    block = _scheduler(llm).block_size  # 128 on the CPU backend
    shared = _fresh(4 * block)
    _serve(llm, Sarathi(256), [shared + _fresh(100)])
    steps = _serve(llm, Sarathi(256), [shared + _fresh(200)])  # its first 4 blocks are cached
    assert all(s.agrees for s in steps)
    assert [c for s in steps for c in s.chunks] == [(200, 4 * block)]


def _first_token_step(steps, prompt_len: int) -> int:
    """The step whose chunk completes the prompt of this length (its first token)."""
    return next(i for i, s in enumerate(steps) for q, c in s.chunks if q + c == prompt_len)


@pytest.mark.parametrize(("rule", "shorter_first"), [("fcfs", False), ("shortest_first", True)])
def test_waiting_prompts_get_prefill_in_the_policys_order(llm, rule, shorter_first):
    steps = _serve(llm, Sarathi(256, rule), [900, 200])  # the longer prompt arrives first
    assert all(s.agrees for s in steps)
    long_done, short_done = _first_token_step(steps, 900), _first_token_step(steps, 200)
    assert (short_done < long_done) is shorter_first
    first = steps[0].chunks
    assert first == ([(200, 0), (56, 0)] if shorter_first else [(256, 0)])


def test_a_bad_policy_name_fails_at_engine_start(model_dir, monkeypatch):
    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"policy='nope': unknown policy 'nope'; valid names: ") as err:
        _llm(model_dir, "nope")
    assert "\n" not in str(err.value)


def test_vtc_inside_vllm_serves_a_light_tenant_beside_a_flood(model_dir, monkeypatch):
    """With ``tenants`` on, the tenant comes from ``extra_args`` and the class from vLLM's priority:
    VTC starts the light tenant's prompt second, where FCFS order would start it last."""
    from vllm import SamplingParams, TokensPrompt

    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    llm = _llm(model_dir, "vtc", tenants=True)
    try:
        sched = _scheduler(llm)
        assert isinstance(sched.chunkgym_policy, Vtc) and sched.view.tenants
        assert sched.view.classes_by_priority[1][0] == "standard"
        sched.steps = []
        tenants = ["flood"] * 5 + ["light"]
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=_fresh(600)) for _ in tenants],
            [
                SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False, extra_args={"tenant": t})
                for t in tenants
            ],
            priority=[1] * len(tenants),
            use_tqdm=False,
        )
        steps = sched.steps
        assert all(s.agrees for s in steps)
        first: dict[str, int] = {}  # request id as the LLM returns it -> the step of its first token
        for i, step in enumerate(steps):
            for internal in step.emitted:
                first.setdefault(internal.split("-")[0], i)  # vLLM's internal ids add a suffix
        ids = [o.request_id for o in outputs]
        light, flood = first[ids[-1]], [first[i] for i in ids[:-1]]
        assert light < sorted(flood)[2]  # second or third to start, not last
    finally:
        llm.llm_engine.engine_core.shutdown()
