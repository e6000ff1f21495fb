"""Discrete-event simulation of one serving instance: the core plus a cost model and a virtual clock.

No wall clock anywhere: each iteration advances time by the cost model's latency;
an idle engine jumps to the next arrival.  Stretches of decode-only iterations (no
prompt waiting, so every policy's only valid plan is "step the decodes") are advanced
without consulting the policy, up to the next event (arrival, finish, KV-block
shortage), which is what makes an hour-long production trace take seconds.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from envs.serving.core import Batch, ServingConfig, ServingCore
from envs.serving.cost_model import CostModel
from envs.serving.kv_cache import BlockManager
from envs.serving.metrics import SLO, RequestOutcomes, request_summary
from envs.serving.request import Request
from envs.serving.scheduling import Plan, Policy
from envs.serving.specs import HardwareSpec, ModelSpec, kv_capacity_tokens
from envs.serving.workloads.trace import Trace

ITERATION_COLUMNS = {
    "start": np.float64,  # iteration start time (s)
    "latency": np.float64,  # its duration (s)
    "decode_tokens": np.int64,
    "prefill_tokens": np.int64,
    "prefill_seqs": np.int64,  # prefill chunks in the batch
    "kv_used": np.int64,  # KV blocks in use after the iteration's allocation
}
FAST_FORWARD_MAX = 4096  # decode-only iterations per fast-forward call


class IterationLog:
    """Per-iteration records, one Python list per column (cheap appends), numpy on demand."""

    def __init__(self) -> None:
        self.cols: dict[str, list] = {name: [] for name in ITERATION_COLUMNS}
        self._append = [col.append for col in self.cols.values()]

    def append(self, *row: float) -> None:
        for add, value in zip(self._append, row, strict=True):
            add(value)

    def extend(self, **columns: list) -> None:
        for name, values in columns.items():
            self.cols[name].extend(values)

    def __getitem__(self, name: str) -> list:
        return self.cols[name]

    def __len__(self) -> int:
        return len(self.cols["start"])

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: np.array(self.cols[name], dtype=dt) for name, dt in ITERATION_COLUMNS.items()}


@dataclass
class SimResult:
    """Everything a run produced: per-request outcomes, per-iteration records, system metrics."""

    outcomes: RequestOutcomes
    iterations: dict[str, np.ndarray]
    metrics: dict[str, float]
    token_times: dict[int, np.ndarray]
    stopped: bool = False  # ``run``'s ``stop`` ended it before the trace was done: the results are partial


class Simulator:
    """Replays a trace through a policy on a simulated engine."""

    def __init__(
        self,
        trace: Trace,
        model: ModelSpec,
        hardware: HardwareSpec,
        cost_model: CostModel,
        slo: SLO,
        config: ServingConfig | None = None,
        tp: int = 1,
    ) -> None:
        self.trace = trace
        self.config = config = config or ServingConfig()
        self.cost = cost_model
        self.slo = slo
        num_blocks = config.num_blocks or (
            kv_capacity_tokens(model, hardware, tp, config.activation_reserve_gib) // config.block_size
        )
        kv = BlockManager(num_blocks, config.block_size, trace.hash_block_tokens)
        hashes = trace.hash_ids
        requests = [
            Request(i, float(a), int(p), int(o), None if hashes is None else hashes[i])
            for i, (a, p, o) in enumerate(
                zip(trace.arrival_s, trace.prompt_len, trace.output_len, strict=True)
            )
        ]
        self.core = ServingCore(
            requests, kv, cost_model, slo, config, config.max_model_len or model.max_context
        )
        self.log = IterationLog()

    def fork(self, keep_log: bool = True) -> Simulator:
        """An independent copy of the current state for what-if rollouts.

        Immutable parts (trace, cost model, SLO, finished requests' token times) are
        shared; ``keep_log=False`` starts the copy with an empty iteration log.
        """
        core = self.core
        shared = [self.trace, self.cost, self.slo, self.config, core.cost_model, core.slo, core.config]
        shared += [r.hash_ids for r in core.requests if r.hash_ids is not None]
        shared += core.token_times.values()
        if not keep_log:
            shared.append(self.log)
        memo = {id(x): x for x in shared}
        twin = copy.deepcopy(self, memo)
        if not keep_log:
            twin.log = IterationLog()
        return twin

    # ---- stepping ------------------------------------------------------------------------
    def advance_to_work(self) -> bool:
        """Admit arrivals, jumping an idle clock to the next one; False once the trace is done."""
        return self.core.advance_to_work(_jump)

    def step(self, plan: Plan) -> float:
        """Run one iteration of ``plan``; returns its latency in seconds."""
        core = self.core
        start = core.now
        batch = core.begin(plan)
        used = core.kv.used
        latency = self._latency(batch)
        core.end(batch, start + latency)
        self.log.append(
            start, latency, batch.num_decode, sum(q for _, q, _ in batch.chunks), len(batch.chunks), used
        )
        return latency

    def _latency(self, batch: Batch) -> float:
        chunks = batch.chunks
        return self.cost.iteration_time(
            batch.num_decode, batch.decode_context, [q for _, q, _ in chunks], [c for _, _, c in chunks]
        )

    def fast_forward(self) -> bool:
        """Run decode-only iterations back to back while no prompt waits; False if none ran.

        Exactly what :meth:`step` would do with the only valid plan (step the decodes),
        minus the policy call and the plan validation, up to the next event: an arrival,
        a finish, a KV-block shortage (preemption) or a stall violation.
        """
        core = self.core
        dec = core.decode
        if core.queue or not dec.n or dec.joiners:
            return False
        n, bs, phase = dec.n, dec.bs, dec.phase
        t_arr = core.next_arrival_time()
        stop = min(dec.next_finish(), dec.clock + FAST_FORWARD_MAX)
        free, stall = core.kv.free, core.slo.stall_s
        used = core.kv.used
        cost = self.cost.iteration_time
        append = self.log.append
        start_clock, now, allocated = dec.clock, core.now, 0
        while dec.clock < stop and now < t_arr:  # a step starts only while no arrival is due
            need = phase[-dec.clock % bs]
            if allocated + need > free:
                break
            lat = cost(n, dec.context_sum(dec.clock), (), ())
            end = now + lat
            if end - dec.last_time > stall:
                break
            allocated += need
            append(now, lat, n, 0, 0, used + allocated)
            core.observe_time(end)
            dec.record(end)
            now = end
        if dec.clock == start_clock:
            return False
        core.kv.allocate(allocated)
        for req in dec.pop_finished():
            core.finish(req, dec.leave(req))
        return True

    def run(
        self, policy: Policy, fast_forward: bool = True, stop: Callable[[ServingCore], bool] | None = None
    ) -> SimResult:
        """Serve the whole trace with ``policy``, asked once per iteration.

        ``fast_forward=False`` steps decode-only stretches one by one too (for tests:
        the results are identical, bit for bit).  ``stop(core)``, checked between
        iterations, ends the run early once true (a capacity probe whose answer is known,
        :mod:`envs.serving.early`); the result is then partial and says so (``stopped``).
        """
        wall = time.perf_counter()
        core = self.core
        policy.reset(core)
        view = core.view
        stopped = False
        while self.advance_to_work():
            if stop is not None and stop(core):  # early stop hook: the only use of ``stop``
                stopped = True
                break
            if fast_forward and self.fast_forward():
                continue
            self.step(policy.plan(view))
        result = self.result(time.perf_counter() - wall)
        result.stopped = stopped
        return result

    # ---- results -------------------------------------------------------------------------
    def result(self, wall_s: float = math.nan) -> SimResult:
        core = self.core
        reqs = core.requests
        times = core.token_times
        outcomes = RequestOutcomes.from_token_times(
            arrival=[r.arrival for r in reqs],
            prompt_len=[r.prompt_len for r in reqs],
            output_len=[r.output_len for r in reqs],
            token_times=[times.get(r.rid) for r in reqs],
            first_scheduled=[r.first_scheduled for r in reqs],
            ttft_bound=[r.ttft_bound for r in reqs],
            slo=self.slo,
            reject_reason=[r.reject_reason for r in reqs],
            prefix_hit=[r.prefix_hit for r in reqs],
            preemptions=[r.preemptions for r in reqs],
        )
        it = self.log.arrays()
        metrics = request_summary(outcomes, self.trace.span_s)
        metrics.update(iteration_summary(it, core.kv.total, outcomes))
        metrics["sim_wall_s"] = wall_s
        return SimResult(outcomes, it, metrics, times)


def iteration_summary(it: dict[str, np.ndarray], kv_total: int, out: RequestOutcomes) -> dict[str, float]:
    """System metrics from the per-iteration records."""
    n = len(it["latency"])
    if not n:
        return {
            k: math.nan
            for k in (
                "iterations",
                "throughput_tok_s",
                "busy_fraction",
                "prefill_token_share",
                "kv_util_mean",
            )
        }
    busy = float(it["latency"].sum())
    first = float(out.arrival.min()) if len(out.arrival) else 0.0
    end = float(it["start"][-1] + it["latency"][-1])
    span = max(end - first, 1e-12)
    tokens = it["decode_tokens"] + it["prefill_tokens"]
    generated = int(out.output_len[out.finished].sum())
    return {
        "iterations": n,
        "throughput_tok_s": generated / span,
        "busy_fraction": busy / span,
        "prefill_token_share": float(np.mean(it["prefill_tokens"] / np.maximum(tokens, 1))),
        "kv_util_mean": float(np.mean(it["kv_used"]) / kv_total),
    }


def _jump(t: float) -> float:
    """The virtual clock reaches the next arrival at once."""
    return t
