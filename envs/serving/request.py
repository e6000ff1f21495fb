"""A request's lifecycle state, as the scheduler and the metrics see it.

Like nano-vllm's ``Sequence``: one small object per request, mutated only by the
serving core (``envs.serving.core``).  Policies read it through the view; they must
not mutate it.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Status(IntEnum):
    WAITING = 0  # queued for prefill: not started, partly prefilled, or preempted
    DECODING = 1  # prefill done, streaming tokens in the decode group
    FINISHED = 2
    REJECTED = 3


class Request:
    """One request.  Token bookkeeping, in tokens of KV cache:

    * ``target``: tokens this request must have in KV before it can emit its next
      token: the prompt, or prompt + generated tokens after a preemption (recompute).
    * ``computed``: tokens already in KV (prefix-cache hits count), ``<= target``.
    * ``generated``: output tokens emitted so far, ``<= output_len``.
    """

    __slots__ = (
        "rid",
        "arrival",
        "prompt_len",
        "output_len",
        "hash_ids",
        "status",
        "reject_reason",
        "target",
        "computed",
        "generated",
        "prefix_hit",
        "prefix_units",
        "start_order",
        "tenant",
        "slo_class",
        "priority",
        "weight",
        "ttft_bound",
        "tpot_bound",
        "stall_bound",
        "deadline",
        "violated",
        "credited",
        "first_scheduled",
        "emissions",
        "decode_join",
        "decode_kv0",
        "preemptions",
        "seq",
        "running",
        "resume_gap",
    )

    def __init__(
        self,
        rid: int,
        arrival: float,
        prompt_len: int,
        output_len: int,
        hash_ids: list[int] | None = None,
        tenant: str = "default",
        slo_class: str = "",
    ) -> None:
        self.rid = rid
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.hash_ids = hash_ids
        self.status = Status.WAITING
        self.reject_reason = ""
        self.target = prompt_len
        self.computed = 0
        self.generated = 0
        self.prefix_hit = 0  # prompt tokens served from the prefix cache at first admission
        self.prefix_units: list[int] = []  # hash ids of the shared cache units this request holds
        self.start_order = -1  # when it last got a batch slot: preemption takes the latest first
        self.tenant = tenant  # who sent it (a trace's label; docs/tenants.md)
        self.slo_class = slo_class  # the conf/slo_class it is judged by; "": the run's SLO
        # Set at admission from its class (the run's SLO: 0 and 1): vLLM's request priority (lower
        # is served first) and the class weight (the fairness baselines' and weighted goodput's).
        self.priority = 0
        self.weight = 1.0
        # Its SLO's bounds (s), set at admission: its class's, or the run's.
        self.ttft_bound = 0.0
        self.tpot_bound = 0.0
        self.stall_bound = 0.0
        self.deadline = 0.0  # arrival + ttft_bound
        self.violated = False  # SLO already known to be missed
        self.credited = False  # its first token met the TTFT bound (and it was not yet known to miss)
        self.first_scheduled = -1.0
        # Emitted token times, as pieces: a float (a token at that time) or a
        # (start, stop) range of decode-clock indices (one token per decode iteration).
        self.emissions: list[float | tuple[int, int]] = []
        self.decode_join = -1  # decode clock of this request's first decode iteration
        self.decode_kv0 = 0  # KV tokens held when it joined the decode group
        self.preemptions = 0
        self.seq = rid  # queue order key: arrival order, preempted requests jump ahead
        self.running = False  # holds a batch slot: got a prefill chunk since its (re)admission
        self.resume_gap = 0.0  # largest gap before a token emitted on resuming after a preemption

    def __deepcopy__(self, memo: dict[int, object]) -> Request:
        """A copy for a simulator fork, fast: a request's only mutable parts are its two lists
        (of numbers and tuples), and its hash ids are never written, so they are shared."""
        twin = Request.__new__(Request)
        for name in Request.__slots__:  # every slot is set in __init__
            setattr(twin, name, getattr(self, name))
        twin.emissions = self.emissions.copy()
        twin.prefix_units = self.prefix_units.copy()
        memo[id(self)] = twin
        return twin

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to compute before the next token can be emitted."""
        return self.target - self.computed

    def last_token_time(self, decode_end: list[float]) -> float:
        """The time of the latest emitted token (one was)."""
        p = self.emissions[-1]
        return p if isinstance(p, float) else decode_end[p[1] - 1]

    def token_times(self, decode_end: list[float] | np.ndarray) -> np.ndarray:
        """Every emitted token's time, in order, from the emission pieces (``generated`` of them);
        ``decode_end`` as a numpy array copies its ranges several times faster than as a list."""
        times = np.empty(self.generated)
        i = 0
        for p in self.emissions:
            if isinstance(p, float):
                times[i] = p
                i += 1
            else:
                a, b = p
                times[i : i + b - a] = decode_end[a:b]
                i += b - a
        return times

    def __repr__(self) -> str:
        return (
            f"Request(rid={self.rid}, status={self.status.name}, prompt={self.prompt_len}, "
            f"output={self.output_len}, computed={self.computed}/{self.target}, generated={self.generated})"
        )
