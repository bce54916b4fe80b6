"""`drelay report`: the Table-1 comparison (S and τ per benchmark, Avg.) from MLflow evaluation runs.

Reads the parent run of an evaluation (by run name or id; default the latest finished one), its
method runs' metrics, and prints Markdown; `--out DIR` also writes report.md, report.csv and
relative.csv. Several `--run`s are compared in one table, rows labelled `<run>:<method>`.
"""

from __future__ import annotations

import argparse

from pipelines.eval.report import render, write_report
from pipelines.eval.session import DEFAULT_EXPERIMENT
from pipelines.eval.tracking import build_table


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="comparison table (Table 1 layout) from MLflow evaluation runs", description=__doc__)
    p.add_argument(
        "--run",
        dest="runs",
        action="append",
        default=[],
        metavar="NAME_OR_ID",
        help="evaluation run (repeatable; default: latest)",
    )
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help=f"MLflow experiment (default: {DEFAULT_EXPERIMENT})")
    p.add_argument("--out", metavar="DIR", help="also write report.md, report.csv and relative.csv here")
    p.add_argument("--plots", action="store_true", help="with --out: redraw the plots from the logged metrics")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipelines.common.tracking import get_client

    client = get_client()
    table, title, everything = build_table(client, args.experiment, args.runs)
    print(render(table, title))
    if args.out:
        paths = write_report(table, args.out, title)
        if args.plots:
            from pipelines.eval.plots import plot_all

            paths += plot_all(everything, table.benchmarks, Path(args.out) / "plots", title)
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0
