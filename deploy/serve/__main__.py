"""`python -m deploy.serve {serve,serve-bench} ...`: the two commands until the `drelay` CLI wires them
(`drelay serve` → commands.run_serve, `drelay serve-bench` → bench.run_bench)."""

import argparse
import sys

from deploy.serve.bench import add_bench_args, run_bench
from deploy.serve.commands import add_serve_args, run_serve
from pipelines.cli import guarded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.serve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="serve an OpenAI-compatible endpoint"))
    add_bench_args(sub.add_parser("serve-bench", help="load-test an endpoint; results to MLflow"))
    args = parser.parse_args(argv)
    run = run_serve if args.command == "serve" else run_bench
    return guarded(lambda: run(args), "drelay")


if __name__ == "__main__":
    sys.exit(main())
