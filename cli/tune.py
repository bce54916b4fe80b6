"""`drelay tune`: sweep a training config's values with Ray Tune (each trial a Ray Train run).

drelay tune --config platform/sweeps/smollm2-135m.yaml [--resume]
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="sweep training values on Ray Tune", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", required=True, help="sweep YAML (e.g. platform/sweeps/smollm2-135m.yaml)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep; finished trials are not rerun")
    p.add_argument("--dry-run", action="store_true", help="check the sweep and print its trial budget, run nothing")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.tune.config import load_sweep

    sweep, base_doc = load_sweep(args.config)
    if args.dry_run:
        print(f"sweep '{sweep.name}': {len(sweep.space)} values ({', '.join(sweep.space)}), search {sweep.search}, "
              f"scheduler {sweep.scheduler.name}, metric {sweep.metric} ({sweep.mode}); config OK")  # fmt: skip
        return 0
    from pipelines.tune.runner import run_sweep

    result = run_sweep(sweep, base_doc, resume=args.resume)
    for row in result.rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "checkpoint"))
    print(f"results: {result.sweep_dir}\nmlflow parent run: {result.parent_run_id}\n"
          f"{result.best_against_start()}\n{result.best_against_runner_up()}\nbest config: {result.best_config}")  # fmt: skip
    return 0
