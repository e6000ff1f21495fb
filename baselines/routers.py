"""Production routers as :class:`~envs.serving.routing.Router` policies: each as its system routes.

* ``round_robin``: the next server in turn (vLLM production stack's and SGLang's simple mode).
* ``least_requests``: the fewest in-flight requests (vLLM production stack's
  ``--routing-logic=session``-less default load balancing: requests routed and not finished).
* ``least_outstanding_tokens``: join the shortest queue by work, the fewest prompt tokens still to
  prefill.
* ``power_of_two``: two distinct servers drawn at random, the one with fewer in-flight requests
  (Mitzenmacher's power of two choices).
* ``prefix_affinity``: SGLang's cache-aware router.  It keeps, per server, an approximate record of
  the prefixes it routed there (the router sees no KV events), capped at the server's KV capacity
  and evicted least recently routed first.  When the fleet is balanced, a request goes to the
  server whose record matches the longest share of its prompt (ties: the least loaded) if that
  share passes ``cache_threshold``, else to the server with the smallest record (the most cache
  room); when it is imbalanced (in-flight requests max - min > ``balance_abs_threshold`` and
  max > ``balance_rel_threshold`` x min), to the least loaded server.  Defaults as the SGLang model
  gateway's ``router_args.py``: 0.3, 64, 1.5.
* ``llmd_default``: llm-d's inference scheduler with its default scorer weights, prefix 3, queue 2,
  KV utilisation 2: each score in [0, 1] (prefix: matched share of the prompt, from the same
  approximate record; queue: 1 for the shortest waiting queue, 0 for the longest; KV: 1 - use),
  the highest weighted sum wins, ties to the lowest index.

Ties go to the lowest server index everywhere, so routing is deterministic given the seed.  Traces
without prefix hash ids (the Azure traces) give the prefix-aware routers no signal: they then
route on load alone.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

import yaml

from chunkgym import REPO_ROOT
from envs.serving.request import Request
from envs.serving.routing import ServerView


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0
        self._n = 1

    def reset(self, servers: int, seed: int) -> None:
        self._next, self._n = 0, servers

    def route(self, req: Request, servers: Sequence[ServerView]) -> int:
        k = self._next
        self._next = (k + 1) % self._n
        return k


class LeastRequests:
    name = "least_requests"

    def reset(self, servers: int, seed: int) -> None:
        pass

    def route(self, req: Request, servers: Sequence[ServerView]) -> int:
        return min(range(len(servers)), key=lambda i: servers[i].in_flight)


class LeastOutstandingTokens:
    name = "least_outstanding_tokens"

    def reset(self, servers: int, seed: int) -> None:
        pass

    def route(self, req: Request, servers: Sequence[ServerView]) -> int:
        return min(
            range(len(servers)), key=lambda i: (servers[i].outstanding_prefill_tokens, servers[i].in_flight)
        )


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self) -> None:
        self._rng = random.Random(0)

    def reset(self, servers: int, seed: int) -> None:
        self._rng = random.Random(seed)

    def route(self, req: Request, servers: Sequence[ServerView]) -> int:
        if len(servers) == 1:
            return 0
        a, b = sorted(self._rng.sample(range(len(servers)), 2))
        return a if servers[a].in_flight <= servers[b].in_flight else b


class PrefixRecord:
    """Per server, the prefix units the router sent there, with when it last sent each: entries not
    routed for ``ttl_s`` are evicted, as SGLang's router evicts its approximate trees on a timer."""

    def __init__(self, servers: int, ttl_s: float) -> None:
        self.units: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(servers)]
        self.ttl_s = ttl_s

    def matched(self, k: int, hash_ids: list[int]) -> int:
        """Leading units of ``hash_ids`` recorded for server ``k``."""
        record, n = self.units[k], 0
        for uid in hash_ids:
            if uid not in record:
                break
            n += 1
        return n

    def expire(self, now: float) -> None:
        for record in self.units:
            while record and next(iter(record.values())) < now - self.ttl_s:
                record.popitem(last=False)

    def add(self, k: int, hash_ids: list[int], now: float) -> None:
        record = self.units[k]
        for uid in hash_ids:
            record[uid] = now
            record.move_to_end(uid)


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
    ) -> None:
        self.eviction_interval_s = eviction_interval_s
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._record: PrefixRecord | None = None

    def reset(self, servers: int, seed: int) -> None:
        self._record = None  # sized at the first route, from the servers' caches

    def route(self, req: Request, servers: Sequence[ServerView]) -> int:
        loads = [v.in_flight for v in servers]
        lo, hi = min(loads), max(loads)
        least = loads.index(lo)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            k = least
        elif req.hash_ids is None or not servers[0].prefix_unit_tokens:
            k = least
        else:
            record = self._record_for(len(servers), req.arrival)
            matches = [record.matched(i, req.hash_ids) for i in range(len(servers))]
            best = min(range(len(servers)), key=lambda i: (-matches[i], loads[i]))  # ties: least loaded
            share = matches[best] * servers[0].prefix_unit_tokens / req.prompt_len
            if share > self.cache_threshold:
                k = best
            else:
                k = min(range(len(servers)), key=lambda i: (len(record.units[i]), loads[i]))
        if req.hash_ids is not None and servers[0].prefix_unit_tokens:
            self._record_for(len(servers), req.arrival).add(k, req.hash_ids, req.arrival)
        return k

    def _record_for(self, servers: int, now: float) -> PrefixRecord:
        if self._record is None:
            self._record = PrefixRecord(servers, self.eviction_interval_s)
        self._record.expire(now)
        return self._record


class LlmdDefault:
    name = "llmd_default"

    def __init__(
        self,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        record_ttl_s: float = 120.0,
    ) -> None:
        self.weights = (prefix_weight, queue_weight, kv_weight)
        self.record_ttl_s = record_ttl_s
        self._record: PrefixRecord | None = None

    def reset(self, servers: int, seed: int) -> None:
        self._record = None

    def route(self, req: Request, servers: Sequence[ServerView]) -> int:
        wp, wq, wk = self.weights
        n = len(servers)
        unit = servers[0].prefix_unit_tokens
        hashed = req.hash_ids is not None and unit > 0
        if hashed and self._record is None:
            self._record = PrefixRecord(n, self.record_ttl_s)
        if hashed:
            assert self._record is not None
            self._record.expire(req.arrival)
        queues = [v.waiting for v in servers]
        qlo, qhi = min(queues), max(queues)
        best, best_score = 0, -1.0
        for i, v in enumerate(servers):
            prefix = 0.0
            if hashed:
                assert self._record is not None and req.hash_ids is not None
                prefix = min(1.0, self._record.matched(i, req.hash_ids) * unit / req.prompt_len)
            queue = 1.0 if qhi == qlo else (qhi - queues[i]) / (qhi - qlo)
            score = wp * prefix + wq * queue + wk * (1.0 - v.kv_utilization)
            if score > best_score:
                best, best_score = i, score
        if hashed:
            assert self._record is not None and req.hash_ids is not None
            self._record.add(best, req.hash_ids, req.arrival)
        return best


RouterBaseline = (
    RoundRobin | LeastRequests | LeastOutstandingTokens | PowerOfTwo | PrefixAffinity | LlmdDefault
)
ROUTERS: dict[str, type[RouterBaseline]] = {
    cls.name: cls
    for cls in (RoundRobin, LeastRequests, LeastOutstandingTokens, PowerOfTwo, PrefixAffinity, LlmdDefault)
}
"""Every router baseline by kind; the presets in conf/router/ name a kind and its arguments."""
ROUTER_DIR = REPO_ROOT / "conf" / "router"


def router_names() -> list[str]:
    """The presets ``fleet.router`` may name (conf/router/*.yaml)."""
    return sorted(p.stem for p in ROUTER_DIR.glob("*.yaml"))


def make_router(name: str) -> RouterBaseline:
    """A fresh router from its preset in conf/router/ (trusted: part of the checkout); one line
    listing the names otherwise."""
    if name not in router_names():
        raise ValueError(f"fleet.router={name!r} is not a router; choose one of {router_names()}")
    preset = yaml.safe_load((ROUTER_DIR / f"{name}.yaml").read_text())
    return ROUTERS[preset["kind"]](**preset.get("args") or {})
