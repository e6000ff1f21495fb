"""Gymnasium registrations of chunkgym's envs: one id per version of one class, as Gymnasium does.

Entry points are strings, so registering imports nothing of ``envs``: ``import chunkgym``
(or ``import envs``) is enough for ``gym.make``, without an import cycle between the two.
The version history of v0-v4 and v6 is in :mod:`envs.chunked_prefill`'s docstring, v5's (the routing env)
in :mod:`envs.fleet_routing`'s, v7's (the prefill pool of a disaggregated fleet) in
:mod:`envs.disaggregated_prefill`'s.
"""

from __future__ import annotations

import gymnasium
from gymnasium.envs.registration import WrapperSpec

ENV_ID_V0 = "chunkgym/ChunkedPrefill-v0"
ENV_ID_V1 = "chunkgym/ChunkedPrefill-v1"
ENV_ID_V2 = "chunkgym/ChunkedPrefill-v2"
ENV_ID_V3 = "chunkgym/ChunkedPrefill-v3"
ENV_ID_V4 = "chunkgym/ChunkedPrefill-v4"
ENV_ID_V5 = "chunkgym/ChunkedPrefill-v5"
"""The routing env: one step per arrival, the server it goes to as the action (a fleet's router)."""
ENV_ID_V6 = "chunkgym/ChunkedPrefill-v6"
"""v4 for many tenants and SLO classes: who waits in the observation, the class-weighted reward."""
ENV_ID_V7 = "chunkgym/ChunkedPrefill-v7"
"""v4 on the prefill pool of a disaggregated fleet: the agent plans the prefill servers' iterations."""
ENV_ID = ENV_ID_V4
"""The newest scheduling version: the default of train.py, the leaderboard and the benchmarks."""

_ACTION_MASKS = WrapperSpec("ActionMasks", "envs.chunked_prefill:ActionMasks", {})

for _version, _id in enumerate((ENV_ID_V0, ENV_ID_V1, ENV_ID_V2, ENV_ID_V3, ENV_ID_V4)):
    if _id not in gymnasium.registry:
        gymnasium.register(
            id=_id,
            entry_point="envs.chunked_prefill:ChunkedPrefillEnv",
            kwargs={"version": _version},
            additional_wrappers=(_ACTION_MASKS,),
        )

if ENV_ID_V6 not in gymnasium.registry:
    gymnasium.register(
        id=ENV_ID_V6,
        entry_point="envs.chunked_prefill:ChunkedPrefillEnv",
        kwargs={"version": 6},
        additional_wrappers=(_ACTION_MASKS,),
    )

if ENV_ID_V5 not in gymnasium.registry:
    gymnasium.register(
        id=ENV_ID_V5,
        entry_point="envs.fleet_routing:FleetRoutingEnv",
        # The servers' policies by name: the registry of the policies layer, named, not imported.
        kwargs={"policy_factory": "policies.registry:make_policy"},
        additional_wrappers=(_ACTION_MASKS,),
    )

if ENV_ID_V7 not in gymnasium.registry:
    gymnasium.register(
        id=ENV_ID_V7,
        entry_point="envs.disaggregated_prefill:DisaggregatedPrefillEnv",
        # The decode pool's policy and the routers by name, from the layers that own them.
        kwargs={
            "version": 7,
            "policy_factory": "policies.registry:make_policy",
            "router_factory": "baselines.routers:make_router",
        },
        additional_wrappers=(_ACTION_MASKS,),
    )
