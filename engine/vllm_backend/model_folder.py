"""A model folder vLLM can serve, written locally: seeded random weights of a ``conf/model`` file and a tokenizer.

    python -m engine.vllm_backend.model_folder                         # outputs/vllm/checkpoints/vllm_small-seed0
    python -m engine.vllm_backend.model_folder out=/tmp/vllm_small model=vllm_small seed=0

The weights are a Llama checkpoint with the model's shapes and seeded random weights
(``transformers``, safetensors), the tokenizer :mod:`engine.vllm_backend.tokenizer`'s word-level
vocabulary of the model's ``vocab_size``: nothing is downloaded.  The replay and the profile load
the same folders (token ids in, no tokenizer); vLLM's OpenAI server and its benchmark client read
the tokenizer.  A folder is written once (into a temporary sibling, then renamed) and reused after;
a reused folder written before the tokenizer existed gets it added.  The last stdout line is the
folder's path.  Needs the ``[vllm]`` extra's ``transformers`` and ``tokenizers`` (not vLLM itself).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkgym import resolve_path
from chunkgym.cli import hydra_cli
from chunkgym.config import Rule
from engine.vllm_backend import tokenizer
from envs.serving.specs import ModelSpec, load_model, model_names

DTYPES = {4: "float32", 2: "bfloat16"}
"""``conf/model`` ``dtype_bytes`` -> the checkpoint's and vLLM's dtype."""
WEIGHTS = "model.safetensors"
CHECKPOINTS = "outputs/vllm/checkpoints"
"""Where the replay keeps its folders (``checkpoints`` in ``conf/replay/vllm/cpu_vllm.yaml``), one per (model, seed)."""


def dtype_of(spec: ModelSpec) -> str:
    if spec.dtype_bytes not in DTYPES:
        raise ValueError(f"model {spec.name}: dtype_bytes {spec.dtype_bytes} is not one of {sorted(DTYPES)}")
    return DTYPES[spec.dtype_bytes]


def folder_name(model: str, seed: int) -> str:
    return f"{model}-seed{seed}"


def llama_config(spec: ModelSpec) -> dict[str, Any]:
    """The Hugging Face Llama config fields that give ``spec``'s shapes."""
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_context,
    }


def write(model: str, seed: int, path: Path) -> Path:
    """``path``: ``model``'s weights (seeded by ``seed``) and tokenizer, written unless there already.

    An existing folder is reused if it holds weights of ``model``'s shapes (their seed cannot be
    told from the files: a folder per seed is the caller's), else it is refused, as is a
    non-empty folder without weights.
    """
    spec = load_model(model)
    if (path / WEIGHTS).is_file():
        _check_shapes(path, spec)
        if not all((path / name).is_file() for name in tokenizer.FILES):
            _add_tokenizer(path, spec)
        return path
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"{path}: not empty and holds no {WEIGHTS}: not a model folder to reuse or fill")
    import torch
    import transformers  # the [vllm] extra's, absent from the default install

    dtype = dtype_of(spec)
    cfg = transformers.LlamaConfig(**llama_config(spec), tie_word_embeddings=False, torch_dtype=dtype)
    torch.manual_seed(seed)
    net = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    tmp = path.with_name(path.name + ".tmp")
    net.save_pretrained(tmp, safe_serialization=True)
    tokenizer.write(tmp, spec.vocab_size, spec.max_context)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(path)  # replaces an empty folder
    return path


def _check_shapes(path: Path, spec: ModelSpec) -> None:
    try:
        found = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path / 'config.json'}: {exc}") from None
    for key, want in llama_config(spec).items():
        if found.get(key) != want:
            raise ValueError(
                f"{path / 'config.json'}: {key}={found.get(key)!r}, but model {spec.name} has {want}: "
                f"another model's folder (delete it or name another out=)"
            )


def _add_tokenizer(path: Path, spec: ModelSpec) -> None:
    """The tokenizer into a folder of weights: written beside it, then each file moved in."""
    tmp = path.with_name(path.name + ".tokenizer.tmp")
    tmp.mkdir(exist_ok=True)
    tokenizer.write(tmp, spec.vocab_size, spec.max_context)
    for name in tokenizer.FILES:
        os.replace(tmp / name, path / name)
    tmp.rmdir()


@dataclass
class ModelFolderOptions:
    """Which model folder to write."""

    model: str = "vllm_small"  # a conf/model name
    seed: int = 0  # seeds the random weights
    out: str = ""  # the folder; empty: CHECKPOINTS/<model>-seed<seed>, the replay's folder


RULES: dict[str, Rule] = {
    "model": Rule(lambda v: v in model_names(), f"one of {', '.join(model_names())}"),
}


@hydra_cli(ModelFolderOptions, "vllm_model_folder", RULES)
def main(opts: ModelFolderOptions) -> Path:
    path = resolve_path(opts.out or os.path.join(CHECKPOINTS, folder_name(opts.model, opts.seed)))
    try:
        done = write(opts.model, opts.seed, path)
    except ValueError as exc:
        raise SystemExit(f"python -m engine.vllm_backend.model_folder: error: {exc}") from None
    print(done)
    return done


if __name__ == "__main__":
    main()
