"""The engine: the simulator's run loop and :class:`~envs.serving.core.ServingCore` on a real clock.

:class:`Engine` is the :class:`~envs.serving.loop.Executor` of a
:class:`~envs.serving.loop.ServingLoop`, exactly as the simulator's cost-model clock is::

    core.advance_to_work(engine.wait_until)   # admit arrivals due by now (sleep when idle), preempt
    plan = policy.plan(view)                  # any Policy: baselines, learned:PATH, ...
    batch = core.begin(plan)                  # same validation and KV accounting
    engine.execute(batch, start)              # a real forward pass instead of a predicted latency
    core.end(batch, clock.now())

so every policy runs unchanged and scheduling decisions follow the simulator's rules.  The core
counts KV blocks; :class:`Engine` mirrors its accounting in the runner's physical
:class:`engine.kv_cache.PagedKVPool` (same block count and size): a prefill chunk reserves
its tokens' blocks, a decode its next token's block, and the core's ``on_release`` hook frees a
request's blocks when the core releases them (finish or preemption).  After every allocation the
physical blocks in use must equal the core's count, or the engine stops with an error.

Tokens: each prompt is synthetic, drawn from (seed, request id); the model decodes greedily and
every request emits exactly its trace output length (no EOS).  A preempted request is recomputed
from its prompt and the tokens it had generated, so its output does not change.  Prefix caching
is off: trace prefix hashes (Mooncake) are refused rather than ignored, since the core would
count cache hits the engine does not have.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np

from engine.kv_cache import KVCache, PagedKVPool
from engine.model import LlamaModel
from engine.runner import BatchItem, ModelRunner
from envs.serving.core import Batch, ServingCore
from envs.serving.loop import IterationLog, ServingLoop, SimResult
from envs.serving.request import Request
from envs.serving.scheduling import Policy
from envs.serving.setup import ServingSetup
from envs.serving.workloads.trace import Trace

EXTRA_COLUMNS = {
    "predicted": np.float64,  # the cost model's latency for the same batch (s)
    "execute": np.float64,  # of the iteration's latency, the forward pass alone (s)
    "decode_context": np.int64,  # KV tokens the decodes attend to, summed
}
"""Per-iteration records the engine keeps beside the simulator's ``ITERATION_COLUMNS``."""


class Clock(Protocol):
    """Seconds since the replay started; the engine never reads time any other way."""

    def start(self) -> None: ...

    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...


IDLE_MODES = ("sleep", "spin")


class WallClock:
    """``time.perf_counter`` from :meth:`start`; an idle engine sleeps or spins until its next arrival.

    ``idle="spin"`` busy-waits, holding the core.  On a shared machine a process that sleeps loses its
    core to others, and its next iteration (always a prefill) then runs slower than back to back
    (conf/replay/cpu_replay.yaml); spinning keeps the conditions the profile was measured in, at
    the price of one busy core for the replay.
    """

    def __init__(self, idle: str = "sleep") -> None:
        if idle not in IDLE_MODES:
            raise ValueError(f"idle must be one of {', '.join(IDLE_MODES)}, got {idle!r}")
        self.spin = idle == "spin"
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def sleep_until(self, t: float) -> None:
        if self.spin:
            while self.now() < t:
                pass
            return
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    """Time that moves only when a :class:`PacedRunner` or a sleep moves it (dry runs, tests)."""

    def __init__(self) -> None:
        self.t = 0.0

    def start(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)


class PacedRunner:
    """Stands in for an engine's runner: each batch takes the cost model's latency on a virtual clock.

    With ``inner`` (the engine's real runner) the model still computes every token; without, every
    sampled token is 0 and no forward pass runs (a dry run of the scheduler alone).  Decodes are
    told from one-token prefill chunks by the core's decode group, and the latency is recomputed
    from the items alone, so a paced run also checks the batches the engine builds.
    """

    def __init__(self, core: ServingCore, clock: VirtualClock, inner: ModelRunner | None = None) -> None:
        self.core, self.clock, self.inner = core, clock, inner

    def execute(self, items: Sequence[BatchItem]) -> list[int | None]:
        members = self.core.decode.members
        is_decode = [len(i.token_ids) == 1 and i.seq_id in members for i in items]
        decodes = [i for i, d in zip(items, is_decode, strict=True) if d]
        chunks = [i for i, d in zip(items, is_decode, strict=True) if not d]
        latency = self.core.cost_model.iteration_time(
            len(decodes),
            sum(i.start + 1 for i in decodes),
            [len(i.token_ids) for i in chunks],
            [i.start for i in chunks],
        )
        tokens = self.inner.execute(items) if self.inner else [0 if i.sample else None for i in items]
        self.clock.t += latency
        return tokens


def prompt_tokens(seed: int, rid: int, length: int, vocab_size: int) -> list[int]:
    """The synthetic prompt of request ``rid``: uniform token ids, the same for a (seed, rid) anywhere."""
    return np.random.default_rng([seed, rid]).integers(0, vocab_size, size=length).tolist()


@dataclass
class EngineResult:
    """A replay's results in the simulator's terms (``result.iterations`` also holds :data:`EXTRA_COLUMNS`),
    and every request's generated token ids (empty for rejected requests)."""

    result: SimResult
    outputs: list[list[int]]


class Engine:
    """Serves one trace in real time with a model runner, scheduled by the serving core.

    The loop (:attr:`loop`) is the simulator's; the engine is its executor: it turns each
    batch into runner items over physical KV blocks, runs them, and keeps the tokens.

    Args:
        trace: the requests; arrival times are seconds on ``clock``.
        setup: model spec, cost model, SLO and serving settings, as for the simulator.  The cost
            model still serves the core (TTFT bounds, slack estimates) and predicts each batch's
            latency for comparison; it never delays anything.
        model: the decoder; the engine gives it a KV cache of exactly the core's block count and
            size (``setup.config.num_blocks``: size it explicitly, the default fills device memory).
        seed: draws the synthetic prompts.
        clock: :class:`WallClock` for real replays; dry runs and tests pass a :class:`VirtualClock`
            and replace :attr:`runner` with a :class:`PacedRunner`.
    """

    chunk_clock = None  # the policy's planning is part of each iteration's wall time

    def __init__(
        self,
        trace: Trace,
        setup: ServingSetup,
        model: LlamaModel,
        seed: int = 0,
        clock: Clock | None = None,
    ) -> None:
        if trace.hash_ids is not None:
            raise ValueError(
                f"trace {trace.name!r} carries prefix hash ids; the engine serves unique synthetic "
                "prompts without prefix caching, so it cannot reproduce the core's cache hits"
            )
        self.core = core = ServingCore.for_trace(
            trace, setup.model, setup.hardware, setup.cost_model, setup.slo, setup.config, setup.tp
        )
        if core.max_model_len > model.config.max_context:
            raise ValueError(
                f"max_model_len {core.max_model_len} exceeds the model's max_context "
                f"{model.config.max_context}"
            )
        weight = model.embed.weight
        cache = KVCache(model.config, core.kv.total, core.kv.block_size, weight.dtype, weight.device)
        self.runner = ModelRunner(model, cache)
        self.blocks = PagedKVPool(cache.num_blocks, cache.block_size, enable_prefix_caching=False)
        self.clock: Clock = clock or WallClock()
        self.seed = seed
        self.vocab_size = model.config.vocab_size
        self.tokens: dict[int, list[int]] = {}  # rid -> prompt + generated token ids, once admitted
        self.extra: dict[str, list] = {name: [] for name in EXTRA_COLUMNS}
        core.on_release = self._release
        self.loop = ServingLoop(core, self, trace.span_s)

    def run(self, policy: Policy) -> EngineResult:
        """Serve the whole trace with ``policy``, asked once per iteration."""
        self.clock.start()  # trace time 0 is now
        sim = self.loop.run(policy)
        sim.iterations.update(
            {name: np.array(self.extra[name], dtype=dt) for name, dt in EXTRA_COLUMNS.items()}
        )
        outputs = [self.tokens.get(r.rid, [])[r.prompt_len :] for r in self.core.requests]
        return EngineResult(sim, outputs)

    # ---- the executor -----------------------------------------------------------------------
    def wait_until(self, t: float) -> float:
        """Sleep until trace time ``t``; the clock may overshoot it, never undershoot.

        While busy the core's clock stays at the last iteration's end, as in the simulator: an
        iteration's latency runs from there to the end of its forward pass, so it includes the
        scheduler's own work, and latencies tile the busy time with no gaps.
        """
        self.clock.sleep_until(t)
        return max(t, self.clock.now())

    def execute(self, batch: Batch, start: float) -> tuple[float, float]:
        """Run ``batch`` on the model, its physical blocks checked against the core's count."""
        core = self.core
        used = core.kv.used
        items = self._items(batch)
        if self.blocks.num_used_blocks != used:
            raise RuntimeError(
                f"physical KV blocks in use ({self.blocks.num_used_blocks}) differ from the core's "
                f"accounting ({used}) at t={start:.6f}s"
            )
        predicted = core.cost_model.iteration_time(
            batch.num_decode,
            batch.decode_context,
            [q for _, q, _ in batch.chunks],
            [c for _, _, c in batch.chunks],
        )
        t0 = self.clock.now()
        sampled = self.runner.execute(items)
        end = self.clock.now()
        for item, token in zip(items, sampled, strict=True):
            if token is not None:
                self.tokens[cast(int, item.seq_id)].append(token)  # _items names sequences by request id
                self.blocks.append_token(item.seq_id, token)
        for name, value in (("predicted", predicted), ("execute", end - t0)):
            self.extra[name].append(value)
        self.extra["decode_context"].append(batch.decode_context)
        return end, end - start

    def fast_forward(self, core: ServingCore, log: IterationLog) -> bool:
        """Never: every iteration is a real forward pass."""
        return False

    def _items(self, batch: Batch) -> list[BatchItem]:
        """The runner's items for ``batch``, physical blocks reserved: chunks, then the decode group."""
        blocks, items = self.blocks, []
        for req, n, computed in batch.chunks:
            rid = req.rid
            if rid not in self.tokens:
                self.tokens[rid] = prompt_tokens(self.seed, rid, req.prompt_len, self.vocab_size)
            if computed == 0:  # first chunk since admission or preemption: register with its known tokens
                blocks.add(rid, self.tokens[rid])
            end = computed + n
            self._reserve(rid, end)
            tokens = self.tokens[rid][computed:end]
            items.append(BatchItem(rid, tokens, computed, blocks.block_table(rid), end == req.target))
        if batch.num_decode:
            dec = self.core.decode
            for req in dec.members.values():
                rid = req.rid
                position = req.decode_kv0 + dec.clock - req.decode_join
                if position != len(self.tokens[rid]) - 1:
                    raise RuntimeError(
                        f"request {rid}: the core decodes position {position}, the engine holds "
                        f"{len(self.tokens[rid])} tokens"
                    )
                self._reserve(rid, position + 1)
                items.append(BatchItem(rid, self.tokens[rid][-1:], position, blocks.block_table(rid)))
        return items

    def _reserve(self, rid: Hashable, tokens: int) -> None:
        if not self.blocks.reserve(rid, tokens):
            raise RuntimeError(
                f"request {rid}: no physical KV block left for {tokens} tokens although the core "
                f"allocated them ({self.core.kv.used} of {self.core.kv.total} in use)"
            )

    def _release(self, req: Request) -> None:
        """The core released ``req``'s KV (finished or preempted): free its physical blocks."""
        self.blocks.free(req.rid)
