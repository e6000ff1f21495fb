"""engine/runner.py: chunking, batching, prefix caching and preemption do not change what the model computes.

Every check compares the paged runner against ``LlamaModel.reference_logits``, a plain
causal forward of the whole sequence with no cache.

Tolerances, relative to the largest logit.  float64: 1e-10 (observed ~2e-15: only the
summation order of GEMMs and attention tiles differs).  float32: ``F32_TOL`` = 1e-5.
float32 rounds at u = 6e-8; a logit ends ~2 * num_layers + 1 chained reductions over
hidden, ffn and context lengths, blocked differently in a batched chunk than in the
reference, and the worst case observed for the tiny and small presets over chunk sizes
1/7/64 and prompts up to 300 tokens is 5e-7 (~8u).  1e-5 leaves a 20x margin and is
still far below what a masking or position error does (it moves logits by O(0.1)).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from engine.kv_cache import KVCache, PagedKVPool
from engine.model import LlamaModel, build_model
from engine.runner import BatchItem, ModelRunner

F64_TOL = 1e-10
F32_TOL = 1e-5
TOL = {torch.float64: F64_TOL, torch.float32: F32_TOL}
BS = 8


class Driver:
    """A minimal scheduler for tests: it owns the block manager and feeds the runner."""

    def __init__(self, model: LlamaModel, num_blocks: int = 256, prefix_caching: bool = True) -> None:
        dtype = model.embed.weight.dtype
        self.bm = PagedKVPool(num_blocks, BS, prefix_caching)
        self.runner = ModelRunner(model, KVCache(model.config, num_blocks, BS, dtype))
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def admit(self, sid: str, tokens: list[int]) -> int:
        self.tokens[sid] = list(tokens)
        self.done[sid] = self.bm.add(sid, tokens)
        return self.done[sid]

    def preempt(self, sid: str) -> list[int]:
        self.bm.free(sid)
        del self.done[sid]
        return self.tokens.pop(sid)

    def pending(self, sid: str) -> int:
        return len(self.tokens[sid]) - self.done[sid]

    def _items(self, plan: dict[str, int]) -> list[BatchItem]:
        items = []
        for sid, n in plan.items():
            start = self.done[sid]
            end = min(start + n, len(self.tokens[sid]))
            assert self.bm.reserve(sid, end), "test cache too small"
            items.append(
                BatchItem(
                    sid,
                    self.tokens[sid][start:end],
                    start,
                    self.bm.block_table(sid),
                    end == len(self.tokens[sid]),
                )
            )
        return items

    def _computed(self, items: list[BatchItem]) -> None:
        for item in items:
            self.done[item.seq_id] = item.start + len(item.token_ids)
            self.bm.mark_computed(item.seq_id, self.done[item.seq_id])

    def forward(self, plan: dict[str, int]) -> dict[str, Tensor]:
        """Teacher-forced: compute up to ``plan[sid]`` known tokens of each sequence; their logits."""
        items = self._items(plan)
        logits = self.runner.logits(items)
        self._computed(items)
        return {item.seq_id: out for item, out in zip(items, logits, strict=True)}

    def step(self, plan: dict[str, int]) -> dict[str, int | None]:
        """Generate: compute the planned tokens; sequences that reach their end get a greedy token."""
        items = self._items(plan)
        tokens = self.runner.execute(items)
        self._computed(items)
        for item, token in zip(items, tokens, strict=True):
            assert (token is None) == (not item.sample)
            if token is not None:
                self.tokens[item.seq_id].append(token)
                self.bm.append_token(item.seq_id, token)
        return {item.seq_id: t for item, t in zip(items, tokens, strict=True)}


def _assert_logits_close(got: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(got, ref, rtol=0, atol=TOL[dtype] * scale)


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.slow
def test_chunked_prefill_matches_full_forward_float64(seed):
    model = build_model("tiny", seed=seed, dtype=torch.float64)
    rng = random.Random(seed)
    for length in (1, 9, 40, 130):
        tokens = _prompt(rng, length, model.config.vocab_size)
        ref = model.reference_logits(torch.tensor(tokens))
        for chunk in (1, 7, 64, length):
            driver = Driver(model)
            driver.admit("s", tokens)
            parts = []
            while driver.pending("s"):
                parts.append(driver.forward({"s": chunk})["s"])
            _assert_logits_close(torch.cat(parts), ref, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.slow
def test_mixed_batches_match_full_forward(dtype):
    """Random iterations mixing several sequences' chunks with other sequences' single tokens."""
    for seed in (0, 1):
        model = build_model("tiny", seed=seed, dtype=dtype)
        rng = random.Random(100 + seed)
        driver = Driver(model)
        seqs = {f"s{i}": _prompt(rng, rng.randint(2, 120), model.config.vocab_size) for i in range(12)}
        # The last up-to-40 tokens of each sequence go one per iteration, like decodes.
        prompt_len = {sid: max(1, len(tokens) - rng.randint(0, 40)) for sid, tokens in seqs.items()}
        got: dict[str, list[Tensor]] = {sid: [] for sid in seqs}
        arrivals = list(seqs)
        mixed = multi = 0
        while arrivals or any(driver.pending(sid) for sid in driver.tokens):
            if arrivals and rng.random() < 0.3:  # staggered arrivals overlap prefills with decodes
                sid = arrivals.pop()
                driver.admit(sid, seqs[sid])
            live = [sid for sid in driver.tokens if driver.pending(sid)]
            if not live:
                continue
            plan = {}
            for sid in rng.sample(live, rng.randint(1, len(live))):
                left = prompt_len[sid] - driver.done[sid]
                plan[sid] = rng.choice([1, 7, 7, 16, 64, left]) if left > 0 else 1
            sizes = [min(n, driver.pending(sid)) for sid, n in plan.items()]
            chunks = sum(n > 1 for n in sizes)
            mixed += 0 < chunks < len(sizes)
            multi += 1 < chunks < len(sizes)
            for sid, out in driver.forward(plan).items():
                got[sid].append(out)
        assert mixed >= 8 and multi >= 2, f"too few mixed iterations: {mixed}, {multi} with several chunks"
        for sid, tokens in seqs.items():
            _assert_logits_close(torch.cat(got[sid]), model.reference_logits(torch.tensor(tokens)), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_tokens_match_reference_where_margin_exceeds_tolerance(dtype):
    model = build_model("tiny", seed=5, dtype=dtype)
    rng = random.Random(7)
    driver = Driver(model)
    prompts = {f"s{i}": _prompt(rng, rng.randint(1, 60), model.config.vocab_size) for i in range(5)}
    for sid, tokens in prompts.items():
        driver.admit(sid, tokens)
    for _ in range(60):
        # Prefills advance by random chunks; decoding sequences (pending == 1) by one token.
        driver.step({sid: rng.choice([1, 7, 64]) for sid in prompts if len(driver.tokens[sid]) < 100})
    checked = 0
    for sid, prompt in prompts.items():
        seq = driver.tokens[sid]
        assert len(seq) > len(prompt)
        ref = model.reference_logits(torch.tensor(seq[:-1]))
        top2 = ref.topk(2, dim=-1).values
        scale = max(1.0, ref.abs().max().item())
        for p in range(len(prompt) - 1, len(seq) - 1):
            if top2[p, 0] - top2[p, 1] > 2 * TOL[dtype] * scale:
                assert seq[p + 1] == int(ref[p].argmax()), (sid, p)
                checked += 1
    assert checked > 100


def test_prefix_cache_hits_give_the_logits_of_recomputation():
    model = build_model("tiny", seed=3, dtype=torch.float64)
    rng = random.Random(3)
    shared = _prompt(rng, 5 * BS + 3, model.config.vocab_size)
    other = shared[: 5 * BS] + _prompt(rng, 11, model.config.vocab_size)
    driver = Driver(model)
    driver.admit("a", shared)
    while driver.pending("a"):
        driver.forward({"a": 16})
    assert driver.admit("b", other) == 5 * BS
    assert driver.bm.block_table("b")[:5] == driver.bm.block_table("a")[:5]
    out = torch.cat([driver.forward({"b": 4})["b"] for _ in range(3)])
    _assert_logits_close(out, model.reference_logits(torch.tensor(other))[5 * BS :], torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_preempt_and_recompute_continues_with_the_same_tokens(dtype):
    model = build_model("tiny", seed=4, dtype=dtype)
    rng = random.Random(4)
    prompts = {sid: _prompt(rng, n, model.config.vocab_size) for sid, n in (("a", 37), ("b", 20))}

    def run(preempt: bool) -> tuple[list[int], int]:
        driver = Driver(model, num_blocks=11)
        for sid, tokens in prompts.items():
            driver.admit(sid, tokens)
        for _ in range(12):
            driver.step({"a": 16, "b": 16})
        cached = -1
        if preempt:
            saved = driver.preempt("a")
            for _ in range(25):  # b grows into a's freed blocks, evicting the tail of its prefix
                driver.step({"b": 1})
            driver.preempt("b")
            cached = driver.admit("a", saved)
        else:
            driver.preempt("b")
        while len(driver.tokens["a"]) < 70:
            driver.step({"a": 7})
        return driver.tokens["a"], cached

    straight, _ = run(preempt=False)
    resumed, cached = run(preempt=True)
    assert cached == 4 * BS, "the recompute should mix prefix hits (4 blocks) and recomputation"
    assert resumed == straight


def test_only_sampling_items_get_tokens_and_ties_pick_lowest_id():
    model = build_model("tiny", seed=0, dtype=torch.float32)
    model.lm_head.weight.zero_()  # every logit ties at 0
    runner = ModelRunner(model, KVCache(model.config, 8, BS, torch.float32))
    items = [BatchItem("a", [1, 2, 3], 0, [0], sample=False), BatchItem("b", [4], 0, [1])]
    assert runner.execute(items) == [None, 0]


@pytest.mark.parametrize(
    ("items", "match"),
    [
        ([], "empty batch"),
        ([BatchItem("a", [1], 0, [0]), BatchItem("a", [2], 0, [1])], "'a' appears twice"),
        ([BatchItem("a", [1] * 9, 0, [0])], "1 blocks of 8 cannot hold positions up to 8"),
        ([BatchItem("a", [1], 0, [8])], r"ids outside \[0, 8\)"),
        ([BatchItem("a", [1], -1, [0])], "start >= 0"),
        ([BatchItem("a", [1], 5000, [0] * 700)], "exceeds max_context 4096"),
        ([BatchItem("a", [512], 0, [0])], r"'a' has a token id outside \[0, 512\)"),
    ],
)
def test_bad_batches_are_rejected_by_name(items, match):
    model = build_model("tiny", dtype=torch.float32)
    runner = ModelRunner(model, KVCache(model.config, 8, BS, torch.float32))
    with pytest.raises(ValueError, match=match):
        runner.execute(items)


def test_cache_must_match_model_dtype():
    model = build_model("tiny", dtype=torch.float32)
    with pytest.raises(ValueError, match="cache is torch.float64"):
        ModelRunner(model, KVCache(model.config, 8, BS, torch.float64))
