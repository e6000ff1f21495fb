"""The one switch between a run's fast paths and its reference path.

Every way the simulator runs faster than one planned, booked iteration at a time is a field of
:class:`Shortcuts`, each with bit-identical results; a run reads them all from its core
(:attr:`~envs.serving.core.ServingCore.shortcuts`, set before it starts): the core's bookkeeping,
the loop's stretches and iteration log (:meth:`~envs.serving.loop.ServingLoop.run_until`) and the
policies' budget planning (:func:`~envs.serving.budgets.budget_plans`).  The reference path, :data:`NO_SHORTCUTS`
(a capacity search with ``early_stop=False``, the advisor's ``fast=false``, and the tests that
compare both), takes none, so its runs measure and check them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Shortcuts:
    """The fast paths a run may take.  All but ``deferred_ewma`` and ``unlogged`` are on by default;
    those two are for capacity probes (:data:`PROBE_SHORTCUTS`)."""

    # A finishing request's SLO verdict from its first and last token times, its token count and
    # its largest resume gap (the gaps the decode steps do not check), not from its token-time
    # array; the arrays are built when ``token_times`` is read.
    verdicts: bool = True
    # Decode-only iterations (no prompt waiting, so the only valid plan steps the decodes) run back
    # to back without asking the policy, up to the next event, on executors that can
    # (:meth:`~envs.serving.simulator.CostModelClock.fast_forward`).
    fast_forward: bool = True
    # A fast-forwarded stretch's TPOT slack is summed with numpy (in sequence).
    stretches: bool = True
    # The loop runs the iterations that give one running prompt the chunk its policy's ``follow``
    # names, without asking the policy to plan, on executors whose clock planning does not move
    # (:class:`~envs.serving.stretches.FollowsChunks`; the simulator's, not a real engine's).
    chunk_stretches: bool = True
    # With ``chunk_stretches``, a stretch whose follower says how long its answer holds
    # (``SteadyFollower``: Sarathi's, adaptive's) runs in segments, each priced and checked in one
    # loop up to its next event and booked at once, on the simulator's clock, when the run's
    # ``stop`` is none or a ``CountStop`` (``CostModelClock.run_segment``).
    segments: bool = True
    # A policy asking for several budgets' plans in one state gets them from one planning pass
    # (:class:`~envs.serving.budgets.BudgetPrefixes`), not each from scratch.
    one_pass_budgets: bool = True
    # Iteration latencies wait in a list and are folded into ``latency_ewma`` when it is read: for
    # runs whose policy never reads it (capacity probes of the baselines); the list grows until then.
    deferred_ewma: bool = False
    # The run keeps no per-iteration log (the loop's log is an ``UnrecordedLog`` from the run's start,
    # so stretches count no KV per iteration): for runs judged on the core's SLO counters alone
    # (capacity probes decided early), which never read it.
    unlogged: bool = False


NO_SHORTCUTS = Shortcuts(**{f.name: False for f in fields(Shortcuts)})
PROBE_SHORTCUTS = Shortcuts(deferred_ewma=True, unlogged=True)
