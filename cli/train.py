"""`drelay train`: train a drafter (and selector) on Ray Train from a YAML run config."""

from __future__ import annotations

import argparse
import json

from pipelines.train.config import load_config


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter on Ray Train", description=__doc__)
    p.add_argument("--config", help="YAML run config (e.g. platform/experiments/smollm2-135m/train.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides, e.g. train.max_steps=200")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and check inputs, train nothing")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.train.driver import check_inputs, run_training

    cfg = load_config(args.config, args.overrides)
    print("resolved config:\n" + json.dumps(cfg.model_dump(mode="json"), indent=2))
    if args.dry_run:
        check_inputs(cfg)
        return 0
    result = run_training(cfg)
    print(f"checkpoint: {result.checkpoint}\nmlflow run: {result.mlflow_run_id}\nfinal metrics: {json.dumps(result.metrics)}")
    return 0
