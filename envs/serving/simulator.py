"""Discrete-event simulation of one serving instance: the run loop on a cost-model clock.

No wall clock anywhere: each iteration advances time by the cost model's latency;
an idle engine jumps to the next arrival.  Stretches of decode-only iterations (no
prompt waiting, so every policy's only valid plan is "step the decodes") are advanced
without consulting the policy, up to the next event (arrival, finish, KV-block
shortage), which is what makes an hour-long production trace take seconds.
"""

from __future__ import annotations

import copy

from envs.serving.core import Batch, ServingConfig, ServingCore
from envs.serving.cost_model import CostModel
from envs.serving.loop import IterationLog, ServingLoop
from envs.serving.metrics import SLO
from envs.serving.specs import HardwareSpec, ModelSpec
from envs.serving.workloads.trace import Trace

FAST_FORWARD_MAX = 4096  # decode-only iterations per fast-forward call


class CostModelClock:
    """The simulator's executor: a batch takes the cost model's latency on a virtual clock."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost = cost_model

    def wait_until(self, t: float) -> float:
        """The virtual clock reaches the next arrival at once."""
        return t

    def execute(self, batch: Batch, start: float) -> tuple[float, float]:
        chunks = batch.chunks
        latency = self.cost.iteration_time(
            batch.num_decode, batch.decode_context, [q for _, q, _ in chunks], [c for _, _, c in chunks]
        )
        return start + latency, latency

    def fast_forward(self, core: ServingCore, log: IterationLog) -> bool:
        """Run decode-only iterations back to back while no prompt waits; False if none ran.

        Exactly what :meth:`ServingLoop.step` would do with the only valid plan (step the
        decodes), minus the policy call and the plan validation, up to the next event: an
        arrival, a finish, a KV-block shortage (preemption) or a stall violation.
        """
        dec = core.decode
        if core.queue or not dec.n or dec.joiners:
            return False
        n, bs, phase = dec.n, dec.bs, dec.phase
        t_arr = core.next_arrival_time()
        stop = min(dec.next_finish(), dec.clock + FAST_FORWARD_MAX)
        free, stall = core.kv.free, core.slo.stall_s
        used = core.kv.used
        cost = self.cost.iteration_time
        append = log.append
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


class Simulator(ServingLoop):
    """Replays a trace through a policy on a simulated engine: :class:`ServingLoop` with a
    :class:`CostModelClock`, plus :meth:`fork` for what-if rollouts."""

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
        core = ServingCore.for_trace(trace, model, hardware, cost_model, slo, config, tp)
        super().__init__(core, CostModelClock(cost_model), trace.span_s)

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
