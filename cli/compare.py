"""`drelay compare`: greedy replay τ of several drafter checkpoints on the benchmarks, side by side.

    drelay compare --variant native=outputs/train/A/drafter --variant drelay=outputs/train/B/drafter \\
                   [--variant drelay-native-pick=outputs/train/B/drafter:native] [--baseline native] \\
                   [--benchmarks all] [--limit 8] [--max-new-tokens 128]

The target decodes each benchmark's prompts once (AR, greedy; cached), then every variant is replayed
over those continuations (pipelines/eval/compare.py). Prints the τ table with ratios to the baseline,
each with its 95% paired-bootstrap interval over prompts (--bootstrap-resamples, --bootstrap-seed), a
verdict per variant (ahead / behind / unresolved) and the half-widths reached (how many prompts a 2%
difference would need); writes compare.md, compare.json and compare.png to --out (default
outputs/compare/<run-name>); the same land in one MLflow run. Rerunning the same command resumes:
finished cells are loaded, and the intervals come out the same.
"""

from __future__ import annotations

import argparse

from cli.options import (add_benchmark_set, add_bootstrap_options, add_max_new_tokens, add_run_outputs, add_target,
                         bootstrap_options, check_limit, decode_config)  # fmt: skip
from pipelines.eval.compare_run import DEFAULT_EXPERIMENT, CompareJob, run_compare


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="replay τ of drafter checkpoints side by side (native vs DRelay, ablations)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR[:SELECTOR]",
                   help="a checkpoint to compare (repeatable); SELECTOR defaults to the one it was trained with, "
                        "and may name a head installed in DIR/heads/ (`drelay heads add`)")  # fmt: skip
    p.add_argument("--baseline", help="label the ratios divide by (default: the first --variant)")
    add_target(p)
    add_benchmark_set(p)
    add_max_new_tokens(p)
    add_bootstrap_options(p)
    add_run_outputs(p, kind="compare", experiment=DEFAULT_EXPERIMENT)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    decode = decode_config(args.max_new_tokens)
    check_limit(args.limit)
    bootstrap = bootstrap_options(args)
    return run_compare(CompareJob(
        variants=tuple(args.variant), baseline=args.baseline, target=args.target, device=args.device, dtype=args.dtype, benchmarks=args.benchmarks, limit=args.limit,
        subset_seed=args.subset_seed, data_dir=args.data_dir, decode=decode, run_name=args.run_name, out=args.out,
        experiment=args.experiment, mlflow=not args.no_mlflow, progress=not args.no_progress,
        bootstrap_resamples=bootstrap["resamples"], bootstrap_seed=bootstrap["seed"],
    ))  # fmt: skip
