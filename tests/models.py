"""Model folders the vLLM tests serve, built here with seeded random weights (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path


def tiny_llama(path: Path, max_position: int) -> Path:
    """A 2-layer Llama with seeded random weights saved under ``path``, for the vLLM tests (nothing
    downloaded); head size 64, since vLLM's CPU attention kernels take 32 and up."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_position,
    )
    LlamaForCausalLM(shape).save_pretrained(path)
    return path
