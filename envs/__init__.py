"""chunkgym's serving model (``envs.serving``) and its Gymnasium env.

Importing this package registers ``chunkgym/ChunkedPrefill-v0``.
"""

import gymnasium

__chunkgym__ = True

ENV_ID = "chunkgym/ChunkedPrefill-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="envs.chunked_prefill:ChunkedPrefillEnv")
