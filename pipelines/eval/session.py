"""One evaluation session: run (or resume) the cells, log them to MLflow, write table and plots.

Files under `out_dir` (also logged to the parent MLflow run):
    config.json        the EvalConfig and run name
    cells/*.json       one per finished (benchmark, method) cell — the resume state
    prompts/*.csv      per-prompt results per cell
    summary.json       per-method flat metrics (pipelines/eval/metrics.py)
    report.md, report.csv, relative.csv   the Table-1 comparison (pipelines/eval/report.py)
    plots/*.png        τ/S bars, acceptance by slot, latency breakdown, throughput vs concurrency
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from drelay_model.errors import DRelayError
from pipelines.eval.metrics import cell_metrics, method_metrics
from pipelines.eval.plots import plot_all
from pipelines.eval.results import CellResult
from pipelines.eval.tracking import KIND, LEVEL_TAG, EvalTracker, write_json
from pipelines.eval.runner import CellKey, EvalConfig, Evaluation
from pipelines.eval.report import ComparisonTable, MethodRow, interval_note, render, write_report
from pipelines.common.intervals import DEFAULT_RESAMPLES, DEFAULT_SEED
from pipelines.common.methods import AR
from pipelines.common.tracking import fail_stale_runs, get_client, git_commit, hardware_description, tracked_run

DEFAULT_EXPERIMENT = "drelay-eval"
REPLAY_TOLERANCE = 1e-9


@dataclass
class SessionSummary:
    text: str
    method_metrics: dict[str, dict[str, float]]
    files: list[Path]
    plots: list[Path]
    warnings: list[str] = field(default_factory=list)
    run_id: str | None = None
    resumed_cells: int = 0


def title_of(c: EvalConfig, n_prompts: int) -> str:
    text = f"{c.target}, T={c.temperature:g}, {n_prompts} prompts, ≤{c.max_new_tokens} new tokens, concurrency {c.concurrency[0]}"
    return text + (" — UNTRAINED drafter (plumbing only)" if c.random_drafter else "")


def eval_tags(c: EvalConfig, run_name: str, out_dir: Path) -> dict[str, str]:
    commit = git_commit()
    checkpoints = ";".join(f"{m}={p}" for m, p in c.checkpoints.items() if m != AR) or "none"
    return {
        LEVEL_TAG: "evaluation", KIND[0]: KIND[1], "drelay.methods": ",".join(c.methods),
        "drelay.benchmarks": ",".join(c.benchmarks), "drelay.checkpoint": "random" if c.random_drafter else checkpoints,
        "drelay.target": c.target, "drelay.method": ",".join(c.methods), "drelay.hardware": hardware_description(), "drelay.git_commit": commit,
        "mlflow.source.git.commit": commit, "drelay.temperature": f"{c.temperature:g}", "drelay.out_dir": str(out_dir),
        "mlflow.note.content": f"drelay eval {run_name}",
    }  # fmt: skip


def connect(experiment: str, run_name: str):
    """A client for the tracking store, after failing this run name's runs left RUNNING by dead
    processes; an unreachable store is a one-line error (use --no-mlflow to run without it)."""
    from mlflow.exceptions import MlflowException

    client = get_client()
    try:
        fail_stale_runs(experiment, client=client, run_name=run_name)
    except (MlflowException, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DRelayError(
            f"MLflow tracking store {client.tracking_uri} is not usable ({first}); pass --no-mlflow to skip it"
        ) from exc
    return client


def run_session(
    evaluation: Evaluation,
    *,
    run_name: str,
    out_dir: Path,
    experiment: str | None,
    stack: ExitStack,
    bootstrap: Mapping[str, int] | None = None,
) -> SessionSummary:
    """Run all cells; with `experiment`, inside a tracked parent run (ended by `stack`'s owner).
    `bootstrap`: the 95% intervals' `resamples` and `seed` (default: `pipelines.common.intervals`')."""
    c = evaluation.config
    bootstrap = with_defaults(bootstrap)
    params = {**c.as_params(), "bootstrap_resamples": str(bootstrap["resamples"]), "bootstrap_seed": str(bootstrap["seed"])}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "config.json", {"run_name": run_name, **params})
    tracker, ar_cells, loaded_count = None, {}, [0]
    if experiment is not None:
        client = connect(experiment, run_name)
        parent = stack.enter_context(
            tracked_run(experiment, run_name=run_name, tags=eval_tags(c, run_name, out_dir), params=params, client=client)
        )
        tracker = EvalTracker(parent, stack, dict(c.checkpoints))

    def on_cell(cell: CellResult, loaded: bool) -> None:
        if cell.method == AR:
            ar_cells[cell.benchmark] = cell
        loaded_count[0] += int(loaded)
        if tracker is not None:
            metrics = cell_metrics(cell, ar_cells[cell.benchmark], c.concurrency, bootstrap=bootstrap)
            store_path = evaluation.store.path(cell.benchmark, cell.method)
            tracker.log_cell(cell, metrics, loaded=loaded, cell_file=store_path, work_dir=out_dir)

    cells = evaluation.run(on_cell=on_cell)
    summary = summarize(evaluation, cells, out_dir, run_name, bootstrap)
    summary.resumed_cells = loaded_count[0]
    if tracker is not None:
        tracker.parent.set_tags({"drelay.resumed_cells": summary.resumed_cells})
        tracker.log_summary(summary.method_metrics, summary.files, summary.plots)
        summary.run_id = tracker.parent.run_id
        summary.text += (
            f"MLflow: run '{run_name}' ({summary.run_id}) in experiment '{experiment}' at {tracker.parent.client.tracking_uri}\n"
        )
    return summary


def with_defaults(bootstrap: Mapping[str, int] | None) -> dict[str, int]:
    """The intervals' bootstrap options, `pipelines.common.intervals`' defaults filled in."""
    return {"resamples": DEFAULT_RESAMPLES, "seed": DEFAULT_SEED, **(bootstrap or {})}


def summarize(
    evaluation: Evaluation,
    cells: dict[CellKey, CellResult],
    out_dir: Path,
    run_name: str,
    bootstrap: Mapping[str, int] | None = None,
) -> SessionSummary:
    """Per-method metrics, summary.json, report files and plots; warnings for broken invariants."""
    c, bootstrap = evaluation.config, with_defaults(bootstrap)
    ar_cells = {b: cells[(b, AR)] for b in c.benchmarks}
    per_method = {
        m: method_metrics([cells[(b, m)] for b in c.benchmarks], ar_cells, c.concurrency, bootstrap=bootstrap) for m in c.methods
    }
    n_prompts = sum(len(evaluation.prompts[b]) for b in c.benchmarks)
    title = title_of(c, n_prompts)
    ar_tps = per_method[AR].get(f"throughput/c{c.concurrency[0]}", 0.0)
    notes = [
        f"S = method tokens/s ÷ AR tokens/s on the same engine and hardware, prefill included; "
        f"AR: {ar_tps:.1f} tokens/s at concurrency {c.concurrency[0]} (pooled over benchmarks).",
        "τ = committed tokens per verification round (accepted drafts + the target's token)"
        + (f"; mean ± std over seeds {list(c.run_seeds)}." if len(c.run_seeds) > 1 else "."),
    ]
    if any(k.endswith("_ci_low") for m in per_method.values() for k in m):
        notes.append(interval_note(bootstrap))
    table = ComparisonTable(c.benchmarks, [MethodRow(m, per_method[m]) for m in c.methods if m != AR], notes)
    files = [write_json(out_dir / "summary.json", per_method), out_dir / "config.json"]
    files += write_report(table, out_dir, title)
    plots = plot_all(per_method, c.benchmarks, out_dir / "plots", title)
    text = render(table, title) + f"\nOutputs: {out_dir}\n"
    return SessionSummary(text, per_method, files, plots, warnings=invariant_warnings(c, cells, ar_cells))


def invariant_warnings(c: EvalConfig, cells: dict[CellKey, CellResult], ar_cells: dict[str, CellResult]) -> list[str]:
    """Greedy decoding must equal AR token for token, and replay τ must equal real τ."""
    out = []
    for (bench, m), cell in cells.items():
        if m == AR:
            continue
        metrics = cell_metrics(cell, ar_cells[bench], c.concurrency)
        if c.greedy and metrics.get("matches_ar", 1.0) < 1.0:
            out.append(f"{bench}/{m}: greedy output differs from AR on {1 - metrics['matches_ar']:.0%} of prompt-turns")
        if metrics.get("tau_replay_gap", 0.0) > REPLAY_TOLERANCE:
            out.append(f"{bench}/{m}: replay τ {metrics['tau_replay']:.4f} ≠ decoding τ {metrics['tau']:.4f}")
    return out
