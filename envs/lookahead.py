"""One pass over the queue's lookahead: the sums the features and the action masks both read.

The env needs them every step, for the observation and for the mask of the same state, so it
scans once and hands the result to both (:func:`envs.features.features_v1`'s ``look``,
:meth:`envs.actions.ActionSpec.valid`'s ``look``); a caller without one gets a fresh scan.
"""

from __future__ import annotations

from typing import NamedTuple

from envs.serving.scheduling import ServingView


class Lookahead(NamedTuple):
    """Sums over the lookahead prompts ("alive": those that can still meet their TTFT bound)."""

    size: int
    pending: int  # prefill tokens left
    shortest: int  # fewest tokens left of one prompt (0: none waits)
    min_slack: float  # least (deadline - now - left * prefill s/token) / TTFT bound, at most 1
    oldest: float  # earliest arrival (now: none waits)
    doomed: int  # prompts already known to miss their SLO
    alive: int
    alive_pending: int
    alive_shortest: int
    new: int  # prompts not yet holding a batch slot
    blocks: int  # private KV blocks the prompts need for all their remaining prefill


def scan_lookahead(view: ServingView) -> Lookahead:
    """:class:`Lookahead` of ``view``'s current state, in one loop."""
    now = view.now
    look = view.lookahead
    if not look:
        return Lookahead(0, 0, 0, 1.0, now, 0, 0, 0, 0, 0, 0)
    per_token = view.prefill_s_per_token
    bs = view.block_size
    pending = shortest = doomed = alive = alive_pending = alive_shortest = new = blocks = 0
    min_slack = 1.0
    oldest = now
    for r in look:
        target, computed = r.target, r.computed
        left = target - computed
        pending += left
        if not shortest or left < shortest:
            shortest = left
        bound = r.ttft_bound
        slack = (r.deadline - now - per_token * left) / bound
        if slack < min_slack:
            min_slack = slack
        arrival = r.arrival
        if arrival < oldest:
            oldest = arrival
        violated = r.violated
        doomed += violated
        if not violated and now - arrival <= bound:
            alive += 1
            alive_pending += left
            if not alive_shortest or left < alive_shortest:
                alive_shortest = left
        new += not r.running
        blocks += -(-target // bs) - -(-computed // bs)  # scheduling.blocks_needed(bs, r, left)
    return Lookahead(
        len(look),
        pending,
        shortest,
        min_slack,
        oldest,
        doomed,
        alive,
        alive_pending,
        alive_shortest,
        new,
        blocks,
    )
