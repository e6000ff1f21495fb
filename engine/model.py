"""A Llama-style decoder in plain PyTorch with seeded random weights.

RMSNorm, rotary position embeddings (rotate-half convention, configurable theta),
grouped-query attention, SwiGLU MLP and an untied LM head.  Nothing is downloaded:
weights are drawn from a seed, identically on any machine (see :func:`init_weights`).

The model computes hidden states for a flat list of tokens.  How tokens attend to
each other is delegated to an :class:`AttentionBackend`: the default is one causal
sequence with no cache (the reference forward); ``engine.attention.PagedAttention``
serves mixed batches over a paged KV cache.

The LM head is untied on purpose: with random weights the residual stream stays close
to the current token's embedding, so a tied head would score the input token highest
and greedy decoding would repeat it forever.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from chunkgym.config import check
from envs.serving.specs import MODEL_RULES, ModelSpec, load_model, model_names


@dataclass(frozen=True)
class ModelConfig(ModelSpec):
    """A ``conf/model`` spec plus the decoder's numerics; weights come separately from a seed."""

    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        check(self, MODEL_RULES, f"ModelConfig {self.name!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelConfig {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig {self.name!r}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig {self.name!r}: head_dim {self.head_dim} must be even for RoPE")
        if not (self.rope_theta > 1 and self.rms_eps > 0):
            raise ValueError(f"ModelConfig {self.name!r}: need rope_theta > 1 and rms_eps > 0")

    @property
    def num_params(self) -> int:
        """The decoder's exact weight count: the spec's plus the norm gains (two per layer, one final)."""
        return super().num_params + (2 * self.num_layers + 1) * self.hidden_size

    @classmethod
    def from_spec(cls, spec: ModelSpec, rope_theta: float = 10000.0) -> ModelConfig:
        """The shapes of a ``conf/model`` entry (RoPE theta is not part of those files)."""
        return cls(**dataclasses.asdict(spec), rope_theta=rope_theta)


PRESETS: dict[str, ModelConfig] = {
    # Unit tests: ~0.15M parameters, every code path (GQA group 2) still exercised.
    "tiny": ModelConfig("tiny", 2, 64, 4, 2, 128, 512, 4096),
    # CPU trace replays: 12.9M parameters (4.7M in the layers, 4.2M each embedding and head).
    # Decode is memory-bound (~36 MB of float32 weights read per iteration), prefill compute-bound.
    # Timings and the command that measures them: docs/engine.md.
    "small": ModelConfig("small", 6, 256, 4, 1, 768, 16384, 16384),
    # Llama-3.2-1B layer shapes (meta-llama/Llama-3.2-1B config.json), with an untied head.
    "llama_1b": ModelConfig("llama_1b", 16, 2048, 32, 8, 8192, 128256, 131072, rope_theta=500000.0),
}


def preset(name: str) -> ModelConfig:
    """An engine preset (``tiny``, ``small``, ``llama_1b``) or the shapes of any ``conf/model`` name."""
    if name in PRESETS:
        return PRESETS[name]
    if name in model_names():
        return ModelConfig.from_spec(load_model(name))
    raise ValueError(f"unknown model preset {name!r}; valid names: {', '.join(preset_names())}")


def preset_names() -> list[str]:
    return sorted(PRESETS) + model_names()


class AttentionBackend(Protocol):
    """Attention of one layer over a flat batch of tokens; returns ``[T, num_heads, head_dim]``."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def causal_attention(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The reference: all tokens form one sequence, each attends to itself and those before it."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))

    def forward(self, x: Tensor) -> Tensor:
        # Half-precision inputs are normalised in float32, as Llama does.
        xf = x.float() if x.element_size() < 4 else x
        return F.rms_norm(xf, (xf.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotate-half RoPE: cos/sin tables for every position up to ``max_context``."""

    cos: Tensor  # buffers, registered in __init__
    sin: Tensor

    def __init__(self, head_dim: int, theta: float, max_context: int) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("cos", torch.empty(max_context, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_context, head_dim // 2), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """Fill the tables (angles in float64, then rounded to the buffers' dtype)."""
        if self.cos.is_meta:
            return
        inv_freq = self.theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        angles = torch.arange(self.cos.shape[0], dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin at ``positions`` ``[T]``, shaped ``[T, 1, head_dim / 2]`` to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Apply RoPE to ``x`` of shape ``[T, heads, head_dim]``."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, False
        )
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], attention: AttentionBackend) -> Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1
        )
        q = rotate(q.view(t, self.num_heads, d), rope)
        k = rotate(k.view(t, self.num_kv_heads, d), rope)
        out = attention(self.layer, q, k, v.view(t, self.num_kv_heads, d))
        return self.o_proj(out.reshape(t, self.num_heads * d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg, layer)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], attention: AttentionBackend) -> Tensor:
        x = x + self.attn(self.input_norm(x), rope, attention)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    """Decoder over a flat token list; :meth:`forward` gives final hidden states, :meth:`logits` scores."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_context)

    def forward(
        self, token_ids: Tensor, positions: Tensor, attention: AttentionBackend = causal_attention
    ) -> Tensor:
        """Final-normed hidden states ``[T, hidden]`` of ``token_ids`` at ``positions`` (both ``[T]``)."""
        x = self.embed(token_ids)
        rope = self.rotary(positions)
        for layer in self.layers:
            x = layer(x, rope, attention)
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """Scores over the vocabulary; half-precision models score in float32."""
        out = self.lm_head(hidden)
        return out.float() if out.element_size() < 4 else out

    def greedy(self, hidden: Tensor) -> list[int]:
        """The argmax token of each row of ``hidden`` (ties to the lowest id): :meth:`logits`' argmax.

        Computed as ``head @ hidden.T`` over at least two columns.  On CPU BLAS the usual
        ``hidden @ head.T`` of 1-3 rows runs as that many matrix-vector products, each reading the
        whole head (16 MB for ``small``), so 3 rows cost more than 4; this layout reads the head once
        for a few rows, so the head's cost grows smoothly with the rows, as the cost model assumes
        (docs/engine.md).  On CUDA both layouts are one GEMM.
        """
        n = hidden.shape[0]
        columns = hidden if n > 1 else hidden.repeat(2, 1)
        scores = self.lm_head.weight @ columns.T  # [vocab, columns]
        return scores[:, :n].float().argmax(dim=0).tolist()

    def reference_logits(self, token_ids: Tensor) -> Tensor:
        """Logits at every position of one sequence by a plain causal forward, no cache."""
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        return self.logits(self(token_ids, positions))


def _std(name: str, cfg: ModelConfig) -> float | None:
    """Init scale per weight; ``None`` means ones (norm gains).

    Projections get ``1/sqrt(fan_in)`` so unit-RMS inputs give unit-RMS outputs; the two
    that write into the residual stream are further divided by ``sqrt(2 * num_layers)``
    so the stream's RMS stays O(1) after all layers.  Embeddings have unit entries, so
    attention logits and LM-head logits are O(1) as well.
    """
    if name.endswith("norm.weight"):
        return None
    if name == "embed.weight":
        return 1.0
    residual = 1.0 / math.sqrt(2 * cfg.num_layers)
    if name.endswith("o_proj.weight"):
        return residual / math.sqrt(cfg.num_heads * cfg.head_dim)
    if name.endswith("down_proj.weight"):
        return residual / math.sqrt(cfg.ffn_size)
    if name.endswith(("qkv_proj.weight", "gate_up_proj.weight", "lm_head.weight")):
        return 1.0 / math.sqrt(cfg.hidden_size)
    raise ValueError(f"engine/model.py: no init rule for parameter {name!r}")


def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed per (model seed, parameter name): tensors are independent of each other's shapes."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


_INIT_CHUNK = 1 << 22


@torch.no_grad()
def init_weights(model: LlamaModel, seed: int) -> None:
    """Fill every parameter from ``seed``; the same seed gives the same weights on any machine.

    Values are uniform with the variance of :func:`_std`.  They are drawn in float64 by
    torch's CPU Mersenne Twister, whose uniform draws are serial integer arithmetic
    (no vectorised transcendental functions that differ between CPUs), then scaled by
    one exact-rounded multiply and cast to the model's dtype and device in row chunks.
    """
    for name, param in model.named_parameters():
        std = _std(name, model.config)
        if std is None:
            param.fill_(1.0)
            continue
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        rows = param.view(param.shape[0], -1)
        step = max(1, _INIT_CHUNK // rows.shape[1])
        for r in range(0, rows.shape[0], step):
            u = torch.rand(rows[r : r + step].shape, generator=gen, dtype=torch.float64)
            rows[r : r + step].copy_((2.0 * u - 1.0) * (math.sqrt(3.0) * std))


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(
    cfg: ModelConfig | str,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> LlamaModel:
    """A model in eval mode with weights from ``seed`` (dtype defaults to :func:`default_dtype`)."""
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.rotary.reset_tables()
    init_weights(model, seed)
    return model.eval().requires_grad_(False)
