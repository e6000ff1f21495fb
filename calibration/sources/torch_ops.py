"""Profile one decoder layer's non-attention ops on this device, into a Vidur-format ``mlp.csv``.

Plain PyTorch (bf16 on CUDA by default): the same ops Vidur times (token embedding, RMSNorms,
fused QKV projection, RoPE, output projection, fused gate/up projection, SwiGLU, down
projection, residual add), each on one tensor-parallel rank's shard, for a grid of token
counts.  The output has Vidur's columns, so ``python -m calibration`` code fits it as is::

    python -m calibration.sources.torch_ops model=llama3_8b "tp=[1,2,4,8]" out=profiles/h200/mlp.csv

``smoke=true`` runs a tiny model on a few token counts (seconds on a CPU) to check the format.
Tests and CI never need a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from calibration.sources.vidur import ALL_OPS, STATS, op_column
from chunkgym import resolve_path
from chunkgym.cli import hydra_cli
from envs.serving.specs import ModelSpec, load_model

SMOKE_MODEL = ModelSpec(
    name="smoke",
    num_layers=1,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    ffn_size=128,
    vocab_size=256,
    max_context=64,
)
SMOKE_TOKENS = (1, 4, 8, 16, 32, 64)


def default_tokens(max_tokens: int = 4096) -> list[int]:
    """Vidur's grid: 1, 2, 4, every 8 to 1024, every 16 to 2048, every 32 beyond."""
    grid = [1, 2, 4, *range(8, 1024, 8), *range(1024, 2048, 16), *range(2048, max_tokens + 1, 32)]
    return [t for t in grid if t <= max_tokens]


@dataclass(frozen=True)
class Shard:
    """One tensor-parallel rank's weights for one layer."""

    emb: nn.Embedding
    qkv: nn.Linear
    out: nn.Linear
    up: nn.Linear
    down: nn.Linear
    norm_weight: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    inv_freq: torch.Tensor


def make_shard(model: ModelSpec, tp: int, device: torch.device, dtype: torch.dtype) -> Shard:
    if model.num_heads % tp or model.num_kv_heads % tp or model.ffn_size % tp or model.vocab_size % tp:
        raise ValueError(f"{model.name}: heads, KV heads, FFN and vocabulary must divide by tp={tp}")
    h, hd = model.hidden_size, model.head_dim
    heads, kv = model.num_heads // tp, model.num_kv_heads // tp
    ffn = model.ffn_size // tp

    def linear(n_in: int, n_out: int) -> nn.Linear:
        return nn.Linear(n_in, n_out, bias=False, device=device, dtype=dtype)

    return Shard(
        emb=nn.Embedding(model.vocab_size // tp, h, device=device, dtype=dtype),
        qkv=linear(h, (heads + 2 * kv) * hd),
        out=linear(heads * hd, h),
        up=linear(h, 2 * ffn),
        down=linear(ffn, h),
        norm_weight=torch.ones(h, device=device, dtype=dtype),
        heads=heads,
        kv_heads=kv,
        head_dim=hd,
        inv_freq=1.0 / (10000 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate half of each head by position-dependent angles: x is [tokens, heads, head_dim]."""
    angles = positions[:, None].float() * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def layer_ops(
    shard: Shard, tokens: int, device: torch.device, dtype: torch.dtype
) -> dict[str, Callable[[], object]]:
    """Each op as a closure over inputs of the right shape, so only the op itself is timed."""
    ids = torch.randint(0, shard.emb.num_embeddings, (tokens,), device=device)
    hidden = torch.randn(tokens, shard.norm_weight.numel(), device=device, dtype=dtype)
    positions = torch.arange(tokens, device=device)
    qkv = shard.qkv(hidden)
    q = qkv[:, : shard.heads * shard.head_dim].reshape(tokens, shard.heads, shard.head_dim)
    k_end = (shard.heads + shard.kv_heads) * shard.head_dim
    k = qkv[:, shard.heads * shard.head_dim : k_end].reshape(tokens, shard.kv_heads, shard.head_dim)
    attn = torch.randn(tokens, shard.heads * shard.head_dim, device=device, dtype=dtype)
    gate_up = shard.up(hidden)
    ffn = gate_up.shape[-1] // 2
    act = torch.randn(tokens, ffn, device=device, dtype=dtype)
    return {
        "emb": lambda: shard.emb(ids),
        "input_layernorm": lambda: rms_norm(hidden, shard.norm_weight),
        "attn_pre_proj": lambda: shard.qkv(hidden),
        "attn_rope": lambda: (rope(q, positions, shard.inv_freq), rope(k, positions, shard.inv_freq)),
        "attn_post_proj": lambda: shard.out(attn),
        "post_attention_layernorm": lambda: rms_norm(hidden, shard.norm_weight),
        "mlp_up_proj": lambda: shard.up(hidden),
        "mlp_act": lambda: nn.functional.silu(gate_up[:, :ffn]) * gate_up[:, ffn:],
        "mlp_down_proj": lambda: shard.down(act),
        "add": lambda: hidden + hidden,
    }


def time_op(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds per call: CUDA events on a GPU, the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def profile(
    model: ModelSpec,
    tps: Sequence[int],
    tokens: Sequence[int],
    device: torch.device,
    dtype: torch.dtype,
    warmup: int = 5,
    repeats: int = 20,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per (tp, token count) in Vidur's ``mlp.csv`` column order."""
    torch.manual_seed(seed)
    rows = []
    with torch.inference_mode():
        for tp in tps:
            shard = make_shard(model, tp, device, dtype)
            for n in tokens:
                row: dict[str, object] = {}
                for op, fn in layer_ops(shard, n, device, dtype).items():
                    ms = time_op(fn, device, warmup, repeats)
                    row.update(_stats(op, ms))
                row.update(
                    n_head=model.num_heads,
                    n_kv_head=model.num_kv_heads,
                    n_embd=model.hidden_size,
                    n_expanded_embd=model.ffn_size,
                    vocab_size=model.vocab_size,
                    use_gated_mlp=True,
                    num_tokens=n,
                    num_tensor_parallel_workers=tp,
                )
                rows.append(row)
    return pd.DataFrame(rows, columns=vidur_columns())


def vidur_columns() -> list[str]:
    stats = [op_column(op, s) for op in ALL_OPS for s in STATS]
    shape = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp"]
    return stats + shape + ["num_tokens", "num_tensor_parallel_workers"]


def _stats(op: str, ms: list[float]) -> dict[str, float]:
    return {
        op_column(op, "min"): min(ms),
        op_column(op, "max"): max(ms),
        op_column(op, "mean"): statistics.fmean(ms),
        op_column(op, "median"): statistics.median(ms),
        op_column(op, "std"): statistics.pstdev(ms),
    }


DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class Options:
    """``python -m calibration.sources.torch_ops``'s options."""

    out: str  # the mlp.csv to write (required)
    model: str = "llama3_8b"  # conf/model name
    tp: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # tensor-parallel degrees (shards)
    max_tokens: int = 4096
    warmup: int = 5
    repeats: int = 20
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    dtype: str = "bfloat16"  # bfloat16, float16 or float32
    smoke: bool = False  # tiny model, a few token counts: a format check


def run(opts: Options) -> Path:
    """Profile and write the table; returns its path."""
    if opts.dtype not in DTYPES:
        raise SystemExit(f"dtype: {opts.dtype!r} is not one of {', '.join(DTYPES)}")
    device = torch.device(opts.device)
    tokens: Sequence[int]
    if opts.smoke:
        model, tokens, tps, warmup, repeats = SMOKE_MODEL, SMOKE_TOKENS, [1, 2], 1, 3
    else:
        model, tokens, tps = load_model(opts.model), default_tokens(opts.max_tokens), opts.tp
        warmup, repeats = opts.warmup, opts.repeats
    table = profile(model, tps, tokens, device, getattr(torch, opts.dtype), warmup, repeats)
    out = resolve_path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    print(f"wrote {len(table)} rows ({model.name}, tp {tps}, {device}) to {out}")
    return out


main = hydra_cli(Options, name="calibration_torch_ops")(run)

if __name__ == "__main__":
    main()
