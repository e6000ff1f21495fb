"""One server's SLO bookkeeping: which requests are known to meet or miss their SLO, the moment it is known.

A request is known bad as soon as a bound is past (rejected, its TTFT deadline passed without a
first token, a token gap over the stall bound, or at its finish), known good at its finish within
every bound.  Both counts only grow, which is what the rewards, the early stops
(:mod:`envs.serving.early`) and the truncation of a run read; the core reports each event here.
"""

from __future__ import annotations

import heapq
import math
from typing import cast

import numpy as np

from envs.serving.decode_group import DecodeGroup
from envs.serving.metrics import SLO, meets_slo, stall_of, tpot_of
from envs.serving.request import Request, Status


class SloBook:
    """The verdicts known so far on one server's requests, and the TTFT deadlines still watched."""

    def __init__(self, slo: SLO, decode: DecodeGroup) -> None:
        self.slo = slo
        self.decode = decode  # its members' doomed count follows the verdicts
        self.n_good = 0  # requests known to meet their SLO (finished within all bounds)
        self.n_bad = 0  # requests known to miss it (as soon as it is known)
        self.n_credited = 0  # requests whose first token met TTFT while still in the running
        self.n_uncredited = 0  # of those, the ones later found to miss their SLO
        # The same counts, each request counted its class weight (``Request.weight``) times.
        self.w_bad = 0.0
        self.w_credited = 0.0
        self.w_uncredited = 0.0
        self.deadlines: list[tuple[float, int, Request]] = []  # heap of (TTFT deadline, rid, request)

    def watch(self, req: Request) -> None:
        """Watch an admitted request's TTFT deadline (``req.deadline``) until its first token."""
        heapq.heappush(self.deadlines, (req.deadline, req.rid, req))

    def next_deadline(self) -> float:
        """The earliest TTFT deadline of a request still waiting for its first token and not known to
        miss it (inf: none); the ones before it are dropped, as :meth:`expire` would."""
        heap = self.deadlines
        while heap:
            if _awaits_first_token(heap[0][2]):
                return heap[0][0]
            heapq.heappop(heap)
        return math.inf

    def expire(self, now: float) -> None:
        """Requests still without a first token past their TTFT bound at ``now`` are known to miss it."""
        heap = self.deadlines
        while heap and heap[0][0] < now:
            _, _, req = heapq.heappop(heap)
            if _awaits_first_token(req):
                if now - req.arrival > req.ttft_bound:
                    self.violate(req)
                else:  # rounding put the deadline a hair early: look again next iteration
                    heapq.heappush(heap, (now, req.rid, req))
                    break

    def first_token(self, req: Request, t: float) -> None:
        """``req``'s first token came at ``t``: it missed TTFT, or is credited while still in the running."""
        if req.violated:
            return
        if t - req.arrival > req.ttft_bound:
            self.violate(req)
        else:
            req.credited = True
            self.n_credited += 1
            self.w_credited += req.weight

    def violate(self, req: Request) -> None:
        """``req`` is known to miss its SLO."""
        req.violated = True
        self.n_bad += 1
        self.n_uncredited += req.credited
        self.w_bad += req.weight
        if req.credited:
            self.w_uncredited += req.weight
        if req.status is Status.DECODING:
            self.decode.n_doomed += 1

    def judge(self, req: Request, times: np.ndarray) -> None:
        """The verdict on a finished request from its token times."""
        if req.violated:
            return
        if meets_slo(times[0] - req.arrival, tpot_of(times), stall_of(times), req):
            self.n_good += 1
        else:
            self.violate(req)

    def judge_so_far(self, req: Request) -> None:
        """:meth:`judge` without the token times (the ``verdicts`` shortcut), the same verdict.

        Its TTFT was checked at its first token; every token gap is at most the stall bound:
        each decode step checked its members' gaps (fast-forward stops before a longer one), and
        the gaps before resumed prefill tokens are in ``resume_gap``.  TPOT is the same division
        as :func:`tpot_of`'s, on the same two times, so the verdict is identical.
        """
        if req.violated:
            return
        n = req.generated
        first = cast(float, req.emissions[0])
        tpot = (req.last_token_time(self.decode.end) - first) / (n - 1) if n > 1 else 0.0
        if (
            first - req.arrival <= req.ttft_bound
            and tpot <= req.tpot_bound
            and req.resume_gap <= req.stall_bound
        ):
            self.n_good += 1
        else:
            self.violate(req)


def _awaits_first_token(req: Request) -> bool:
    """Whether ``req``'s TTFT deadline is still watched: it waits for its first token, not yet known
    to miss its SLO."""
    return req.generated == 0 and req.status is Status.WAITING and not req.violated
