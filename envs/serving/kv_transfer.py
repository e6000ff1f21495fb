r"""The KV transfer (link) model of prefill-decode disaggregation: how long a request's KV cache takes
to move from the prefill server that computed it to the decode server that will use it.

The physics is a pipe: a fixed setup delay, then bytes at the link's bandwidth.  Per transfer::

    bytes   = kv_transfer_bytes(model, tokens, tp)   # what ONE GPU pair moves (tp pairs move in parallel)
    alone   = base_latency_s + bytes / bandwidth_bytes_s
    shared  = processor sharing: k transfers whose bytes are flowing each get bandwidth / k
    layered = base_latency_s + max(alone_bw / L, alone_bw - prefill_s * (L - 1) / L)   # exposed after prefill

where ``alone_bw = bytes / bandwidth_bytes_s``.  With tensor parallelism ``tp`` each prefill GPU holds
``num_kv_heads / tp`` of the KV heads and sends them to its counterpart on the decode side over its own
link (one NIC or NVLink port per GPU, as DGX-class machines are built), so the transfer time is set by
the bytes of one GPU pair.  The fleet is assumed to use the same ``tp`` on both sides.

Links (``conf/link/NAME.yaml``, one per :data:`~envs.serving.fleet.LINKS` kind) carry their sources:
NVIDIA's A100 datasheet (NVLink 3, 600 GB/s over both directions: the default hardware ``a100_80gb``),
the InfiniBand HDR/NDR line rates (200/400 Gb/s per port, taken at 90% effective), and the 25 Gb/s
Ethernet of DistServe's cross-node testbed (Zhong et al., OSDI'24).  Layer-wise streaming follows
Splitwise (Patel et al., ISCA'24, section IV-C) and Mooncake (Qin et al., FAST'25), whose transfer
engines send each layer's KV as soon as that layer's prefill is done.

Validation (``calibration/kv_transfer_validation.csv``, tests/test_kv_transfer.py): published transfer
measurements, chosen before any fitting and never fitted to.  Measured ratios predicted/measured:
Mooncake Transfer Engine 40 GiB over 4x200 Gb/s RoCE 0.97 and over 8x400 Gb/s RoCE 0.53; MORI-IO
single-NIC 400G RDMA writes of 1 GiB 1.05 and of 1 MiB 0.74; Dynamo/NIXL moving a 7500-token
Llama-3.1-8B KV over H100 NVLink 0.27 (128-token pages) and 0.11 (16-token pages).  The band asserted
is 3x, on the rows that move their bytes as large transfers; the paged NVLink rows move ~30,000 and
~3,800 separate blocks and are slower than the pipe model by more than 3x (per-block overhead is left
out, docs/disaggregation.md): the test asserts only that the model under-predicts them (the CSV's
``in_band`` marks say which rows are which; they were set knowing the rough ratios, as scope, not result).

Left out: congestion beyond fair sharing (incast, switch buffers, flow-control pauses), PCIe staging
through host memory, per-block/per-descriptor overhead of paged KV layouts, and protocol overheads
beyond what the effective bandwidth already folds in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import yaml

from chunkgym.config import POSITIVE, Rule, from_mapping
from envs.serving.specs import CONF_DIR, ModelSpec

LINK_DIR = CONF_DIR / "link"
RULES: dict[str, Rule] = {key: POSITIVE for key in ("bandwidth_bytes_s", "base_latency_s")}


@dataclass(frozen=True)
class LinkSpec:
    """One kind of link between a prefill GPU and a decode GPU.

    ``bandwidth_bytes_s``: effective one-direction bandwidth of one GPU pair's link (bytes/s).
    ``base_latency_s``: the per-transfer setup delay (posting the work, the first byte's flight, the
    completion notice); it is a fixed delay before the bytes flow and takes no bandwidth.
    ``source``: where the numbers come from.  In code (tests, what-ifs) a zero base latency is
    allowed; a YAML file must give positive numbers (:data:`RULES`).
    """

    name: str
    bandwidth_bytes_s: float
    base_latency_s: float
    source: str = ""

    def __post_init__(self) -> None:
        bw, base = self.bandwidth_bytes_s, self.base_latency_s
        if not (_is_number(bw) and bw > 0):
            raise ValueError(f"bandwidth_bytes_s={bw!r}: must be a positive finite number")
        if not (_is_number(base) and base >= 0):
            raise ValueError(f"base_latency_s={base!r}: must be a finite number >= 0")


def _is_number(v: object) -> bool:
    """A finite real number (not a bool)."""
    return isinstance(v, int | float | np.number) and not isinstance(v, bool) and math.isfinite(float(v))


def link_names(conf_dir: Path = LINK_DIR) -> list[str]:
    """Names of the links in ``conf/link``."""
    return sorted(p.stem for p in conf_dir.glob("*.yaml"))


def load_link(name: str, conf_dir: Path = LINK_DIR) -> LinkSpec:
    """The link ``conf/link/NAME.yaml``; an unknown name raises with the valid ones, a bad value
    with the file and the field (``conf_dir``: another folder of link files, for tests)."""
    path = conf_dir / f"{name}.yaml"
    if name not in link_names(conf_dir):
        raise ValueError(f"unknown link {name!r}; valid names: {', '.join(link_names(conf_dir))}")
    spec = from_mapping(LinkSpec, yaml.safe_load(path.read_text()), str(path), RULES)
    if spec.name != name:
        raise ValueError(f"{path}: field 'name' is {spec.name!r}, expected the file's name {name!r}")
    return spec


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """KV heads each of ``tp`` GPUs holds: ``num_kv_heads / tp``, or 1 when ``tp`` exceeds the heads
    (vLLM then replicates each head on ``tp / num_kv_heads`` GPUs).  As in vLLM, ``tp`` must divide
    the heads or be a multiple of them."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}: an integer >= 1")
    heads = model.num_kv_heads
    if tp <= heads:
        if heads % tp:
            raise ValueError(f"tp={tp} does not divide {model.name}'s {heads} KV heads")
        return heads // tp
    if tp % heads:
        raise ValueError(f"tp={tp} is not a multiple of {model.name}'s {heads} KV heads (replication)")
    return 1


def kv_transfer_bytes(model: ModelSpec, tokens: int, tp: int = 1) -> int:
    """Bytes of KV cache ONE GPU pair moves for ``tokens`` tokens: K and V of every layer for the
    heads that GPU holds, ``2 * num_layers * kv_heads_per_gpu * head_dim * dtype_bytes * tokens``.

    That is ``model.kv_bytes_per_token * tokens / tp`` when ``tp`` divides the KV heads.  When ``tp``
    exceeds them the heads are replicated and every pair still moves one head's worth, so the pairs
    together move more than the cache holds (each decode GPU needs its own copy).
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int | np.integer) or tokens < 0:
        raise ValueError(f"tokens={tokens!r}: an integer >= 0")
    per_token = 2 * model.num_layers * kv_heads_per_gpu(model, tp) * model.head_dim * model.dtype_bytes
    return per_token * int(tokens)


def _check_bytes(nbytes: float) -> float:
    if not (_is_number(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes={nbytes!r}: a finite number >= 0")
    return float(nbytes)


def transfer_time(link: LinkSpec, nbytes: float) -> float:
    """Seconds to move ``nbytes`` alone on ``link``: the setup delay, then the bytes at full bandwidth."""
    return link.base_latency_s + _check_bytes(nbytes) / link.bandwidth_bytes_s


def exposed_transfer_time(link: LinkSpec, nbytes: float, prefill_s: float, num_layers: int) -> float:
    """Transfer time left after the prefill ends when the KV streams layer by layer during it.

    Layer ``i`` (of ``num_layers`` = L, each ``nbytes / L``) is ready when its prefill compute is, at
    ``prefill_s * (i + 1) / L`` (layers take equal time); the link sends layers in order, each as soon
    as it is ready and the previous one has gone, at full bandwidth (the transfer is alone on the link).
    The last byte lands at ``max(prefill_s / L + T, prefill_s + T / L)`` with ``T = nbytes / bandwidth``
    (the later of: the link busy from the first layer on, and the last layer sent right when ready), so
    what is left after the prefill is ``max(T / L, T - prefill_s * (L - 1) / L)``, plus the base latency
    once (one setup, then the layers pipeline behind it).  It never exceeds :func:`transfer_time` and
    tends to the base latency plus one layer's share as the link outpaces the prefill.
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers={num_layers!r}: an integer >= 1")
    if not (math.isfinite(prefill_s) and prefill_s >= 0):
        raise ValueError(f"prefill_s={prefill_s!r}: a finite number >= 0")
    bw_time = _check_bytes(nbytes) / link.bandwidth_bytes_s
    layers = num_layers
    last = max(prefill_s / layers + bw_time, prefill_s + bw_time / layers)
    return link.base_latency_s + max(0.0, last - prefill_s)


class Link:
    """One shared link (say, a prefill server's NIC towards the decode pool): an exact event model of
    concurrent transfers under fair sharing.

    Rule: a transfer started at ``t`` waits ``base_latency_s`` (setup; it takes no bandwidth), then its
    bytes flow; while ``k`` transfers are flowing each receives ``bandwidth_bytes_s / k`` (processor
    sharing), and one finishes when its last byte has been served.  Completion times are exact: the
    model keeps the service every flowing transfer has received since the link was created
    (``virtual`` bytes, growing at ``bandwidth / k``), so a transfer admitted when that counter reads
    ``v`` with ``b`` bytes finishes when it reads ``v + b`` (finish tags order the completions).

    Use: :meth:`start` transfers in time order, :meth:`advance` the clock to collect the completions up
    to a time, :meth:`next_completion` to peek at the next one without moving, :meth:`drain` to run to
    the end.  :func:`completion_times` does all of it for a batch.
    """

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.now = -math.inf  # the link's clock: every event up to here is processed
        self._virtual = 0.0  # bytes of service each flowing transfer has received since creation
        self._flowing: list[tuple[float, int]] = []  # heap of (finish tag, tid)
        self._waiting: list[tuple[float, int, float]] = []  # heap of (ready time, tid, bytes): in setup
        self._ids: set[int] = set()  # transfers started and not finished

    @property
    def active(self) -> int:
        """Transfers started and not finished (in setup or flowing)."""
        return len(self._ids)

    @property
    def flowing(self) -> int:
        """Transfers whose bytes are flowing now (past their setup delay)."""
        return len(self._flowing)

    def start(self, tid: int, t: float, nbytes: float) -> None:
        """Start transfer ``tid`` of ``nbytes`` at time ``t`` (no earlier than :attr:`now`; the link is
        advanced to ``t`` first, so collect completions with :meth:`advance` before starting)."""
        if tid in self._ids:
            raise ValueError(f"transfer {tid} is already on the link")
        if not math.isfinite(t):
            raise ValueError(f"t={t!r}: a finite time")
        if t < self.now:
            raise ValueError(f"t={t} is before the link's clock {self.now}: start transfers in time order")
        size = _check_bytes(nbytes)
        while True:  # admissions before t happen here; a completion before t must be collected first
            when, kind = self._next_event()
            if when >= t:
                break
            if kind == "finish":
                raise ValueError(f"a transfer finishes at {when} < t={t}: call advance({t}) first")
            self._move_to(when)
            self._admit_ready()
        self._move_to(t)
        self._ids.add(tid)
        heapq.heappush(self._waiting, (t + self.spec.base_latency_s, tid, size))
        self._admit_ready()

    def next_completion(self) -> tuple[float, int] | None:
        """``(time, tid)`` of the next completion if no other transfer starts, None when idle."""
        now, virtual = self.now, self._virtual
        flowing = list(self._flowing)
        waiting = sorted(self._waiting)
        i = 0
        bw = self.spec.bandwidth_bytes_s
        while flowing or i < len(waiting):
            finish = now + (flowing[0][0] - virtual) * len(flowing) / bw if flowing else math.inf
            if i < len(waiting) and waiting[i][0] < finish:
                ready, tid, size = waiting[i]
                if flowing:
                    virtual += (ready - now) * bw / len(flowing)
                now = ready
                heapq.heappush(flowing, (virtual + size, tid))
                i += 1
                continue
            return finish, flowing[0][1]
        return None

    def advance(self, t: float) -> list[tuple[float, int]]:
        """Move the clock to ``t``; the ``(time, tid)`` completions at or before ``t``, in order."""
        if t < self.now:
            raise ValueError(f"t={t} is before the link's clock {self.now}")
        done: list[tuple[float, int]] = []
        while True:
            when, kind = self._next_event()
            if when > t:
                break
            self._move_to(when)
            if kind == "ready":
                self._admit_ready()
            else:
                _tag, tid = heapq.heappop(self._flowing)
                self._ids.discard(tid)
                done.append((when, tid))
        self._move_to(t)
        return done

    def drain(self) -> list[tuple[float, int]]:
        """Run until every transfer has finished; their ``(time, tid)`` completions, in order."""
        done: list[tuple[float, int]] = []
        while self._ids:
            nxt = self.next_completion()
            assert nxt is not None  # transfers are on the link
            done += self.advance(nxt[0])
        return done

    def _next_event(self) -> tuple[float, str]:
        """The time of the next admission or completion, and which ("ready" first on a tie)."""
        ready = self._waiting[0][0] if self._waiting else math.inf
        finish = math.inf
        if self._flowing:
            left = max(0.0, self._flowing[0][0] - self._virtual)
            finish = self.now + left * len(self._flowing) / self.spec.bandwidth_bytes_s
        return (ready, "ready") if ready <= finish else (finish, "finish")

    def _move_to(self, t: float) -> None:
        """Run the flowing transfers from :attr:`now` to ``t`` (no event may lie strictly between)."""
        if t > self.now and self._flowing:
            self._virtual += (t - self.now) * self.spec.bandwidth_bytes_s / len(self._flowing)
        self.now = max(self.now, t)

    def _admit_ready(self) -> None:
        """Let the transfers whose setup is over by now start flowing."""
        while self._waiting and self._waiting[0][0] <= self.now:
            _, tid, size = heapq.heappop(self._waiting)
            heapq.heappush(self._flowing, (self._virtual + size, tid))


def completion_times(
    link: LinkSpec, starts: Sequence[float] | npt.ArrayLike, sizes: Sequence[float] | npt.ArrayLike
) -> npt.NDArray[np.float64]:
    """Completion time of every transfer of a batch sharing ``link`` (the :class:`Link` rule), in the
    order given: transfer ``i`` starts at ``starts[i]`` with ``sizes[i]`` bytes."""
    t0 = np.asarray(starts, dtype=np.float64).ravel()
    nb = np.asarray(sizes, dtype=np.float64).ravel()
    if t0.shape != nb.shape:
        raise ValueError(f"{t0.size} start times and {nb.size} sizes: one size per start")
    if not (np.isfinite(t0).all() and np.isfinite(nb).all() and (nb >= 0).all()):
        raise ValueError("start times must be finite and sizes finite and >= 0")
    out = np.full(t0.size, np.nan)
    shared = Link(link)
    for i in np.argsort(t0, kind="stable"):
        for when, tid in shared.advance(float(t0[i])):
            out[tid] = when
        shared.start(int(i), float(t0[i]), float(nb[i]))
    for when, tid in shared.drain():
        out[tid] = when
    return out
