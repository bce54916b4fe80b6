"""`drelay compare`: greedy replay τ of several drafter checkpoints on the benchmarks, side by side.

    drelay compare --variant native=outputs/train/A/drafter --variant drelay=outputs/train/B/drafter \\
                   [--variant drelay-native-pick=outputs/train/B/drafter:native] [--baseline native] \\
                   [--benchmarks all] [--limit 8] [--max-new-tokens 128]

The target decodes each benchmark's prompts once (AR, greedy; cached), then every variant is replayed
over those continuations (pipelines/eval/compare.py). Prints the τ table with ratios to the baseline and
writes compare.md, compare.json and compare.png to --out (default outputs/compare/<run-name>); the
same land in one MLflow run. Rerunning the same command resumes: finished cells are loaded.
"""

from __future__ import annotations

import argparse

from cli.options import add_benchmark_set, add_max_new_tokens, add_run_outputs, add_target, check_limit, decode_config
from pipelines.eval.compare_run import DEFAULT_EXPERIMENT, CompareJob, run_compare


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="replay τ of drafter checkpoints side by side (native vs DRelay, ablations)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR[:SELECTOR]",
                   help="a checkpoint to compare (repeatable); SELECTOR defaults to the one it was trained with")  # fmt: skip
    p.add_argument("--baseline", help="label the ratios divide by (default: the first --variant)")
    add_target(p)
    add_benchmark_set(p)
    add_max_new_tokens(p)
    add_run_outputs(p, kind="compare", experiment=DEFAULT_EXPERIMENT)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    decode = decode_config(args.max_new_tokens)
    check_limit(args.limit)
    return run_compare(CompareJob(
        variants=tuple(args.variant), baseline=args.baseline, target=args.target, device=args.device, dtype=args.dtype, benchmarks=args.benchmarks, limit=args.limit,
        subset_seed=args.subset_seed, data_dir=args.data_dir, decode=decode, run_name=args.run_name, out=args.out,
        experiment=args.experiment, mlflow=not args.no_mlflow, progress=not args.no_progress,
    ))  # fmt: skip
