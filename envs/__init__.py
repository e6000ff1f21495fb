"""chunkgym's serving model (``envs.serving``) and its Gymnasium envs.

Importing this package (or ``chunkgym``) registers one id per version of
:class:`envs.chunked_prefill.ChunkedPrefillEnv`: ``chunkgym/ChunkedPrefill-v0`` (one step
per engine iteration), ``chunkgym/ChunkedPrefill-v1`` (one step per scheduling
decision, richer features, several workloads), ``chunkgym/ChunkedPrefill-v2`` (v1 with
Sarathi-Serve's admission), ``chunkgym/ChunkedPrefill-v3`` (v2 whose actions also name latency
targets, so every mixed-batch heuristic is a constant action) and ``chunkgym/ChunkedPrefill-v4`` (v3
with features of the recent traffic: prompt and output lengths); the module's docstring has the version history.
``chunkgym/ChunkedPrefill-v5`` is another class, :class:`envs.fleet_routing.FleetRoutingEnv`: the agent routes
each arrival to one server of a fleet.  ``chunkgym/ChunkedPrefill-v6`` is v4 for many tenants and SLO
classes (who waits in the observation, the class-weighted reward).  ``chunkgym/ChunkedPrefill-v7`` is v4 on
the prefill pool of a prefill-decode disaggregated fleet (:class:`envs.disaggregated_prefill.DisaggregatedPrefillEnv`).
:data:`ENV_ID` (v4) is the default everywhere.
"""

from pathlib import Path

import chunkgym

if getattr(chunkgym, "__file__", None) is None:  # a folder without __init__.py: a namespace package
    raise ImportError(
        f"`import chunkgym` found the folder {', '.join(chunkgym.__path__)}, not chunkgym's package "
        f"{Path(__file__).resolve().parent.parent / 'chunkgym'}: Python was started in the folder that "
        "holds the clone, whose name shadows the package. Start Python in another folder (e.g. the clone's root)."
    )

__chunkgym__ = True

from chunkgym.registration import (  # noqa: E402  (registers the envs)
    ENV_ID,
    ENV_ID_V0,
    ENV_ID_V1,
    ENV_ID_V2,
    ENV_ID_V3,
    ENV_ID_V4,
    ENV_ID_V5,
    ENV_ID_V6,
    ENV_ID_V7,
)

__all__ = [
    "ENV_ID",
    "ENV_ID_V0",
    "ENV_ID_V1",
    "ENV_ID_V2",
    "ENV_ID_V3",
    "ENV_ID_V4",
    "ENV_ID_V5",
    "ENV_ID_V6",
    "ENV_ID_V7",
]
