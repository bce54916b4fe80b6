"""`drelay serve-bench`: a bounded load generator against one OpenAI-compatible endpoint or two side by
side (`--config A --config B` or `--url A --url B`; B ÷ A per level, with 95% intervals over the pairs of
legs from `--rounds 3` on); throughput, latency, time to first token and τ per concurrency level, written
to MLflow (`deploy/serve/bench_run.py`)."""

from __future__ import annotations

import argparse

from cli.options import add_bootstrap_options, bootstrap_options


def add_parser(sub) -> None:
    from deploy.serve.bench_run import add_bench_args

    p = sub.add_parser("serve-bench", help="load-test an endpoint, or two side by side; results to MLflow", description=__doc__)
    add_bench_args(p)
    add_bootstrap_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deploy.serve.bench_run import run_bench

    return run_bench(args, bootstrap_options(args))
