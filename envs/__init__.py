"""chunkgym's serving model (``envs.serving``) and its Gymnasium envs.

Importing this package registers one id per version of
:class:`envs.chunked_prefill.ChunkedPrefillEnv`: ``chunkgym/ChunkedPrefill-v0`` (one step
per engine iteration) and ``chunkgym/ChunkedPrefill-v1`` (one step per scheduling
decision, richer features, several workloads); the module's docstring has the version
history.  :data:`ENV_ID` is the newest, the default everywhere.
"""

import gymnasium
from gymnasium.envs.registration import WrapperSpec

__chunkgym__ = True

ENV_ID_V0 = "chunkgym/ChunkedPrefill-v0"
ENV_ID_V1 = "chunkgym/ChunkedPrefill-v1"
ENV_ID = ENV_ID_V1
"""The newest version: the default of train.py, the leaderboard and the benchmarks."""

_ACTION_MASKS = WrapperSpec("ActionMasks", "envs.chunked_prefill:ActionMasks", {})

for _version, _id in enumerate((ENV_ID_V0, ENV_ID_V1)):
    if _id not in gymnasium.registry:
        gymnasium.register(
            id=_id,
            entry_point="envs.chunked_prefill:ChunkedPrefillEnv",
            kwargs={"version": _version},
            additional_wrappers=(_ACTION_MASKS,),
        )
