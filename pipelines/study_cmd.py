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
import json
import shutil

from drelay_model.errors import DRelayError


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
    from pipelines.study import final_checkpoint, finished, load_study, run_configs
    from pipelines.cluster.paths import rooted
    from pipelines.train.driver import check_inputs, repo_path, run_training

    spec = load_study(args.spec)
    configs = {label: rooted(c) for label, c in run_configs(spec, repo_path).items()}
    unknown = [x for x in args.only if x not in configs]
    if unknown:
        raise DRelayError(f"--only: unknown run label(s) {', '.join(unknown)} (have: {', '.join(configs)})")
    todo = [label for label in configs if not args.only or label in args.only]
    for label in todo:
        cfg = configs[label]
        state = "done" if finished(cfg, repo_path) else "to train"
        print(f"[study] {label}: run {cfg.ray.run_name}, {cfg.train.max_steps} steps, selector {cfg.selector.name} — {state}")
    if args.dry_run:
        check_inputs(configs[todo[0]])
        return 0
    for label in todo:
        cfg = configs[label]
        if finished(cfg, repo_path):
            continue
        print(f"[study] training {label} …", flush=True)
        result = run_training(cfg)
        print(f"[study] {label}: {result.checkpoint} · " + json.dumps({k: round(v, 4) for k, v in result.metrics.items() if k.startswith("val/")}))
    if args.no_compare or args.only:
        return 0
    missing = [label for label in configs if not finished(configs[label], repo_path)]
    if missing:
        raise DRelayError(f"runs not finished: {', '.join(missing)}")
    if spec.compare is not None:
        _compare(spec, configs, final_checkpoint, repo_path, args.no_progress)
    if spec.ship is not None:
        _ship(configs[spec.ship], final_checkpoint(configs[spec.ship], repo_path))
    return 0


def _compare(spec, configs, final_checkpoint, repo_path, no_progress: bool) -> None:
    from pipelines.compare_cmd import CompareJob, compare

    c = spec.compare
    variants = []
    for label, ref in spec.compared().items():
        run_label, _, selector = ref.partition(":")
        path = final_checkpoint(configs[run_label], repo_path)
        variants.append(f"{label}={path}" + (f":{selector}" if selector else ""))
    compare(CompareJob(
        variants=tuple(variants), baseline=c.baseline, target=configs[spec.run_labels()[0]].target.spec,
        benchmarks=c.benchmarks, limit=c.limit, data_dir=str(repo_path(c.data_dir)) if c.data_dir else None,
        max_new_tokens=c.max_new_tokens, run_name=spec.name, out=str(repo_path(c.out or f"outputs/compare/{spec.name}")),
        progress=not no_progress,
    ))  # fmt: skip


def _ship(cfg, checkpoint) -> None:
    from drelay_model.atomic import atomic_directory
    from pipelines.cluster.paths import shipped_checkpoints_dir
    from pipelines.resolve import BUNDLED_CHECKPOINTS

    dest = (shipped_checkpoints_dir() or BUNDLED_CHECKPOINTS) / cfg.target.spec
    with atomic_directory(dest) as tmp:
        shutil.copytree(checkpoint, tmp, dirs_exist_ok=True)
    print(f"[study] shipped {checkpoint} → {dest}")
