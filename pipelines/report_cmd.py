"""`drelay report`: the Table-1 comparison (S and τ per benchmark, Avg.) from MLflow evaluation runs.

Reads the parent run of an evaluation (by run name or id; default the latest finished one), its
method runs' metrics, and prints Markdown; `--out DIR` also writes report.md, report.csv and
relative.csv. Several `--run`s are compared in one table, rows labelled `<run>:<method>`.
"""

from __future__ import annotations

import argparse

from pipelines.report import ComparisonTable, MethodRow, render, write_report

DEFAULT_EXPERIMENT = "drelay-eval"


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="comparison table (Table 1 layout) from MLflow evaluation runs", description=__doc__)
    p.add_argument("--run", dest="runs", action="append", default=[], metavar="NAME_OR_ID", help="evaluation run (repeatable; default: latest)")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help=f"MLflow experiment (default: {DEFAULT_EXPERIMENT})")
    p.add_argument("--out", metavar="DIR", help="also write report.md, report.csv and relative.csv here")
    p.add_argument("--plots", action="store_true", help="with --out: redraw the plots from the logged metrics")
    p.set_defaults(run=run)


def build_table(client, experiment: str, refs: list[str]) -> tuple[ComparisonTable, str, dict[str, dict[str, float]]]:
    """Rows of every requested evaluation; returns (table, title, all method metrics incl. AR)."""
    from pipelines.eval_tracking import find_evaluation, method_rows

    parents = [find_evaluation(client, experiment, ref) for ref in (refs or [None])]
    benchmarks: tuple[str, ...] = ()
    rows, everything, titles = [], {}, []
    for parent in parents:
        benches, method_list, ar = method_rows(client, parent)
        benchmarks = benchmarks or benches
        name = parent.info.run_name
        prefix = f"{name}:" if len(parents) > 1 else ""
        rows += [MethodRow(prefix + r.label, r.metrics) for r in method_list]
        everything.update({prefix + r.label: r.metrics for r in method_list})
        if ar:
            everything[prefix + "ar"] = ar
        tags = parent.data.tags
        titles.append(f"{name} ({tags.get('drelay.target', '?')}, T={tags.get('drelay.temperature', '?')}, "
                      f"checkpoint {tags.get('drelay.checkpoint', '?')}, {tags.get('drelay.hardware', '?')})")  # fmt: skip
    notes = ["S = tokens/s ÷ AR tokens/s (same engine and hardware, prefill included); τ = tokens committed per round."]
    return ComparisonTable(benchmarks, rows, notes), "; ".join(titles), everything


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipelines.tracking import get_client

    client = get_client()
    table, title, everything = build_table(client, args.experiment, args.runs)
    print(render(table, title))
    if args.out:
        paths = write_report(table, args.out, title)
        if args.plots:
            from pipelines.eval_plots import plot_all

            paths += plot_all(everything, table.benchmarks, Path(args.out) / "plots", title)
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0
