"""Mix workloads: several tenants' sources merged into one request stream, labelled per request.

Tenant ``i`` (share ``s_i`` of the shares' sum ``S``) draws from its source's split at
``s_i / S * base_rate`` requests per mix second: its source's times (trace seconds) are divided by
``c_i = s_i / S * base_rate / r_i``, where ``r_i`` is the source's mean rate over the split, so
burstiness within a window is the source's own and request counts per tenant follow the shares.
A window of ``window_s`` mix seconds reads ``c_i * window_s`` trace seconds of each source, at a
start drawn from a seed derived from the mix's seed and the tenant's name; a split reads each
source's whole split.  The streams are merged by arrival time (ties: tenant order), cut at the
shortest tenant's span (so every tenant sends throughout), and each request is labelled with its
tenant's name and SLO class (labels a source file carries are replaced).  The mix's own
``rate_scale`` and ``load_scale`` then divide every time alike, so load scaling scales every
tenant; a source's ``length_scale`` applies to its tenant, its ``rate_scale`` and ``window_s``
do not (the mix sets both).

Prefix hash ids are kept: each source file's ids are renumbered into a range of their own (two
Mooncake files both count blocks from 0, and their blocks are not the same tokens; two tenants
on one file share its range, as they share its blocks), and a tenant whose source has no hash
ids gets fresh ids, one per block of its prompt, that match nothing.  Sources whose block sizes
differ cannot share one cache's units: then the mix drops every hash id (and logs it once).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from envs.serving.workloads.renewal import rng_for
from envs.serving.workloads.spec import TenantSpec
from envs.serving.workloads.trace import Source, Trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tenant:
    """A tenant's spec, its opened source and the length scale of the source's workload."""

    spec: TenantSpec
    source: Source
    length_scale: float = 1.0


class MixSource:
    """Splits and windows of a mix: see the module docstring."""

    def __init__(self, name: str, base_rate: float, tenants: list[Tenant], seeded: bool):
        self.name, self.base_rate, self.tenants, self.seeded = name, base_rate, tenants, seeded
        self.source = "mix:" + "+".join(dict.fromkeys(t.spec.source for t in tenants))
        total = math.fsum(t.spec.share for t in tenants)
        self._rates = [base_rate * t.spec.share / total for t in tenants]
        self._warned = False

    def mean_rate(self, split: str) -> float:
        """Requests per mix second: ``base_rate`` in every split."""
        return self.base_rate

    def extract(self, split: str, seed: int, window_s: float | None) -> Trace:
        parts = [
            self._part(t, rate, split, seed, window_s)
            for t, rate in zip(self.tenants, self._rates, strict=True)
        ]
        span = min(p.span_s for p in parts)
        parts = [p.slice(0, int(np.searchsorted(p.arrival_s, span, side="right"))) for p in parts]
        arrival = np.concatenate([p.arrival_s for p in parts])
        order = np.argsort(arrival, kind="stable")
        hashes, block = self._hash_ids(parts)
        tenant = [t.spec.name for t, p in zip(self.tenants, parts, strict=True) for _ in range(len(p))]
        slo_class = [
            t.spec.slo_class for t, p in zip(self.tenants, parts, strict=True) for _ in range(len(p))
        ]
        picked = order.tolist()
        return Trace(
            name=self.name,
            source=self.source,
            arrival_s=arrival[order],
            prompt_len=np.concatenate([p.prompt_len for p in parts])[order],
            output_len=np.concatenate([p.output_len for p in parts])[order],
            hash_ids=None if hashes is None else tuple(hashes[i] for i in picked),
            hash_block_tokens=block,
            span_s=span,
            offset_s=0.0,
            first_row=-1,
            tenant=tuple(tenant[i] for i in picked),
            slo_class=tuple(slo_class[i] for i in picked),
        )

    def _part(self, tenant: Tenant, rate: float, split: str, seed: int, window_s: float | None) -> Trace:
        """The tenant's stream in mix seconds: its source's times divided by its compression."""
        native = tenant.source.mean_rate(split)
        if not (native > 0 and math.isfinite(native)):
            raise ValueError(
                f"mix {self.name!r}: tenant {tenant.spec.name!r}'s source has no requests in split {split!r}"
            )
        factor = rate / native
        tseed = int(rng_for(seed, "mix-tenant", tenant.spec.name).integers(2**32))
        trace = tenant.source.extract(split, tseed, None if window_s is None else window_s * factor)
        trace = trace.scale_lengths(tenant.length_scale)
        return Trace(
            name=trace.name,
            source=trace.source,
            arrival_s=trace.arrival_s / factor,
            prompt_len=trace.prompt_len,
            output_len=trace.output_len,
            hash_ids=trace.hash_ids,
            hash_block_tokens=trace.hash_block_tokens,
            span_s=trace.span_s / factor,
        )

    def _hash_ids(self, parts: list[Trace]) -> tuple[list[np.ndarray] | None, int]:
        """Every request's hash ids in concatenated tenant order, each source file's renumbered
        into a range of its own, fresh ids for tenants without; None where none has any or the
        block sizes differ."""
        blocks = {p.hash_block_tokens for p in parts if p.hash_ids is not None}
        if not blocks:
            return None, 0
        if len(blocks) > 1:
            if not self._warned:
                log.warning(
                    "mix %r: sources' prefix blocks differ (%s tokens): hash ids dropped",
                    self.name,
                    sorted(blocks),
                )
                self._warned = True
            return None, 0
        block = blocks.pop()
        by_source: dict[str, list[np.ndarray]] = {}
        for p in parts:
            if p.hash_ids is not None:
                by_source.setdefault(p.source, []).extend(p.hash_ids)
        ranges: dict[str, tuple[np.ndarray, int]] = {}  # source -> (its distinct ids, the first new id)
        nxt = 0
        for source, lists in by_source.items():
            ids = np.unique(np.concatenate(lists)) if lists else np.zeros(0, np.int64)
            ranges[source] = ids, nxt
            nxt += len(ids)
        out: list[np.ndarray] = []
        for p in parts:
            if p.hash_ids is None:
                counts = -(-p.prompt_len // block)
                fresh = nxt + np.arange(int(counts.sum()), dtype=np.int64)
                nxt += len(fresh)
                out.extend(np.split(fresh, np.cumsum(counts)[:-1]) if len(counts) else [])
            else:
                ids, first = ranges[p.source]
                out.extend(first + np.searchsorted(ids, h) for h in p.hash_ids)
        for ids in out:
            ids.flags.writeable = False
        return out, block
