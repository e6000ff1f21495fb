"""What a router sees and does: the interface between a fleet and its routing policies.

A router is a policy one level above the servers' schedulers: at each arrival it reads a
read-only :class:`ServerView` of every server and names the server the request goes to.  The
views read the live servers (no copies), so a router costs what it reads; routers must not
mutate them or the request.  The baselines (``baselines/routers.py``) implement production
routers; a learned router reads the same views through the routing env.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from envs.serving.core import ServingCore
from envs.serving.request import Request

STATE, COUNTS, IN_FLIGHT = 0, 1, 2
"""What a view reads, for the fleet's ``sync``: anything (the server must be at the arrival), the
request counts (waiting, running, queued work), or the requests in flight alone."""


class ServerView:
    """One server as a router may read it, at the arrival being routed.

    Counts include requests routed to the server that it has not yet admitted (routed while it
    was mid-iteration), as a router's own bookkeeping would.  Each read first calls
    ``sync(index, reads)`` (the fleet's: it brings the server to the arrival's time, unless what
    ``reads`` names provably stands until then), so a router pays for the servers it reads.
    """

    __slots__ = ("index", "_core", "_sync")

    def __init__(
        self,
        index: int,
        core: ServingCore,
        sync: Callable[[int, int], None] = lambda index, reads: None,
    ) -> None:
        self.index = index
        self._core = core
        self._sync = sync

    @property
    def waiting(self) -> int:
        """Requests waiting for a prefill chunk: queued and not started, plus routed not yet admitted."""
        self._sync(self.index, COUNTS)
        core = self._core
        return len(core.queue) - core.n_running_prefill + len(core.requests) - core.next_arrival

    @property
    def running(self) -> int:
        """Requests holding a batch slot: decoding or part-way through their prefill."""
        self._sync(self.index, COUNTS)
        core = self._core
        return core.decode.n + core.n_running_prefill

    @property
    def in_flight(self) -> int:
        """Requests routed here and not finished or rejected (vLLM production stack's request count)."""
        self._sync(self.index, IN_FLIGHT)
        core = self._core
        return len(core.queue) + core.decode.n + len(core.requests) - core.next_arrival

    @property
    def outstanding_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: queued prompts' remainders and unadmitted prompts."""
        self._sync(self.index, COUNTS)
        core = self._core
        queued = sum(r.target - r.computed for r in core.queue)
        return queued + sum(r.prompt_len for r in core.pending)

    @property
    def kv_utilization(self) -> float:
        """Share of KV blocks in use (cached prefix blocks nobody holds count as free)."""
        self._sync(self.index, STATE)
        kv = self._core.kv
        return kv.used / kv.total

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the server's KV cache holds in all."""
        kv = self._core.kv
        return kv.total * kv.block_size

    @property
    def prefix_unit_tokens(self) -> int:
        """Tokens per prefix hash unit of the trace (0: the trace carries no prefix hashes)."""
        return self._core.kv.unit_tokens

    def cached_prefix_tokens(self, req: Request) -> int:
        """Prompt tokens of ``req`` this server's prefix cache holds now (a read: the LRU is untouched)."""
        self._sync(self.index, STATE)
        kv = self._core.kv
        if req.hash_ids is None or not kv.unit_tokens:
            return 0
        return len(kv.match(req.hash_ids, len(req.hash_ids))) * kv.unit_tokens

    @property
    def tokens_served(self) -> int:
        """Prompt and output tokens of the requests this server has finished."""
        self._sync(self.index, COUNTS)
        return sum(r.prompt_len + r.generated for r in self._core.finished)


class Router(Protocol):
    """Names the server each arrival goes to."""

    name: str

    def reset(self, servers: int, seed: int) -> None:
        """A new run over ``servers`` servers; ``seed`` for routers that draw."""
        ...

    def route(self, req: Request, servers: Sequence[ServerView]) -> int:
        """The index of the server ``req`` goes to."""
        ...
