"""Device attention of the kernels modern engines run (FlashAttention-2/3, FlashInfer), from FLOPs and KV bytes.

No table in our data times an attention kernel (Vidur's attention ran on a roofline stand-in),
so a device-only cost file prices attention at fixed efficiencies over the GPU's datasheet,
each with where it comes from:

* prefill: :data:`PREFILL_EFFICIENCY` of peak FLOP/s on the causal query-key pairs.  The
  FlashAttention-2 paper (Dao, 2023, arXiv:2307.08691, abstract) reports its forward pass at
  "50-73% of the theoretical maximum FLOPs/s on A100"; serving chunks (hundreds of query
  tokens, causal) sit at the low end, so the low end is used;
* decode: :data:`DECODE_EFFICIENCY` of datasheet HBM bandwidth on the KV bytes read, the same
  nominal efficiency the roofline v0 uses for every memory-bound op.  It is an assumption,
  not a measurement: ``bench/engine_gpu.py`` measures both on a GPU and writes them into a
  measured cost file;
* per chunk and per decoding sequence, per layer: the roofline v0's nominal 5 us and 0.1 us.

The 2023 engine behind Splitwise's runs had slower kernels; its profile
(``conf/engine_overhead/splitwise_2023_eager.yaml``) carries its own fitted attention terms.
"""

from __future__ import annotations

import dataclasses

from envs.serving.cost_model import CostParams
from envs.serving.engine_overhead import decode_token_seconds, prefill_pair_seconds
from envs.serving.specs import HardwareSpec, ModelSpec

PREFILL_EFFICIENCY = 0.5
DECODE_EFFICIENCY = 0.8
PREFILL_CHUNK_S = 5e-6
DECODE_SEQ_S = 1e-7
SOURCE = (
    f"attention: modern kernels at {PREFILL_EFFICIENCY:.0%} of peak FLOP/s (FlashAttention-2, arXiv:2307.08691: "
    f"50-73% on A100) and {DECODE_EFFICIENCY:.0%} of HBM bandwidth (nominal, as the roofline v0)"
)


def with_modern_attention(
    params: CostParams, model: ModelSpec, hardware: HardwareSpec, tp: int
) -> CostParams:
    """``params`` with attention priced at the module's efficiencies."""
    return dataclasses.replace(
        params,
        attn_prefill_s_per_pair=prefill_pair_seconds(model, hardware, tp) / PREFILL_EFFICIENCY,
        attn_prefill_fixed_s=PREFILL_CHUNK_S,
        attn_decode_s_per_token=decode_token_seconds(model, hardware, tp) / DECODE_EFFICIENCY,
        attn_decode_fixed_s=DECODE_SEQ_S,
    )
