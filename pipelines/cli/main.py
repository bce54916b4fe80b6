"""`drelay`: one entry point, one subcommand per module listed in COMMANDS.

Every subcommand raises `DRelayError` for bad input; `main` prints it as one line on stderr and
exits 2, so users never see a traceback for their own mistakes.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable

from drelay_model.errors import DRelayError

# The command modules under pipelines/cli/, in `drelay --help` order. A new command is a new module
# plus one entry here.
COMMANDS = (
    "generate",
    "costs",
    "data",
    "train",
    "eval",
    "report",
    "compare",
    "study",
    "tune",
    "plan",
    "serve",
    "serve_bench",
    "export",
    "submit",
    "jobs",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drelay", description="DRelay speculative decoding platform")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"pipelines.cli.{name}").add_parser(sub)
    return parser


def _quiet_libraries() -> None:
    """Keep library chatter (weight-loading bars, advisory warnings) off the user's terminal."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def guarded(run: Callable[[], int | None], prog: str) -> int:
    """Run a job; bad input (`DRelayError`) becomes one line on stderr and exit status 2, Ctrl-C 130.
    The `drelay` command and the scripts in benchmarks/ and analysis/ exit through it."""
    try:
        return int(run() or 0)
    except DRelayError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    return guarded(lambda: args.run(args), "drelay")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
