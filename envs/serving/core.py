"""The serving state machine shared by the simulator and the real engine.

Per iteration :class:`~envs.serving.loop.ServingLoop` calls::

    core.advance_to_work(wait)    # admit arrivals (idle: wait for one), keep the decodes' KV room
    plan = policy.plan(core)      # the core is the policy's read-only ServingView
    batch = core.begin(plan)      # validate the plan, allocate KV
    ...an executor runs the batch: cost model or real forward pass -> t_end...
    core.end(batch, t_end)        # progress, token emissions, finishes, SLO bookkeeping

Decoding requests form one :class:`~envs.serving.decode_group.DecodeGroup` that steps
together; the SLO verdicts are kept by a :class:`~envs.serving.slo_book.SloBook`; which fast
paths a run takes is its :attr:`ServingCore.shortcuts` (:mod:`envs.serving.shortcuts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from envs.serving.cost_model import CostModel
from envs.serving.decode_group import DecodeGroup
from envs.serving.kv_cache import BlockManager
from envs.serving.metrics import SLO
from envs.serving.request import Request, Status
from envs.serving.scheduling import Plan, Preemption, blocks_needed, may_prefill
from envs.serving.shortcuts import Shortcuts
from envs.serving.slo_book import SloBook
from envs.serving.slo_classes import ClassBounds, resolve_classes
from envs.serving.specs import HardwareSpec, ModelSpec, kv_capacity_tokens
from envs.serving.traffic import TrafficStats
from envs.serving.workloads.trace import Trace

LATENCY_EWMA_ALPHA = 0.1
TIMES_BATCH = 64  # token-time arrays built at once above which the decode ends are copied to numpy


@dataclass
class ServingConfig:
    """Engine settings that are not the model or the hardware."""

    block_size: int = 16  # tokens per KV block (vLLM's default)
    max_num_seqs: int = 256  # batch slots: requests decoding or prefilling at once
    max_model_len: int = 0  # longest prompt + output accepted; 0 = the model's max context
    activation_reserve_gib: float = 8.0  # per device, kept out of the KV cache
    lookahead: int = 64  # queued prompts the allocation rules may reorder
    num_blocks: int = 0  # KV blocks; 0 = from memory (see specs.kv_capacity_tokens)


@dataclass
class Batch:
    """What one iteration computes, as the executor needs it."""

    num_decode: int
    decode_context: int  # KV tokens the decodes attend to, summed
    chunks: list[tuple[Request, int, int]]  # (request, query tokens, tokens already in KV)
    latency: float | None = None  # the plan's price (Plan.latency): predict_latency of this batch


class ServingCore:
    """Queues, KV cache, decode group and SLO book of one serving instance: admission, preemption
    and the per-iteration protocol over them.

    It satisfies :class:`~envs.serving.scheduling.ServingView` (the properties and queries
    below the bookkeeping), so policies read it directly, typed as the read-only view.
    """

    def __init__(
        self,
        kv: BlockManager,
        cost_model: CostModel,
        slo: SLO,
        config: ServingConfig,
        max_model_len: int,
    ) -> None:
        self.requests: list[Request] = []  # every request submitted to this server, in arrival order
        self.kv = kv
        self.cost_model = cost_model
        self.slo = slo
        # The SLO classes its requests may name (resolved on its cost model); a request without one
        # is judged by ``slo``.  ``stall_floor``: the least stall bound of any of them, where the fast
        # paths stop and a decode step looks at each member's own bound.
        self.classes: dict[str, ClassBounds] = {}
        self.stall_floor = slo.stall_s
        self.config = config
        self.max_model_len = max_model_len
        self.now = 0.0
        self.queue: list[Request] = []
        self.decode = DecodeGroup(kv.block_size, slo.tpot_s)
        self.next_arrival = 0  # index into requests of the next arrival not yet admitted
        # No request is submitted with an arrival before this time that is not submitted already: a
        # fleet sets it to its next arrival, which may come here, so that nothing (an idle wait, a
        # fast-forwarded stretch) runs past it before the fleet has routed that arrival.
        self.horizon = math.inf
        self.finished: list[Request] = []
        self.rejected: list[Request] = []
        self._shortcuts = Shortcuts()
        self._token_times: dict[int, np.ndarray] = {}  # of finished[:len(it)], in finish order
        self.book = SloBook(slo, self.decode)  # the SLO verdicts known so far
        self.n_running_prefill = 0  # queued requests holding a batch slot
        # The most requests present at once (queued, decoding or landed): while it stays below
        # max_num_seqs no batch-slot check can fail and the lookahead (never below max_num_seqs for
        # vLLM's scheduler) holds the whole queue, so a larger max_num_seqs would run the same.
        self.peak_present = 0
        self.preemptions = 0
        self.preemption = Preemption.LATEST_STARTED  # the victim rule: the policy's, set by the loop
        self._preempt_seq = 0
        self._start_seq = 0
        self.last_latency = 0.0
        self._latency_ewma = 0.0
        # Latencies not in the EWMA yet (deferred_ewma): one iteration's, or a stretch's (start, ends).
        self._unfolded: list[float | tuple[float, list[float]]] = []
        self.traffic = TrafficStats()  # arrival rate, prefix hits, prompt and output lengths seen so far
        # Called after a request's KV blocks are released (finish or preemption), so an executor
        # that holds physical blocks (the real engine) frees them at the same point; None: no one.
        self.on_release: Callable[[Request], None] | None = None
        # Seconds per prefill token on an idle engine (LEAST_SLACK's estimate), from a 1k prompt.
        self.prefill_s_per_token = cost_model.prefill_time_alone(1024) / 1024
        # Roles of prefill-decode disaggregation (envs/serving/disaggregation.py); all unset: a
        # colocated server.  A prefill server gives each request it has prefilled, with tokens left
        # to emit, to ``on_handover(req, t)`` instead of decoding it, and keeps its KV blocks
        # (``held``) until :meth:`release_held`; a decode server takes requests in with
        # :meth:`accept`, each joining its decode group once its KV blocks are free, and tells
        # ``on_accept(req)`` at that moment.  ``extra_refusal``: a further reason to reject at
        # admission (the decode pool's).
        self.on_handover: Callable[[Request, float], None] | None = None
        self.held: dict[int, Request] = {}
        self.landed: list[Request] = []
        self.on_accept: Callable[[Request], None] | None = None
        self.extra_refusal: Callable[[Request], str] | None = None

    @classmethod
    def for_trace(
        cls,
        trace: Trace,
        model: ModelSpec,
        hardware: HardwareSpec,
        cost_model: CostModel,
        slo: SLO,
        config: ServingConfig,
        tp: int = 1,
        submit: bool = True,
    ) -> ServingCore:
        """A fresh core serving ``trace``, its KV cache sized from the model and the hardware
        (unless ``config.num_blocks`` is set); ``submit=False``: empty, its prefix units the trace's."""
        num_blocks = config.num_blocks or (
            kv_capacity_tokens(model, hardware, tp, config.activation_reserve_gib) // config.block_size
        )
        kv = BlockManager(num_blocks, config.block_size, trace.hash_block_tokens)
        core = cls(kv, cost_model, slo, config, config.max_model_len or model.max_context)
        if trace.slo_class is not None:
            core.set_classes(resolve_classes(trace.slo_class, cost_model))
        for req in requests_of(trace) if submit else ():
            core.submit(req)
        return core

    def set_classes(self, classes: dict[str, ClassBounds]) -> None:
        """The SLO classes requests may name, before any is submitted."""
        if self.requests:
            raise ValueError("SLO classes are set before requests are submitted")
        self.classes = classes
        self.stall_floor = min([self.slo.stall_s, *(c.slo.stall_s for c in classes.values())])

    @property
    def shortcuts(self) -> Shortcuts:
        return self._shortcuts

    @shortcuts.setter
    def shortcuts(self, value: Shortcuts) -> None:
        """Set before the run starts: the deferred bookkeeping assumes one setting per run."""
        if self.now or self.next_arrival:
            raise ValueError(f"shortcuts are set before a run starts; this one is at t={self.now:.6f}s")
        self._shortcuts = value

    @property
    def n_good(self) -> int:
        """Requests known to meet their SLO (finished within all bounds)."""
        return self.book.n_good

    @property
    def n_bad(self) -> int:
        """Requests known to miss it (as soon as it is known)."""
        return self.book.n_bad

    @property
    def n_credited(self) -> int:
        """Requests whose first token met TTFT while still in the running."""
        return self.book.n_credited

    @property
    def n_uncredited(self) -> int:
        """Of those, the ones later found to miss their SLO."""
        return self.book.n_uncredited

    @property
    def token_times(self) -> dict[int, np.ndarray]:
        """Every finished request's token times, by request id, in finish order."""
        times, finished = self._token_times, self.finished
        todo = len(finished) - len(times)
        if todo > 0:
            end: list[float] | np.ndarray = self.decode.end
            if todo > TIMES_BATCH:  # worth one array of every decode end
                end = self.decode.ends_array()
            for req in finished[len(times) :]:
                times[req.rid] = req.token_times(end)
        return times

    # ---- the read-only view (ServingView) ------------------------------------------------
    @property
    def lookahead(self) -> Sequence[Request]:
        queue, n = self.queue, self.config.lookahead
        return queue if len(queue) <= n else queue[:n]  # read-only: no copy needed

    @property
    def latency_ewma(self) -> float:
        if self._unfolded:
            self._fold_latencies()
        return self._latency_ewma

    @property
    def num_decode(self) -> int:
        return self.decode.n

    @property
    def num_decode_doomed(self) -> int:
        return self.decode.n_doomed

    @property
    def decode_context(self) -> int:
        return self.decode.context_sum(self.decode.clock)

    @property
    def last_decode_time(self) -> float:
        return self.decode.last_time

    @property
    def num_prefilling(self) -> int:
        return self.n_running_prefill

    @property
    def free_blocks(self) -> int:
        return self.kv.free - self.decode_block_need()

    @property
    def total_blocks(self) -> int:
        return self.kv.total

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def free_slots(self) -> int:
        return self.config.max_num_seqs - self.decode.n - self.n_running_prefill

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    def tokens_generated(self, req: Request) -> int:
        """Output tokens ``req`` has emitted so far: a decoding member's run with the decode clock."""
        if req.status is Status.DECODING:
            return req.generated + self.decode.clock - req.decode_join
        return req.generated

    def min_tpot_slack(self) -> float:
        return self.decode.min_tpot_slack()

    def predict_latency(
        self, num_decode: int, decode_context: int, query_lens: Sequence[int], computed_lens: Sequence[int]
    ) -> float:
        return self.cost_model.iteration_time(num_decode, decode_context, query_lens, computed_lens)

    @property
    def latency_monotone(self) -> bool:
        return self.cost_model.monotone

    # ---- arrivals ------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        """Hand this server a request: the only way one enters.  It is admitted at the first
        iteration start at or after its arrival (at once if that has passed: a fleet routes an
        arrival while a server is mid-iteration).  Submissions come in arrival order."""
        reqs = self.requests
        if reqs and req.arrival < reqs[-1].arrival:
            raise ValueError(
                f"request {req.rid} arrives at {req.arrival:.6f}s, before request {reqs[-1].rid} "
                f"submitted earlier ({reqs[-1].arrival:.6f}s): submit in arrival order"
            )
        reqs.append(req)

    @property
    def pending(self) -> Sequence[Request]:
        """Requests submitted but not yet admitted (their arrival is after the last iteration start)."""
        return self.requests[self.next_arrival :]

    def admit_arrivals(self) -> None:
        reqs, i, now = self.requests, self.next_arrival, self.now
        while i < len(reqs) and reqs[i].arrival <= now:
            self._admit(reqs[i])
            i += 1
        self.next_arrival = i

    def next_deadline(self) -> float:
        """The earliest TTFT deadline still watched (:meth:`SloBook.next_deadline`)."""
        return self.book.next_deadline()

    def next_arrival_time(self) -> float:
        """The next event that may bring work: the next submitted arrival, or the :attr:`horizon`."""
        i = self.next_arrival
        t = self.requests[i].arrival if i < len(self.requests) else math.inf
        return t if t < self.horizon else self.horizon

    def refusal(self, req: Request) -> str:
        """Why this server rejects ``req`` at admission ("" if it does not): a property of the request
        and the server's size alone, so a fleet may ask before routing it."""
        total = req.prompt_len + req.output_len
        if total > self.max_model_len:
            return f"prompt+output {total} tokens exceeds max_model_len {self.max_model_len}"
        blocks = self.kv.blocks_for(total - 1)
        if blocks > self.kv.total:
            return f"needs {blocks} KV blocks at full length, the cache holds {self.kv.total}"
        return "" if self.extra_refusal is None else self.extra_refusal(req)

    def _admit(self, req: Request) -> None:
        self.traffic.arrive(req.arrival, req.prompt_len)
        reason = self.refusal(req)
        if reason:
            return self._reject(req, reason)
        slo = self.slo
        if req.slo_class:
            cls = self.classes[req.slo_class]
            slo, req.weight, req.priority = cls.slo, cls.weight, cls.priority
        req.ttft_bound = slo.ttft_bound(self.cost_model.prefill_time_alone(req.prompt_len))
        req.tpot_bound, req.stall_bound = slo.tpot_s, slo.stall_s
        req.deadline = req.arrival + req.ttft_bound
        self.book.watch(req)
        self._match_prefix(req)
        req.prefix_hit = req.computed
        self.traffic.prefix_hit(req.computed / req.prompt_len)
        self.queue.append(req)
        self._count_present()

    def _reject(self, req: Request, reason: str) -> None:
        req.status = Status.REJECTED
        req.reject_reason = reason
        self.rejected.append(req)
        self.book.violate(req)

    def _match_prefix(self, req: Request) -> None:
        """Reuse cached prefix units (pinned while the request waits); leave >= 1 token to compute."""
        if req.hash_ids is None or not self.kv.unit_tokens:
            return
        u = self.kv.unit_tokens
        units = self.kv.match(req.hash_ids, (req.target - 1) // u)
        self.kv.acquire(units)
        req.prefix_units = units
        req.computed = len(units) * u

    # ---- per-iteration -------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.queue) or self.decode.n > 0

    def done(self) -> bool:
        return not self.has_work() and self.next_arrival >= len(self.requests)

    def advance_to_work(self, wait_until: Callable[[float], float]) -> bool:
        """Admit arrivals; when idle, let ``wait_until(t)`` move time to the next arrival ``t`` (it
        returns the time it is then: ``t`` on a virtual clock, possibly later on a wall clock).
        False once no submitted request is left and the clock has reached the :attr:`horizon`
        (the trace is done, or the fleet has to route its next arrival first)."""
        self.prepare()
        while not self.has_work():
            t = self.next_arrival_time()
            if math.isinf(t) or t <= self.now:
                return False
            self.now = wait_until(t)
            self.prepare()
        return True

    def prepare(self) -> None:
        """Admit arrivals up to now and make room for the decodes' next step."""
        i, reqs = self.next_arrival, self.requests
        if i < len(reqs) and reqs[i].arrival <= self.now:
            self.admit_arrivals()
        if self.landed:
            self._admit_landed()
        while self.decode_block_need() > self.kv.free:
            self._preempt_one()
        if not self.decode.n and self.queue and not self._can_progress() and not self.held:
            self._free_for_progress()  # a prefill server holding handed-over KV waits for it instead

    def _can_progress(self) -> bool:
        """Whether the planner could give some queued prompt a token with the free KV blocks."""
        free, slots, bs = self.kv.free, self.free_slots, self.kv.block_size
        for r in self.lookahead:
            if may_prefill(bs, r, free, slots):
                return True
        return False

    def _free_for_progress(self) -> None:
        """With no decodes to finish and free memory, partial prefills could wait on each other forever.

        Release memory until some prompt can move: first prefix blocks pinned by idle
        queued prompts (newest first), then preempt a running prefill (latest started first)
        and look again: a preempted prompt re-pins its cached prefix when it is queued again,
        so when its KV was all cached prefix, preempting it frees nothing until that is released.
        """
        while not self._can_progress():
            if not self.release_idle_prefix():
                self._preempt_one()

    def release_idle_prefix(self) -> bool:
        """Release the cached prefix pinned by the newest queued prompt that has not started
        (it loses its prefix hit); False if no such prompt pins one.

        Waiting prompts pin their prefix hit from the moment they are queued; vLLM instead
        evicts cached blocks no running request holds when it needs room.  A server with
        nothing running that still cannot plan (a whole-prompt policy whose head prompt does
        not fit beside those pins) calls this until it can, as vLLM's eviction would let it.
        """
        idle = next((r for r in reversed(self.queue) if not r.running and r.prefix_units), None)
        if idle is None:
            return False
        self.kv.release_units(idle.prefix_units)
        idle.prefix_units = []
        idle.computed = 0
        return True

    def decode_block_need(self) -> int:
        dec = self.decode  # DecodeGroup.block_need at its clock, inlined: read several times a step
        return dec.phase[-dec.clock % dec.bs] if dec.n else 0

    def begin(self, plan: Plan) -> Batch:
        """Validate ``plan`` against the state and allocate its KV; the batch to execute."""
        dec = self.decode
        run_decode = plan.decode and dec.n > 0
        if not plan.chunks and not run_decode:
            raise ValueError(
                f"empty plan at t={self.now:.6f}s with {len(self.queue)} queued prompts and "
                f"{dec.n} decodes: a policy must schedule some work while work is pending"
            )
        kv = self.kv
        # The blocks are allocated at once after validation: evicting cached units for their sum
        # evicts the same LRU units as evicting for each part in turn.
        total = self.decode_block_need() if run_decode else 0
        free = kv.free - total
        chunks = []
        if plan.chunks:
            slots = self.free_slots
            bs = kv.block_size
            seen = set()
            for req, n in plan.chunks:
                if req.status is not Status.WAITING or req.rid in seen:
                    raise ValueError(f"plan schedules {req!r}, which is not a distinct queued prompt")
                computed = req.computed
                if not 1 <= n <= req.target - computed:
                    raise ValueError(f"plan gives {req!r} {n} tokens; it has {req.target - computed} left")
                need = blocks_needed(bs, req, n)
                if need > free:
                    raise ValueError(f"plan needs {need} KV blocks for {req!r}; {free} are free")
                if not req.running:
                    if slots <= 0:
                        raise ValueError(
                            f"plan starts {req!r} but all {self.config.max_num_seqs} slots are taken"
                        )
                    slots -= 1
                    self._start(req)
                seen.add(req.rid)
                total += need
                free -= need
                chunks.append((req, n, computed))
        kv.allocate(total)
        n_dec = dec.n if run_decode else 0
        return Batch(n_dec, dec.context_sum(dec.clock) if n_dec else 0, chunks, plan.latency)

    def run_followed(self, head: Request, tokens: int, blocks: int, t_end: float) -> None:
        """:meth:`begin` and :meth:`end` of a chunk stretch's iteration, every decode plus ``tokens``
        of ``head``, that ended at ``t_end``: the loop has checked what :meth:`begin` would
        (``head`` is the running prompt the last plan gave a chunk, ``tokens`` leaves some of it,
        the ``blocks`` it and the decodes need are free), so this allocates them and books the
        iteration as :meth:`end` would; the head goes on prefilling."""
        self.kv.allocate(blocks)
        self.observe_time(t_end)
        if self.decode.n:
            self._decode_step(t_end)
        self._prefilled(head, tokens)
        deadlines = self.book.deadlines
        if deadlines and deadlines[0][0] < t_end:
            self.book.expire(t_end)

    def run_stretch(
        self,
        ends: list[float],
        blocks: int,
        gaps: np.ndarray | None,
        head: Request | None = None,
        tokens: int = 0,
        slack: float | None = None,
    ) -> None:
        """Book iterations that ended at ``ends``, run back to back by the simulator, in one call, as
        :meth:`begin` and :meth:`end` of each would: every decode (no member joining, none finishing
        before the last, no stall), plus, with ``head``, ``tokens`` of its prefill over all of them
        (it goes on prefilling; no TTFT deadline passes).  ``blocks``: the KV blocks they allocate;
        ``gaps`` and ``slack``: see :meth:`DecodeGroup.record_stretch`.  Bit for bit the state iteration by
        iteration booking reaches: the blocks are allocated first and the prefix units published last,
        as neither eviction nor a finish changes which units a publish finds cached."""
        self.kv.allocate(blocks)
        self.observe_stretch(ends)
        dec = self.decode
        if dec.n:
            dec.record_stretch(ends, gaps if self._shortcuts.stretches else None, slack)
            for req in dec.pop_finished():
                self.finish(req, dec.leave(req))
        if head is not None:
            self._prefilled(head, tokens)

    def _start(self, req: Request) -> None:
        req.running = True
        self.n_running_prefill += 1
        req.start_order = self._start_seq
        self._start_seq += 1
        if req.first_scheduled < 0:
            req.first_scheduled = self.now

    def end(self, batch: Batch, t_end: float) -> None:
        """Apply the executed batch at time ``t_end``: tokens, finishes, SLO bookkeeping."""
        self.observe_time(t_end)
        if batch.num_decode:
            self._decode_step(t_end)
        for req, n, _ in batch.chunks:
            self._prefilled(req, n)
            if req.computed == req.target:
                self._prefill_done(req, t_end)
        deadlines = self.book.deadlines
        if deadlines and deadlines[0][0] < t_end:
            self.book.expire(t_end)

    def _prefilled(self, req: Request, tokens: int) -> None:
        """``req`` computed ``tokens`` more prompt tokens: publish the prefix units it completed."""
        req.computed = computed = req.computed + tokens
        u = self.kv.unit_tokens
        if u and req.hash_ids is not None and min(computed, req.prompt_len) // u > len(req.prefix_units):
            self._publish_units(req)

    def observe_time(self, t_end: float) -> None:
        """Advance the clock to the end of an iteration, tracking recent latencies."""
        self.last_latency = latency = t_end - self.now
        if self._shortcuts.deferred_ewma:
            self._unfolded.append(latency)
        else:
            self._latency_ewma += LATENCY_EWMA_ALPHA * (latency - self._latency_ewma)
        self.now = t_end

    def observe_stretch(self, ends: list[float]) -> None:
        """:meth:`observe_time` for back-to-back iterations ending at ``ends``, in one call."""
        now = self.now
        self.last_latency = ends[-1] - (ends[-2] if len(ends) > 1 else now)
        self.now = ends[-1]
        self._unfolded.append((now, ends))
        if not self._shortcuts.deferred_ewma:
            self._fold_latencies()

    def _fold_latencies(self) -> None:
        """Apply the waiting latencies to the EWMA, in order, as :meth:`observe_time` would have."""
        ewma = self._latency_ewma
        for item in self._unfolded:
            if isinstance(item, float):
                ewma += LATENCY_EWMA_ALPHA * (item - ewma)
                continue
            now, ends = item
            for t_end in ends:
                ewma += LATENCY_EWMA_ALPHA * ((t_end - now) - ewma)
                now = t_end
        self._latency_ewma = ewma
        self._unfolded = []

    def _decode_step(self, t_end: float) -> None:
        """One decode iteration ended at ``t_end``: stall checks, clock, finishes."""
        dec = self.decode
        joiners = dec.joiners
        gap = t_end - dec.last_time
        if gap > self.stall_floor:  # every member but the joiners last emitted at last_time
            for req in dec.members.values():
                if not req.violated and gap > req.stall_bound and req not in joiners:
                    self.book.violate(req)
        for req in joiners:  # a joiner last emitted when its prefill finished
            if not req.violated and t_end - cast(float, req.emissions[-1]) > req.stall_bound:
                self.book.violate(req)
        dec.record(t_end)
        for req in dec.pop_finished():
            self.finish(req, dec.leave(req))

    def _publish_units(self, req: Request) -> None:
        """Cache every full prompt unit this request has now computed."""
        kv = self.kv
        units = req.prefix_units
        hash_ids = req.hash_ids
        assert hash_ids is not None, "called only for requests with hash ids"
        limit = min(min(req.computed, req.prompt_len) // kv.unit_tokens, len(hash_ids))
        new = hash_ids[len(units) : limit]
        published = kv.publish(new)
        units.extend(new if published == len(new) else new[:published])

    def _prefill_done(self, req: Request, t: float) -> None:
        self.queue.remove(req)
        self.n_running_prefill -= 1
        req.running = False
        if req.generated:  # resumed after a preemption: the one gap no decode step checks
            gap = t - req.last_token_time(self.decode.end)
            if gap > req.resume_gap:
                req.resume_gap = gap
        req.emissions.append(t)
        req.generated += 1
        if req.generated == 1:
            self.book.first_token(req, t)
        if req.generated >= req.output_len:
            self.finish(req, req.computed)
        elif self.on_handover is not None:  # a prefill server: the KV stays here until taken
            self.held[req.rid] = req
            self.on_handover(req, t)
        else:
            self.decode.join(req)

    def finish(self, req: Request, kv_tokens: int) -> None:
        req.status = Status.FINISHED
        self.traffic.finish(req.generated)
        self._release(req, kv_tokens)
        self.finished.append(req)
        if self._shortcuts.verdicts:
            self.book.judge_so_far(req)
            return
        times = req.token_times(self.decode.end)
        self._token_times[req.rid] = times
        self.book.judge(req, times)

    # ---- prefill-decode hand-over (envs/serving/disaggregation.py) ---------------------------
    def release_held(self, req: Request) -> None:
        """A prefill server: the decode server has taken ``req``'s KV; free its blocks here."""
        del self.held[req.rid]
        self._release(req, req.computed)

    def accept(self, req: Request) -> None:
        """A decode server: ``req``'s KV (``req.computed`` tokens: the prompt, or prompt and
        generated tokens after a preemption, the first output token's KV not yet written) has
        landed; it joins the decode group at the first iteration start where its blocks, the
        decodes' next blocks and a batch slot are free, in landing order."""
        self.landed.append(req)
        self._count_present()

    def _count_present(self) -> None:
        """A request arrived or landed (the only ways the requests present grow): update the peak."""
        present = len(self.queue) + self.decode.n + len(self.landed)
        if present > self.peak_present:
            self.peak_present = present

    def _admit_landed(self) -> None:
        """Move the landed requests that fit, first come first served, into the decode group."""
        kv, dec, taken = self.kv, self.decode, 0
        for req in self.landed:
            blocks = kv.blocks_for(req.computed)
            # After joining, the decodes' next step needs one more block if its KV fills its blocks.
            if self.free_slots <= 0 or (
                blocks + self.decode_block_need() + (req.computed % kv.block_size == 0) > kv.free
            ):
                break
            kv.allocate(blocks)
            if self.on_accept is not None:
                self.on_accept(req)
            req.start_order = self._start_seq
            self._start_seq += 1
            dec.join(req)
            taken += 1
        if taken:
            del self.landed[:taken]

    def _release(self, req: Request, kv_tokens: int) -> None:
        kv = self.kv
        kv.release(kv.blocks_for(kv_tokens) - len(req.prefix_units) * kv.unit_blocks)
        kv.release_units(req.prefix_units)
        req.prefix_units = []
        if self.on_release is not None:
            self.on_release(req)

    # ---- preemption ----------------------------------------------------------------------
    def _preempt_one(self) -> None:
        """Preempt, for recompute, the running request :attr:`preemption` names: by default the one
        that started last (vLLM's choice), under the priority policy the lowest priority, latest
        arrival (vLLM's ``max(running, key=(priority, arrival_time))``)."""
        running = [*self.decode.members.values(), *(r for r in self.queue if r.running)]
        if not running:
            raise RuntimeError("the decodes need KV blocks but no running request is left to preempt")
        if self.preemption is Preemption.LOWEST_PRIORITY:
            victim = max(running, key=_priority_order)
        else:
            victim = max(running, key=_start_order)
        if victim.status is Status.DECODING:
            kv_tokens = self.decode.leave(victim)
        else:
            kv_tokens = victim.computed
            self.queue.remove(victim)
            self.n_running_prefill -= 1
        self._release(victim, kv_tokens)
        victim.status = Status.WAITING
        victim.running = False
        victim.target = victim.prompt_len + victim.generated
        victim.computed = 0
        victim.preemptions += 1
        self.preemptions += 1
        self._preempt_seq += 1
        victim.seq = -self._preempt_seq
        self._match_prefix(victim)
        self.queue.insert(0, victim)


def requests_of(trace: Trace) -> list[Request]:
    """The trace's requests, ids in arrival order, as the core reads them: Python numbers (a third of
    the time of numpy's), hash ids as lists, read one by one as prompts are matched and published."""
    hashes = None if trace.hash_ids is None else [ids.tolist() for ids in trace.hash_ids]
    columns = (np.asarray(c).tolist() for c in (trace.arrival_s, trace.prompt_len, trace.output_len))
    reqs = [
        Request(i, float(a), int(p), int(o), None if hashes is None else hashes[i])
        for i, (a, p, o) in enumerate(zip(*columns, strict=True))
    ]
    for labels, slot in ((trace.tenant, "tenant"), (trace.slo_class, "slo_class")):
        if labels is not None:
            for req, label in zip(reqs, labels, strict=True):
                setattr(req, slot, label)
    return reqs


def _start_order(req: Request) -> int:
    return req.start_order


def _priority_order(req: Request) -> tuple[int, float, int]:
    return (req.priority, req.arrival, req.rid)
