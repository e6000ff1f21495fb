"""Colocated against disaggregated serving on the same GPUs (``topology=auto``).

An operator with ``fleet.replicas`` servers of ``tp`` GPUs each can run them colocated (every
server prefills and decodes, behind ``fleet.router``) or split them into ``x`` prefill and ``y``
decode servers (``x + y`` the same servers, ``x, y >= 1``) joined by ``fleet.link``. The colocated
side is the advisor's own recommendation, already searched on those servers; each split is searched
the same way (:func:`advisor.search.search`, the same SLO criterion and tolerance), both pools with
the settings of one candidate: the current settings, the colocated search's best budget and its
recommendation (at most three searches per split: searching every candidate on every split would
cost the colocated search again per split). Disaggregation is recommended only when it serves more
than :data:`STRICT_WIN` above colocated serving: a split must pay for its link and its idle roles
with a margin the capacity search can resolve (its tolerance is 2% by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from advisor.search import Found
from envs.serving.fleet import FleetSpec
from envs.serving.loop import SimResult

TOPOLOGIES = ("colocated", "auto")
"""``topology=``: colocated serving only (the advice without a ``topology`` block), or both compared."""
STRICT_WIN = 0.02
"""Disaggregation is recommended when its capacity exceeds colocated serving's by more than this share."""
BUDGET_FAMILY = "max_num_batched_tokens"
"""The family whose best budget each split is also searched with."""


def splits(topology: str, fleet: FleetSpec) -> tuple[FleetSpec, ...]:
    """Every xPyD of ``fleet``'s servers, fewest prefill servers first (none for ``colocated``);
    raises ValueError naming the value when ``auto`` has no split to try."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r}: one of {', '.join(TOPOLOGIES)}")
    if topology == "colocated":
        return ()
    if fleet.replicas < 2:
        raise ValueError(
            f"topology=auto with fleet.replicas={fleet.replicas}: splitting servers into prefill and "
            "decode needs fleet.replicas >= 2 (the servers to compare)"
        )
    return tuple(
        FleetSpec(
            router=fleet.router,
            prefill=x,
            decode=fleet.replicas - x,
            link=fleet.link,
            decode_router=fleet.decode_router,
        )
        for x in range(1, fleet.replicas)
    )


def tried(
    split_fleets: Sequence[FleetSpec], found: Sequence[Found], recommended: Found | None
) -> list[tuple[FleetSpec, int]]:
    """Each split with each candidate (by index in ``found``) it is searched with, splits in order:
    the current settings, the colocated search's best budget of vLLM's own scheduler (ties: the
    first, the smaller budget) and the colocated recommendation, each once."""
    budgets = [i for i, f in enumerate(found) if f.candidate.family == BUDGET_FAMILY]
    picks = {0, max(budgets, key=lambda i: (found[i].scale, -i))}
    if recommended is not None:
        picks.add(found.index(recommended))
    return [(f, i) for f in split_fleets for i in sorted(picks)]


def best(found: Sequence[Found]) -> int:
    """The highest capacity; ties to the first tried (fewer prefill servers, then candidate order)."""
    return max(range(len(found)), key=lambda k: (found[k].scale, -k))


def recommend(colocated_rps: float, disaggregated_rps: float) -> str:
    """ "disaggregated" only when it serves more than :data:`STRICT_WIN` above colocated serving."""
    return "disaggregated" if disaggregated_rps > colocated_rps * (1 + STRICT_WIN) else "colocated"


def name(fleet: FleetSpec) -> str:
    return f"{fleet.prefill}P{fleet.decode}D"


@dataclass(frozen=True)
class Topology:
    """Both sides of the comparison and the disaggregated side's run at its capacity."""

    fleet: FleetSpec  # the colocated servers
    tp: int
    colocated: Found | None  # the advisor's recommendation (None: no candidate meets the SLO)
    pairs: list[tuple[FleetSpec, int]]  # each split and candidate index tried
    found: list[Found]  # their capacities, in that order
    at_capacity: SimResult  # the best split at its capacity (today's rate when that is 0)

    @property
    def gpus(self) -> int:
        return self.fleet.replicas * self.tp

    @property
    def disaggregated(self) -> Found:
        return self.found[best(self.found)]

    @property
    def split(self) -> FleetSpec:
        """The servers of the best split."""
        return self.pairs[best(self.found)][0]

    @property
    def recommended(self) -> str:
        return recommend(self.colocated.rps if self.colocated is not None else 0.0, self.disaggregated.rps)
