"""`drelay plan --config <train.yaml> [--gpu-memory 80] [--device cuda]`: per-GPU peak memory by
component and FLOPs per step of a training run, from shapes alone, with attention priced on the path
the code takes on the planned device (named in the output); a plan that does not fit is a one-line
error (exit 2)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="estimate a training run's per-GPU memory and FLOPs", description=__doc__)
    p.add_argument("--config", required=True, help="YAML run config (e.g. platform/experiments/qwen3-4b/train.yaml)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="device to plan for (default: cuda with ray.use_gpu unless target.device is cpu, else cpu)",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted config overrides")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.train.config import load_config
    from pipelines.train.plan import check_fits, format_report, plan_from_config

    report = plan_from_config(
        load_config(args.config, args.overrides), args.gpu_memory, config_name=args.config, device=args.device
    )
    print(format_report(report))
    check_fits(report)
    return 0
