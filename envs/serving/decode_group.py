"""The decode group: every request in its decode phase, stepped together.

Plans step all decodes or none, so a decode iteration costs O(1) Python work however many users
stream: the group keeps a decode clock, the end time of every decode iteration, and aggregates
(members, summed KV, KV-block phases).  A member's token times are the decode end times over its
clock range (:meth:`~envs.serving.request.Request.token_times`), so every token's time is exact.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import cast

import numpy as np

from envs.serving.request import Request, Status


class DecodeGroup:
    """Every request in its decode phase, stepped together."""

    def __init__(self, block_size: int, tpot_s: float) -> None:
        self.bs = block_size
        self.tpot_s = tpot_s
        self.clock = 0  # decode iterations run so far
        self.n = 0
        self._offset = 0  # sum over members of (kv0 - join clock)
        self.phase = [0] * block_size  # members per (kv0 - join) mod block_size
        self.members: dict[int, Request] = {}  # rid -> request, in join order
        self.finish_heap: list[tuple[int, int, int, Request]] = []  # (finish clock, rid, join, req)
        self.end: list[float] = []  # end time of each decode iteration, indexed by decode clock
        self._end_array = np.empty(0)  # a numpy copy of a prefix of ``end`` (see ends_array)
        self.last_time = -math.inf
        self.joiners: list[Request] = []  # joined since the last decode iteration
        self.n_doomed = 0  # members already known to miss their SLO
        # TPOT slack of member i, B * (tokens - 1) - (last token - first token), is c_i + slack_base:
        # every decode step adds B - gap to all members at once.  Heap of (c_i, rid, join, request).
        self.slack_base = 0.0
        self._slack_heap: list[tuple[float, int, int, Request]] = []

    def context_sum(self, clock: int) -> int:
        """KV tokens all members attend to in the decode iteration at ``clock``."""
        return self._offset + self.n * (clock + 1)

    def context_sums(self, clock: int, count: int) -> np.ndarray:
        """:meth:`context_sum` of the ``count`` decode iterations from ``clock`` on (int64)."""
        first, n = self.context_sum(clock), self.n
        if not n:
            return np.full(count, first, dtype=np.int64)
        return np.arange(first, first + n * count, n, dtype=np.int64)

    def block_needs(self, clock: int, count: int) -> np.ndarray:
        """:meth:`block_need` of the ``count`` decode iterations from ``clock`` on (int64)."""
        phase = np.array(self.phase, dtype=np.int64)
        return phase[np.arange(-clock, -clock - count, -1, dtype=np.int64) % self.bs]

    def blocks_over(self, clock: int, count: int) -> int:
        """:meth:`block_needs` of those iterations, summed: every member needs one block in each
        ``bs`` iterations in a row."""
        bs, phase, rounds = self.bs, self.phase, count // self.bs
        left = count - rounds * bs  # the last iterations', fewer than bs: residues top down from
        top = -(clock + rounds * bs) % bs  # this one's, wrapping past 0 to bs - 1
        if left <= top + 1:
            return rounds * self.n + sum(phase[top + 1 - left : top + 1])
        return rounds * self.n + sum(phase[: top + 1]) + sum(phase[bs - (left - top - 1) :])

    def block_need(self, clock: int) -> int:
        """New KV blocks the members need for the decode iteration at ``clock``."""
        return self.phase[-clock % self.bs] if self.n else 0

    def join(self, req: Request) -> None:
        req.status = Status.DECODING
        req.decode_join = j = self.clock
        req.decode_kv0 = kv0 = req.computed
        self.n += 1
        self.n_doomed += req.violated
        self._offset += kv0 - j
        self.phase[(kv0 - j) % self.bs] += 1
        self.members[req.rid] = req
        remaining = req.output_len - req.generated
        heapq.heappush(self.finish_heap, (j + remaining, req.rid, j, req))
        self.joiners.append(req)

    def leave(self, req: Request) -> int:
        """Remove ``req``; records its decode tokens; returns its KV tokens now."""
        j, kv0 = req.decode_join, req.decode_kv0
        steps = self.clock - j
        self.n -= 1
        self._offset -= kv0 - j
        self.phase[(kv0 - j) % self.bs] -= 1
        del self.members[req.rid]
        self.n_doomed -= req.violated
        if steps:
            req.emissions.append((j, self.clock))
            req.generated += steps
        if req in self.joiners:
            self.joiners.remove(req)
        return kv0 + steps

    def ends_array(self) -> np.ndarray:
        """``end`` as a numpy array. ``end`` only grows, so only the part added since the last call
        is converted: a run that reads token times often (a probe's checks) copies each decode end
        from Python once, not once per read."""
        cached, end = self._end_array, self.end
        if len(cached) < len(end):
            self._end_array = cached = np.concatenate((cached, np.array(end[len(cached) :])))
        return cached

    def record(self, t_end: float) -> None:
        """A decode iteration ended at ``t_end``: log it, advance the clock, track TPOT slack."""
        tpot = self.tpot_s
        if self.n > len(self.joiners):  # members that emitted at last_time gain B minus this gap
            self.slack_base += tpot - (t_end - self.last_time)
        if self.joiners:
            for req in self.joiners:
                # A joiner's first and latest emissions are prefill tokens: times, not decode ranges.
                first, last = cast(float, req.emissions[0]), cast(float, req.emissions[-1])
                slack = tpot * (req.generated - 1) - (last - first) + tpot - (t_end - last)
                heapq.heappush(self._slack_heap, (slack - self.slack_base, req.rid, req.decode_join, req))
            self.joiners = []
        self.end.append(t_end)
        self.last_time = t_end
        self.clock += 1

    def record_stretch(
        self, ends: list[float], gaps: np.ndarray | None = None, slack: float | None = None
    ) -> None:
        """Decode iterations ended at ``ends``, no member joining: :meth:`record` once per end, in
        one call (the slack sums in the same order, so bit for bit the same state).  ``gaps``, if
        given: ``ends`` minus each one's previous end (the first's: ``last_time``), as numpy
        computed them, so the slack is one sequential ``np.cumsum``; ``slack``, if given: the sum
        itself, as the caller's loop added it up (:meth:`record`'s operations in its order)."""
        tpot, last = self.tpot_s, self.last_time
        if slack is None:
            slack = self.slack_base
            if gaps is None:
                for t_end in ends:
                    slack += tpot - (t_end - last)
                    last = t_end
            else:
                slack = float(np.concatenate(([slack], tpot - gaps)).cumsum()[-1])
        self.slack_base = slack
        self.end.extend(ends)
        self.last_time = ends[-1]
        self.clock += len(ends)

    def min_tpot_slack(self) -> float:
        """Least TPOT slack (s) among members still able to meet their SLO; inf if none."""
        heap = self._slack_heap
        while heap:
            _, _, j, req = heap[0]
            if req.status is Status.DECODING and req.decode_join == j and not req.violated:
                return heap[0][0] + self.slack_base
            heapq.heappop(heap)
        return math.inf

    def pop_finished(self) -> Sequence[Request]:
        heap = self.finish_heap
        if not heap or heap[0][0] > self.clock:
            return ()  # most decode steps: nobody finishes
        done = []
        while heap and heap[0][0] <= self.clock:
            _, _, j, req = heapq.heappop(heap)
            if req.status is Status.DECODING and req.decode_join == j:
                done.append(req)
        return done

    def next_finish(self) -> int:
        """Decode clock at which the next member finishes (skipping stale heap entries)."""
        heap = self.finish_heap
        while heap:
            _, _, j, req = heap[0]
            if req.status is Status.DECODING and req.decode_join == j:
                return heap[0][0]
            heapq.heappop(heap)
        return 1 << 62
