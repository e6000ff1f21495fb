"""A tokenizer for chunkgym's random-weight checkpoints, built here so that vLLM's server can start.

vLLM's OpenAI server needs the model folder's tokenizer to turn text into token ids, and its
benchmark client needs it to build prompts of exact lengths; a checkpoint of seeded random weights
has no trained tokenizer, and fetching one would download.  This one is a word-level vocabulary
over the model's ``vocab_size`` ids: Llama's special tokens at Llama's ids (:data:`SPECIAL`, which
the checkpoint's ``bos_token_id`` and ``eos_token_id`` name) and the words ``w3`` ... ``w<N-1>``,
split on whitespace.  Any sequence of word ids decodes to text that encodes back to the same ids,
so a prompt's token count is its word count (the benchmark's random prompts keep their lengths);
other text maps to ``<unk>``.  No BOS is added to a prompt.

The files are the ``tokenizers`` library's ``tokenizer.json`` and a ``tokenizer_config.json`` naming
``PreTrainedTokenizerFast``, which ``transformers.AutoTokenizer`` loads offline (v4 and v5 alike),
plus ``special_tokens_map.json`` for loaders that read the special tokens from there.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

SPECIAL = ("<unk>", "<s>", "</s>")
"""Unknown, beginning and end of sequence: ids 0, 1 and 2, as in Llama's vocabulary and config."""
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def word(token_id: int) -> str:
    """The vocabulary's word for a non-special id."""
    return f"w{token_id}"


def build(vocab_size: int) -> Tokenizer:
    """The word-level tokenizer of ``vocab_size`` ids (:data:`SPECIAL` first)."""
    if vocab_size <= len(SPECIAL):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL)} special tokens, got {vocab_size}")
    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab.update((word(i), i) for i in range(len(SPECIAL), vocab_size))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL))
    return tok


def write(path: Path, vocab_size: int, max_length: int) -> None:
    """Write the tokenizer's :data:`FILES` into the folder ``path`` (which must exist)."""
    build(vocab_size).save(str(path / "tokenizer.json"))
    unk, bos, eos = SPECIAL
    special = {"unk_token": unk, "bos_token": bos, "eos_token": eos}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
