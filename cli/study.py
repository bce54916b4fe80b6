"""`drelay study`: run a study spec — its training runs stage by stage, then the replay comparison.

    drelay study --spec platform/studies/smollm2-135m-drelay.yaml [--dry-run] [--only LABEL ...] [--no-compare]

Every run is an ordinary `drelay train` job (Ray Train, MLflow run `<study>-<label>`), resumable: a
finished run is skipped, an interrupted one continues from its last checkpoint. The comparison is
`drelay compare` over the runs' exported checkpoints (outputs/compare/<study>, MLflow experiment
drelay-compare). With `ship: LABEL`, that run's checkpoint is copied (atomically) to
checkpoints/<target>/, the drafter the CLI and the demo use by default.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="train a study's runs (stages, ablations) and compare them", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--spec", required=True, help="study spec YAML (e.g. platform/studies/smollm2-135m-drelay.yaml)")
    p.add_argument("--only", action="append", default=[], metavar="LABEL", help="train only these runs (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="validate the spec and every run config, print the plan, train nothing")
    p.add_argument("--no-compare", action="store_true", help="train only; skip the comparison and shipping")
    p.add_argument("--no-progress", action="store_true", help="hide the comparison's progress bars")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.study.runner import (check_compare_checkpoints, compare_and_ship, dry_run, end_study_run, plan,
                                        study_parent_run, train_runs)  # fmt: skip
    from pipelines.study.spec import load_study

    spec = load_study(args.spec)
    configs, todo = plan(spec, args.only)
    if not (args.no_compare or args.only):
        check_compare_checkpoints(spec)  # before anything trains
    if args.dry_run:
        dry_run(configs, todo)
        return 0
    parent = study_parent_run(spec, configs)  # the training runs and the comparison nest under it
    train_runs(configs, todo, parent_run_id=parent)
    if not (args.no_compare or args.only):
        compare_and_ship(spec, configs, progress=not args.no_progress, parent_run_id=parent)
    end_study_run(configs, parent)
    return 0
