"""chunkgym's serving model (``envs.serving``) and its Gymnasium envs.

Importing this package registers ``chunkgym/ChunkedPrefill-v0`` (one step per engine
iteration) and ``chunkgym/ChunkedPrefill-v1`` (one step per scheduling decision, richer
features, several workloads); see their modules.
"""

import gymnasium

__chunkgym__ = True

ENV_ID = "chunkgym/ChunkedPrefill-v0"
ENV_ID_V1 = "chunkgym/ChunkedPrefill-v1"

for _id, _entry in (
    (ENV_ID, "envs.chunked_prefill:ChunkedPrefillEnv"),
    (ENV_ID_V1, "envs.chunked_prefill_v1:ChunkedPrefillEnvV1"),
):
    if _id not in gymnasium.registry:
        gymnasium.register(id=_id, entry_point=_entry)
