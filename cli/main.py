"""`drelay`: one entry point, one subcommand per module listed in COMMANDS.

Every subcommand raises `DRelayError` for bad input; `main` prints it as one line on stderr and
exits 2, so users never see a traceback for their own mistakes.
"""

from __future__ import annotations

import argparse
import importlib
import keyword
import os
import sys
from collections.abc import Callable

from drelay_model.errors import DRelayError

# The command modules under cli/, in `drelay --help` order. A new command is a new module
# plus one entry here (a Python keyword's module ends in `_`: `import` is import_.py).
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
    "import",
    "heads",
    "snapshot",
    "submit",
    "jobs",
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or only COMMAND's: a command's module imports what its run needs (torch,
    transformers, Ray), so `drelay jobs`, `drelay submit` and `drelay plan` start in a fraction of a second."""
    parser = argparse.ArgumentParser(prog="drelay", description="DRelay speculative decoding platform")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS if command is None else (command,):
        importlib.import_module(f"cli.{name}_" if keyword.iskeyword(name) else f"cli.{name}").add_parser(sub)
    return parser


def requested_command(argv: list[str]) -> str | None:
    """The command module ARGV names (its first argument: `drelay` itself takes no options but --help;
    `serve-bench` → serve_bench), or None for `drelay`, `drelay --help …` and unknown words, which get
    the whole parser and its list of commands."""
    name = argv[0].replace("-", "_") if argv else None
    return name if name in COMMANDS else None


def _quiet_libraries() -> None:
    """Keep library chatter (weight-loading bars, advisory warnings) off the user's terminal. Through
    the environment where transformers is not imported yet (it reads both variables at import), so a
    command that never loads a model does not pay for importing it."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


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
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(requested_command(argv)).parse_args(argv)
    return guarded(lambda: args.run(args), "drelay")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
