"""`drelay serve-bench`: a bounded load generator against an OpenAI-compatible endpoint; throughput,
latency, time to first token and τ per concurrency level, written to MLflow (`deploy/serve/bench.py`)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from deploy.serve.bench import add_bench_args

    p = sub.add_parser("serve-bench", help="load-test an endpoint; results to MLflow", description=__doc__)
    add_bench_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deploy.serve.bench import run_bench

    return run_bench(args)
